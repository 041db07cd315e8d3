//! masked_attention against an f64 reference written from the definition (every mask kind,
//! dtype, m != n, grouped-query heads, strided views, rows that see no key), gradients against
//! candle's composed attention, the log-sum-exp, and bad input, on the CPU and on CUDA (the
//! tensor-core kernels for f16 / bf16 at every padded head dim, the row kernels for f32).

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_fastops::{
    masked_attention, masked_attention_backward, masked_attention_combine, masked_attention_packed,
    masked_attention_qkv, masked_attention_tokens, masked_attention_with,
    masked_attention_with_lse, AttentionMask, AttentionOptions,
};

/// The mask of a test, with its definition for the reference.
#[derive(Clone)]
enum Spec {
    Full,
    Causal,
    Window(usize),
    /// ids per batch entry, causal.
    Documents(Vec<Vec<u32>>, bool),
    /// `[mb, mh, m, n]` keep bytes with mb, mh 1 when broadcast; the rank the tensor is given at.
    Dense(Vec<u8>, [usize; 4], usize),
}

impl Spec {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize, m: usize, n: usize) -> bool {
        let pos = i as i64 + n as i64 - m as i64;
        let j64 = j as i64;
        match self {
            Spec::Full => true,
            Spec::Causal => j64 <= pos,
            Spec::Window(w) => j64 <= pos && pos - j64 < *w as i64,
            Spec::Documents(ids, causal) => ids[b][i] == ids[b][j] && (!causal || j <= i),
            Spec::Dense(bytes, [mb, mh, _, _], _) => {
                let (bi, hi) = (if *mb == 1 { 0 } else { b }, if *mh == 1 { 0 } else { h });
                bytes[((bi * mh + hi) * m + i) * n + j] != 0
            }
        }
    }

    fn mask(&self, dev: &Device) -> Result<AttentionMask> {
        Ok(match self {
            Spec::Full => AttentionMask::full(),
            Spec::Causal => AttentionMask::causal(),
            Spec::Window(w) => AttentionMask::sliding_window(*w),
            Spec::Documents(ids, causal) => {
                let (b, s) = (ids.len(), ids[0].len());
                let flat: Vec<u32> = ids.concat();
                AttentionMask::documents(&Tensor::from_vec(flat, (b, s), dev)?, *causal)?
            }
            Spec::Dense(bytes, [mb, mh, m, n], rank) => {
                let t = Tensor::from_vec(bytes.clone(), (*mb, *mh, *m, *n), dev)?;
                let t = match rank {
                    2 => t.reshape((*m, *n))?,
                    3 => t.reshape((*mb, *m, *n))?,
                    _ => t,
                };
                AttentionMask::dense(&t)?
            }
        })
    }
}

/// Output `[b, h, m, dv]` and log-sum-exp `[b, h, m]` in f64 from the definition.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64], k: &[f64], v: &[f64],
    (b, h, hk, m, n, d, dv): (usize, usize, usize, usize, usize, usize, usize), spec: &Spec,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; b * h * m * dv];
    let mut lse = vec![f64::NEG_INFINITY; b * h * m];
    for bi in 0..b {
        for hi in 0..h {
            let kv = bi * hk + hi / (h / hk);
            for i in 0..m {
                let qrow = &q[((bi * h + hi) * m + i) * d..][..d];
                let scores: Vec<(usize, f64)> = (0..n)
                    .filter(|&j| spec.visible(bi, hi, i, j, m, n))
                    .map(|j| {
                        let krow = &k[(kv * n + j) * d..][..d];
                        (
                            j,
                            scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>(),
                        )
                    })
                    .collect();
                if scores.is_empty() {
                    continue;
                }
                let max = scores.iter().fold(f64::NEG_INFINITY, |a, s| a.max(s.1));
                let sum: f64 = scores.iter().map(|s| (s.1 - max).exp()).sum();
                lse[(bi * h + hi) * m + i] = max + sum.ln();
                let orow = &mut out[((bi * h + hi) * m + i) * dv..][..dv];
                for (j, s) in scores {
                    let p = (s - max).exp() / sum;
                    for (o, x) in orow.iter_mut().zip(&v[(kv * n + j) * dv..][..dv]) {
                        *o += p * x;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// How the operands of a test are laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Views {
    /// Contiguous tensors.
    Plain,
    /// k and v strided views into one `[b, n, 2, hk, d]` projection (d == dv), q a transposed view.
    Packed,
    /// Column windows of wider tensors, starting 3 elements in (rows off any 16-byte boundary).
    Offset,
}

/// A problem's inputs: q `[b, h, m, d]`, k `[b, hk, n, d]`, v `[b, hk, n, dv]`, laid out as
/// `views` says.
fn inputs(
    (b, h, hk, m, n, d, dv): (usize, usize, usize, usize, usize, usize, usize), dtype: DType,
    dev: &Device, views: Views, salt: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    if views == Views::Offset {
        let window = |shape: [usize; 4], salt| -> Result<Tensor> {
            let wide = [shape[0], shape[1], shape[2], shape[3] + 5];
            rand_tensor(&wide, 1.0, dtype, dev, salt)?.narrow(3, 3, shape[3])
        };
        return Ok((
            window([b, h, m, d], salt)?,
            window([b, hk, n, d], salt + 1)?,
            window([b, hk, n, dv], salt + 2)?,
        ));
    }
    if views == Views::Packed {
        assert_eq!(d, dv);
        let q = rand_tensor(&[b, m, h, d], 1.0, dtype, dev, salt)?.transpose(1, 2)?;
        let kv = rand_tensor(&[b, n, 2, hk, d], 1.0, dtype, dev, salt + 1)?;
        let k = kv.narrow(2, 0, 1)?.squeeze(2)?.transpose(1, 2)?;
        let v = kv.narrow(2, 1, 1)?.squeeze(2)?.transpose(1, 2)?;
        assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
        return Ok((q, k, v));
    }
    Ok((
        rand_tensor(&[b, h, m, d], 1.0, dtype, dev, salt)?,
        rand_tensor(&[b, hk, n, d], 1.0, dtype, dev, salt + 1)?,
        rand_tensor(&[b, hk, n, dv], 1.0, dtype, dev, salt + 2)?,
    ))
}

fn random_bytes(len: usize, keep: f64, salt: u64) -> Vec<u8> {
    use rand::Rng;
    let mut r = rng(salt);
    (0..len).map(|_| r.random_bool(keep) as u8 * 3).collect()
}

/// Document ids of `b` sequences of `s` tokens, runs of random lengths.
fn documents(b: usize, s: usize, salt: u64) -> Vec<Vec<u32>> {
    use rand::Rng;
    let mut r = rng(salt);
    (0..b)
        .map(|_| {
            let mut ids = Vec::with_capacity(s);
            let mut id = 0;
            while ids.len() < s {
                let len = r.random_range(1..90);
                ids.extend(std::iter::repeat_n(id, len.min(s - ids.len())));
                id += 1;
            }
            ids
        })
        .collect()
}

/// Document ids whose values recur (run k has id k % 3), so that a document is not one
/// contiguous run: the masks that the Hopper kernels read from tile states and ids.
fn recurring_documents(b: usize, s: usize, salt: u64) -> Vec<Vec<u32>> {
    documents(b, s, salt)
        .into_iter()
        .map(|row| row.into_iter().map(|id| id % 3).collect())
        .collect()
}

fn attention_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

fn check(
    dims: (usize, usize, usize, usize, usize, usize, usize), spec: &Spec, dtype: DType,
    dev: &Device, views: Views, what: &str,
) -> Result<()> {
    let (q, k, v) = inputs(dims, dtype, dev, views, 300)?;
    let scale = 1.0 / (dims.5 as f64).sqrt() * 1.3;
    let options = AttentionOptions {
        scale: Some(scale),
        ..Default::default()
    };
    let (out, lse) = masked_attention_with_lse(&q, &k, &v, &spec.mask(dev)?, &options)?;
    assert_eq!(out.dims(), &[dims.0, dims.1, dims.3, dims.6], "{what}");
    assert_eq!(out.dtype(), dtype);
    let (want, want_lse) = reference(&to_f64(&q)?, &to_f64(&k)?, &to_f64(&v)?, dims, spec, scale);
    let tol = attention_tolerance(dtype);
    assert_close(
        &to_f64(&out)?,
        &want,
        tol,
        &format!("{what} {dtype:?} output"),
    );
    assert_close(
        &to_f64(&lse)?,
        &want_lse,
        tol.max(1e-6),
        &format!("{what} {dtype:?} lse"),
    );
    Ok(())
}

/// The dtypes a device computes attention in: f32 and f64 on the CPU (the 16-bit types there
/// share the f32 code), f32 and the tensor cores' f16 and bf16 on CUDA.
fn attention_dtypes(dev: &Device) -> Vec<DType> {
    if dev.is_cuda() {
        vec![DType::F32, DType::BF16, DType::F16]
    } else {
        vec![DType::F32, DType::F64]
    }
}

#[test]
fn every_mask_kind_matches_the_reference() -> Result<()> {
    for_each_device(|dev| {
        // (batch, heads, kv_heads, m, n, d, dv): odd sizes, several tiles of 64 and a ragged one.
        let dims = (2, 4, 2, 131, 131, 24, 40);
        let (b, h, _, m, n, _, _) = dims;
        let specs = [
            ("full", Spec::Full),
            ("causal", Spec::Causal),
            ("window 37", Spec::Window(37)),
            ("window 1", Spec::Window(1)),
            (
                "documents causal",
                Spec::Documents(documents(b, m, 5), true),
            ),
            ("documents", Spec::Documents(documents(b, m, 6), false)),
            (
                "documents recurring causal",
                Spec::Documents(recurring_documents(b, m, 5), true),
            ),
            (
                "documents recurring",
                Spec::Documents(recurring_documents(b, m, 6), false),
            ),
            (
                "dense [m, n]",
                Spec::Dense(random_bytes(m * n, 0.3, 7), [1, 1, m, n], 2),
            ),
            (
                "dense [b, m, n]",
                Spec::Dense(random_bytes(b * m * n, 0.5, 8), [b, 1, m, n], 3),
            ),
            (
                "dense [b, h, m, n]",
                Spec::Dense(random_bytes(b * h * m * n, 0.05, 9), [b, h, m, n], 4),
            ),
        ];
        for (name, spec) in &specs {
            for dtype in attention_dtypes(dev) {
                check(dims, spec, dtype, dev, Views::Plain, name)?;
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn every_dtype_shape_and_layout() -> Result<()> {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            check(
                (1, 3, 3, 70, 70, 16, 16),
                &Spec::Causal,
                dtype,
                dev,
                Views::Plain,
                "dtype",
            )?;
        }
        // Every padded head dim of the tensor-core kernels (64, 128, 256), head dims that are not
        // a multiple of 8, d != dv, and rows off 16-byte boundaries.
        for dtype in attention_dtypes(dev) {
            let cases = [
                (
                    (1, 2, 1, 100, 130, 128, 128),
                    Spec::Window(70),
                    Views::Plain,
                ),
                ((1, 2, 2, 70, 70, 200, 136), Spec::Causal, Views::Plain),
                ((2, 1, 1, 33, 45, 13, 5), Spec::Full, Views::Plain),
                ((1, 2, 1, 66, 66, 40, 24), Spec::Causal, Views::Offset),
                (
                    (1, 2, 1, 100, 100, 200, 136),
                    Spec::Documents(documents(1, 100, 31), true),
                    Views::Plain,
                ),
            ];
            for (dims, spec, views) in &cases {
                check(
                    *dims,
                    spec,
                    dtype,
                    dev,
                    *views,
                    &format!("{dims:?} {views:?}"),
                )?;
            }
        }
        for dtype in attention_dtypes(dev) {
            // m < n (decoding with a cache) and m > n (early queries see nothing), bottom-right.
            check(
                (2, 2, 1, 5, 200, 32, 32),
                &Spec::Causal,
                dtype,
                dev,
                Views::Plain,
                "m < n",
            )?;
            check(
                (1, 2, 2, 150, 7, 8, 8),
                &Spec::Causal,
                dtype,
                dev,
                Views::Plain,
                "m > n",
            )?;
            check(
                (1, 2, 2, 67, 300, 8, 8),
                &Spec::Window(50),
                dtype,
                dev,
                Views::Plain,
                "window m < n",
            )?;
            // Grouped-query heads, one kv head for eight query heads, strided views of projections.
            check(
                (2, 8, 1, 65, 65, 16, 16),
                &Spec::Full,
                dtype,
                dev,
                Views::Packed,
                "gqa packed",
            )?;
        }
        check(
            (1, 4, 2, 97, 97, 64, 64),
            &Spec::Causal,
            DType::BF16,
            dev,
            Views::Packed,
            "packed bf16",
        )?;
        // Size 1 and empty dims.
        for dims in [
            (1, 1, 1, 1, 1, 1, 1),
            (0, 2, 1, 5, 5, 8, 8),
            (2, 2, 2, 0, 5, 8, 8),
            (2, 2, 2, 5, 0, 8, 8),
            (1, 1, 1, 1, 1, 256, 256),
        ] {
            check(
                dims,
                &Spec::Full,
                DType::F32,
                dev,
                Views::Plain,
                &format!("{dims:?}"),
            )?;
        }
        Ok(())
    });
    Ok(())
}

/// Sequences of several blocks of query tiles (the Hopper forward takes four tiles of 64 queries
/// a block, the portable one two), a ragged last tile, every mask kind, both fast head dims and
/// d != dv below them, in the 16-bit types (f32 where those have no tensor-core kernels).
/// The masks of the long-sequence tests: every kind, documents and dense bytes drawn for `b`
/// sequences of `m` tokens (`salt`, `salt + 1`).
fn long_sequence_masks(b: usize, m: usize, salt: u64) -> [(&'static str, Spec); 7] {
    [
        ("causal", Spec::Causal),
        ("full", Spec::Full),
        ("window 100", Spec::Window(100)),
        (
            "documents causal",
            Spec::Documents(documents(b, m, salt), true),
        ),
        (
            "documents",
            Spec::Documents(documents(b, m, salt + 2), false),
        ),
        (
            "documents recurring causal",
            Spec::Documents(recurring_documents(b, m, salt), true),
        ),
        (
            "dense [b, m, n]",
            Spec::Dense(random_bytes(b * m * m, 0.4, salt + 1), [b, 1, m, m], 3),
        ),
    ]
}

/// The dtypes of the long-sequence tests: the tensor-core ones on CUDA, f32 on the CPU.
fn long_sequence_dtypes(dev: &Device) -> Vec<DType> {
    if dev.is_cuda() {
        vec![DType::BF16, DType::F16]
    } else {
        vec![DType::F32]
    }
}

#[test]
fn long_sequences_every_mask() -> Result<()> {
    for_each_device(|dev| {
        let (b, m) = (2, 389);
        let specs = long_sequence_masks(b, m, 21);
        let dtypes = long_sequence_dtypes(dev);
        for (name, spec) in &specs {
            for dtype in &dtypes {
                for (d, dv) in [(128, 128), (64, 64), (40, 72)] {
                    check(
                        (b, 2, 1, m, m, d, dv),
                        spec,
                        *dtype,
                        dev,
                        Views::Plain,
                        &format!("{name} d {d} dv {dv}"),
                    )?;
                }
            }
        }
        // Documents in runs over three blocks of 128 queries and keys (the Hopper kernels' blocks
        // take row / key blocks r and 2 - r: the middle block takes one), causal and not.
        for (name, spec) in [
            (
                "documents causal",
                Spec::Documents(documents(b, 300, 23), true),
            ),
            ("documents", Spec::Documents(documents(b, 300, 25), false)),
        ] {
            for dtype in &dtypes {
                for d in [128, 64] {
                    check(
                        (b, 2, 1, 300, 300, d, d),
                        &spec,
                        *dtype,
                        dev,
                        Views::Plain,
                        &format!("{name} m 300 d {d}"),
                    )?;
                }
            }
        }
        // m < n across blocks (a cache of 700 keys), causal and window.
        for dtype in &dtypes {
            check(
                (1, 2, 2, 300, 700, 128, 128),
                &Spec::Causal,
                *dtype,
                dev,
                Views::Plain,
                "causal m < n",
            )?;
            check(
                (1, 2, 2, 300, 700, 64, 64),
                &Spec::Window(333),
                *dtype,
                dev,
                Views::Plain,
                "window m < n",
            )?;
        }
        Ok(())
    });
    Ok(())
}

/// Rows that see no key: zero output, `-inf` log-sum-exp, zero gradients, never NaN.
#[test]
fn rows_that_see_no_key_are_zero() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, m, n, d) = (1, 2, 9, 9, 8);
        let mut bytes = random_bytes(m * n, 0.6, 12);
        for j in 0..n {
            bytes[3 * n + j] = 0; // query 3 sees nothing
        }
        let specs = [Spec::Window(0), Spec::Dense(bytes, [1, 1, m, n], 2)];
        for (spec, dtype) in specs
            .iter()
            .flat_map(|s| attention_dtypes(dev).into_iter().map(move |t| (s, t)))
        {
            check(
                (b, h, h, m, n, d, d),
                spec,
                dtype,
                dev,
                Views::Plain,
                "empty rows",
            )?;
            let (q, k, v) = inputs((b, h, h, m, n, d, d), dtype, dev, Views::Plain, 40)?;
            let (qv, kv, vv) = (
                Var::from_tensor(&q)?,
                Var::from_tensor(&k)?,
                Var::from_tensor(&v)?,
            );
            let out = masked_attention(&qv, &kv, &vv, &spec.mask(dev)?, 0.3)?;
            let grads = out.sqr()?.sum_all()?.backward()?;
            for (name, var) in [("q", &qv), ("k", &kv), ("v", &vv)] {
                let g = to_f64(grads.get(var).expect("a gradient"))?;
                assert!(
                    g.iter().all(|x| x.is_finite()),
                    "{name}: non-finite gradient"
                );
            }
            if let Spec::Window(0) = *spec {
                for var in [&qv, &kv, &vv] {
                    assert!(to_f64(grads.get(var).unwrap())?.iter().all(|&x| x == 0.0));
                }
            } else {
                let gq = to_f64(grads.get(&qv).unwrap())?;
                for hi in 0..h {
                    let row = &gq[(hi * m + 3) * d..][..d];
                    assert!(row.iter().all(|&x| x == 0.0), "query 3's gradient");
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// Causal with m > n (bottom-right aligned): the first m - n queries see no key. Their dq rows
/// are zero (on CUDA whole query tiles that no key block visits), and the gradients of the other
/// rows, of k and of v equal those of the last n queries attending alone.
#[test]
fn queries_before_the_keys_have_zero_gradients() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, m, n) = (1, 2, 460, 200);
        let tail = m - n;
        for (dtype, d) in long_sequence_dtypes(dev)
            .into_iter()
            .flat_map(|t| [(t, 64), (t, 128)])
        {
            let (q, k, v) = inputs((b, h, h, m, n, d, d), dtype, dev, Views::Plain, 70)?;
            let weights = rand_tensor(&[b, h, m, d], 1.0, dtype, dev, 71)?;
            let grads_of = |q: &Tensor, weights: &Tensor| -> Result<[Vec<f64>; 3]> {
                let (qv, kv, vv) = (
                    Var::from_tensor(q)?,
                    Var::from_tensor(&k)?,
                    Var::from_tensor(&v)?,
                );
                let out = masked_attention(&qv, &kv, &vv, &Spec::Causal.mask(dev)?, 0.3)?;
                let grads = (out * weights)?.sum_all()?.backward()?;
                let grad = |x: &Var| to_f64(grads.get(x).expect("a gradient"));
                Ok([grad(&qv)?, grad(&kv)?, grad(&vv)?])
            };
            let [dq, dk, dv] = grads_of(&q, &weights)?;
            let last = |t: &Tensor| t.narrow(2, tail, n)?.contiguous();
            let [dq_last, dk_last, dv_last] = grads_of(&last(&q)?, &last(&weights)?)?;
            let tol = gradient_tolerance(dtype);
            for hi in 0..h {
                let rows = &dq[hi * m * d..][..m * d];
                assert!(
                    rows[..tail * d].iter().all(|&x| x == 0.0),
                    "{dtype:?} d {d}: dq of the queries that see no key"
                );
                assert_close(
                    &rows[tail * d..],
                    &dq_last[hi * n * d..][..n * d],
                    tol,
                    &format!("{dtype:?} d {d}: dq of the last {n} queries, head {hi}"),
                );
            }
            assert_close(&dk, &dk_last, tol, &format!("{dtype:?} d {d}: dk"));
            assert_close(&dv, &dv_last, tol, &format!("{dtype:?} d {d}: dv"));
        }
        Ok(())
    });
    Ok(())
}

/// The gradients' tolerance of a dtype (against f64 references or the same op in f64 terms).
fn gradient_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 5e-2,
    }
}

/// The additive f64 mask `[b, h, m, n]` of `spec` (0 where a key is visible, -inf elsewhere),
/// for the composed attention.
fn additive_bias(
    spec: &Spec, (b, h, m, n): (usize, usize, usize, usize), dev: &Device,
) -> Result<Tensor> {
    let mut bias = vec![f64::NEG_INFINITY; b * h * m * n];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..m {
                for j in 0..n {
                    if spec.visible(bi, hi, i, j, m, n) {
                        bias[((bi * h + hi) * m + i) * n + j] = 0.0;
                    }
                }
            }
        }
    }
    Tensor::from_vec(bias, (b, h, m, n), dev)
}

/// Composed candle attention with an additive mask (0 or -inf), for autograd comparisons.
fn composed(
    q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64, group: usize,
) -> Result<Tensor> {
    let (b, hk, n, d) = k.dims4()?;
    let expand = |t: &Tensor| -> Result<Tensor> {
        let last = t.dim(3)?;
        t.unsqueeze(2)?
            .broadcast_as((b, hk, group, n, last))?
            .reshape((b, hk * group, n, last))
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let _ = d;
    let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(bias)?;
    candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?.matmul(&v)
}

/// Gradients of `sum(masked_attention(q, k, v) * weights)` for q, k and v against candle's
/// composed attention in f64 with an additive mask (`views`: how q, k and v are laid out).
#[allow(clippy::too_many_arguments)]
fn check_gradients(
    dims: (usize, usize, usize, usize, usize, usize, usize), spec: &Spec, scale: f64,
    deterministic: bool, dtype: DType, dev: &Device, views: Views, name: &str,
) -> Result<()> {
    let (b, h, hk, m, n, _, dv) = dims;
    let options = AttentionOptions {
        scale: Some(scale),
        deterministic: Some(deterministic),
        ..Default::default()
    };
    let (q, k, v) = inputs(dims, dtype, dev, views, 60)?;
    let (qv, kv, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let weights = rand_tensor(&[b, h, m, dv], 1.0, dtype, dev, 61)?;
    let ours = masked_attention_with(&qv, &kv, &vv, &spec.mask(dev)?, &options)?;
    let grads = (ours * &weights)?.sum_all()?.backward()?;
    let bias = additive_bias(spec, (b, h, m, n), dev)?;
    let f64v = |t: &Tensor| -> Result<Var> { Var::from_tensor(&t.to_dtype(DType::F64)?) };
    let (q64, k64, v64) = (f64v(&q)?, f64v(&k)?, f64v(&v)?);
    let want = composed(&q64, &k64, &v64, &bias, scale, h / hk)?;
    let want_grads = (want * weights.to_dtype(DType::F64)?)?
        .sum_all()?
        .backward()?;
    let tol = gradient_tolerance(dtype);
    for (which, ours, theirs) in [("q", &qv, &q64), ("k", &kv, &k64), ("v", &vv, &v64)] {
        let got = to_f64(grads.get(ours).expect("gradient"))?;
        // candle's graph has no path to q and k through a zero scale: zeros.
        let want = match want_grads.get(theirs) {
            Some(g) => to_f64(g)?,
            None if scale == 0.0 => vec![0.0; got.len()],
            None => panic!("{name} {dtype:?} composed d{which}"),
        };
        assert_close(
            &got,
            &want,
            tol,
            &format!("{name} {dtype:?} deterministic {deterministic} d{which}"),
        );
    }
    Ok(())
}

#[test]
fn gradients_match_composed_attention() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, hk, m, n, d, dv) = (2, 4, 2, 70, 133, 16, 24);
        let docs = documents(b, 133, 21);
        // (name, mask, m, (d, dv), scale); head dims 16 / 24 run the CUDA kernels of head dim
        // 64, 96 / 128 those of 128 (dq's columns past 96 cut off). Negative and zero scales
        // are legal (a zero scale attends uniformly).
        let cases = [
            ("causal", Spec::Causal, m, (d, dv), 0.4),
            ("window", Spec::Window(40), m, (d, dv), 0.4),
            (
                "documents",
                Spec::Documents(docs.clone(), true),
                n,
                (d, dv),
                0.4,
            ),
            (
                "documents recurring",
                Spec::Documents(recurring_documents(b, 133, 21), true),
                n,
                (d, dv),
                0.4,
            ),
            (
                "documents, not causal",
                Spec::Documents(docs.clone(), false),
                n,
                (d, dv),
                0.4,
            ),
            // Documents at the head tiles of 128 and 256 (on CUDA the runs kernels' two-pass
            // backward).
            (
                "documents, d 96",
                Spec::Documents(docs.clone(), true),
                n,
                (96, 128),
                0.4,
            ),
            (
                "documents, not causal, d 200",
                Spec::Documents(docs, false),
                n,
                (200, 136),
                0.4,
            ),
            ("full", Spec::Full, m, (d, dv), 0.4),
            ("causal, d 96", Spec::Causal, m, (96, 128), 0.4),
            // Head tile 128, f16 / bf16, not deterministic: on CUDA (compute capability 9.0) the
            // one-pass backward, with a formula, stored documents and a dense mask (per head).
            ("window, d 128", Spec::Window(40), m, (128, 96), 0.4),
            ("full, d 104", Spec::Full, m, (104, 112), 0.4),
            (
                "documents recurring, d 96",
                Spec::Documents(recurring_documents(b, 133, 21), true),
                n,
                (96, 128),
                0.4,
            ),
            (
                "dense per head, d 96",
                Spec::Dense(random_bytes(b * h * m * n, 0.3, 11), [b, h, m, n], 4),
                m,
                (96, 72),
                0.4,
            ),
            ("causal, scale -0.3", Spec::Causal, m, (d, dv), -0.3),
            ("window, scale 0", Spec::Window(40), m, (d, dv), 0.0),
        ];
        // Both modes: on CUDA (f16 / bf16) the default backward adds dq with atomics (Hopper's,
        // or the one-pass one at head tile 128), the deterministic one has a dq pass of its own.
        for (name, spec, m, (d, dv), scale) in cases {
            for deterministic in [false, true] {
                for dtype in attention_dtypes(dev) {
                    let dims = (b, h, hk, m, n, d, dv);
                    check_gradients(
                        dims,
                        &spec,
                        scale,
                        deterministic,
                        dtype,
                        dev,
                        Views::Plain,
                        name,
                    )?;
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// Gradients over several query and key blocks (the CUDA backwards' blocks of 64 and 128 keys,
/// ragged last tiles), every mask kind, head dims 64, 128 and 40-with-dv-72, strided views,
/// grouped-query heads, and m < n.
#[test]
fn long_sequences_gradients_every_mask() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, hk, m) = (2, 4, 2, 333);
        let specs = long_sequence_masks(b, m, 23);
        let dtypes = long_sequence_dtypes(dev);
        for dtype in dtypes {
            for (name, spec) in &specs {
                for (d, dv) in [(128, 128), (64, 64), (40, 72)] {
                    let dims = (b, h, hk, m, m, d, dv);
                    let name = format!("{name} d {d} dv {dv}");
                    check_gradients(dims, spec, 0.3, false, dtype, dev, Views::Plain, &name)?;
                }
            }
            for d in [128, 64] {
                let dims = (b, h, hk, m, m, d, d);
                let name = format!("causal packed d {d}");
                check_gradients(
                    dims,
                    &Spec::Causal,
                    0.3,
                    false,
                    dtype,
                    dev,
                    Views::Packed,
                    &name,
                )?;
                let name = format!("window offset d {d}");
                let window = Spec::Window(150);
                check_gradients(dims, &window, 0.3, false, dtype, dev, Views::Offset, &name)?;
            }
            let dims = (1, 2, 1, 200, 450, 128, 128);
            check_gradients(
                dims,
                &Spec::Causal,
                0.3,
                false,
                dtype,
                dev,
                Views::Plain,
                "causal m < n",
            )?;
            let dims = (1, 2, 1, 200, 450, 64, 64);
            let window = Spec::Window(150);
            check_gradients(
                dims,
                &window,
                0.3,
                false,
                dtype,
                dev,
                Views::Plain,
                "window m < n",
            )?;
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error() -> Result<()> {
    let dev = Device::Cpu;
    let t = |shape: &[usize], dtype: DType| rand_tensor(shape, 1.0, dtype, &dev, 90);
    let (q, k, v) = (
        t(&[2, 4, 8, 16], DType::F32)?,
        t(&[2, 2, 9, 16], DType::F32)?,
        t(&[2, 2, 9, 16], DType::F32)?,
    );
    let full = AttentionMask::full();
    let err = |r: Result<Tensor>| r.expect_err("must fail").to_string();
    assert!(err(masked_attention(&q.flatten_to(1)?, &k, &v, &full, 1.0)).contains("q must be"));
    assert!(err(masked_attention(
        &q,
        &t(&[3, 2, 9, 16], DType::F32)?,
        &v,
        &full,
        1.0
    ))
    .contains("batch"));
    assert!(err(masked_attention(
        &q,
        &t(&[2, 3, 9, 16], DType::F32)?,
        &t(&[2, 3, 9, 16], DType::F32)?,
        &full,
        1.0
    ))
    .contains("multiple"));
    assert!(err(masked_attention(
        &q,
        &t(&[2, 2, 9, 8], DType::F32)?,
        &v,
        &full,
        1.0
    ))
    .contains("head dims"));
    assert!(err(masked_attention(
        &q,
        &k,
        &t(&[2, 2, 8, 16], DType::F32)?,
        &full,
        1.0
    ))
    .contains("share"));
    assert!(err(masked_attention(
        &q,
        &k.to_dtype(DType::F16)?,
        &v,
        &full,
        1.0
    ))
    .contains("dtype"));
    let big = t(&[1, 1, 2, 257], DType::F32)?;
    assert!(err(masked_attention(&big, &big, &big, &full, 1.0)).contains("257"));
    let ints = Tensor::zeros((2, 4, 8, 16), DType::U32, &dev)?;
    assert!(err(masked_attention(&ints, &ints, &ints, &full, 1.0)).contains("dtype"));
    // Masks.
    let float_mask = Tensor::zeros((8, 9), DType::F32, &dev)?;
    assert!(AttentionMask::dense(&float_mask)
        .unwrap_err()
        .to_string()
        .contains("u8"));
    let wrong = AttentionMask::dense(&Tensor::zeros((8, 10), DType::U8, &dev)?)?;
    assert!(err(masked_attention(&q, &k, &v, &wrong, 1.0)).contains("dense mask"));
    let ids_f32 = Tensor::zeros((2, 9), DType::F32, &dev)?;
    assert!(AttentionMask::documents(&ids_f32, true)
        .unwrap_err()
        .to_string()
        .contains("u32 or i64"));
    let ids_rank = Tensor::zeros(9, DType::U32, &dev)?;
    assert!(AttentionMask::documents(&ids_rank, true)
        .unwrap_err()
        .to_string()
        .contains("[batch, seq]"));
    let docs = AttentionMask::documents(&Tensor::zeros((2, 9), DType::U32, &dev)?, true)?;
    assert!(err(masked_attention(&q, &k, &v, &docs, 1.0)).contains("m == n == seq"));
    assert!(err(masked_attention(&q, &k, &v, &full, f64::NAN)).contains("finite"));
    if let Some(gpu) = gpu() {
        let on_gpu = q.to_device(&gpu)?;
        assert!(err(masked_attention(&on_gpu, &k, &v, &full, 1.0)).contains("device"));
        let f64s = on_gpu.to_dtype(DType::F64)?;
        assert!(err(masked_attention(&f64s, &f64s, &f64s, &full, 1.0)).contains("dtype"));
        let cpu_mask = AttentionMask::dense(&Tensor::ones((8, 9), DType::U8, &dev)?)?;
        let (kg, vg) = (k.to_device(&gpu)?, v.to_device(&gpu)?);
        assert!(err(masked_attention(&on_gpu, &kg, &vg, &cpu_mask, 1.0)).contains("dense mask"));
    }
    Ok(())
}

/// The deterministic backward gives identical bits run to run (on CUDA it sums every gradient in
/// one block in a fixed order), for every dtype, with grouped-query heads and a partial mask.
#[test]
fn gradients_repeat_bit_for_bit() -> Result<()> {
    for_each_device(|dev| {
        let dims = (1, 4, 2, 130, 130, 64, 64);
        let docs = Spec::Documents(documents(1, 130, 80), true);
        for dtype in attention_dtypes(dev) {
            let (q, k, v) = inputs(dims, dtype, dev, Views::Plain, 81)?;
            let weights = rand_tensor(&[1, 4, 130, 64], 1.0, dtype, dev, 82)?;
            let run = || -> Result<Vec<Vec<f64>>> {
                let vars = [
                    Var::from_tensor(&q)?,
                    Var::from_tensor(&k)?,
                    Var::from_tensor(&v)?,
                ];
                let options = AttentionOptions {
                    scale: Some(0.2),
                    deterministic: Some(true),
                    ..Default::default()
                };
                let out = masked_attention_with(
                    &vars[0],
                    &vars[1],
                    &vars[2],
                    &docs.mask(dev)?,
                    &options,
                )?;
                let grads = (out * &weights)?.sum_all()?.backward()?;
                vars.iter()
                    .map(|var| to_f64(grads.get(var).expect("a gradient")))
                    .collect()
            };
            let (first, second) = (run()?, run()?);
            for (a, b) in first.iter().zip(&second) {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{dtype:?}: gradients differ between runs"
                );
            }
        }
        Ok(())
    });
    Ok(())
}

/// With gradients tracked, the Hopper forward zeroes the backward's dq accumulator on the way and
/// the first backward takes it; a second backward of the same graph zeroes its own, and so does
/// a graph built with `dq_in_forward: Some(false)`. All three agree (outputs are poisoned: a tile
/// the forward missed would be NaN in the first), with partial query tiles, an odd count of
/// 128-row blocks, grouped-query heads and every dtype.
#[test]
fn second_backward_of_one_graph_matches_the_first() -> Result<()> {
    for_each_device(|dev| {
        let dims = (2, 4, 2, 333, 333, 128, 128);
        let docs = Spec::Documents(documents(2, 333, 93), true);
        for dtype in attention_dtypes(dev) {
            let (q, k, v) = inputs(dims, dtype, dev, Views::Plain, 91)?;
            let weights = rand_tensor(&[2, 4, 333, 128], 1.0, dtype, dev, 92)?;
            let vars = [
                Var::from_tensor(&q)?,
                Var::from_tensor(&k)?,
                Var::from_tensor(&v)?,
            ];
            let loss = |dq_in_forward| -> Result<Tensor> {
                let options = AttentionOptions {
                    scale: Some(0.1),
                    dq_in_forward,
                    ..Default::default()
                };
                let mask = docs.mask(dev)?;
                let out = masked_attention_with(&vars[0], &vars[1], &vars[2], &mask, &options)?;
                (out * &weights)?.sum_all()
            };
            let carried = loss(None)?;
            let (first, second) = (carried.backward()?, carried.backward()?);
            let in_backward = loss(Some(false))?.backward()?;
            for (name, var) in ["q", "k", "v"].iter().zip(&vars) {
                let gradient = |grads: &candle_core::backprop::GradStore| {
                    to_f64(grads.get(var).expect("a gradient"))
                };
                for (other, which) in [(&second, "the second"), (&in_backward, "dq_in_forward off")]
                {
                    assert_close(
                        &gradient(&first)?,
                        &gradient(other)?,
                        gradient_tolerance(dtype),
                        &format!("{dtype:?} d{name}, first backward against {which}"),
                    );
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// The CPU backward takes one pass (a task per batch entry and kv head) where there are at least as
/// many such tasks as threads, and two (dq by query tiles, then dk / dv by key tiles) where there
/// are fewer: on one thread and on 64 the same problem takes each, and the gradients agree bit for
/// bit (every mask kind, grouped-query heads, f32 and f64, partial tiles at both ends).
#[test]
fn cpu_backward_one_pass_matches_two_passes() -> Result<()> {
    let dev = Device::Cpu;
    let (b, h, hk, m, n, d, dv) = (2, 6, 2, 141, 203, 40, 24);
    let specs = [
        ("full", Spec::Full),
        ("causal", Spec::Causal),
        ("window", Spec::Window(70)),
        ("documents", Spec::Documents(documents(b, 203, 90), true)),
    ];
    let pool = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
    };
    let (one, many) = (pool(1), pool(64));
    for dtype in [DType::F32, DType::F64] {
        let k = rand_tensor(&[b, hk, n, d], 1.0, dtype, &dev, 91)?;
        let v = rand_tensor(&[b, hk, n, dv], 1.0, dtype, &dev, 92)?;
        for (name, spec) in &specs {
            // m != n, but the documents mask needs m == n.
            let rows = if matches!(spec, Spec::Documents(..)) {
                n
            } else {
                m
            };
            let q = rand_tensor(&[b, h, rows, d], 1.0, dtype, &dev, 93)?;
            let weights = rand_tensor(&[b, h, rows, dv], 1.0, dtype, &dev, 94)?;
            let mask = spec.mask(&dev)?;
            let run = || -> Result<Vec<Vec<f64>>> {
                let vars = [
                    Var::from_tensor(&q)?,
                    Var::from_tensor(&k)?,
                    Var::from_tensor(&v)?,
                ];
                let out = masked_attention(&vars[0], &vars[1], &vars[2], &mask, 0.3)?;
                let grads = (out * &weights)?.sum_all()?.backward()?;
                vars.iter()
                    .map(|var| to_f64(grads.get(var).expect("a gradient")))
                    .collect()
            };
            let (one_pass, two_passes) = (one.install(run)?, many.install(run)?);
            for ((a, b), grad) in one_pass.iter().zip(&two_passes).zip(["dq", "dk", "dv"]) {
                assert!(
                    a.iter().any(|x| *x != 0.0),
                    "{name} {dtype:?}: {grad} is all zero"
                );
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name} {dtype:?}: {grad} differs between one pass and two"
                );
            }
        }
    }
    Ok(())
}

/// The default scale is `1 / sqrt(d)`, and the options form gives what the plain form gives.
#[test]
fn default_options_scale_by_the_head_dim() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = inputs((1, 2, 2, 33, 40, 25, 7), DType::F32, &dev, Views::Plain, 70)?;
    let mask = AttentionMask::causal();
    let plain = masked_attention(&q, &k, &v, &mask, 0.2)?;
    let with = masked_attention_with(&q, &k, &v, &mask, &AttentionOptions::default())?;
    assert_eq!(to_f64(&plain)?, to_f64(&with)?);
    Ok(())
}

/// A window at least as wide as the sequence is the causal mask, up to `usize::MAX` (the
/// widths past `i64::MAX` included), on every device; m > n too (the first queries sit before
/// every key).
#[test]
fn windows_wider_than_the_sequence_are_causal() -> Result<()> {
    for dev in devices() {
        let dtype = if dev.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        };
        for (m, n) in [(37, 45), (60, 21)] {
            let (q, k, v) = inputs((1, 2, 2, m, n, 32, 32), dtype, &dev, Views::Plain, 71)?;
            let causal = to_f64(&masked_attention(
                &q,
                &k,
                &v,
                &AttentionMask::causal(),
                0.2,
            )?)?;
            for w in [m + n, 1 << 40, (1 << 63) + 5, usize::MAX] {
                let window = AttentionMask::sliding_window(w);
                let out = to_f64(&masked_attention(&q, &k, &v, &window, 0.2)?)?;
                // The same keys in the same order: equal on the CPU; on CUDA the window kernels
                // may split the diagonal tiles differently, so within a 16-bit rounding.
                let worst = out
                    .iter()
                    .zip(&causal)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                let bound = if dev.is_cpu() { 0.0 } else { 1e-2 };
                assert!(
                    worst <= bound,
                    "window {w}, m {m}, n {n} on {dev:?}: {worst:e} from causal"
                );
            }
        }
    }
    Ok(())
}

/// How a test's packed projection is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PackedLayout {
    /// A contiguous `[b, n, h + 2 hk, d]` tensor.
    Plain,
    /// A transposed view of a `[b, h + 2 hk, n, d]` tensor (no unit stride between tokens).
    Transposed,
    /// Tokens 5.. of a longer projection (a start offset of whole rows).
    Tokens,
    /// Columns 3.. of a wider projection (rows off any 16-byte boundary: the view form on CUDA).
    Columns,
}

/// The tensor a packed projection `[b, n, h + 2 hk, d]` laid out as `layout` is a view of, of
/// random values.
fn packed_base(
    (b, n, h, hk, d): PackedDims, layout: PackedLayout, dtype: DType, dev: &Device, salt: u64,
) -> Result<Tensor> {
    let total = h + 2 * hk;
    let shape = match layout {
        PackedLayout::Plain => [b, n, total, d],
        PackedLayout::Transposed => [b, total, n, d],
        PackedLayout::Tokens => [b, n + 5, total, d],
        PackedLayout::Columns => [b, n, total, d + 3],
    };
    rand_tensor(&shape, 1.0, dtype, dev, salt)
}

/// The packed projection of `packed_base` (candle ops, so gradients reach the base).
fn packed_view(base: &Tensor, (_, n, _, _, d): PackedDims, layout: PackedLayout) -> Result<Tensor> {
    match layout {
        PackedLayout::Plain => Ok(base.clone()),
        PackedLayout::Transposed => base.transpose(1, 2),
        PackedLayout::Tokens => base.narrow(1, 5, n),
        PackedLayout::Columns => base.narrow(3, 3, d),
    }
}

/// q, k and v of a packed projection as `[b, heads, n, d]` views (candle ops).
fn packed_views(qkv: &Tensor, h: usize, hk: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let part = |first: usize, count: usize| qkv.narrow(2, first, count)?.transpose(1, 2);
    Ok((part(0, h)?, part(h, hk)?, part(h + hk, hk)?))
}

/// (b, n, h, hk, d) of a packed projection.
type PackedDims = (usize, usize, usize, usize, usize);

/// The packed cases: their dims, the projection's layout, and the mask. d = 12 and column windows
/// take the view form on CUDA (a head dim the kernels pad, rows off 16 bytes), the others the
/// in-place op.
fn packed_cases(dev: &Device, b: usize, n: usize) -> Vec<(PackedDims, PackedLayout, Spec)> {
    let mut cases = vec![
        ((b, n, 4, 2, 16), PackedLayout::Plain, Spec::Causal),
        (
            (b, n, 3, 3, 8),
            PackedLayout::Transposed,
            Spec::Documents(documents(b, n, 31), true),
        ),
        ((b, n, 2, 1, 64), PackedLayout::Tokens, Spec::Window(17)),
        ((1, n, 2, 2, 12), PackedLayout::Plain, Spec::Full),
        ((b, n, 2, 2, 16), PackedLayout::Columns, Spec::Causal),
    ];
    if dev.is_cuda() {
        cases.push(((b, n, 2, 2, 128), PackedLayout::Transposed, Spec::Causal));
    }
    cases
}

#[test]
fn packed_projection_matches_the_reference() -> Result<()> {
    for_each_device(|dev| {
        for dtype in attention_dtypes(dev) {
            for (dims, layout, spec) in packed_cases(dev, 2, 45) {
                let (b, n, h, hk, d) = dims;
                let what = format!("packed {dims:?} {layout:?} {dtype:?}");
                let qkv = packed_view(&packed_base(dims, layout, dtype, dev, 70)?, dims, layout)?;
                let scale = 0.9 / (d as f64).sqrt();
                let options = AttentionOptions {
                    scale: Some(scale),
                    ..Default::default()
                };
                let packed = masked_attention_packed(&qkv, hk, &spec.mask(dev)?, &options)?;
                assert_eq!(packed.dims(), &[b, n, h, d], "{what}");
                assert_eq!(packed.dtype(), dtype, "{what}");
                // Head-major, as the reference and masked_attention give it.
                let out = packed.transpose(1, 2)?;
                let (q, k, v) = packed_views(&qkv, h, hk)?;
                let f64c = |t: &Tensor| to_f64(&t.contiguous()?);
                let (want, _) = reference(
                    &f64c(&q)?,
                    &f64c(&k)?,
                    &f64c(&v)?,
                    (b, h, hk, n, n, d, d),
                    &spec,
                    scale,
                );
                assert_close(&to_f64(&out)?, &want, attention_tolerance(dtype), &what);
                // The same kernels as the view form: the same values.
                let views = masked_attention_with(&q, &k, &v, &spec.mask(dev)?, &options)?;
                assert_close(
                    &to_f64(&out)?,
                    &to_f64(&views)?,
                    1e-12,
                    &format!("{what} vs views"),
                );
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn packed_projection_gradients_match_the_views() -> Result<()> {
    for_each_device(|dev| {
        for dtype in attention_dtypes(dev) {
            for (dims, layout, spec) in packed_cases(dev, 2, 39) {
                let (b, n, h, hk, d) = dims;
                let what = format!("packed {dims:?} {layout:?} {dtype:?}");
                // Gradients of the base, through the layout's view ops (a Var itself is
                // contiguous).
                let base = Var::from_tensor(&packed_base(dims, layout, dtype, dev, 80)?)?;
                let qkv = packed_view(&base, dims, layout)?;
                // Weights of the token-major output; the view form's is head-major.
                let weights = rand_tensor(&[b, n, h, d], 1.0, dtype, dev, 81)?;
                let options = AttentionOptions::default();
                let mask = spec.mask(dev)?;
                let ours = masked_attention_packed(&qkv, hk, &mask, &options)?;
                let grads = (ours * &weights)?.sum_all()?.backward()?;
                let got = grads.get(&base).expect("the packed gradient");
                assert_eq!(got.dims(), base.dims(), "{what}");
                // The view form in f64, gradients through candle's narrow and transpose.
                let base64 = Var::from_tensor(&base.to_dtype(DType::F64)?)?;
                let qkv64 = packed_view(&base64, dims, layout)?;
                let want = if dev.is_cuda() {
                    // (no f64 masked_attention on CUDA: candle's composed attention, masked
                    // additively; its matmul takes contiguous operands)
                    let (q, k, v) = packed_views(&qkv64, h, hk)?;
                    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
                    let bias = additive_bias(&spec, (b, h, n, n), dev)?;
                    composed(&q, &k, &v, &bias, 1.0 / (d as f64).sqrt(), h / hk)?
                } else {
                    let (q, k, v) = packed_views(&qkv64, h, hk)?;
                    masked_attention_with(&q, &k, &v, &mask, &options)?
                };
                let want_grads = (want * weights.to_dtype(DType::F64)?.transpose(1, 2)?)?
                    .sum_all()?
                    .backward()?;
                let want = to_f64(want_grads.get(&base64).expect("the views' gradient"))?;
                assert_close(&to_f64(got)?, &want, gradient_tolerance(dtype), &what);
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn packed_projection_bad_input_is_a_clear_error() -> Result<()> {
    let dev = Device::Cpu;
    let full = AttentionMask::full();
    let options = AttentionOptions::default();
    let err = |shape: &[usize], kv_heads: usize| -> Result<String> {
        let qkv = rand_tensor(shape, 1.0, DType::F32, &dev, 95)?;
        Ok(masked_attention_packed(&qkv, kv_heads, &full, &options)
            .expect_err("must fail")
            .to_string())
    };
    assert!(err(&[2, 5, 4 * 16], 1)?.contains("qkv must be"));
    assert!(err(&[2, 5, 4, 16], 0)?.contains("not heads + 2 * kv_heads"));
    assert!(err(&[2, 5, 4, 16], 2)?.contains("not heads + 2 * kv_heads"));
    assert!(err(&[2, 5, 7, 16], 2)?.contains("not heads + 2 * kv_heads"));
    assert!(err(&[2, 5, 4, 300], 1)?.contains("head dim"));
    // A mask for other lengths is refused at the call.
    let qkv = rand_tensor(&[1, 6, 3, 8], 1.0, DType::F32, &dev, 96)?;
    let ids = Tensor::zeros((1, 7), DType::U32, &dev)?;
    let docs = AttentionMask::documents(&ids, true)?;
    assert!(masked_attention_packed(&qkv, 1, &docs, &options).is_err());
    // The op's output and gradient for an empty batch.
    let empty = Var::from_tensor(&rand_tensor(&[0, 6, 3, 8], 1.0, DType::F32, &dev, 97)?)?;
    let out = masked_attention_packed(&empty, 1, &full, &options)?;
    assert_eq!(out.dims(), &[0, 6, 1, 8]);
    Ok(())
}

/// `masked_attention_qkv` (the projection as a linear layer gives it, `[b, n, (h + 2 hk) d]`, out
/// `[b, n, h d]`) against `masked_attention_packed` on the same projection reshaped: the same
/// values, and the same gradient of the projection. Contiguous projections take the op itself;
/// a token window of a longer one (not contiguous) takes the reshaped form.
#[test]
fn qkv_projection_matches_the_packed_form() -> Result<()> {
    for_each_device(|dev| {
        for dtype in attention_dtypes(dev) {
            let mut cases = vec![
                ((2, 37, 4, 2, 16), Spec::Causal, false),
                (
                    (1, 29, 3, 3, 8),
                    Spec::Documents(documents(1, 29, 33), true),
                    false,
                ),
                ((2, 31, 2, 1, 64), Spec::Window(9), true),
                ((1, 23, 2, 2, 12), Spec::Full, false),
            ];
            if dev.is_cuda() {
                cases.push(((2, 70, 2, 2, 128), Spec::Causal, false));
            }
            for ((b, n, h, hk, d), spec, window) in cases {
                let what = format!("qkv {:?} window {window} {dtype:?}", (b, n, h, hk, d));
                let total = h + 2 * hk;
                let rows = if window { n + 4 } else { n };
                let base =
                    Var::from_tensor(&rand_tensor(&[b, rows, total * d], 1.0, dtype, dev, 110)?)?;
                let qkv = if window {
                    base.narrow(1, 4, n)?
                } else {
                    base.as_tensor().clone()
                };
                let weights = rand_tensor(&[b, n, h * d], 1.0, dtype, dev, 111)?;
                let (mask, options) = (spec.mask(dev)?, AttentionOptions::default());
                let ours = masked_attention_qkv(&qkv, h, hk, &mask, &options)?;
                assert_eq!(ours.dims(), &[b, n, h * d], "{what}");
                let grads = (&ours * &weights)?.sum_all()?.backward()?;
                let got = to_f64(grads.get(&base).expect("the projection's gradient"))?;
                let packed =
                    masked_attention_packed(&qkv.reshape((b, n, total, d))?, hk, &mask, &options)?
                        .reshape((b, n, h * d))?;
                assert_close(&to_f64(&ours)?, &to_f64(&packed)?, 1e-12, &what);
                let want_grads = (&packed * &weights)?.sum_all()?.backward()?;
                let want = to_f64(want_grads.get(&base).expect("the packed form's gradient"))?;
                assert_close(
                    &got,
                    &want,
                    gradient_tolerance(dtype),
                    &format!("{what} gradient"),
                );
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn qkv_projection_bad_input_is_a_clear_error() -> Result<()> {
    let dev = Device::Cpu;
    let full = AttentionMask::full();
    let options = AttentionOptions::default();
    let err = |shape: &[usize], heads: usize, kv_heads: usize| -> Result<String> {
        let qkv = rand_tensor(shape, 1.0, DType::F32, &dev, 112)?;
        Ok(masked_attention_qkv(&qkv, heads, kv_heads, &full, &options)
            .expect_err("must fail")
            .to_string())
    };
    assert!(err(&[2, 5, 4, 16], 2, 1)?.contains("qkv must be"));
    assert!(err(&[2, 5, 64], 2, 0)?.contains("positive multiple of kv_heads"));
    assert!(err(&[2, 5, 64], 0, 1)?.contains("positive multiple of kv_heads"));
    assert!(err(&[2, 5, 64], 3, 2)?.contains("positive multiple of kv_heads"));
    assert!(err(&[2, 5, 62], 2, 1)?.contains("last dim 62"));
    assert!(err(&[2, 5, 0], 2, 1)?.contains("last dim 0"));
    assert!(err(&[2, 5, 4 * 300], 2, 1)?.contains("head dim"));
    // An empty batch or sequence gives an empty output.
    let empty = rand_tensor(&[0, 6, 3 * 8], 1.0, DType::F32, &dev, 113)?;
    assert_eq!(
        masked_attention_qkv(&empty, 1, 1, &full, &options)?.dims(),
        &[0, 6, 8]
    );
    let empty = rand_tensor(&[2, 0, 3 * 8], 1.0, DType::F32, &dev, 114)?;
    assert_eq!(
        masked_attention_qkv(&empty, 1, 1, &full, &options)?.dims(),
        &[2, 0, 8]
    );
    Ok(())
}

/// How a test's token-major operand `[b, rows, heads, cols]` is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TokenLayout {
    /// A contiguous tensor.
    Plain,
    /// A transposed view of a head-major `[b, heads, rows, cols]` tensor.
    HeadsFirst,
    /// Columns 3.. of wider rows (rows off any 16-byte boundary: the view form on CUDA).
    Columns,
}

/// A random base tensor and the token-major `[b, rows, heads, cols]` view of it laid out as
/// `layout` (candle ops, so gradients reach the base).
fn token_operand(
    [b, rows, heads, cols]: [usize; 4], layout: TokenLayout, dtype: DType, dev: &Device, salt: u64,
) -> Result<(Var, Tensor)> {
    let shape = match layout {
        TokenLayout::Plain => [b, rows, heads, cols],
        TokenLayout::HeadsFirst => [b, heads, rows, cols],
        TokenLayout::Columns => [b, rows, heads, cols + 3],
    };
    let base = Var::from_tensor(&rand_tensor(&shape, 1.0, dtype, dev, salt)?)?;
    let view = match layout {
        TokenLayout::Plain => base.as_tensor().clone(),
        TokenLayout::HeadsFirst => base.transpose(1, 2)?,
        TokenLayout::Columns => base.narrow(3, 3, cols)?,
    };
    Ok((base, view))
}

/// `masked_attention_tokens` (token-major q, k, v and output) against `masked_attention_with` on
/// the transposed views: the same values and the same gradients of the operands' bases. m < n
/// (a KV cache), GQA, d != dv, every mask family; d = 12, dv = 20 and column windows take the
/// view form on CUDA.
#[test]
fn token_major_operands_match_the_views() -> Result<()> {
    for_each_device(|dev| {
        for dtype in attention_dtypes(dev) {
            let mut cases = vec![
                ((2, 37, 37, 4, 2, 16, 16), TokenLayout::Plain, Spec::Causal),
                ((1, 9, 50, 4, 1, 16, 24), TokenLayout::Plain, Spec::Causal),
                ((1, 17, 17, 2, 2, 16, 20), TokenLayout::Plain, Spec::Causal),
                (
                    (2, 29, 29, 3, 3, 8, 8),
                    TokenLayout::HeadsFirst,
                    Spec::Documents(documents(2, 29, 41), true),
                ),
                (
                    (1, 31, 40, 2, 1, 64, 64),
                    TokenLayout::Plain,
                    Spec::Window(11),
                ),
                ((1, 23, 23, 2, 2, 12, 12), TokenLayout::Plain, Spec::Full),
                (
                    (2, 21, 21, 2, 2, 16, 16),
                    TokenLayout::Columns,
                    Spec::Causal,
                ),
            ];
            if dev.is_cuda() {
                cases.push((
                    (2, 70, 70, 2, 2, 128, 128),
                    TokenLayout::HeadsFirst,
                    Spec::Causal,
                ));
            }
            for ((b, m, n, h, hk, d, dv), layout, spec) in cases {
                let what = format!("tokens {:?} {layout:?} {dtype:?}", (b, m, n, h, hk, d, dv));
                let (qb, q) = token_operand([b, m, h, d], layout, dtype, dev, 120)?;
                let (kb, k) = token_operand([b, n, hk, d], layout, dtype, dev, 121)?;
                let (vb, v) = token_operand([b, n, hk, dv], layout, dtype, dev, 122)?;
                let weights = rand_tensor(&[b, m, h, dv], 1.0, dtype, dev, 123)?;
                let (mask, options) = (spec.mask(dev)?, AttentionOptions::default());
                let ours = masked_attention_tokens(&q, &k, &v, &mask, &options)?;
                assert_eq!(ours.dims(), &[b, m, h, dv], "{what}");
                let grads = (&ours * &weights)?.sum_all()?.backward()?;
                let views = masked_attention_with(
                    &q.transpose(1, 2)?,
                    &k.transpose(1, 2)?,
                    &v.transpose(1, 2)?,
                    &mask,
                    &options,
                )?
                .transpose(1, 2)?;
                assert_close(&to_f64(&ours)?, &to_f64(&views)?, 1e-12, &what);
                let want = (&views * &weights)?.sum_all()?.backward()?;
                for (name, base) in [("q", &qb), ("k", &kb), ("v", &vb)] {
                    let got = grads.get(base).expect("our gradient");
                    assert_eq!(got.dims(), base.dims(), "{what} {name}");
                    let expected = want.get(base).expect("the views' gradient");
                    assert_close(
                        &to_f64(got)?,
                        &to_f64(expected)?,
                        gradient_tolerance(dtype),
                        &format!("{what} d{name}"),
                    );
                }
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn token_major_bad_input_is_a_clear_error() -> Result<()> {
    let dev = Device::Cpu;
    let full = AttentionMask::full();
    let options = AttentionOptions::default();
    let t = |shape: &[usize]| rand_tensor(shape, 1.0, DType::F32, &dev, 124);
    let err = |q: &[usize], k: &[usize], v: &[usize]| -> Result<String> {
        Ok(
            masked_attention_tokens(&t(q)?, &t(k)?, &t(v)?, &full, &options)
                .expect_err("must fail")
                .to_string(),
        )
    };
    assert!(err(&[2, 5, 4 * 8], &[2, 5, 2, 8], &[2, 5, 2, 8])?
        .contains("q must be [batch, m, heads, d]"));
    assert!(err(&[2, 5, 4, 8], &[2, 5, 16], &[2, 5, 2, 8])?.contains("k must be"));
    assert!(err(&[2, 5, 4, 8], &[1, 5, 2, 8], &[1, 5, 2, 8])?.contains("do not fit"));
    assert!(err(&[2, 5, 4, 8], &[2, 5, 2, 8], &[2, 6, 2, 8])?.contains("do not fit"));
    assert!(err(&[2, 5, 4, 8], &[2, 5, 2, 8], &[2, 5, 1, 8])?.contains("do not fit"));
    assert!(err(&[2, 5, 4, 8], &[2, 5, 2, 16], &[2, 5, 2, 8])?.contains("do not fit"));
    assert!(err(&[2, 5, 3, 8], &[2, 5, 2, 8], &[2, 5, 2, 8])?.contains("multiple of kv_heads"));
    assert!(err(&[2, 5, 2, 300], &[2, 5, 2, 300], &[2, 5, 2, 8])?.contains("head dim"));
    let q = t(&[1, 4, 2, 8])?;
    let k = rand_tensor(&[1, 4, 2, 8], 1.0, DType::F64, &dev, 125)?;
    assert!(masked_attention_tokens(&q, &k, &k, &full, &options).is_err());
    // Empty lengths give empty outputs.
    let out = masked_attention_tokens(
        &t(&[1, 0, 2, 8])?,
        &t(&[1, 5, 2, 8])?,
        &t(&[1, 5, 2, 8])?,
        &full,
        &options,
    )?;
    assert_eq!(out.dims(), &[1, 0, 2, 8]);
    Ok(())
}

/// `masked_attention_backward` gives autograd's gradients: the same values in deterministic mode,
/// within the gradient tolerance otherwise (dq summed in a varying order), over the kernel paths
/// (head dims padded to 64 and 128, the one-pass backward at head tile 128, a dense mask, a
/// negative scale) and operand layouts (strided and offset views).
#[test]
fn explicit_backward_matches_autograd() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, hk) = (2, 4, 2);
        let docs = Spec::Documents(documents(b, 133, 90), true);
        let dense = Spec::Dense(random_bytes(b * h * 70 * 133, 0.3, 91), [b, h, 70, 133], 4);
        let cases = [
            ("causal", Spec::Causal, (70, 133, 16, 24), 0.4, Views::Plain),
            ("documents", docs, (133, 133, 16, 24), 0.4, Views::Plain),
            (
                "dense per head, d 96",
                dense,
                (70, 133, 96, 72),
                0.4,
                Views::Plain,
            ),
            (
                "window, d 128",
                Spec::Window(40),
                (70, 133, 128, 96),
                0.4,
                Views::Plain,
            ),
            (
                "causal, scale -0.3",
                Spec::Causal,
                (70, 133, 16, 24),
                -0.3,
                Views::Plain,
            ),
            (
                "causal, packed views",
                Spec::Causal,
                (70, 133, 64, 64),
                0.2,
                Views::Packed,
            ),
            (
                "full, offset views",
                Spec::Full,
                (70, 133, 40, 24),
                0.2,
                Views::Offset,
            ),
            (
                "causal, no queries",
                Spec::Causal,
                (0, 133, 16, 24),
                0.4,
                Views::Plain,
            ),
            (
                "full, no keys",
                Spec::Full,
                (70, 0, 16, 24),
                0.4,
                Views::Plain,
            ),
        ];
        for (name, spec, (m, n, d, dv), scale, views) in cases {
            let mask = spec.mask(dev)?;
            for deterministic in [false, true] {
                let options = AttentionOptions {
                    scale: Some(scale),
                    deterministic: Some(deterministic),
                    ..Default::default()
                };
                for dtype in attention_dtypes(dev) {
                    let what = format!("{name} {dtype:?} deterministic {deterministic}");
                    let (q, k, v) = inputs((b, h, hk, m, n, d, dv), dtype, dev, views, 92)?;
                    let vars = [&q, &k, &v].map(Var::from_tensor);
                    let [qv, kv, vv] = [&vars[0], &vars[1], &vars[2]].map(|v| v.as_ref().unwrap());
                    let grad_out = rand_tensor(&[b, h, m, dv], 1.0, dtype, dev, 93)?;
                    let (out, lse) = masked_attention_with_lse(qv, kv, vv, &mask, &options)?;
                    let autograd = (out.clone() * &grad_out)?.sum_all()?.backward()?;
                    let explicit = masked_attention_backward(
                        &q,
                        &k,
                        &v,
                        (&out, &lse),
                        &grad_out,
                        &mask,
                        &options,
                    )?;
                    let explicit = [explicit.0, explicit.1, explicit.2];
                    for ((which, var), got) in
                        ["q", "k", "v"].iter().zip([qv, kv, vv]).zip(&explicit)
                    {
                        assert_eq!(got.dims(), var.dims(), "{what} d{which} shape");
                        assert_eq!(got.dtype(), dtype, "{what} d{which} dtype");
                        let want = to_f64(autograd.get(var).expect("a gradient"))?;
                        let got = to_f64(got)?;
                        if deterministic {
                            assert!(
                                got.iter().zip(&want).all(|(a, b)| a == b),
                                "{what} d{which}: differs from autograd's"
                            );
                        } else {
                            assert_close(
                                &got,
                                &want,
                                gradient_tolerance(dtype),
                                &format!("{what} d{which}"),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// Keys split in two parts, as ring attention splits them: the parts' forwards combined by their
/// log-sum-exps give the whole output, and each part's backward with the whole output and
/// log-sum-exp gives its share of the gradients (dq summed, dk and dv concatenated), which must
/// match the gradients of attention over all the keys. Some rows see no key of one part; the
/// dense mask keeps every row one key at least.
#[test]
fn split_keys_backward_sums_to_the_whole() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, hk, m, n, d, dv) = (2, 4, 2, 70, 133, 32, 24);
        let split = 69;
        let mut bytes = random_bytes(m * n, 0.25, 95);
        for i in 0..m {
            bytes[i * n + (i * 7) % n] = 1;
            if i % 5 == 0 {
                // Rows that see no key of the first part.
                bytes[i * n..i * n + split].iter_mut().for_each(|x| *x = 0);
                bytes[i * n + split + i % (n - split)] = 1;
            }
        }
        let part_bytes = |cols: std::ops::Range<usize>| -> Vec<u8> {
            (0..m)
                .flat_map(|i| bytes[i * n + cols.start..i * n + cols.end].to_vec())
                .collect()
        };
        let whole = Spec::Dense(bytes.clone(), [1, 1, m, n], 2).mask(dev)?;
        let parts = [(0..split), (split..n)].map(|cols| {
            let width = cols.len();
            (
                cols.clone(),
                Spec::Dense(part_bytes(cols), [1, 1, m, width], 2),
            )
        });
        let options = AttentionOptions {
            scale: Some(0.3),
            ..Default::default()
        };
        for dtype in attention_dtypes(dev) {
            let (q, k, v) = inputs((b, h, hk, m, n, d, dv), dtype, dev, Views::Plain, 96)?;
            let grad_out = rand_tensor(&[b, h, m, dv], 1.0, dtype, dev, 97)?;
            let mut forwards = Vec::new();
            for (cols, spec) in &parts {
                let (kp, vp) = (
                    k.narrow(2, cols.start, cols.len())?,
                    v.narrow(2, cols.start, cols.len())?,
                );
                let (out, lse) =
                    masked_attention_with_lse(&q, &kp, &vp, &spec.mask(dev)?, &options)?;
                forwards.push((to_f64(&out)?, to_f64(&lse)?));
            }
            // lse = log(exp(lse_1) + exp(lse_2)); out = sum_p exp(lse_p - lse) out_p.
            let rows = b * h * m;
            let mut out = vec![0.0; rows * dv];
            let mut lse = vec![0.0; rows];
            for r in 0..rows {
                let (l1, l2) = (forwards[0].1[r], forwards[1].1[r]);
                let top = l1.max(l2);
                lse[r] = top + ((l1 - top).exp() + (l2 - top).exp()).ln();
                for (out_p, lse_p) in &forwards {
                    let w = (lse_p[r] - lse[r]).exp();
                    for c in 0..dv {
                        out[r * dv + c] += w * out_p[r * dv + c];
                    }
                }
            }
            let out = Tensor::from_vec(out, (b, h, m, dv), dev)?.to_dtype(dtype)?;
            let lse_dtype = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let lse = Tensor::from_vec(lse, (b, h, m), dev)?.to_dtype(lse_dtype)?;
            let mut dq: Option<Tensor> = None;
            let (mut dks, mut dvs) = (Vec::new(), Vec::new());
            for (cols, spec) in &parts {
                let (kp, vp) = (
                    k.narrow(2, cols.start, cols.len())?,
                    v.narrow(2, cols.start, cols.len())?,
                );
                let (dqp, dkp, dvp) = masked_attention_backward(
                    &q,
                    &kp,
                    &vp,
                    (&out, &lse),
                    &grad_out,
                    &spec.mask(dev)?,
                    &options,
                )?;
                let dqp = dqp.to_dtype(DType::F64)?;
                dq = Some(match dq {
                    Some(sum) => (sum + dqp)?,
                    None => dqp,
                });
                dks.push(dkp);
                dvs.push(dvp);
            }
            let vars = [&q, &k, &v].map(Var::from_tensor);
            let [qv, kv, vv] = [&vars[0], &vars[1], &vars[2]].map(|v| v.as_ref().unwrap());
            let grads = (masked_attention_with(qv, kv, vv, &whole, &options)? * &grad_out)?
                .sum_all()?
                .backward()?;
            let got = [
                dq.expect("two parts"),
                Tensor::cat(&dks, 2)?,
                Tensor::cat(&dvs, 2)?,
            ];
            for ((which, var), got) in ["q", "k", "v"].iter().zip([qv, kv, vv]).zip(&got) {
                assert_close(
                    &to_f64(got)?,
                    &to_f64(grads.get(var).expect("a gradient"))?,
                    gradient_tolerance(dtype),
                    &format!("split keys {dtype:?} d{which}"),
                );
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn explicit_backward_bad_input_is_a_clear_error() -> Result<()> {
    let dev = Device::Cpu;
    let causal = AttentionMask::causal();
    let options = AttentionOptions::default();
    let t = |shape: &[usize], dtype: DType| rand_tensor(shape, 1.0, dtype, &dev, 98);
    let (q, k, v) = (
        t(&[1, 4, 5, 8], DType::F32)?,
        t(&[1, 2, 7, 8], DType::F32)?,
        t(&[1, 2, 7, 6], DType::F32)?,
    );
    let (out, lse) = masked_attention_with_lse(&q, &k, &v, &causal, &options)?;
    let grad_out = t(&[1, 4, 5, 6], DType::F32)?;
    let err = |q: &Tensor, out: &Tensor, lse: &Tensor, grad_out: &Tensor| -> String {
        masked_attention_backward(q, &k, &v, (out, lse), grad_out, &causal, &options)
            .expect_err("must fail")
            .to_string()
    };
    assert!(err(&q, &out.narrow(3, 0, 5)?, &lse, &grad_out)
        .contains("out must be [batch, heads, m, dv]"));
    assert!(err(&q, &out, &lse, &t(&[1, 4, 6, 6], DType::F32)?).contains("grad_out must be"));
    assert!(err(&q, &out, &lse, &grad_out.to_dtype(DType::F64)?).contains("dtype mismatch"));
    assert!(
        err(&q, &out, &lse.narrow(2, 0, 4)?, &grad_out).contains("lse must be [batch, heads, m]")
    );
    assert!(err(&q, &out, &lse.to_dtype(DType::BF16)?, &grad_out).contains("lse must be f32"));
    assert!(err(&t(&[1, 4, 5], DType::F32)?, &out, &lse, &grad_out).contains("q must be"));
    assert!(
        err(&t(&[1, 3, 5, 8], DType::F32)?, &out, &lse, &grad_out).contains("multiple of kv_heads")
    );
    // A dense mask of the wrong shape.
    let dense = AttentionMask::dense(&Tensor::ones((5, 6), DType::U8, &dev)?)?;
    assert!(
        masked_attention_backward(&q, &k, &v, (&out, &lse), &grad_out, &dense, &options).is_err()
    );
    // The same inputs, well formed, give the gradients.
    let (dq, dk, dv) =
        masked_attention_backward(&q, &k, &v, (&out, &lse), &grad_out, &causal, &options)?;
    assert_eq!(
        (dq.dims(), dk.dims(), dv.dims()),
        (q.dims(), k.dims(), v.dims())
    );
    Ok(())
}

/// Keys split in three uneven parts under a dense mask: `masked_attention_combine` of the parts'
/// forwards gives the forward over all the keys (output and log-sum-exp), with rows that see no
/// key of some part, and rows that see no key at all (zero rows, `-inf`).
#[test]
fn parts_combine_to_the_whole_forward() -> Result<()> {
    for_each_device(|dev| {
        let (b, h, hk, m, n, d, dv) = (2, 4, 2, 45, 150, 24, 40);
        let mut bytes = random_bytes(m * n, 0.2, 100);
        for i in 0..m {
            match i % 6 {
                // No key at all.
                0 => bytes[i * n..(i + 1) * n].iter_mut().for_each(|x| *x = 0),
                // None of the first part.
                1 => bytes[i * n..i * n + 64].iter_mut().for_each(|x| *x = 0),
                _ => {}
            }
        }
        let bounds = [0, 64, 67, n];
        let options = AttentionOptions {
            scale: Some(0.25),
            ..Default::default()
        };
        let whole = Spec::Dense(bytes.clone(), [1, 1, m, n], 2).mask(dev)?;
        for dtype in attention_dtypes(dev) {
            let (q, k, v) = inputs((b, h, hk, m, n, d, dv), dtype, dev, Views::Plain, 101)?;
            let mut parts = Vec::new();
            for w in bounds.windows(2) {
                let (start, len) = (w[0], w[1] - w[0]);
                let cols: Vec<u8> = (0..m)
                    .flat_map(|i| bytes[i * n + start..i * n + start + len].to_vec())
                    .collect();
                let mask = Spec::Dense(cols, [1, 1, m, len], 2).mask(dev)?;
                let (kp, vp) = (k.narrow(2, start, len)?, v.narrow(2, start, len)?);
                parts.push(masked_attention_with_lse(&q, &kp, &vp, &mask, &options)?);
            }
            let (out, lse) = masked_attention_combine(&parts)?;
            let (want, want_lse) = masked_attention_with_lse(&q, &k, &v, &whole, &options)?;
            assert_eq!(out.dtype(), dtype);
            assert_eq!(lse.dtype(), want_lse.dtype());
            let tol = attention_tolerance(dtype);
            assert_close(
                &to_f64(&out)?,
                &to_f64(&want)?,
                tol,
                &format!("combined {dtype:?} out"),
            );
            assert_close(
                &to_f64(&lse)?,
                &to_f64(&want_lse)?,
                tol.max(1e-6),
                &format!("combined {dtype:?} lse"),
            );
            let rows = to_f64(&lse)?;
            assert!(rows
                .chunks(m)
                .all(|row| row.iter().step_by(6).all(|x| *x == f64::NEG_INFINITY)));
        }
        // Bad input.
        let t = |shape: &[usize], dtype: DType| rand_tensor(shape, 1.0, dtype, dev, 102);
        let part = (t(&[1, 2, 3, 8], DType::F32)?, t(&[1, 2, 3], DType::F32)?);
        let err = |parts: &[(Tensor, Tensor)]| {
            masked_attention_combine(parts)
                .expect_err("must fail")
                .to_string()
        };
        assert!(err(&[]).contains("one part at least"));
        assert!(err(&[
            part.clone(),
            (t(&[1, 2, 4, 8], DType::F32)?, t(&[1, 2, 4], DType::F32)?)
        ])
        .contains("part 1"));
        assert!(
            err(&[part.clone(), (part.0.clone(), t(&[1, 2, 2], DType::F32)?)])
                .contains("lse must be")
        );
        assert!(
            err(&[part.clone(), (part.0.to_dtype(DType::F16)?, part.1.clone())])
                .contains("part 1 is")
        );
        assert!(err(&[(part.0.clone(), part.1.to_dtype(DType::BF16)?)])
            .contains("lse must be f32 or f64"));
        assert!(
            err(&[(t(&[2, 3, 8], DType::F32)?, part.1.clone())]).contains("[batch, heads, m, dv]")
        );
        Ok(())
    });
    Ok(())
}
