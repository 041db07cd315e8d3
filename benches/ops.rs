//! Times every op against the baseline a candle user would write today, in the same run.
//!
//! ```text
//! cargo bench --bench ops                       # CPU
//! cargo bench --bench ops --features cuda       # CUDA device 0 (CPU with --cpu)
//! cargo bench --bench ops -- bias_add           # only ops whose name contains "bias_add"
//! ```
//!
//! Prints a table and appends the same rows as JSON lines to `target/bench/ops.jsonl` (or to
//! `$FASTOPS_BENCH_OUT`). CUDA timings use events around each call after a warm-up of at least
//! `STEADY_WARM_MS` of calls (the GPU's steady clock under its power cap;
//! `FASTOPS_BENCH_WARM_MS=0` times right after the counted warm-up calls); CPU timings a
//! monotonic clock. Every figure is the median of the timed calls.

use candle_core::{DType, Device, Result, Tensor};
use std::io::Write;
use std::time::Instant;

/// Milliseconds of calls before a CUDA case is timed (`FASTOPS_BENCH_WARM_MS` overrides it).
const STEADY_WARM_MS: u64 = 500;

struct Bench {
    device: Device,
    filters: Vec<String>,
    rows: Vec<Row>,
    /// (warm-up, timed) calls; `None` for the defaults (10/50 on CUDA, 2/11 on the CPU).
    iterations: Option<(usize, usize)>,
}

struct Row {
    op: &'static str,
    case: String,
    dtype: DType,
    device: &'static str,
    median_us: f64,
    /// Effective rate: bytes that must move (GB/s) or FLOPs (TFLOP/s).
    rate: f64,
    rate_unit: &'static str,
    baseline: String,
    baseline_us: f64,
}

/// What an op must move or compute, for the effective-rate column.
#[derive(Clone, Copy)]
enum Work {
    Bytes(f64),
    Flops(f64),
}

impl Bench {
    fn device_name(&self) -> &'static str {
        if self.device.is_cuda() {
            "cuda"
        } else {
            "cpu"
        }
    }

    fn wants(&self, op: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| op.contains(f.as_str()))
    }

    /// Whether a case of a section that honours `FASTOPS_BENCH_CASES` runs: that variable (when
    /// set) is a comma-separated list of substrings, one of which the case's name must contain,
    /// or, written `^prefix`, begin with (for A/B jobs; masked_attention honours it, masked_bmm
    /// with its case and dtype, as `causal b=64 m=n=2048 k=64 f32`, and small_fc_lopt with its
    /// set's name, as `152M/97 step (fused)` or `gpt2-medium 354M/289 AdamW`).
    fn wants_case(&self, case: &str) -> bool {
        match std::env::var("FASTOPS_BENCH_CASES") {
            Ok(list) => list
                .split(',')
                .map(str::trim)
                .any(|f| match f.strip_prefix('^') {
                    Some(prefix) => case.starts_with(prefix),
                    None => case.contains(f),
                }),
            Err(_) => true,
        }
    }

    /// Median wall time of `f` in microseconds.
    fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        // FASTOPS_BENCH_CALLS="warm-up,timed" overrides every section's counts (e.g. "0,1"
        // under a profiler, so that each case's kernels run once).
        let forced = std::env::var("FASTOPS_BENCH_CALLS").ok().and_then(|v| {
            let (w, t) = v.split_once(',')?;
            Some((
                w.trim().parse().ok()?,
                t.trim().parse::<usize>().ok()?.max(1),
            ))
        });
        let (warmup, iters) = match forced.or(self.iterations) {
            Some(counts) => counts,
            None if self.device.is_cuda() => (10, 50),
            None => (2, 11),
        };
        let warm_start = Instant::now();
        for _ in 0..warmup {
            f()?;
        }
        self.device.synchronize()?;
        // The warm-up then goes on (a call at a time) until FASTOPS_BENCH_WARM_MS ms have passed
        // since it began (STEADY_WARM_MS on CUDA unless the counts are forced, 0 on the CPU), so
        // that the timed calls run in the board's steady state: an H200's power cap lowers its SM
        // clock 5-9% within ~0.2 s of sustained load (BENCHMARKS.md, session 47).
        // scripts/torch_anchors.py warms up the same way.
        let steady = if self.device.is_cuda() && forced.is_none() {
            STEADY_WARM_MS
        } else {
            0
        };
        let warm_ms = std::env::var("FASTOPS_BENCH_WARM_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(steady);
        while warm_start.elapsed() < std::time::Duration::from_millis(warm_ms) {
            f()?;
            self.device.synchronize()?;
        }
        let mut samples = Vec::with_capacity(iters);
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            use candle_core::cuda_backend::WrapErr;
            let stream = cuda.cuda_stream();
            // FASTOPS_BENCH_COOL_MS=N leaves the GPU idle N ms after each timed call (the host
            // waits for it, then sleeps), for studies of the board's power limit.
            let cool = std::env::var("FASTOPS_BENCH_COOL_MS")
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            let mut events = Vec::with_capacity(iters);
            for _ in 0..iters {
                let start = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                f()?;
                let end = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                events.push((start, end));
                if let Some(ms) = cool {
                    stream.synchronize().w()?;
                    std::thread::sleep(std::time::Duration::from_millis(ms));
                }
            }
            for (start, end) in events {
                samples.push(start.elapsed_ms(&end).w()? as f64 * 1e3);
            }
            return Ok(median(samples));
        }
        for _ in 0..iters {
            let start = Instant::now();
            f()?;
            self.device.synchronize()?;
            samples.push(start.elapsed().as_secs_f64() * 1e6);
        }
        Ok(median(samples))
    }

    /// Times `ours` and `baseline`, then records and prints one row.
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &mut self, op: &'static str, case: &str, dtype: DType, work: Work,
        ours: impl FnMut() -> Result<()>, baseline_name: &str,
        baseline: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let median_us = self.time(ours)?;
        // FASTOPS_BENCH_NO_BASELINE=1 times only ours (for A/B jobs); the row's baseline is 0.
        let baseline_us = if std::env::var("FASTOPS_BENCH_NO_BASELINE").as_deref() == Ok("1") {
            0.0
        } else {
            self.time(baseline)?
        };
        self.push_row(op, case, dtype, work, median_us, baseline_name, baseline_us);
        Ok(())
    }

    /// A row without a baseline (where the baseline does not fit in memory).
    fn measure(
        &mut self, op: &'static str, case: &str, dtype: DType, work: Work,
        ours: impl FnMut() -> Result<()>, why: &str,
    ) -> Result<()> {
        let median_us = self.time(ours)?;
        self.push_row(op, case, dtype, work, median_us, why, 0.0);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn push_row(
        &mut self, op: &'static str, case: &str, dtype: DType, work: Work, median_us: f64,
        baseline: &str, baseline_us: f64,
    ) {
        let (rate, rate_unit) = match work {
            Work::Bytes(b) => (b / median_us * 1e-3, "GB/s"),
            // CPU rates are below a TFLOP/s: GFLOP/s keeps their digits.
            Work::Flops(f) if f / median_us < 1e6 => (f / median_us * 1e-3, "GFLOP/s"),
            Work::Flops(f) => (f / median_us * 1e-6, "TFLOP/s"),
        };
        let row = Row {
            op,
            case: case.to_string(),
            dtype,
            device: self.device_name(),
            median_us,
            rate,
            rate_unit,
            baseline: baseline.to_string(),
            baseline_us,
        };
        print_row(&row);
        self.rows.push(row);
    }

    fn write_jsonl(&self) -> std::io::Result<std::path::PathBuf> {
        let path = std::env::var("FASTOPS_BENCH_OUT")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench/ops.jsonl")
            });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        for r in &self.rows {
            writeln!(
                file,
                "{{\"op\":\"{}\",\"case\":\"{}\",\"dtype\":\"{:?}\",\"device\":\"{}\",\"median_us\":{:.2},\"rate\":{:.1},\"rate_unit\":\"{}\",\"baseline\":\"{}\",\"baseline_us\":{:.2},\"speedup\":{:.3}}}",
                r.op,
                r.case.replace('"', "'"),
                r.dtype,
                r.device,
                r.median_us,
                r.rate,
                r.rate_unit,
                r.baseline.replace('"', "'"),
                r.baseline_us,
                r.baseline_us / r.median_us
            )?;
        }
        Ok(path)
    }
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

fn print_header() {
    println!(
        "| {:<9} | {:<44} | {:<4} | {:<4} | {:>10} | {:>15} | {:<28} | {:>11} | {:>7} |",
        "op", "case", "dtype", "dev", "median us", "rate", "baseline", "baseline us", "speedup"
    );
    println!("|{}|", ["---"; 9].join("|"));
}

fn print_row(r: &Row) {
    println!(
        "| {:<9} | {:<44} | {:<4} | {:<4} | {:>10.1} | {:>10.1} {:<4} | {:<28} | {:>11.1} | {:>6.2}x |",
        r.op,
        r.case,
        format!("{:?}", r.dtype).to_lowercase(),
        r.device,
        r.median_us,
        r.rate,
        r.rate_unit,
        r.baseline,
        r.baseline_us,
        r.baseline_us / r.median_us
    );
}

fn randn(shape: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(dtype)
}

fn bench_bias_add(b: &mut Bench) -> Result<()> {
    const OP: &str = "bias_add";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let gpu = dev.is_cuda();
    // (shape, dim, dtypes): the issue's targets on the GPU; sizes this 2-core CPU can repeat.
    let cases: Vec<(Vec<usize>, usize, Vec<DType>)> = if gpu {
        vec![
            (
                vec![16384, 4096],
                1,
                vec![DType::F32, DType::F16, DType::BF16],
            ),
            // Half types over the same bytes as the f32 case above.
            (vec![16384, 8192], 1, vec![DType::F16, DType::BF16]),
            (vec![64, 256, 56, 56], 1, vec![DType::F32, DType::BF16]),
            (vec![16384, 4099], 1, vec![DType::F32]),
        ]
    } else {
        vec![
            (vec![4096, 4096], 1, vec![DType::F32, DType::BF16]),
            (vec![16, 256, 56, 56], 1, vec![DType::F32]),
        ]
    };
    for (shape, dim, dtypes) in cases {
        for dtype in dtypes {
            let xs = randn(&shape, dtype, &dev)?;
            let bias = randn(&[shape[dim]], dtype, &dev)?;
            let mut bshape = vec![1; shape.len()];
            bshape[dim] = shape[dim];
            let bias_b = bias.reshape(bshape)?;
            let bytes = 2.0 * xs.elem_count() as f64 * dtype.size_in_bytes() as f64;
            let case = format!("{shape:?} dim {dim}");
            b.compare(
                OP,
                &case,
                dtype,
                Work::Bytes(bytes),
                || bias_add_out(&xs, &bias, dim),
                "xs.broadcast_add(bias)",
                || xs.broadcast_add(&bias_b).map(drop),
            )?;
            let scratch = xs.copy()?;
            b.compare(
                OP,
                &format!("{case} in place"),
                dtype,
                Work::Bytes(bytes),
                || candle_fastops::bias_add_(&scratch, &bias, dim),
                "xs.broadcast_add(bias)",
                || xs.broadcast_add(&bias_b).map(drop),
            )?;
            if gpu {
                // The device-to-device copy of the same bytes: the ceiling for this op.
                b.compare(
                    OP,
                    &format!("{case} d2d copy (ceiling)"),
                    dtype,
                    Work::Bytes(bytes),
                    || xs.copy().map(drop),
                    "bias_add (ours)",
                    || bias_add_out(&xs, &bias, dim),
                )?;
            }
            if gpu && dtype == DType::F32 && shape == [16384, 4096] {
                use candle_fastops::CacheHint;
                for (name, hint) in [
                    ("ld.cv/st.wt", CacheHint::Volatile),
                    ("plain ld/st", CacheHint::Plain),
                ] {
                    b.compare(
                        OP,
                        &format!("{case} {name}"),
                        dtype,
                        Work::Bytes(bytes),
                        || candle_fastops::bias_add_with_hint(&xs, &bias, dim, hint).map(drop),
                        "ld.cs/st.cs (default)",
                        || bias_add_out(&xs, &bias, dim),
                    )?;
                }
                let offset = xs.flatten_all()?.narrow(0, 1, xs.elem_count() - 1)?;
                let offset_bias = Tensor::cat(&[&bias, &bias], 0)?; // channel count = 8192
                let offset_xs = offset.narrow(0, 0, 8191 * 8192)?.reshape((8191, 8192))?;
                b.compare(
                    OP,
                    "[8191, 8192] misaligned storage offset",
                    dtype,
                    Work::Bytes(2.0 * offset_xs.elem_count() as f64 * 4.0),
                    || bias_add_out(&offset_xs, &offset_bias, 1),
                    "xs.broadcast_add(bias)",
                    || offset_xs.broadcast_add(&offset_bias).map(drop),
                )?;
            }
        }
    }
    // A dense layer's bias with NNUE's clipped ReLU, forward + backward (the seed of ones and
    // candle's gradient bookkeeping included, as a training step sees them): fused against
    // candle's `broadcast_add(..)?.clamp(0, 1)`.
    let clipped_cases: Vec<Vec<usize>> = if gpu {
        vec![vec![16384, 32], vec![16384, 4096]]
    } else {
        vec![vec![16384, 32], vec![1024, 4096]]
    };
    let clipped = candle_fastops::BiasAddOptions {
        activation: candle_fastops::Activation::ClippedRelu { ceiling: 1.0 },
    };
    for shape in clipped_cases {
        for dtype in [DType::F32, DType::BF16] {
            let xs = candle_core::Var::from_tensor(&randn(&shape, dtype, &dev)?)?;
            let bias = candle_core::Var::from_tensor(&randn(&[shape[1]], dtype, &dev)?)?;
            let bias_b = bias.reshape((1, shape[1]))?;
            // Forward read + write, backward reads of output and gradient and write.
            let bytes = 5.0 * xs.elem_count() as f64 * dtype.size_in_bytes() as f64;
            b.compare(
                OP,
                &format!("{shape:?} clipped ReLU fwd+bwd"),
                dtype,
                Work::Bytes(bytes),
                || {
                    candle_fastops::bias_add_with(&xs, &bias, 1, &clipped)?
                        .backward()
                        .map(drop)
                },
                "broadcast_add + clamp(0, 1)",
                || {
                    xs.broadcast_add(&bias_b)?
                        .clamp(0f32, 1f32)?
                        .backward()
                        .map(drop)
                },
            )?;
        }
    }
    Ok(())
}

/// What a candle user writes today for softmax over several dims: five ops, several passes.
fn softmax_composite(xs: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let mut max = xs.clone();
    for &d in dims {
        max = max.max_keepdim(d)?;
    }
    let exp = xs.broadcast_sub(&max)?.exp()?;
    let mut sum = exp.clone();
    for &d in dims {
        sum = sum.sum_keepdim(d)?;
    }
    exp.broadcast_div(&sum)
}

fn bench_softmax(b: &mut Bench) -> Result<()> {
    const OP: &str = "softmax";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let cases: Vec<(Vec<usize>, Vec<usize>, Vec<DType>)> = if dev.is_cuda() {
        vec![
            (
                vec![32, 1024, 4096],
                vec![0, 2],
                vec![DType::F32, DType::BF16],
            ),
            (vec![32, 1024, 4096], vec![2], vec![DType::F32, DType::BF16]),
            (vec![32, 1024, 4096], vec![0], vec![DType::F32, DType::BF16]),
            (
                vec![8, 16, 32, 64, 128],
                vec![1, 3],
                vec![DType::F32, DType::BF16],
            ),
        ]
    } else {
        vec![
            (vec![8, 256, 1024], vec![0, 2], vec![DType::F32]),
            (vec![8, 256, 1024], vec![2], vec![DType::F32]),
            (vec![8, 256, 1024], vec![0], vec![DType::F32]),
        ]
    };
    for (shape, dims, dtypes) in cases {
        for dtype in dtypes {
            let xs = randn(&shape, dtype, &dev)?;
            let bytes = 2.0 * xs.elem_count() as f64 * dtype.size_in_bytes() as f64;
            let case = format!("{shape:?} dims {dims:?}");
            let last_dim_only = dims == [shape.len() - 1];
            if last_dim_only {
                b.compare(
                    OP,
                    &case,
                    dtype,
                    Work::Bytes(bytes),
                    || candle_fastops::softmax_dims(&xs, &dims).map(drop),
                    "candle_nn softmax_last_dim",
                    || candle_nn::ops::softmax_last_dim(&xs).map(drop),
                )?;
                b.compare(
                    OP,
                    &format!("{case} log"),
                    dtype,
                    Work::Bytes(bytes),
                    || candle_fastops::log_softmax_dims(&xs, &dims).map(drop),
                    "candle_nn log_softmax",
                    || candle_nn::ops::log_softmax(&xs, candle_core::D::Minus1).map(drop),
                )?;
            } else {
                b.compare(
                    OP,
                    &case,
                    dtype,
                    Work::Bytes(bytes),
                    || candle_fastops::softmax_dims(&xs, &dims).map(drop),
                    "max/sub/exp/sum/div composite",
                    || softmax_composite(&xs, &dims).map(drop),
                )?;
                if !dev.is_cuda() {
                    b.compare(
                        OP,
                        &format!("{case} vs last-dim"),
                        dtype,
                        Work::Bytes(bytes),
                        || candle_fastops::softmax_dims(&xs, &dims).map(drop),
                        "candle_nn softmax_last_dim",
                        || candle_nn::ops::softmax_last_dim(&xs).map(drop),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Uniformly random feature rows, every slot active (the bench's worst case for the gather).
fn random_features(batch: usize, active: usize, num_inputs: usize, dev: &Device) -> Result<Tensor> {
    Tensor::rand(0f32, num_inputs as f32, (batch, active), &Device::Cpu)?
        .floor()?
        .clamp(0f32, num_inputs as f32 - 1.0)?
        .to_dtype(DType::I64)?
        .to_dtype(DType::I32)?
        .to_device(dev)
}

/// What a candle user writes today: gather the rows, weight them, sum, add the bias.
fn sparse_composite(
    idx: &Tensor, values: &Tensor, weight: &Tensor, bias: &Tensor,
) -> Result<Tensor> {
    let (batch, active) = idx.dims2()?;
    let rows = weight.index_select(&idx.flatten_all()?, 0)?;
    rows.reshape((batch, active, weight.dim(1)?))?
        .broadcast_mul(&values.unsqueeze(2)?)?
        .sum(1)?
        .broadcast_add(bias)
}

/// The composite's gradients: scatter-add the weighted output gradients, sum for the bias.
fn sparse_composite_backward(
    idx: &Tensor, values: &Tensor, grad: &Tensor, num_inputs: usize,
) -> Result<()> {
    let (batch, active) = idx.dims2()?;
    let out = grad.dim(1)?;
    let rows = grad
        .unsqueeze(1)?
        .broadcast_mul(&values.unsqueeze(2)?)?
        .reshape((batch * active, out))?;
    let zeros = Tensor::zeros((num_inputs, out), grad.dtype(), grad.device())?;
    zeros.index_add(&idx.flatten_all()?, &rows, 0)?;
    grad.sum(0).map(drop)
}

fn bench_sparse_linear(b: &mut Bench) -> Result<()> {
    const OP: &str = "sparse_linear";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let active = 32;
    // (num_inputs, out, batch, dtypes)
    let cases: Vec<(usize, usize, usize, Vec<DType>)> = if dev.is_cuda() {
        vec![
            (22528, 1024, 16384, vec![DType::F32, DType::BF16]),
            (45056, 3072, 16384, vec![DType::F32]),
            // A 4 MB weight that stays in L2 whole: the same gather with no DRAM misses, i.e.
            // the kernel's L2-bound ceiling for the rows above.
            (1024, 1024, 16384, vec![DType::F32, DType::BF16]),
        ]
    } else {
        vec![(22528, 256, 4096, vec![DType::F32])]
    };
    for (num_inputs, out, batch, dtypes) in cases {
        let idx = random_features(batch, active, num_inputs, &dev)?;
        let black = random_features(batch, active, num_inputs, &dev)?;
        let stm = Tensor::rand(0f32, 1f32, batch, &dev)?.ge(0.5)?;
        let values = Tensor::ones((batch, active), DType::F32, &dev)?;
        for dtype in dtypes {
            let weight = randn(&[num_inputs, out], dtype, &dev)?;
            let bias = randn(&[out], dtype, &dev)?;
            let elem = dtype.size_in_bytes() as f64;
            // Bytes the gather moves (through L2): every active row slice, plus the output.
            let gathered = (batch * active * out) as f64 * elem + (batch * out) as f64 * elem;
            let case = format!("{num_inputs}->{out} x{active} batch {batch}");
            let values_typed = values.to_dtype(dtype)?;
            // candle's index_select / index_add take u32 (not i32) indices; its CUDA backend
            // cannot cast i32 to u32, so the cast goes through the CPU (outside the timing).
            let idx_u32 = idx
                .to_device(&Device::Cpu)?
                .to_dtype(DType::U32)?
                .to_device(&dev)?;
            // The fast path (indices validated once, no synchronisation) is the row the speed
            // targets refer to; the checked default is timed against it below.
            let unchecked = candle_fastops::SparseLinearOptions {
                index_check: candle_fastops::IndexCheck::Unchecked,
                ..Default::default()
            };
            let fast = || {
                let features = candle_fastops::SparseFeatures::new(&idx);
                candle_fastops::sparse_linear_with(features, &weight, &bias, &unchecked).map(drop)
            };
            b.compare(
                OP,
                &format!("{case} forward"),
                dtype,
                Work::Bytes(gathered),
                fast,
                "index_select+mul+sum+add",
                || sparse_composite(&idx_u32, &values_typed, &weight, &bias).map(drop),
            )?;
            let headline = !dev.is_cuda() || (out == 1024 && num_inputs == 22528);
            if headline {
                b.compare(
                    OP,
                    &format!("{case} forward, indices checked at the call"),
                    dtype,
                    Work::Bytes(gathered),
                    || candle_fastops::sparse_linear(&idx, None, &weight, &bias).map(drop),
                    "unchecked forward",
                    fast,
                )?;
                // Both perspectives, unchecked like the forward row (the checked default adds
                // the same check and synchronisation as the forward's checked row).
                b.compare(
                    OP,
                    &format!("{case} forward_pair (unchecked)"),
                    dtype,
                    Work::Bytes(2.0 * gathered),
                    || {
                        candle_fastops::sparse_linear_pair_with(
                            &idx, &black, &stm, &weight, &bias, &unchecked,
                        )
                        .map(drop)
                    },
                    "one unchecked sparse_linear forward",
                    fast,
                )?;
            }
            if dtype == DType::F32 && headline {
                // A training step's worth of the NNUE input layer: forward_pair, the clamp to
                // [0, 1], a 2 * out -> 1 dense head as the loss (a matrix product: candle's
                // sum_all over the activations would cost more than the layer), backward. Fused:
                // the clamp inside the op; baseline: the same op unclamped, then candle's clamp
                // and its autograd.
                let (wvar, bvar) = (
                    candle_core::Var::from_tensor(&weight)?,
                    candle_core::Var::from_tensor(&bias)?,
                );
                let head = randn(&[2 * out, 1], dtype, &dev)?;
                let fused = candle_fastops::SparseLinearOptions {
                    activation: candle_fastops::SparseActivation::ClippedRelu { ceiling: 1.0 },
                    ..unchecked
                };
                let step = |options: &candle_fastops::SparseLinearOptions, clamp: bool| {
                    let y = candle_fastops::sparse_linear_pair_with(
                        &idx, &black, &stm, &wvar, &bvar, options,
                    )?;
                    let y = if clamp { y.clamp(0f32, 1f32)? } else { y };
                    y.matmul(&head)?.sum_all()?.backward().map(drop)
                };
                b.compare(
                    OP,
                    &format!("{case} forward_pair + clipped ReLU + backward, fused"),
                    dtype,
                    Work::Bytes(2.0 * gathered),
                    || step(&fused, false),
                    "the same, candle's clamp",
                    || step(&unchecked, true),
                )?;
                // NNUE's first dense layer (2 * out -> 32) multiplied inside the op, against the
                // same product on the pair's output: forward, a sum as the loss, backward.
                let next = candle_core::Var::from_tensor(&randn(&[32, 2 * out], dtype, &dev)?)?;
                let ft = candle_fastops::FeatureTransformer::from_tensors(
                    wvar.as_tensor().clone(),
                    bvar.as_tensor().clone(),
                )
                .with_options(fused);
                b.compare(
                    OP,
                    &format!("{case} forward_pair_linear (-> 32) + backward"),
                    dtype,
                    Work::Bytes(2.0 * gathered),
                    || {
                        ft.forward_pair_linear(&idx, &black, &stm, &next)?
                            .sum_all()?
                            .backward()
                            .map(drop)
                    },
                    "forward_pair, matmul, backward",
                    || {
                        ft.forward_pair(&idx, &black, &stm)?
                            .matmul(&next.t()?)?
                            .sum_all()?
                            .backward()
                            .map(drop)
                    },
                )?;
            }
            if dtype == DType::F32 && headline {
                let grad = randn(&[batch, out], dtype, &dev)?;
                // The weight gradient: one atomic add per active row slice element, plus the
                // zeroed buffer and the output gradient read once.
                let bytes = (batch * active * out) as f64 * 4.0
                    + (num_inputs * out) as f64 * 4.0
                    + (batch * out) as f64 * 4.0;
                b.compare(
                    OP,
                    &format!("{case} backward"),
                    dtype,
                    Work::Bytes(bytes),
                    || {
                        candle_fastops::sparse_linear_backward(&idx, None, &grad, num_inputs)
                            .map(drop)
                    },
                    "index_add+sum composite",
                    || sparse_composite_backward(&idx_u32, &values, &grad, num_inputs),
                )?;
                if dev.is_cuda() {
                    // The ordered (atomic-free) backward of deterministic mode against the default.
                    b.compare(
                        OP,
                        &format!("{case} backward (default) vs deterministic"),
                        dtype,
                        Work::Bytes(bytes),
                        || {
                            candle_fastops::sparse_linear_backward(&idx, None, &grad, num_inputs)
                                .map(drop)
                        },
                        "deterministic (sorted) backward",
                        || {
                            candle_fastops::set_deterministic(true);
                            let r = candle_fastops::sparse_linear_backward(
                                &idx, None, &grad, num_inputs,
                            );
                            candle_fastops::set_deterministic(false);
                            r.map(drop)
                        },
                    )?;
                }
                let clamped = grad.relu()?; // half zeros, as behind a clamp
                b.compare(
                    OP,
                    &format!("{case} backward 50% zero grads"),
                    dtype,
                    Work::Bytes(bytes),
                    || {
                        candle_fastops::sparse_linear_backward(&idx, None, &clamped, num_inputs)
                            .map(drop)
                    },
                    "index_add+sum composite",
                    || sparse_composite_backward(&idx_u32, &values, &clamped, num_inputs),
                )?;
            }
        }
    }
    Ok(())
}

/// Parameter shapes of a GPT-2-style stack: the token embedding plus `layers` blocks of 12
/// tensors (two layer norms, attention qkv and projection, MLP in and out, with biases).
fn gpt2_shapes(vocab: usize, width: usize, layers: usize) -> Vec<Vec<usize>> {
    let mut shapes = vec![vec![vocab, width]];
    for _ in 0..layers {
        shapes.extend([
            vec![width],
            vec![width],
            vec![width, 3 * width],
            vec![3 * width],
            vec![width, width],
            vec![width],
            vec![width],
            vec![width],
            vec![width, 4 * width],
            vec![4 * width],
            vec![4 * width, width],
            vec![width],
        ]);
    }
    shapes
}

fn bench_small_fc_lopt(b: &mut Bench) -> Result<()> {
    use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
    use candle_nn::Optimizer;
    const OP: &str = "small_fc_lopt";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let mlp_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/small_fc_lopt_mlp.safetensors"
    );
    let mlp = MlpWeights::from_safetensors(mlp_path, &dev)?;
    // (name, shapes): the issue's GPT-2-medium set (354M in 289 tensors) and 152M in 97.
    let sets: Vec<(&str, Vec<Vec<usize>>)> = if dev.is_cuda() {
        vec![
            ("gpt2-medium 354M/289", gpt2_shapes(50257, 1024, 24)),
            ("152M/97", gpt2_shapes(50257, 1024, 8)),
        ]
    } else {
        vec![("2x256 blocks 1.6M/25", gpt2_shapes(1024, 256, 2))]
    };
    b.iterations = Some(if dev.is_cuda() { (3, 10) } else { (1, 5) });
    for (name, shapes) in sets {
        let vars: Vec<candle_core::Var> = shapes
            .iter()
            .map(|s| candle_core::Var::from_tensor(&(randn(s, DType::F32, &dev)? * 0.02)?))
            .collect::<Result<_>>()?;
        let mut grads = candle_core::backprop::GradStore::default();
        for v in &vars {
            grads.insert(v.as_tensor(), (randn(v.dims(), DType::F32, &dev)? * 1e-3)?);
        }
        let params: usize = vars.iter().map(|v| v.elem_count()).sum();
        // Bytes per element per step: read p, g, 4 state; write p, 4 state (twice over the
        // elementwise state: the accumulators are updated, then read again by both passes).
        let bytes = params as f64 * 4.0 * 18.0;
        // CUDA also times the exact f32 MLP (`tensor_cores = false`) and the deterministic step.
        let modes: &[(&str, bool, bool)] = if dev.is_cuda() {
            &[
                ("fused", true, false),
                ("fused, f32 FMA MLP", false, false),
                ("fused, deterministic", true, true),
            ]
        } else {
            &[("fused", true, false)]
        };
        for &(mode, tensor_cores, deterministic) in modes {
            if !b.wants_case(&format!("{name} step ({mode})")) {
                continue;
            }
            let mut params = ParamsSmallFcLOpt::new(mlp.clone());
            params.backend.tensor_cores = tensor_cores;
            params.backend.deterministic = Some(deterministic);
            let mut lopt = SmallFcLOpt::new(vars.clone(), params)?;
            let mut adamw = candle_nn::AdamW::new_lr(vars.clone(), 1e-3)?;
            b.compare(
                OP,
                &format!("{name} step ({mode})"),
                DType::F32,
                Work::Bytes(bytes),
                || lopt.step(&grads),
                "candle_nn AdamW step",
                || adamw.step(&grads),
            )?;
        }
        // The crate's fused AdamW against candle_nn's on the same parameters (PyTorch's fused
        // AdamW is the anchor of the GPT-2-medium row: "354M/289 AdamW").
        if b.wants_case(&format!("{name} AdamW")) {
            let mut fused = candle_fastops::optim::AdamW::new(
                vars.clone(),
                candle_nn::ParamsAdamW {
                    lr: 1e-3,
                    ..Default::default()
                },
            )?;
            let mut adamw = candle_nn::AdamW::new_lr(vars.clone(), 1e-3)?;
            let case = match name.split_once(' ') {
                Some(("gpt2-medium", rest)) => format!("{rest} AdamW"),
                _ => format!("{name} AdamW"),
            };
            // Reads p, g, m, v and writes p, m, v: 28 bytes per parameter.
            b.compare(
                OP,
                &case,
                DType::F32,
                Work::Bytes(params as f64 * 28.0),
                || fused.step(&grads),
                "candle_nn AdamW step",
                || adamw.step(&grads),
            )?;
        }
        if !dev.is_cuda() {
            let mut params = ParamsSmallFcLOpt::new(mlp.clone());
            params.backend.fused = false;
            let mut composed = SmallFcLOpt::new(vars.clone(), params)?;
            let mut lopt = SmallFcLOpt::new(vars.clone(), ParamsSmallFcLOpt::new(mlp.clone()))?;
            b.compare(
                OP,
                &format!("{name} step (fused vs composed)"),
                DType::F32,
                Work::Bytes(bytes),
                || lopt.step(&grads),
                "composed candle ops (reference)",
                || composed.step(&grads),
            )?;
        }
    }
    b.iterations = None;
    Ok(())
}

/// What a candle user writes today for a masked product: the full product, then `where_cond`.
fn masked_bmm_composite(a: &Tensor, b: &Tensor, mask: &Tensor, fill: &Tensor) -> Result<Tensor> {
    let prod = a.matmul(b)?;
    mask.broadcast_as(prod.shape())?
        .where_cond(&prod, &fill.broadcast_as(prod.shape())?)
}

fn bench_masked_bmm(b: &mut Bench) -> Result<()> {
    const OP: &str = "masked_bmm";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let cases: Vec<(usize, usize, usize, Vec<DType>)> = if dev.is_cuda() {
        vec![
            (64, 2048, 64, vec![DType::F32, DType::BF16]),
            (16, 4096, 128, vec![DType::F32, DType::BF16]),
        ]
    } else {
        vec![
            (8, 512, 64, vec![DType::F32]),
            (2, 1024, 128, vec![DType::F32]),
        ]
    };
    for (batch, size, k, dtypes) in cases {
        let mask = Tensor::tril2(size, DType::U8, &dev)?;
        let plan = candle_fastops::MaskPlan::new(&mask)?;
        for dtype in dtypes {
            let case = format!("causal b={batch} m=n={size} k={k}");
            if !b.wants_case(&format!("{case} {}", dtype.as_str())) {
                continue;
            }
            let q = randn(&[batch, size, k], dtype, &dev)?;
            let kt = randn(&[batch, k, size], dtype, &dev)?;
            let fill = Tensor::full(f32::NEG_INFINITY, (), &dev)?.to_dtype(dtype)?;
            // Dense-equivalent FLOPs: the rate column shows what the skip buys.
            let flops = 2.0 * (batch * size * size * k) as f64;
            b.compare(
                OP,
                &format!("{case} plan"),
                dtype,
                Work::Flops(flops),
                || {
                    candle_fastops::masked_bmm_with_plan(&q, &kt, &mask, &plan, f64::NEG_INFINITY)
                        .map(drop)
                },
                "matmul + where_cond",
                || masked_bmm_composite(&q, &kt, &mask, &fill).map(drop),
            )?;
            b.compare(
                OP,
                &format!("{case} no plan"),
                dtype,
                Work::Flops(flops),
                || candle_fastops::masked_bmm(&q, &kt, &mask, f64::NEG_INFINITY).map(drop),
                "matmul alone",
                || q.matmul(&kt).map(drop),
            )?;
            // Forward and backward (two more products, each skipping the empty tiles' spans).
            let (qv, kv) = (
                candle_core::Var::from_tensor(&q)?,
                candle_core::Var::from_tensor(&kt)?,
            );
            let (qv, kv) = (qv.as_tensor(), kv.as_tensor());
            b.compare(
                OP,
                &format!("{case} fwd+bwd"),
                dtype,
                Work::Flops(3.0 * flops),
                // Backward from the output itself (seeded with ones): a `sum_all` loss would time
                // candle's single-block full reduction instead.
                || {
                    let out = candle_fastops::masked_bmm_with_plan(qv, kv, &mask, &plan, 0.0)?;
                    out.backward().map(drop)
                },
                "matmul + where_cond fwd+bwd",
                || {
                    masked_bmm_composite(qv, kv, &mask, &fill)?
                        .backward()
                        .map(drop)
                },
            )?;
            for (mode, suffix) in OTHER_F32_MODES {
                if !dev.is_cuda() || dtype != DType::F32 {
                    break;
                }
                // Plain FMAs and TF32 (against candle's own TF32 GEMM) next to the default.
                with_f32_mode(mode, || {
                    b.compare(
                        OP,
                        &format!("{case} plan {suffix}"),
                        dtype,
                        Work::Flops(flops),
                        || {
                            candle_fastops::masked_bmm_with_plan(
                                &q,
                                &kt,
                                &mask,
                                &plan,
                                f64::NEG_INFINITY,
                            )
                            .map(drop)
                        },
                        &format!("matmul + where_cond, {suffix}"),
                        || masked_bmm_composite(&q, &kt, &mask, &fill).map(drop),
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// Runs `f` with this crate's f32 matmul kernels in `mode`; TF32 also allows it in candle's f32
/// GEMM (the baseline).
fn with_f32_mode<R>(mode: candle_fastops::F32Matmul, f: impl FnOnce() -> R) -> R {
    candle_fastops::set_f32_matmul(mode);
    #[cfg(feature = "cuda")]
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(
        mode == candle_fastops::F32Matmul::Tf32,
    );
    let r = f();
    candle_fastops::set_f32_matmul(candle_fastops::F32Matmul::default());
    #[cfg(feature = "cuda")]
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(false);
    r
}

/// The non-default f32 modes benched on CUDA, with their row suffixes.
const OTHER_F32_MODES: [(candle_fastops::F32Matmul, &str); 2] = [
    (candle_fastops::F32Matmul::Fma, "fma"),
    (candle_fastops::F32Matmul::Tf32, "tf32"),
];

/// k-means assignment as a candle user writes it: `-2 x.c^T + |c|^2`, argmin, in row chunks so
/// the n x c matrix fits.
fn kmeans_composite(x: &Tensor, centroids: &Tensor, chunk: usize) -> Result<Tensor> {
    let norms = centroids.sqr()?.sum(1)?;
    let ct = centroids.t()?.contiguous()?;
    let mut parts = Vec::new();
    for start in (0..x.dim(0)?).step_by(chunk) {
        let rows = x.narrow(0, start, chunk.min(x.dim(0)? - start))?;
        let scores = rows.matmul(&ct)?.affine(-2.0, 0.0)?.broadcast_add(&norms)?;
        parts.push(scores.argmin(1)?);
    }
    Tensor::cat(&parts, 0)
}

fn bench_kmeans(b: &mut Bench) -> Result<()> {
    const OP: &str = "kmeans_assign";
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let cases: Vec<(usize, usize, usize)> = if dev.is_cuda() {
        vec![(1 << 20, 4096, 128), (1 << 20, 16384, 64)]
    } else {
        vec![(65536, 1024, 64)]
    };
    b.iterations = Some(if dev.is_cuda() { (2, 7) } else { (1, 3) });
    for (n, c, d) in cases {
        let x = randn(&[n, d], DType::F32, &dev)?;
        let centroids = randn(&[c, d], DType::F32, &dev)?;
        let chunk = if dev.is_cuda() { 1 << 16 } else { n };
        b.compare(
            OP,
            &format!("n={n} c={c} d={d}"),
            DType::F32,
            Work::Flops(2.0 * (n * c * d) as f64),
            || candle_fastops::kmeans_assign(&x, &centroids).map(drop),
            &format!("matmul+argmin, chunks of {chunk}"),
            || kmeans_composite(&x, &centroids, chunk).map(drop),
        )?;
        if dev.is_cuda() {
            for (mode, suffix) in OTHER_F32_MODES {
                with_f32_mode(mode, || {
                    b.compare(
                        OP,
                        &format!("n={n} c={c} d={d} {suffix}"),
                        DType::F32,
                        Work::Flops(2.0 * (n * c * d) as f64),
                        || candle_fastops::kmeans_assign(&x, &centroids).map(drop),
                        &format!("matmul+argmin, chunks of {chunk}, {suffix}"),
                        || kmeans_composite(&x, &centroids, chunk).map(drop),
                    )
                })?;
            }
            let (xh, ch) = (x.to_dtype(DType::BF16)?, centroids.to_dtype(DType::BF16)?);
            b.compare(
                OP,
                &format!("n={n} c={c} d={d}"),
                DType::BF16,
                Work::Flops(2.0 * (n * c * d) as f64),
                || candle_fastops::kmeans_assign(&xh, &ch).map(drop),
                &format!("matmul+argmin, chunks of {chunk}"),
                || kmeans_composite(&xh, &ch, chunk).map(drop),
            )?;
        }
    }
    b.iterations = None;
    Ok(())
}

fn bias_add_out(xs: &Tensor, bias: &Tensor, dim: usize) -> Result<()> {
    candle_fastops::bias_add(xs, bias, dim).map(drop)
}

/// What a candle user writes today for masked attention: scores, an additive mask, softmax, values.
/// Scores of 2^31 elements or more go one batch entry at a time (candle's element-wise CUDA
/// kernels count elements in 32 bits), as a user would have to.
fn attention_composite(
    q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64,
) -> Result<Tensor> {
    let (batch, heads, m, _) = q.dims4()?;
    let n = k.dim(2)?;
    if batch > 1 && batch * heads * m * n >= 1 << 31 {
        let parts = (0..batch)
            .map(|i| {
                let one = |t: &Tensor| t.narrow(0, i, 1);
                attention_composite(&one(q)?, &one(k)?, &one(v)?, bias, scale)
            })
            .collect::<Result<Vec<_>>>()?;
        return Tensor::cat(&parts, 0);
    }
    let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(bias)?;
    candle_nn::ops::softmax_last_dim(&scores)?.matmul(v)
}

/// The issue's cases. GPU: bf16, batch 4, 16 heads, head dim 128; causal at 4096 and 8192 tokens,
/// a sliding window of 1024 and causal documents of 1024 tokens at 8192; and causal 4096 at head
/// dim 64 (the other fast path). CPU: f32, batch 1, 8
/// heads, head dim 64, causal at 1024. The composite baseline (scores and an additive mask in the
/// op's dtype) runs where it fits: every forward, and the backward up to 4096 tokens.
fn bench_attention(b: &mut Bench) -> Result<()> {
    /// Whether query i sees key j.
    type Visible = dyn Fn(usize, usize) -> bool;
    const OP: &str = "masked_attention";
    use candle_fastops::AttentionMask;
    if !b.wants(OP) {
        return Ok(());
    }
    let dev = b.device.clone();
    let gpu = dev.is_cuda();
    let (batch, heads, dtype) = if gpu {
        (4, 16, DType::BF16)
    } else {
        (1, 8, DType::F32)
    };
    // (mask, tokens, head dim)
    let cases: &[(&str, usize, usize)] = if gpu {
        &[
            ("causal", 4096, 128),
            ("causal", 8192, 128),
            ("window 1024", 8192, 128),
            ("documents 1024 causal", 8192, 128),
            ("causal", 4096, 64),
            ("causal", 4096, 256),
            ("dense causal", 4096, 128),
        ]
    } else {
        &[("causal", 1024, 64)]
    };
    for &(name, n, d) in cases {
        if !b.wants_case(&format!("{name} b={batch} h={heads} n={n} d={d}")) {
            continue;
        }
        let scale = 1.0 / (d as f64).sqrt();
        let (mask, visible_pairs, keep): (AttentionMask, usize, Box<Visible>) = match name {
            "causal" => (
                AttentionMask::causal(),
                n * (n + 1) / 2,
                Box::new(|i, j| j <= i),
            ),
            "window 1024" => (
                AttentionMask::sliding_window(1024),
                (0..n).map(|i| (i + 1).min(1024)).sum(),
                Box::new(|i, j| j <= i && i - j < 1024),
            ),
            "dense causal" => {
                // The causal mask stored as bytes: the stored-mask kernels.
                let keep: Vec<u8> = (0..n * n).map(|x| u8::from(x % n <= x / n)).collect();
                (
                    AttentionMask::dense(&Tensor::from_vec(keep, (n, n), &dev)?)?,
                    n * (n + 1) / 2,
                    Box::new(|i, j| j <= i),
                )
            }
            _ => {
                let ids: Vec<u32> = (0..batch * n).map(|t| ((t % n) / 1024) as u32).collect();
                let ids = Tensor::from_vec(ids, (batch, n), &dev)?;
                (
                    AttentionMask::documents(&ids, true)?,
                    (n / 1024) * 1024 * 1025 / 2,
                    Box::new(|i, j| j <= i && i / 1024 == j / 1024),
                )
            }
        };
        let (q, k, v) = (
            randn(&[batch, heads, n, d], dtype, &dev)?,
            randn(&[batch, heads, n, d], dtype, &dev)?,
            randn(&[batch, heads, n, d], dtype, &dev)?,
        );
        let flops = 4.0 * (batch * heads * visible_pairs * d) as f64;
        let case = format!("{name} b={batch} h={heads} n={n} d={d}");
        if gpu {
            b.iterations = Some((5, 20));
        }
        let bias: Vec<f32> = (0..n * n)
            .map(|x| {
                if keep(x / n, x % n) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let bias = Tensor::from_vec(bias, (n, n), &dev)?.to_dtype(dtype)?;
        b.compare(
            OP,
            &format!("{case} forward"),
            dtype,
            Work::Flops(flops),
            || candle_fastops::masked_attention(&q, &k, &v, &mask, scale).map(drop),
            "matmul + mask + softmax + matmul",
            || attention_composite(&q, &k, &v, &bias, scale).map(drop),
        )?;
        let (qv, kv, vv) = (
            candle_core::Var::from_tensor(&q)?,
            candle_core::Var::from_tensor(&k)?,
            candle_core::Var::from_tensor(&v)?,
        );
        let ours = || {
            candle_fastops::masked_attention(&qv, &kv, &vv, &mask, scale)?
                .backward()
                .map(drop)
        };
        if n <= 4096 {
            b.compare(
                OP,
                &format!("{case} fwd+bwd"),
                dtype,
                Work::Flops(3.5 * flops),
                ours,
                "the same composite, fwd+bwd",
                || {
                    let scores = (qv.matmul(&kv.t()?)? * scale)?.broadcast_add(&bias)?;
                    candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?
                        .matmul(&vv)?
                        .backward()
                        .map(drop)
                },
            )?;
        } else {
            b.measure(
                OP,
                &format!("{case} fwd+bwd"),
                dtype,
                Work::Flops(3.5 * flops),
                ours,
                "- (the composite's backward does not fit)",
            )?;
        }
        // The default backward against two others: the deterministic one (a dq pass of its own;
        // the default adds dq with atomics, head dim 128 here) and the one that zeroes its own dq
        // accumulator (`dq_in_forward: Some(false)`; by default the Hopper forward, up to head
        // dim 128, zeroes it, holding it until the backward).
        let deterministic = candle_fastops::AttentionOptions {
            scale: Some(scale),
            deterministic: Some(true),
            ..Default::default()
        };
        let dq_in_backward = candle_fastops::AttentionOptions {
            scale: Some(scale),
            dq_in_forward: Some(false),
            ..Default::default()
        };
        let variants = [
            (
                d == 128,
                "deterministic",
                "deterministic backward",
                deterministic,
            ),
            (
                d <= 128,
                "dq zeroed in the backward",
                "dq_in_forward: Some(false)",
                dq_in_backward,
            ),
        ];
        for (wanted, name, what, options) in variants {
            if !(gpu && wanted) {
                continue;
            }
            b.compare(
                OP,
                &format!("{case} fwd+bwd vs {name}"),
                dtype,
                Work::Flops(3.5 * flops),
                ours,
                what,
                || {
                    candle_fastops::masked_attention_with(&qv, &kv, &vv, &mask, &options)?
                        .backward()
                        .map(drop)
                },
            )?;
        }
        // The forward with its log-sum-exp and the backward as a function, from an output
        // gradient made beforehand (as the PyTorch anchors' `backward(grad)`): the same kernels
        // without candle's autograd bookkeeping (the seed, and a zero tensor and an add for each
        // of q, k and v).
        let options = candle_fastops::AttentionOptions {
            scale: Some(scale),
            ..Default::default()
        };
        let grad_out = randn(&[batch, heads, n, d], dtype, &dev)?;
        b.compare(
            OP,
            &format!("{case} fwd+bwd, explicit backward"),
            dtype,
            Work::Flops(3.5 * flops),
            || {
                let (out, lse) =
                    candle_fastops::masked_attention_with_lse(&q, &k, &v, &mask, &options)?;
                candle_fastops::masked_attention_backward(
                    &q,
                    &k,
                    &v,
                    (&out, &lse),
                    &grad_out,
                    &mask,
                    &options,
                )
                .map(drop)
            },
            "the same through candle's autograd (`backward()`)",
            ours,
        )?;
    }
    // One packed projection [b, n, 3 h, d] (causal) to the output projection's input [b, n, h d]:
    // masked_attention_packed (token-major output, so the reshape is free; its gradient is the
    // projection's) against masked_attention on narrow + transpose views of it (its head-major
    // output transposed and reshaped, a copy; the views' gradients go back through candle's
    // narrow, a zero-padded full-size tensor each).
    // The three layout cases below share their problem: causal, b h n d, fwd+bwd.
    let (n, d) = if gpu { (4096, 128) } else { (1024, 64) };
    if gpu {
        b.iterations = Some((5, 20));
    }
    let mask = AttentionMask::causal();
    let options = candle_fastops::AttentionOptions::default();
    let fwd_bwd = Work::Flops(3.5 * 4.0 * (batch * heads * n * (n + 1) / 2 * d) as f64);
    let case = format!("causal b={batch} h={heads} n={n} d={d} packed qkv");
    if b.wants_case(&case) {
        let qkv = candle_core::Var::from_tensor(&randn(&[batch, n, 3 * heads, d], dtype, &dev)?)?;
        b.compare(
            OP,
            &format!("{case} fwd+bwd"),
            dtype,
            fwd_bwd,
            || {
                candle_fastops::masked_attention_packed(&qkv, heads, &mask, &options)?
                    .reshape((batch, n, heads * d))?
                    .backward()
                    .map(drop)
            },
            "masked_attention on narrow views (+ transpose, reshape), fwd+bwd",
            || {
                let part = |i: usize| qkv.narrow(2, i * heads, heads)?.transpose(1, 2);
                candle_fastops::masked_attention_with(
                    &part(0)?,
                    &part(1)?,
                    &part(2)?,
                    &mask,
                    &options,
                )?
                .transpose(1, 2)?
                .reshape((batch, n, heads * d))?
                .backward()
                .map(drop)
            },
        )?;
    }
    // The projection as a linear layer gives it, [b, n, 3 h d], to [b, n, h d]:
    // masked_attention_qkv against masked_attention_packed between the two reshapes a user
    // writes (each a node of candle's graph, whose backward adds a zero tensor and the gradient).
    let case = format!("causal b={batch} h={heads} n={n} d={d} qkv projection");
    if b.wants_case(&case) {
        let qkv = candle_core::Var::from_tensor(&randn(&[batch, n, 3 * heads * d], dtype, &dev)?)?;
        b.compare(
            OP,
            &format!("{case} fwd+bwd"),
            dtype,
            fwd_bwd,
            || {
                candle_fastops::masked_attention_qkv(&qkv, heads, heads, &mask, &options)?
                    .backward()
                    .map(drop)
            },
            "masked_attention_packed between reshapes, fwd+bwd",
            || {
                let qkv4 = qkv.reshape((batch, n, 3 * heads, d))?;
                candle_fastops::masked_attention_packed(&qkv4, heads, &mask, &options)?
                    .reshape((batch, n, heads * d))?
                    .backward()
                    .map(drop)
            },
        )?;
    }
    // Token-major q, k, v [b, n, h, d] (as after `rope_thd`) to [b, n, h d]: masked_attention_tokens
    // against masked_attention on transposed views, its output transposed back and reshaped.
    let case = format!("causal b={batch} h={heads} n={n} d={d} token-major q k v");
    if b.wants_case(&case) {
        let var = || -> Result<candle_core::Var> {
            candle_core::Var::from_tensor(&randn(&[batch, n, heads, d], dtype, &dev)?)
        };
        let (q, k, v) = (var()?, var()?, var()?);
        b.compare(
            OP,
            &format!("{case} fwd+bwd"),
            dtype,
            fwd_bwd,
            || {
                candle_fastops::masked_attention_tokens(&q, &k, &v, &mask, &options)?
                    .reshape((batch, n, heads * d))?
                    .backward()
                    .map(drop)
            },
            "masked_attention on transposed views (+ transpose, reshape), fwd+bwd",
            || {
                let heads_first = |t: &candle_core::Var| t.transpose(1, 2);
                candle_fastops::masked_attention_with(
                    &heads_first(&q)?,
                    &heads_first(&k)?,
                    &heads_first(&v)?,
                    &mask,
                    &options,
                )?
                .transpose(1, 2)?
                .reshape((batch, n, heads * d))?
                .backward()
                .map(drop)
            },
        )?;
    }
    b.iterations = None;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let force_cpu = args.iter().any(|a| a == "--cpu");
    let filters = args.into_iter().filter(|a| !a.starts_with("--")).collect();
    let device = if force_cpu || !cfg!(feature = "cuda") {
        Device::Cpu
    } else {
        Device::new_cuda(0).unwrap_or_else(|e| {
            eprintln!("no usable CUDA device ({e}): benchmarking the CPU");
            Device::Cpu
        })
    };
    println!("device: {:?}", device.location());
    let mut bench = Bench {
        device,
        filters,
        rows: Vec::new(),
        iterations: None,
    };
    print_header();
    bench_bias_add(&mut bench)?;
    bench_softmax(&mut bench)?;
    bench_sparse_linear(&mut bench)?;
    bench_small_fc_lopt(&mut bench)?;
    bench_masked_bmm(&mut bench)?;
    bench_kmeans(&mut bench)?;
    bench_attention(&mut bench)?;
    match bench.write_jsonl() {
        Ok(path) => println!("rows appended to {}", path.display()),
        Err(e) => eprintln!("could not write bench rows: {e}"),
    }
    Ok(())
}
