//! Past 2^31 elements: every op on an operand or output larger than `i32::MAX` elements, on the
//! GPU, with rows sampled across the whole range (the last rows included, where 32-bit offsets
//! would wrap) checked against an f64 reference on the CPU. They need a GPU with about 60 GB
//! free and take seconds each, so they are `#[ignore]`d: the GPU bundle runs them with
//! `--ignored scale::` (TESTING.md).

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
use candle_nn::Optimizer;
use rand::Rng;

const BIG: usize = 1 << 31;

/// Row indices to check in `rows` rows: the first, the last, and some in between.
fn sampled(rows: usize) -> Vec<usize> {
    let mut r = vec![0, 1, rows / 3, rows / 2, rows - 2, rows - 1];
    r.dedup();
    r
}

/// Row `r` of `t` (along dim 0) on the CPU as f64, converted on the device first: candle's
/// `to_device` copies a view's whole storage, and a cast makes a tensor of the view alone.
fn row(t: &Tensor, r: usize) -> Result<Vec<f64>> {
    to_f64(&t.narrow(0, r, 1)?.to_dtype(DType::F64)?)
}

/// Column `c` of a matrix, as [`row`] does it.
fn col(t: &Tensor, c: usize) -> Result<Vec<f64>> {
    to_f64(&t.narrow(1, c, 1)?.to_dtype(DType::F64)?)
}

fn uniform(shape: &[usize], dev: &Device) -> Result<Tensor> {
    Tensor::rand(-1f32, 1f32, shape, dev)
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn bias_add_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (rows, cols) = (32769, 65536);
    assert!(rows * cols > BIG);
    let xs = uniform(&[rows, cols], &dev)?;
    let bias = uniform(&[cols], &dev)?;
    let ys = candle_fastops::bias_add(&xs, &bias, 1)?;
    let b = to_f64(&bias)?;
    for r in sampled(rows) {
        let x = row(&xs, r)?;
        let expected: Vec<f64> = x.iter().zip(&b).map(|(x, b)| x + b).collect();
        assert_close(&row(&ys, r)?, &expected, 1e-6, &format!("bias_add row {r}"));
    }
    // In place, along the leading dim.
    let bias0 = uniform(&[rows], &dev)?;
    let before: Vec<Vec<f64>> = sampled(rows)
        .into_iter()
        .map(|r| row(&xs, r))
        .collect::<Result<_>>()?;
    candle_fastops::bias_add_(&xs, &bias0, 0)?;
    let b0 = to_f64(&bias0)?;
    for (r, x) in sampled(rows).into_iter().zip(before) {
        let expected: Vec<f64> = x.iter().map(|x| x + b0[r]).collect();
        assert_close(
            &row(&xs, r)?,
            &expected,
            1e-6,
            &format!("bias_add_ row {r}"),
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn bias_add_clipped_relu_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (rows, cols) = (32769, 65536);
    // bf16 keeps the autograd buffers (input, output, seed, gradient, candle's sum) near 22 GB.
    let xs = Var::from_tensor(&uniform(&[rows, cols], &dev)?.to_dtype(DType::BF16)?)?;
    let bias = Var::from_tensor(&(uniform(&[cols], &dev)? * 0.5)?.to_dtype(DType::BF16)?)?;
    let options = candle_fastops::BiasAddOptions {
        activation: candle_fastops::Activation::ClippedRelu { ceiling: 0.5 },
    };
    let ys = candle_fastops::bias_add_with(&xs, &bias, 1, &options)?;
    let grads = ys.sum_all()?.backward()?;
    let grad_xs = grads.get(&xs).expect("gradient of xs");
    let b = to_f64(&bias)?;
    for r in sampled(rows) {
        let x = row(&xs, r)?;
        let expected: Vec<f64> = x
            .iter()
            .zip(&b)
            .map(|(x, b)| (x + b).clamp(0.0, 0.5))
            .collect();
        let y = row(&ys, r)?;
        assert_close(&y, &expected, 1e-2, &format!("clipped bias_add row {r}"));
        let expected_grad: Vec<f64> = y
            .iter()
            .map(|&y| if y > 0.0 && y < 0.5 { 1.0 } else { 0.0 })
            .collect();
        assert_eq!(
            row(grad_xs, r)?,
            expected_grad,
            "clipped ReLU gradient row {r}"
        );
    }
    Ok(())
}

/// The f64 softmax of one group.
fn softmax_reference(x: &[f64]) -> Vec<f64> {
    crate::softmax::reference(x, &[x.len()], &[0], false)
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn softmax_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (rows, cols) = (32769, 65536);
    let xs = uniform(&[rows, cols], &dev)?;
    // Last dim: each row a group.
    let ys = candle_fastops::softmax_dims(&xs, [1])?;
    for r in sampled(rows) {
        let expected = softmax_reference(&row(&xs, r)?);
        assert_close(
            &row(&ys, r)?,
            &expected,
            1e-6,
            &format!("softmax last dim row {r}"),
        );
    }
    drop(ys);
    // A non-last set: dim 0, each column a group of 32769 strided elements.
    let ys = candle_fastops::softmax_dims(&xs, [0])?;
    for c in sampled(cols) {
        let (x, got) = (col(&xs, c)?, col(&ys, c)?);
        assert_close(
            &got,
            &softmax_reference(&x),
            1e-6,
            &format!("softmax dim 0 col {c}"),
        );
    }
    drop(ys);
    // Rows of 2048: a block per row on the GPU.
    let short = xs.reshape((rows * 32, 2048))?;
    let ys = candle_fastops::softmax_dims(&short, [1])?;
    for r in sampled(rows * 32) {
        let expected = softmax_reference(&row(&short, r)?);
        assert_close(&row(&ys, r)?, &expected, 1e-6, &format!("row block {r}"));
    }
    drop(ys);
    // Column groups of 1024 x 8 lanes: staged in shared memory on the GPU.
    let lanes = xs.reshape((rows * 8, 1024, 8))?;
    let ys = candle_fastops::softmax_dims(&lanes, [1])?;
    for g in sampled(rows * 8) {
        for lane in [0, 5] {
            let x = to_f64(&lanes.get(g)?.narrow(1, lane, 1)?.flatten_all()?)?;
            let got = to_f64(&ys.get(g)?.narrow(1, lane, 1)?.flatten_all()?)?;
            assert_close(
                &got,
                &softmax_reference(&x),
                1e-6,
                &format!("staged group {g} lane {lane}"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn sparse_linear_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (batch, active, num_inputs, out) = ((1 << 21) + 3, 32, 1000, 1024);
    assert!(batch * out > BIG);
    // Random indices in [0, num_inputs), each row ending at a random -1 (or full).
    let mut rng = rng(31);
    let mut host = vec![-1i32; batch * active];
    for row in host.chunks_mut(active) {
        let len = rng.random_range(0..=active);
        for slot in &mut row[..len] {
            *slot = rng.random_range(0..num_inputs as i32);
        }
    }
    let idx = Tensor::from_vec(host, (batch, active), &dev)?;
    let weight = uniform(&[num_inputs, out], &dev)?;
    let bias = uniform(&[out], &dev)?;
    let ys = candle_fastops::sparse_linear(&idx, None, &weight, &bias)?;
    let (w, b) = (to_f64(&weight)?, to_f64(&bias)?);
    for r in sampled(batch) {
        let mut expected = b.clone();
        for i in to_f64(&idx.narrow(0, r, 1)?)? {
            if i < 0.0 {
                break;
            }
            let i = i as usize;
            for (e, wv) in expected.iter_mut().zip(&w[i * out..(i + 1) * out]) {
                *e += wv;
            }
        }
        assert_close(
            &row(&ys, r)?,
            &expected,
            2e-5,
            &format!("sparse_linear row {r}"),
        );
    }
    drop(ys);
    // Backward of the sum: an output gradient of ones past 2^31 elements, so each weight
    // gradient row is its feature's count in every column and the bias gradient the batch.
    let (wv, bv) = (Var::from_tensor(&weight)?, Var::from_tensor(&bias)?);
    let grads = candle_fastops::sparse_linear(&idx, None, &wv, &bv)?
        .sum_all()?
        .backward()?;
    let mut counts = vec![0f64; num_inputs];
    for i in idx
        .flatten_all()?
        .to_vec1::<i32>()?
        .chunks(active)
        .flat_map(|r| {
            r.iter()
                .take_while(|&&i| i >= 0)
                .copied()
                .collect::<Vec<_>>()
        })
    {
        counts[i as usize] += 1.0;
    }
    let gw = to_f64(grads.get(&wv).expect("weight gradient"))?;
    for (i, &c) in counts.iter().enumerate() {
        let want = vec![c; out];
        assert_close(
            &gw[i * out..(i + 1) * out],
            &want,
            1e-6,
            &format!("weight grad row {i}"),
        );
    }
    let gb = to_f64(grads.get(&bv).expect("bias gradient"))?;
    assert_close(&gb, &vec![batch as f64; out], 1e-6, "bias grad");
    Ok(())
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn masked_bmm_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (batch, m, k) = (129, 4096, 64);
    assert!(batch * m * m > BIG);
    let a = uniform(&[batch, m, k], &dev)?;
    let bt = uniform(&[batch, m, k], &dev)?;
    let causal = Tensor::tril2(m, DType::U8, &dev)?;
    let out = candle_fastops::masked_bmm(&a, &bt.transpose(1, 2)?, &causal, -1e9)?;
    for bi in [0, batch / 2, batch - 1] {
        let bmat = to_f64(&bt.get(bi)?.to_dtype(DType::F64)?)?; // [m, k]
        for r in sampled(m) {
            let arow = row(&a.get(bi)?, r)?;
            let expected: Vec<f64> = (0..m)
                .map(|j| {
                    if j <= r {
                        (0..k).map(|p| arow[p] * bmat[j * k + p]).sum()
                    } else {
                        -1e9
                    }
                })
                .collect();
            let got = row(&out.get(bi)?, r)?;
            assert_close(&got, &expected, 1e-5, &format!("masked_bmm [{bi}, {r}]"));
        }
    }
    drop(out);
    // The backward of sum(out): the output gradient masked by tiles (an element past 2^31 in
    // each of the last batch entries), then grad_a[i] = sum_{j <= i} bt[j] and
    // grad_bt[j] = sum_{i >= j} a[i]. Here a and b are row-major ([batch, m, k], [batch, k, m]:
    // what the Hopper grad_a and grad_b kernels take on an H200;
    // CANDLE_FASTOPS_MATMUL_KERNELS=portable runs the portable ones).
    let (av, bv) = (
        Var::from_tensor(&a)?,
        Var::from_tensor(&bt.transpose(1, 2)?.contiguous()?)?,
    );
    let out = candle_fastops::masked_bmm(av.as_tensor(), bv.as_tensor(), &causal, -1e9)?;
    let grads = out.sum_all()?.backward()?;
    drop(out);
    let grad_a = grads.get(av.as_tensor()).expect("grad a");
    let grad_bt = grads.get(bv.as_tensor()).expect("grad b").transpose(1, 2)?;
    for bi in [0, batch - 1] {
        let (amat, bmat) = (
            to_f64(&a.get(bi)?.to_dtype(DType::F64)?)?,
            to_f64(&bt.get(bi)?.to_dtype(DType::F64)?)?,
        );
        for r in sampled(m) {
            let want_a: Vec<f64> = (0..k)
                .map(|p| (0..=r).map(|j| bmat[j * k + p]).sum())
                .collect();
            let want_bt: Vec<f64> = (0..k)
                .map(|p| (r..m).map(|i| amat[i * k + p]).sum())
                .collect();
            assert_close(
                &row(&grad_a.get(bi)?, r)?,
                &want_a,
                1e-4,
                &format!("grad a [{bi}, {r}]"),
            );
            assert_close(
                &row(&grad_bt.get(bi)?, r)?,
                &want_bt,
                1e-4,
                &format!("grad bt [{bi}, {r}]"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn argmin_matmul_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (n, d, c) = ((1 << 24) + 5, 128, 256);
    assert!(n * d > BIG);
    let x = uniform(&[n, d], &dev)?;
    let centroids = uniform(&[c, d], &dev)?;
    let assign = candle_fastops::kmeans_assign(&x, &centroids)?;
    let cent = to_f64(&centroids)?;
    let rows = sampled(n);
    let got: Vec<u32> = rows
        .iter()
        .map(|&r| row(&assign, r).map(|v| v[0] as u32))
        .collect::<Result<_>>()?;
    let scores: Vec<Vec<f64>> = rows
        .iter()
        .map(|&r| {
            let xr = row(&x, r)?;
            Ok((0..c)
                .map(|j| {
                    (0..d)
                        .map(|p| (xr[p] - cent[j * d + p]).powi(2))
                        .sum::<f64>()
                })
                .collect())
        })
        .collect::<Result<_>>()?;
    check_argmin(&got, &scores, 1e-5, "kmeans_assign past 2^31");
    Ok(())
}

/// A 32769 x 65536 parameter (> 2^31 elements) whose parameter and gradient repeat a random
/// 3 x 65536 block: every per-tensor statistic (feature norms, Adafactor row and column means)
/// then equals the block's, so each row of the big step must match the step of the block alone.
#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn small_fc_lopt_tensor_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (period, repeats, cols) = (3, 10923, 65536);
    let rows = period * repeats;
    assert!(rows * cols > BIG);
    let block = uniform(&[period, cols], &dev)?;
    let block_grad = (uniform(&[period, cols], &dev)? * 0.1)?;
    let mlp = MlpWeights::from_safetensors(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/small_fc_lopt_mlp.safetensors"
        ),
        &dev,
    )?;
    let params = ParamsSmallFcLOpt::new(mlp);
    let small = Var::from_tensor(&block)?;
    let big = Var::from_tensor(&block.repeat((repeats, 1))?)?;
    let mut grads_small = candle_core::backprop::GradStore::default();
    grads_small.insert(small.as_tensor(), block_grad.clone());
    let mut grads_big = candle_core::backprop::GradStore::default();
    grads_big.insert(big.as_tensor(), block_grad.repeat((repeats, 1))?);
    let mut opt_small = SmallFcLOpt::new(vec![small.clone()], params.clone())?;
    let mut opt_big = SmallFcLOpt::new(vec![big.clone()], params)?;
    for _ in 0..2 {
        opt_small.step(&grads_small)?;
        opt_big.step(&grads_big)?;
    }
    let expected: Vec<Vec<f64>> = (0..period)
        .map(|r| row(small.as_tensor(), r))
        .collect::<Result<_>>()?;
    let moved = (big.as_tensor().narrow(0, rows - period, period)? - &block)?
        .abs()?
        .max_keepdim(D::Minus1)?
        .contiguous()?;
    assert!(
        to_f64(&moved)?.iter().all(|&d| d > 0.0),
        "the last rows were not updated"
    );
    for r in sampled(rows) {
        assert_close(
            &row(big.as_tensor(), r)?,
            &expected[r % period],
            1e-5,
            &format!("small_fc_lopt row {r}"),
        );
    }
    Ok(())
}

/// `[1, heads, m, d]` slices of rows `rows` of head `h` of `t`, as f32 on the CPU.
fn head_rows(t: &Tensor, h: usize, rows: std::ops::Range<usize>) -> Result<Tensor> {
    t.narrow(1, h, 1)?
        .narrow(2, rows.start, rows.len())?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)
}

/// masked_attention_packed with the packed projection and its gradient past 2^31 elements (bf16
/// `[1, m, 3 * 16, 128]`, sliding window 64) and the token-major output past 2^30: token rows
/// `s..e` of every head, cut out and run on the CPU, give the rows whose keys (for the gradient,
/// also whose queries) lie inside the cut.
#[test]
#[ignore = "needs a GPU with ~40 GB free; run with --ignored"]
fn masked_attention_packed_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (heads, m, d, window) = (16, 350_003, 128, 64);
    assert!(m * 3 * heads * d > BIG);
    let mask = candle_fastops::AttentionMask::sliding_window(window);
    let options = candle_fastops::AttentionOptions::default();
    let qkv = Var::from_tensor(&uniform(&[1, m, 3 * heads, d], &dev)?.to_dtype(DType::BF16)?)?;
    let w = uniform(&[1, m, heads, d], &dev)?.to_dtype(DType::BF16)?;
    let out = candle_fastops::masked_attention_packed(&qkv, heads, &mask, &options)?;
    let grads = (&out * &w)?.sum_all()?.backward()?;
    let grad = grads.get(&qkv).expect("the packed gradient");
    let cut = 300;
    let tokens = |t: &Tensor, range: std::ops::Range<usize>| -> Result<Tensor> {
        t.narrow(1, range.start, range.len())?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)
    };
    for s in [0, m / 2, m - cut] {
        let e = s + cut;
        let first = if s == 0 { 0 } else { s + window - 1 };
        let last_key = if e == m { e } else { e - window };
        let cpu_qkv = Var::from_tensor(&tokens(&qkv, s..e)?)?;
        let want = candle_fastops::masked_attention_packed(&cpu_qkv, heads, &mask, &options)?;
        let want_grads = (&want * tokens(&w, s..e)?)?.sum_all()?.backward()?;
        let want_grad = want_grads.get(&cpu_qkv).expect("the packed gradient");
        let rows = |t: &Tensor, range: std::ops::Range<usize>| -> Result<Vec<f64>> {
            to_f64(&t.narrow(1, range.start - s, range.len())?)
        };
        let what = format!("tokens {s}..{e}");
        assert_close(
            &rows(&tokens(&out, s..e)?, first..e)?,
            &rows(&want, first..e)?,
            3e-2,
            &format!("{what} output"),
        );
        assert_close(
            &rows(&tokens(grad, s..e)?, first..last_key)?,
            &rows(want_grad, first..last_key)?,
            5e-2,
            &format!("{what} gradient"),
        );
    }
    Ok(())
}

/// masked_attention with q, k, v, the output and every gradient past 2^31 elements (bf16, the
/// tensor-core kernels; the gradients through autograd and through `masked_attention_backward`),
/// under a sliding window of 64 so the work stays linear. A window makes
/// attention local: rows `s..e` of one head, cut out and run on the CPU, give exactly the rows
/// whose keys (and, for key gradients, whose queries) all lie inside the cut.
///
/// Memory: each bf16 operand is 4.3 GB; q, k and v live only as the variables (the explicit
/// backward reads them detached) and only their three gradients are kept from the autograd pass,
/// so the peak is about 60 GB (an 80 GB card holds it).
#[test]
#[ignore = "needs a GPU with ~64 GB free; run with --ignored"]
fn masked_attention_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (heads, m, d, window) = (32, 524_309, 128, 64);
    assert!(heads * m * d > BIG);
    let mask = candle_fastops::AttentionMask::sliding_window(window);
    let bf16 = || uniform(&[1, heads, m, d], &dev)?.to_dtype(DType::BF16);
    let vars = [
        Var::from_tensor(&bf16()?)?,
        Var::from_tensor(&bf16()?)?,
        Var::from_tensor(&bf16()?)?,
    ];
    let w = bf16()?;
    let scale = 1.0 / (d as f64).sqrt();
    let out = candle_fastops::masked_attention(&vars[0], &vars[1], &vars[2], &mask, scale)?;
    let autograd = {
        let grads = (&out * &w)?.sum_all()?.backward()?;
        vars.each_ref()
            .map(|var| grads.get(var).expect("a gradient").clone())
    };
    let [q, k, v] = vars.each_ref().map(|var| var.as_tensor().detach());
    // The backward as a function, from the forward's output and log-sum-exp.
    let options = candle_fastops::AttentionOptions {
        scale: Some(scale),
        ..Default::default()
    };
    let (out_lse, lse) = candle_fastops::masked_attention_with_lse(&q, &k, &v, &mask, &options)?;
    let (dq, dk, dv) = candle_fastops::masked_attention_backward(
        &q,
        &k,
        &v,
        (&out_lse, &lse),
        &w,
        &mask,
        &options,
    )?;
    let explicit = [dq, dk, dv];
    let cut = 300;
    for h in [0, heads - 1] {
        for s in [0, m / 2, m - cut] {
            let e = s + cut;
            // Rows whose keys are all inside the cut, and keys whose queries are.
            let first = if s == 0 { 0 } else { s + window - 1 };
            let last_key = if e == m { e } else { e - window };
            let part = |t: &Tensor| head_rows(t, h, s..e);
            let cpu_vars = [
                Var::from_tensor(&part(&q)?)?,
                Var::from_tensor(&part(&k)?)?,
                Var::from_tensor(&part(&v)?)?,
            ];
            let want = candle_fastops::masked_attention(
                &cpu_vars[0],
                &cpu_vars[1],
                &cpu_vars[2],
                &mask,
                scale,
            )?;
            let want_grads = (&want * part(&w)?)?.sum_all()?.backward()?;
            let rows = |t: &Tensor, range: std::ops::Range<usize>| -> Result<Vec<f64>> {
                to_f64(&t.narrow(2, range.start - s, range.len())?)
            };
            let what = format!("head {h} rows {s}..{e}");
            assert_close(
                &rows(&head_rows(&out, h, s..e)?, first..e)?,
                &rows(&want, first..e)?,
                3e-2,
                &format!("{what} output"),
            );
            for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
                let range = if i == 0 { first..e } else { first..last_key };
                let want = want_grads.get(&cpu_vars[i]).expect("a gradient");
                for (how, got) in [("autograd", &autograd[i]), ("explicit", &explicit[i])] {
                    let got = head_rows(got, h, s..e)?;
                    assert_close(
                        &rows(&got, range.clone())?,
                        &rows(want, range.clone())?,
                        5e-2,
                        &format!("{what} {name} ({how})"),
                    );
                }
            }
        }
    }
    Ok(())
}

/// masked_attention_tokens with token-major q, k, v, the output and every gradient past 2^31
/// elements (bf16 `[1, m, 32, 128]`, sliding window 64): token rows `s..e` of every head, cut out
/// and run on the CPU, give the rows whose keys (for key gradients, also whose queries) lie
/// inside the cut.
#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn masked_attention_tokens_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let (heads, m, d, window) = (32, 524_309, 128, 64);
    assert!(m * heads * d > BIG);
    let mask = candle_fastops::AttentionMask::sliding_window(window);
    let options = candle_fastops::AttentionOptions::default();
    let bf16 = || uniform(&[1, m, heads, d], &dev)?.to_dtype(DType::BF16);
    let w = bf16()?;
    let vars = [
        Var::from_tensor(&bf16()?)?,
        Var::from_tensor(&bf16()?)?,
        Var::from_tensor(&bf16()?)?,
    ];
    let out =
        candle_fastops::masked_attention_tokens(&vars[0], &vars[1], &vars[2], &mask, &options)?;
    let grads = (&out * &w)?.sum_all()?.backward()?;
    let cut = 300;
    let tokens = |t: &Tensor, range: std::ops::Range<usize>| -> Result<Tensor> {
        t.narrow(1, range.start, range.len())?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)
    };
    for s in [0, m / 2, m - cut] {
        let e = s + cut;
        let first = if s == 0 { 0 } else { s + window - 1 };
        let last_key = if e == m { e } else { e - window };
        let cpu_vars = [
            Var::from_tensor(&tokens(&vars[0], s..e)?)?,
            Var::from_tensor(&tokens(&vars[1], s..e)?)?,
            Var::from_tensor(&tokens(&vars[2], s..e)?)?,
        ];
        let want = candle_fastops::masked_attention_tokens(
            &cpu_vars[0],
            &cpu_vars[1],
            &cpu_vars[2],
            &mask,
            &options,
        )?;
        let want_grads = (&want * tokens(&w, s..e)?)?.sum_all()?.backward()?;
        let rows = |t: &Tensor, range: std::ops::Range<usize>| -> Result<Vec<f64>> {
            to_f64(&t.narrow(1, range.start - s, range.len())?)
        };
        let what = format!("tokens {s}..{e}");
        assert_close(
            &rows(&tokens(&out, s..e)?, first..e)?,
            &rows(&want, first..e)?,
            3e-2,
            &format!("{what} output"),
        );
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let range = if i == 0 { first..e } else { first..last_key };
            let got = tokens(grads.get(&vars[i]).expect("a gradient"), s..e)?;
            let want = want_grads.get(&cpu_vars[i]).expect("a gradient");
            assert_close(
                &rows(&got, range.clone())?,
                &rows(want, range)?,
                5e-2,
                &format!("{what} {name}"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU with ~60 GB free; run with --ignored"]
fn adamw_past_2_31() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // One variable of more than 2^31 elements and a small one in the same launch.
    let (rows, cols) = (32769, 65536);
    assert!(rows * cols > BIG);
    let big = Var::from_tensor(&uniform(&[rows, cols], &dev)?)?;
    let small = Var::from_tensor(&uniform(&[3, 5], &dev)?)?;
    let p = candle_nn::ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = candle_fastops::optim::AdamW::new(vec![big.clone(), small.clone()], p.clone())?;
    let before: Vec<Vec<f64>> = sampled(rows)
        .into_iter()
        .map(|r| row(&big, r))
        .collect::<Result<_>>()?;
    let mut grads_by_step = Vec::new();
    for _ in 0..2 {
        let g = uniform(&[rows, cols], &dev)?;
        let mut store = candle_core::backprop::GradStore::default();
        store.insert(big.as_tensor(), g.clone());
        store.insert(small.as_tensor(), uniform(&[3, 5], &dev)?);
        opt.step(&store)?;
        grads_by_step.push(
            sampled(rows)
                .into_iter()
                .map(|r| row(&g, r))
                .collect::<Result<Vec<_>>>()?,
        );
    }
    for (k, r) in sampled(rows).into_iter().enumerate() {
        let mut theta = before[k].clone();
        let (mut m, mut v) = (vec![0f64; cols], vec![0f64; cols]);
        for (t, grads) in grads_by_step.iter().enumerate() {
            let t = (t + 1) as f64;
            let (sm, sv) = (1.0 / (1.0 - p.beta1.powf(t)), 1.0 / (1.0 - p.beta2.powf(t)));
            for j in 0..cols {
                let g = grads[k][j];
                m[j] = p.beta1 * m[j] + (1.0 - p.beta1) * g;
                v[j] = p.beta2 * v[j] + (1.0 - p.beta2) * g * g;
                let upd = (m[j] * sm) / ((v[j] * sv).sqrt() + p.eps);
                theta[j] = theta[j] * (1.0 - p.lr * p.weight_decay) - p.lr * upd;
            }
        }
        assert_close(&row(&big, r)?, &theta, 1e-5, &format!("adamw row {r}"));
    }
    Ok(())
}
