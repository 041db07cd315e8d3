//! Helpers shared by every integration test: devices to run on, fresh random inputs, f64
//! references and tolerance checks.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};
use rand::{Rng, SeedableRng};
use std::sync::OnceLock;

/// Whether the heaviest tests should shrink their sizes (`FASTOPS_TEST_LIGHT=1`): the GPU
/// bundle's sanitize mode sets it, since compute-sanitizer slows kernels by orders of magnitude.
/// Light sizes still cover every code path the full ones do.
pub fn light() -> bool {
    std::env::var("FASTOPS_TEST_LIGHT").is_ok_and(|v| v == "1")
}

/// The devices every test runs on: the CPU, plus CUDA device 0 when the crate is built with
/// `cuda` and a GPU is present. Prints once, clearly, when the GPU is skipped.
pub fn devices() -> Vec<Device> {
    static GPU: OnceLock<Option<Device>> = OnceLock::new();
    let gpu = GPU.get_or_init(|| {
        // Poisoned outputs make an element a kernel forgets to write fail the comparison.
        candle_fastops::set_poison_outputs(true);
        if !cfg!(feature = "cuda") {
            say("note: built without the `cuda` feature: GPU tests skipped, CPU only");
            return None;
        }
        match Device::new_cuda(0) {
            Ok(dev) => {
                say("note: running every test on the CPU and on CUDA device 0");
                Some(dev)
            }
            Err(e) => {
                let reason = e.to_string();
                let reason = reason.lines().next().unwrap_or("unknown error");
                say(&format!(
                    "note: no usable CUDA device ({reason}): GPU tests SKIPPED, CPU only"
                ));
                None
            }
        }
    });
    std::iter::once(Device::Cpu).chain(gpu.clone()).collect()
}

/// Writes straight to stderr, past the test harness's output capture, so the note is seen.
fn say(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// The GPU, when there is one.
pub fn gpu() -> Option<Device> {
    devices().into_iter().find(|d| d.is_cuda())
}

/// Runs `f` on every device of [`devices`], naming the device in any failure.
pub fn for_each_device(mut f: impl FnMut(&Device) -> Result<()>) {
    for dev in devices() {
        if let Err(e) = f(&dev) {
            panic!("failed on {:?}: {e}", dev.location());
        }
    }
}

/// Float dtypes an op supports on `dev` (f64 only on the CPU).
pub fn float_dtypes(dev: &Device) -> Vec<DType> {
    let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
    if dev.is_cpu() {
        dtypes.push(DType::F64);
    }
    dtypes
}

/// A random generator seeded freshly per process (printed so a failure can be replayed with
/// `FASTOPS_TEST_SEED=<seed>`), advanced per call so every tensor differs.
pub fn rng(salt: u64) -> rand::rngs::StdRng {
    static SEED: OnceLock<u64> = OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let seed = std::env::var("FASTOPS_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0x5eed)
            });
        say(&format!("test seed: FASTOPS_TEST_SEED={seed}"));
        seed
    });
    rand::rngs::StdRng::seed_from_u64(seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Uniform values in [-scale, scale), never all zero, as a tensor of `dtype` on `dev`.
/// The values are rounded to `dtype` first, so references built from [`to_f64`] see exactly the
/// op's inputs.
pub fn rand_tensor(
    shape: &[usize], scale: f64, dtype: DType, dev: &Device, salt: u64,
) -> Result<Tensor> {
    let mut rng = rng(salt);
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)
}

/// Every element as f64, in row-major order of the tensor's logical layout. Converted on the
/// CPU: candle's CUDA cast cannot launch on an empty tensor.
pub fn to_f64(t: &Tensor) -> Result<Vec<f64>> {
    // candle's `to_vec1` slices an empty view from its start offset, which may lie past the end
    // of its empty storage (an empty `narrow` of a wider tensor).
    if t.elem_count() == 0 {
        return Ok(Vec::new());
    }
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// Grows `path_max[i]` to the largest magnitude any element of `values[i]` has held (new entries
/// start at `floor`). Optimizer comparisons scale their tolerance by it: rounding a parameter
/// costs an ulp of its value at the time, an error that stays when later steps carry the value
/// towards zero.
pub fn grow_path_max(path_max: &mut Vec<f64>, values: &[Vec<f64>], floor: f64) {
    path_max.resize(values.len(), floor);
    for (m, x) in path_max.iter_mut().zip(values) {
        *m = x.iter().fold(m.max(floor), |m, v| m.max(v.abs()));
    }
}

/// Relative tolerance of one rounding to `dtype`, with some slack.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => 0.0,
    }
}

/// Checks `actual` against `expected` elementwise: |a - e| <= tol * max(|e|, 1). NaN anywhere
/// in `actual` (a poisoned, unwritten element) fails unless `expected` is NaN there too.
pub fn assert_close(actual: &[f64], expected: &[f64], tol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length mismatch");
    let mut worst = (0usize, 0f64);
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        if e.is_nan() {
            assert!(a.is_nan(), "{what}: element {i} is {a}, expected NaN");
            continue;
        }
        if e.is_infinite() {
            assert_eq!(a, e, "{what}: element {i}");
            continue;
        }
        let err = (a - e).abs() / e.abs().max(1.0);
        assert!(
            err.is_finite(),
            "{what}: element {i} is {a}, expected {e} (unwritten?)"
        );
        if err > worst.1 {
            worst = (i, err);
        }
    }
    assert!(
        worst.1 <= tol,
        "{what}: element {} is {}, expected {} (error {:.3e} > tolerance {tol:.1e})",
        worst.0,
        actual[worst.0],
        expected[worst.0],
        worst.1
    );
}

/// `a . b` in f64 for row-major `a` `[batch, m, k]` and `b` `[batch, k, n]`.
pub fn product(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0f64; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            for p in 0..k {
                let x = a[(bi * m + i) * k + p];
                for j in 0..n {
                    out[(bi * m + i) * n + j] += x * b[(bi * k + p) * n + j];
                }
            }
        }
    }
    out
}

/// Row-wise argmin of `scale * (a . b) + bias` in f64, ties to the lowest column; also returns
/// each row's scores.
pub fn argmin_reference(
    a: &[f64], b: &[f64], bias: &[f64], scale: f64, (batch, m, k, n): (usize, usize, usize, usize),
) -> Vec<Vec<f64>> {
    let p = product(a, b, batch, m, k, n);
    (0..batch * m)
        .map(|r| (0..n).map(|j| scale * p[r * n + j] + bias[j]).collect())
        .collect()
}

/// The chosen column must score within `tol` of the row's minimum (near ties may go either way
/// between devices); when the best is separated from the runner-up by more, it must be exact.
pub fn check_argmin(got: &[u32], scores: &[Vec<f64>], tol: f64, what: &str) {
    assert_eq!(got.len(), scores.len(), "{what}: length");
    for (r, (&j, row)) in got.iter().zip(scores).enumerate() {
        let (best_j, best) =
            row.iter().enumerate().fold(
                (0, f64::INFINITY),
                |acc, (j, &v)| if v < acc.1 { (j, v) } else { acc },
            );
        let spread = row.iter().fold(0f64, |m, v| m.max(v.abs())).max(1.0);
        assert!(
            (j as usize) < row.len(),
            "{what}: row {r}: index {j} out of range"
        );
        let err = (row[j as usize] - best) / spread;
        assert!(
            err <= tol,
            "{what}: row {r}: picked {j} (score {}), best {best_j} (score {best}), error {err:.2e}",
            row[j as usize]
        );
    }
}
