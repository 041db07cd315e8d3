//! Trainable attention with arbitrary masks: `softmax(scale * q kᵀ + mask) v`, FlashAttention-2's
//! tiled algorithm (online softmax, no `m x n` buffer), with tiles the mask hides skipped and
//! tiles it keeps whole taken without per-element masking.
//!
//! The CPU path runs rayon over tiles with the `gemm` crate for tile products; the CUDA path runs
//! tensor-core kernels for f16 and bf16 and exact-f32 row kernels for f32 (`src/cuda/attention.cu`),
//! and on compute capability 9.0 the f16 / bf16 forward up to head dim 128 with `wgmma`
//! (`src/cuda/sm90/attention.cu`).

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod mask;

pub use mask::AttentionMask;

use crate::cpu::CpuFloat;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

const OP: &str = "masked_attention";
/// The largest head dimension.
const MAX_HEAD_DIM: usize = 256;

/// Modes of [`masked_attention_with`]; `Default` is what [`masked_attention`] uses, apart from
/// its `scale`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionOptions {
    /// The factor of the scores; `None` is `1 / sqrt(d)`.
    pub scale: Option<f64>,
    /// How f32 inputs are multiplied on CUDA (`None`: [`crate::f32_matmul`]). Both the CPU and
    /// the CUDA kernels compute f32 with exact f32 multiply-adds (the accurate end of every
    /// mode), so no mode changes the result today; f64 is computed in f64 on the CPU.
    pub f32_mode: Option<crate::F32Matmul>,
    /// Bit-reproducible gradients (`None`: [`crate::deterministic`]). The CPU backward is
    /// deterministic in every mode, and so is the portable CUDA backward's two-pass form (dq and
    /// dk / dv each summed in one block in a fixed order). Otherwise f16 / bf16 with head dims
    /// up to 128 take the Hopper backward on compute capability 9.0, and head dims over 64 (up
    /// to 128) the portable one-pass backward where it fits (GPUs with 227 KiB of shared memory
    /// a block); both add each key block's share of dq with float reductions in a varying order.
    /// Deterministic, they take the two-pass backward.
    pub deterministic: Option<bool>,
    /// Whether the Hopper forward, when an operand tracks gradients, also zeroes the Hopper
    /// backward's f32 dq accumulator (`None`: yes). That spares the backward a memset (2-3% of
    /// forward + backward at long sequences on an H100) but holds `4 * batch * heads * m * head
    /// tile` bytes (m rounded up to 64, head tile 64 or 128) from the forward to the first
    /// backward: in a model of many layers, every layer's at once when the forward ends.
    /// `Some(false)` keeps that memory inside the backward. No effect elsewhere.
    pub dq_in_forward: Option<bool>,
}

/// Attention of `q` over `k` and `v` under `mask`: `out = softmax(scale * q kᵀ, masked) v`.
///
/// * `q` `[batch, heads, m, d]`, `k` `[batch, kv_heads, n, d]`, `v` `[batch, kv_heads, n, dv]`,
///   with `heads` a multiple of `kv_heads` (grouped-query attention: query head `h` reads kv
///   head `h / (heads / kv_heads)`). Any strides: `q`, `k`, `v` may be views of one packed
///   projection. `d`, `dv` in `1..=256`. Output `[batch, heads, m, dv]`, the dtype of `q`.
/// * dtypes: f16, bf16 and f32 (f32 accumulation and softmax statistics), f64 on the CPU; q, k
///   and v share one.
/// * A query that sees no key gives a zero row (not NaN) and zero gradients.
/// * Autograd: gradients for `q`, `k` and `v`, recomputing the probabilities from the saved
///   log-sum-exp (no `m x n` buffer). Memory: when an operand tracks gradients, the Hopper
///   forward (below) also zeroes the backward's f32 dq accumulator (`4 * batch * heads * m *
///   head tile` bytes, m rounded up to 64) and the op keeps it until the first backward, which
///   then needs no memset (`AttentionOptions::dq_in_forward` turns this off); dropping the
///   output releases it without a backward.
/// * Cost: `4 * batch * heads * d * (visible keys per query) * m` FLOPs forward, about 2.5x that
///   backward; tiles (128 queries x 64 keys on the CPU, 64 x 64 on CUDA) that the mask hides
///   entirely are skipped.
/// * CUDA: f16 and bf16 on tensor cores, f32 in exact f32 row kernels (correct, but far slower:
///   use bf16 for speed). The tensor-core kernels are built for head dims 64, 128 and 256; a head
///   dim in between runs in the next one up at its cost (d = 96 costs what d = 128 does). On
///   compute capability 9.0 (H100, H200) the forward at head dims up to 128 can run Hopper
///   kernels (`wgmma`) instead of the portable ones (`mma.sync`, sm_80 and up); the environment
///   variable `CANDLE_FASTOPS_ATTENTION_KERNELS=sm90` or `=portable`, read once per process,
///   picks one over the default. Both give the same results within the tolerances above; they
///   are not bit-identical to each other. The Hopper kernels read a document mask whose ids form
///   one contiguous run each as runs (the fast path for packed sequences);
///   `CANDLE_FASTOPS_ATTENTION_RUNS=0` makes them read its tile states instead, for comparisons.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{masked_attention, AttentionMask};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (1, 2, 5, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (1, 2, 5, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1., (1, 2, 5, 8), &dev)?;
/// let out = masked_attention(&q, &k, &v, &AttentionMask::causal(), 8f64.powf(-0.5))?;
/// assert_eq!(out.dims(), &[1, 2, 5, 8]);
/// // The first query sees only the first key: its output is that key's value.
/// let first = out.narrow(2, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
/// let value = v.narrow(2, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(first.iter().zip(&value).all(|(a, b)| (a - b).abs() < 1e-6));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, scale: f64,
) -> Result<Tensor> {
    let options = AttentionOptions {
        scale: Some(scale),
        ..Default::default()
    };
    masked_attention_with(q, k, v, mask, &options)
}

/// [`masked_attention`] with per-call options.
pub fn masked_attention_with(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<Tensor> {
    Ok(attention(q, k, v, mask, options)?.0)
}

/// [`masked_attention_with`] and the row log-sum-exp of the scaled, masked scores: f32 (f64 for
/// f64 inputs) `[batch, heads, m]`, natural log, `-inf` for a query that sees no key. Attention
/// over the union of key sets split in parts is `sum_p exp(lse_p - lse) out_p` with
/// `lse = log(sum_p exp(lse_p))` ([`masked_attention_combine`]). The log-sum-exp carries no
/// gradient; [`masked_attention_backward`] takes it.
pub fn masked_attention_with_lse(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<(Tensor, Tensor)> {
    let (out, saved) = attention(q, k, v, mask, options)?;
    let lse = locked(&saved)?.clone();
    let Some(lse) = lse else {
        bail!("{OP}: internal error, the forward kept no log-sum-exp");
    };
    // Kept as `[b, h, m]`: f64 from the CPU, f32 from CUDA.
    let dtype = if q.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    Ok((out, lse.to_dtype(dtype)?))
}

/// Attention over a key set split in parts, from each part's `(out, lse)` as
/// [`masked_attention_with_lse`] returns them (the same queries; keys and values split, each
/// part under its own mask): `lse = log(sum_p exp(lse_p))` and `out = sum_p exp(lse_p - lse)
/// out_p`, computed in f32 (f64 for f64 outputs). A query that sees no key of any part gets a
/// zero row and `-inf`; one that sees none of a part takes nothing from it.
///
/// The result tracks no gradient (the parts' log-sum-exps carry none, so autograd through the
/// combination would be wrong): to train over split keys, run [`masked_attention_backward`] on
/// each part with the combined `out` and `lse`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{
///     masked_attention_combine, masked_attention_with_lse, AttentionMask, AttentionOptions,
/// };
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (1, 2, 4, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (1, 2, 10, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1., (1, 2, 10, 8), &dev)?;
/// let (full, options) = (AttentionMask::full(), AttentionOptions::default());
/// let part = |start: usize, len: usize| {
///     let (k, v) = (k.narrow(2, start, len)?, v.narrow(2, start, len)?);
///     masked_attention_with_lse(&q, &k, &v, &full, &options)
/// };
/// let (out, lse) = masked_attention_combine(&[part(0, 6)?, part(6, 4)?])?;
/// let (whole, whole_lse) = masked_attention_with_lse(&q, &k, &v, &full, &options)?;
/// let diff = (out - whole)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// let lse_diff = (lse - whole_lse)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5 && lse_diff < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention_combine(parts: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
    let Some((out0, lse0)) = parts.first() else {
        bail!("{OP}: combine needs one part at least");
    };
    let [batch, heads, m, dv] = rank4(out0, "each part's out", "[batch, heads, m, dv]")?;
    for (i, (out, lse)) in parts.iter().enumerate() {
        if out.dims() != out0.dims() || lse.dims() != [batch, heads, m] {
            bail!(
                "{OP}: part {i} has out {:?} and lse {:?}; part 0 has out {:?}, so lse must be {:?}",
                out.dims(),
                lse.dims(),
                out0.dims(),
                [batch, heads, m]
            );
        }
        if out.dtype() != out0.dtype() || lse.dtype() != lse0.dtype() {
            bail!(
                "{OP}: part {i} is {:?} / {:?} (out / lse), part 0 {:?} / {:?}",
                out.dtype(),
                lse.dtype(),
                out0.dtype(),
                lse0.dtype()
            );
        }
        if !matches!(lse.dtype(), DType::F32 | DType::F64) {
            bail!("{OP}: lse must be f32 or f64, got {:?}", lse.dtype());
        }
        for t in [out, lse] {
            if !t.device().same_device(out0.device()) {
                bail!(
                    "{OP}: device mismatch, part 0 is on {:?} but part {i} on {:?}",
                    out0.device().location(),
                    t.device().location()
                );
            }
        }
    }
    let acc = if out0.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let lses = parts
        .iter()
        .map(|(_, lse)| lse.detach().to_dtype(acc))
        .collect::<Result<Vec<_>>>()?;
    let lses = Tensor::stack(&lses, 0)?; // [parts, b, h, m]
    let max = lses.max_keepdim(0)?;
    // Rows no part sees: max -inf, taken as 0 so that every exp below is exp(-inf) = 0.
    let top = max
        .ne(f64::NEG_INFINITY)?
        .where_cond(&max, &max.zeros_like()?)?;
    let weights = lses.broadcast_sub(&top)?.exp()?;
    let sum = weights.sum_keepdim(0)?;
    let lse = (top + sum.log()?)?.squeeze(0)?;
    let seen = sum.gt(0.0)?;
    let weights = weights.broadcast_div(&seen.where_cond(&sum, &sum.ones_like()?)?)?;
    let mut out = Tensor::zeros((batch, heads, m, dv), acc, out0.device())?;
    for (p, (part, _)) in parts.iter().enumerate() {
        let w = weights.get(p)?.unsqueeze(3)?;
        out = (out + part.detach().to_dtype(acc)?.broadcast_mul(&w)?)?;
    }
    Ok((out.to_dtype(out0.dtype())?, lse.to_dtype(lse0.dtype())?))
}

/// The backward of [`masked_attention_with`] as a function, outside candle's autograd: the
/// gradients `(dq, dk, dv)` of a loss whose gradient with respect to the output is `grad_out`,
/// from the forward's output and log-sum-exp as [`masked_attention_with_lse`] returns them.
///
/// * `q`, `k`, `v`, `mask` and `options` as the forward took them; `out` and `grad_out`
///   `[batch, heads, m, dv]` in the dtype of `q`, any layout; `lse` `[batch, heads, m]`, f32 or
///   f64 (as the forward gives it for f64 inputs). Gradients shaped as `q`, `k` and `v`, in
///   their dtype, tracking no graph.
/// * The kernels and the numerics are those of the autograd backward (the same tolerances; the
///   same bits in deterministic mode). What this form leaves out is candle's bookkeeping around
///   a `backward()` call: the seed of the output gradient, and a zero tensor plus an add for each
///   of q, k and v.
/// * Keys split in parts (ring or context-parallel attention): with `out` and `lse` those of the
///   whole key set (the parts' forwards joined by [`masked_attention_combine`]),
///   each part's call gives that part's exact share: dq is the sum of the parts' dq, and each
///   part's dk and dv are its keys' gradients.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fastops::{
///     masked_attention_backward, masked_attention_with, masked_attention_with_lse, AttentionMask,
///     AttentionOptions,
/// };
/// let dev = Device::Cpu;
/// let (q, k, v) = (
///     Var::randn(0f32, 1., (1, 2, 6, 8), &dev)?,
///     Var::randn(0f32, 1., (1, 2, 6, 8), &dev)?,
///     Var::randn(0f32, 1., (1, 2, 6, 8), &dev)?,
/// );
/// let (mask, options) = (AttentionMask::causal(), AttentionOptions::default());
/// let grad_out = Tensor::randn(0f32, 1., (1, 2, 6, 8), &dev)?;
/// let (out, lse) = masked_attention_with_lse(&q, &k, &v, &mask, &options)?;
/// let (dq, _dk, _dv) =
///     masked_attention_backward(&q, &k, &v, (&out, &lse), &grad_out, &mask, &options)?;
/// // The same as autograd's.
/// let loss = (masked_attention_with(&q, &k, &v, &mask, &options)? * &grad_out)?.sum_all()?;
/// let grads = loss.backward()?;
/// let diff = (dq - grads.get(&q).unwrap())?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention_backward(
    q: &Tensor, k: &Tensor, v: &Tensor, (out, lse): (&Tensor, &Tensor), grad_out: &Tensor,
    mask: &AttentionMask, options: &AttentionOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let p = problem(q, k, v, options)?;
    mask.check(p.batch, p.heads, p.m, p.n, q.device())?;
    let out_dims = [p.batch, p.heads, p.m, p.dv];
    for (name, t) in [("out", out), ("grad_out", grad_out)] {
        if t.dims() != out_dims {
            bail!(
                "{OP}: {name} must be [batch, heads, m, dv] = {out_dims:?}, got shape {:?}",
                t.dims()
            );
        }
        if t.dtype() != q.dtype() {
            bail!(
                "{OP}: dtype mismatch, q is {:?} but {name} is {:?}",
                q.dtype(),
                t.dtype()
            );
        }
    }
    if lse.dims() != [p.batch, p.heads, p.m] {
        bail!(
            "{OP}: lse must be [batch, heads, m] = {:?}, got shape {:?}",
            [p.batch, p.heads, p.m],
            lse.dims()
        );
    }
    if !matches!(lse.dtype(), DType::F32 | DType::F64) {
        bail!(
            "{OP}: lse must be f32 (as masked_attention_with_lse gives it) or f64, got {:?}",
            lse.dtype()
        );
    }
    for (name, t) in [("out", out), ("lse", lse), ("grad_out", grad_out)] {
        if !t.device().same_device(q.device()) {
            bail!(
                "{OP}: device mismatch, q is on {:?} but {name} on {:?}",
                q.device().location(),
                t.device().location()
            );
        }
    }
    let [q, k, v, out, lse, grad_out] = [q, k, v, out, lse, grad_out].map(Tensor::detach);
    if q.device().is_cuda() {
        return cuda_attention_backward((&q, &k, &v), (&out, &lse), &grad_out, mask, p);
    }
    let op = Attention {
        p,
        mask: mask.clone(),
        saved: Arc::new(Mutex::new(Some(lse.to_dtype(DType::F64)?))),
        dq: DqCarry::default(),
    };
    if q.dtype() == DType::F64 {
        op.cpu_backward::<f64>((&q, &k, &v), &out, &grad_out)
    } else {
        op.cpu_backward::<f32>((&q, &k, &v), &out, &grad_out)
    }
}

/// Attention over one packed projection: `qkv` `[batch, n, heads + 2 * kv_heads, d]` holds the
/// query heads, then the key heads, then the value heads of each token (a `[batch, n, 3, heads,
/// d]` projection is `qkv.reshape((batch, n, 3 * heads, d))`, with `kv_heads = heads`). The
/// result is that of [`masked_attention_with`] on the three parts as `[batch, heads, n, d]` views
/// (self-attention: m = n), token-major like the input: `[batch, n, heads, d]` (so that
/// `reshape((batch, n, heads * d))` is free), in the dtype of `qkv`.
///
/// The difference is the backward: the op's one input is `qkv`, so its gradient is one
/// `[batch, n, heads + 2 * kv_heads, d]` tensor; on CUDA the kernels write the output
/// token-major and dq, dk and dv straight into their places in that gradient (no copies between
/// layouts; two copies on the CPU). A projection that comes from a linear layer as `[batch, n,
/// (heads + 2 * kv_heads) * d]` is best given to [`masked_attention_qkv`], which spares the two
/// reshapes.
/// Views taken with candle ops (`narrow`, `transpose`) instead each send a full-size padded
/// gradient (`narrow`'s backward) and several zero-filled sums through candle's backprop.
/// Where the kernels cannot read the parts in place (on CUDA: a head dim that is not a multiple
/// of 8, a negative scale, 16-bit rows off 16-byte boundaries), this computes exactly that view
/// form instead (its output a transposed view): same results, the slower backward.
///
/// Errors: `qkv` not rank 4, `kv_heads` 0, or a head count that is not `heads + 2 * kv_heads`
/// with `heads` a positive multiple of `kv_heads`; and every error of [`masked_attention`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{masked_attention_packed, AttentionMask, AttentionOptions};
/// let dev = Device::Cpu;
/// // batch 1, 6 tokens, 2 query heads and 1 key / value head of dim 8.
/// let qkv = Tensor::randn(0f32, 1., (1, 6, 2 + 2 * 1, 8), &dev)?;
/// let out = masked_attention_packed(&qkv, 1, &AttentionMask::causal(), &AttentionOptions::default())?;
/// assert_eq!(out.dims(), &[1, 6, 2, 8]); // [batch, n, heads, d]
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention_packed(
    qkv: &Tensor, kv_heads: usize, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<Tensor> {
    let &[_, _, total, _] = qkv.dims() else {
        bail!(
            "{OP}: qkv must be [batch, n, heads + 2 * kv_heads, d], got shape {:?}",
            qkv.dims()
        );
    };
    if kv_heads == 0 || total <= 2 * kv_heads || !(total - 2 * kv_heads).is_multiple_of(kv_heads) {
        bail!(
            "{OP}: qkv holds {total} heads, not heads + 2 * kv_heads with heads a positive \
             multiple of kv_heads = {kv_heads}"
        );
    }
    packed(qkv, total - 2 * kv_heads, kv_heads, mask, options, false)
}

/// [`masked_attention_packed`] on the projection as a linear layer gives it: `qkv` `[batch, n,
/// (heads + 2 * kv_heads) * d]` (each token's query heads, then its key heads, then its value
/// heads, `d` columns each), the result `[batch, n, heads * d]` (what the output projection
/// takes). The values are those of `masked_attention_packed` on `qkv.reshape((batch, n, heads +
/// 2 * kv_heads, d))` with the output reshaped to `[batch, n, heads * d]`.
///
/// Why a form of its own: candle's backprop pays every node of the graph with a zero tensor and
/// an add the size of its input's gradient. The two reshapes around `masked_attention_packed`
/// are two such nodes (the projection's gradient and the output's); here there are none. A `qkv`
/// that is not contiguous goes through those reshapes (a copy) instead.
///
/// Errors: `qkv` not rank 3, `kv_heads` 0, `heads` not a positive multiple of `kv_heads`, a last
/// dim that is not `(heads + 2 * kv_heads) * d` for a positive `d`; and every error of
/// [`masked_attention_packed`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{masked_attention_qkv, AttentionMask, AttentionOptions};
/// let dev = Device::Cpu;
/// // batch 2, 5 tokens, 4 query heads and 2 key / value heads of dim 8: 64 columns a token.
/// let qkv = Tensor::randn(0f32, 1., (2, 5, (4 + 2 * 2) * 8), &dev)?;
/// let mask = AttentionMask::causal();
/// let out = masked_attention_qkv(&qkv, 4, 2, &mask, &AttentionOptions::default())?;
/// assert_eq!(out.dims(), &[2, 5, 4 * 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention_qkv(
    qkv: &Tensor, heads: usize, kv_heads: usize, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<Tensor> {
    let &[batch, n, columns] = qkv.dims() else {
        bail!(
            "{OP}: qkv must be [batch, n, (heads + 2 * kv_heads) * d], got shape {:?}",
            qkv.dims()
        );
    };
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("{OP}: heads = {heads} must be a positive multiple of kv_heads = {kv_heads}");
    }
    let total = heads + 2 * kv_heads;
    if columns == 0 || !columns.is_multiple_of(total) {
        bail!(
            "{OP}: qkv's last dim {columns} is not (heads + 2 * kv_heads) * d = {total} * d for \
             a positive d"
        );
    }
    let d = columns / total;
    if !qkv.is_contiguous() {
        let out =
            masked_attention_packed(&qkv.reshape((batch, n, total, d))?, kv_heads, mask, options)?;
        return out.reshape((batch, n, heads * d));
    }
    packed(qkv, heads, kv_heads, mask, options, true)
}

/// The packed forms: `qkv` `[b, n, heads + 2 kv_heads, d]`, or `[b, n, (heads + 2 kv_heads) d]`
/// (contiguous) where `flat`.
fn packed(
    qkv: &Tensor, heads: usize, kv_heads: usize, mask: &AttentionMask, options: &AttentionOptions,
    flat: bool,
) -> Result<Tensor> {
    let parts = PackedParts {
        heads,
        kv_heads,
        flat,
    };
    let qkv4 = parts.four_dims(qkv)?;
    let [q, k, v] = parts.views(&qkv4)?;
    let p = problem(&q, &k, &v, options)?;
    mask.check(p.batch, p.heads, p.m, p.n, q.device())?;
    if qkv.elem_count() == 0 || !packed_in_place(&p, [&q, &k, &v]) {
        let out = attention(&q, &k, &v, mask, options)?.0.transpose(1, 2)?;
        return if flat {
            out.reshape((p.batch, p.n, p.heads * p.dv))
        } else {
            Ok(out)
        };
    }
    let attention = Attention {
        p,
        mask: mask.clone(),
        saved: SavedLse::default(),
        dq: DqCarry::for_operands(&p, &[qkv]),
    };
    qkv.apply_op1(PackedAttention { parts, attention })
}

/// Attention on token-major operands, the layout of candle-flash-attn and of
/// `candle_nn::rotary_emb::rope_thd`: `q` `[batch, m, heads, d]`, `k` `[batch, n, kv_heads, d]`,
/// `v` `[batch, n, kv_heads, dv]`, the result `[batch, m, heads, dv]` (so that `reshape((batch,
/// m, heads * dv))` is free). The values are those of [`masked_attention_with`] on
/// `q.transpose(1, 2)`, `k.transpose(1, 2)` and `v.transpose(1, 2)`, transposed back; any m and n
/// (m < n: decoding with a KV cache, the masks bottom-right aligned as there).
///
/// The difference is the backward: the gradients of q, k and v come back token-major like them
/// (on CUDA the kernels write them there, and the output, in place), where the transposed views
/// would each send theirs through a `transpose` node, which candle's backprop pays with a zero
/// tensor and a strided add. Where the kernels cannot read the operands in place (on CUDA: a
/// head dim that is not a multiple of 8, a negative scale, 16-bit rows off 16-byte boundaries),
/// this computes exactly that view form instead.
///
/// Errors: operands not rank 4; batch, length, head or head-dim mismatches (k and v share n and
/// kv_heads, q and k share d); `heads` not a positive multiple of `kv_heads`; and every error of
/// [`masked_attention`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{masked_attention_tokens, AttentionMask, AttentionOptions};
/// let dev = Device::Cpu;
/// // batch 1: 3 new queries over 7 keys (a KV cache), 4 query heads, 2 key / value heads.
/// let q = Tensor::randn(0f32, 1., (1, 3, 4, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (1, 7, 2, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1., (1, 7, 2, 8), &dev)?;
/// let mask = AttentionMask::causal();
/// let out = masked_attention_tokens(&q, &k, &v, &mask, &AttentionOptions::default())?;
/// assert_eq!(out.dims(), &[1, 3, 4, 8]); // [batch, m, heads, dv]
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_attention_tokens(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<Tensor> {
    let [b, _, _, d] = rank4(q, "q", "[batch, m, heads, d]")?;
    let [kb, n, kv_heads, kd] = rank4(k, "k", "[batch, n, kv_heads, d]")?;
    let [vb, vn, vh, _] = rank4(v, "v", "[batch, n, kv_heads, dv]")?;
    if kb != b || vb != b || vn != n || vh != kv_heads || kd != d {
        bail!(
            "{OP}: q {:?}, k {:?} and v {:?} do not fit [batch, m, heads, d], [batch, n, kv_heads, \
             d] and [batch, n, kv_heads, dv]",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let [qh, kh, vh] = [q, k, v].map(|t| t.transpose(1, 2));
    let (qh, kh, vh) = (qh?, kh?, vh?);
    let p = problem(&qh, &kh, &vh, options)?;
    mask.check(p.batch, p.heads, p.m, p.n, q.device())?;
    if q.elem_count() == 0 || k.elem_count() == 0 || !packed_in_place(&p, [&qh, &kh, &vh]) {
        return attention(&qh, &kh, &vh, mask, options)?.0.transpose(1, 2);
    }
    let attention = Attention {
        p,
        mask: mask.clone(),
        saved: SavedLse::default(),
        dq: DqCarry::for_operands(&p, &[q, k, v]),
    };
    q.apply_op3(k, v, TokenAttention { attention })
}

/// Whether the kernels read q, k and v where they lie and write the output and gradients in the
/// packed or token-major layout (else the view form).
fn packed_in_place(p: &Problem, parts: [&Tensor; 3]) -> bool {
    if parts[0].device().is_cpu() {
        return true;
    }
    #[cfg(feature = "cuda")]
    {
        p.d.is_multiple_of(8)
            && p.dv.is_multiple_of(8)
            && p.scale >= 0.0
            && parts
                .iter()
                .all(|t| cuda::operand_ok(t.layout(), t.dtype()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = p;
        false
    }
}

/// Where q, k and v lie in a packed `[batch, n, heads + 2 * kv_heads, d]` tensor (`flat`: one
/// shaped `[batch, n, (heads + 2 * kv_heads) * d]`, contiguous; the output then `[batch, n, heads
/// * d]`).
#[derive(Debug, Clone, Copy)]
struct PackedParts {
    heads: usize,
    kv_heads: usize,
    flat: bool,
}

impl PackedParts {
    /// (first head, head count) of q, k and v.
    fn ranges(self) -> [(usize, usize); 3] {
        let (h, hk) = (self.heads, self.kv_heads);
        [(0, h), (h, hk), (h + hk, hk)]
    }

    /// `qkv` as `[batch, n, heads + 2 * kv_heads, d]` (a free reshape where `flat`).
    fn four_dims(self, qkv: &Tensor) -> Result<Tensor> {
        if !self.flat {
            return Ok(qkv.clone());
        }
        let (b, n, columns) = qkv.dims3()?;
        let total = self.heads + 2 * self.kv_heads;
        qkv.reshape((b, n, total, columns / total))
    }

    /// `layout` (the op's input's) as the layout of [`Self::four_dims`].
    fn four_dims_layout(self, layout: &Layout) -> Result<Layout> {
        if !self.flat {
            return Ok(layout.clone());
        }
        let (b, n, columns) = layout.shape().dims3()?;
        let total = self.heads + 2 * self.kv_heads;
        let d = columns / total;
        let s = layout.stride();
        Ok(Layout::new(
            Shape::from((b, n, total, d)),
            vec![s[0], s[1], d * s[2], s[2]],
            layout.start_offset(),
        ))
    }

    /// The op's output shape for `[b, n, heads, dv]`.
    fn out_shape(self, p: &Problem) -> Shape {
        if self.flat {
            Shape::from((p.batch, p.n, p.heads * p.dv))
        } else {
            Shape::from((p.batch, p.n, p.heads, p.dv))
        }
    }

    /// q, k and v as `[batch, heads, n, d]` views of the four-dim `qkv` (candle ops).
    fn views(self, qkv: &Tensor) -> Result<[Tensor; 3]> {
        let view = |(first, count): (usize, usize)| qkv.narrow(2, first, count)?.transpose(1, 2);
        let [q, k, v] = self.ranges();
        Ok([view(q)?, view(k)?, view(v)?])
    }

    /// The layouts of those views inside the op's input's layout.
    fn layouts(self, packed: &Layout) -> Result<[Layout; 3]> {
        let packed = &self.four_dims_layout(packed)?;
        let [q, k, v] = self
            .ranges()
            .map(|(first, count)| heads_first(&packed.narrow(2, first, count)?));
        Ok([q?, k?, v?])
    }
}

/// The op of [`masked_attention_packed`]: [`Attention`] on three parts of one input, its output
/// token-major (`[b, n, heads, dv]`), its gradient the three parts' gradients in the packed order.
struct PackedAttention {
    parts: PackedParts,
    attention: Attention,
}

impl candle_core::CustomOp1 for PackedAttention {
    fn name(&self) -> &'static str {
        "fastops-masked-attention-packed"
    }

    fn cpu_fwd(&self, qkv: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let [q, k, v] = self.parts.layouts(layout)?;
        let (out, _) = self.attention.cpu_fwd(qkv, &q, qkv, &k, qkv, &v)?;
        // [b, heads, n, dv] -> [b, n, heads, dv] (or [b, n, heads * dv]).
        let p = &self.attention.p;
        let out = cpu_token_major(&out, (p.heads, p.n, p.dv))?;
        Ok((out, self.parts.out_shape(p)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, qkv: &candle_core::CudaStorage, layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let [q, k, v] = self.parts.layouts(layout)?;
        // The kernels write the output token-major.
        let out = self
            .attention
            .cuda_forward((qkv, &q), (qkv, &k), (qkv, &v), cuda::Io::Packed)?;
        Ok((out, self.parts.out_shape(&self.attention.p)))
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad_out: &Tensor) -> Result<Option<Tensor>> {
        let p = &self.attention.p;
        let [q, k, v] = self.parts.views(&self.parts.four_dims(&qkv.detach())?)?;
        // out and its gradient as [b, n, heads, dv] (free reshapes of the contiguous output;
        // a copy of a gradient that is not).
        let (out, grad_out) = if self.parts.flat {
            let four = (p.batch, p.n, p.heads, p.dv);
            (out.reshape(four)?, grad_out.reshape(four)?)
        } else {
            (out.clone(), grad_out.clone())
        };
        #[cfg(feature = "cuda")]
        if qkv.device().is_cuda() {
            // The kernels read out and its gradient token-major and write the packed gradient.
            let grads =
                self.attention
                    .cuda_backward((&q, &k, &v), &out, &grad_out, cuda::Io::Packed)?;
            let cuda::Gradients::Packed(grads) = grads else {
                bail!("{OP}: internal error, the packed backward gave separate gradients");
            };
            return Ok(Some(grads.reshape(qkv.shape())?));
        }
        // The attention backward takes its output and gradient head-major, [b, heads, n, dv].
        let (out, grad_out) = (out.transpose(1, 2)?, grad_out.transpose(1, 2)?);
        let (Some(dq), Some(dk), Some(dv)) = self.attention.bwd(&q, &k, &v, &out, &grad_out)?
        else {
            bail!("{OP}: internal error, the backward left a gradient out");
        };
        // [batch, heads + 2 kv_heads, n, d] in one buffer, then in the packed order.
        let grads = Tensor::cat(&[&dq, &dk, &dv], 1)?;
        Ok(Some(
            grads.transpose(1, 2)?.contiguous()?.reshape(qkv.shape())?,
        ))
    }
}

/// A token-major `[b, rows, heads, cols]` layout as the head-major `[b, heads, rows, cols]` view
/// of the same elements.
fn heads_first(layout: &Layout) -> Result<Layout> {
    let (b, rows, heads, cols) = layout.shape().dims4()?;
    let s = layout.stride();
    Ok(Layout::new(
        Shape::from((b, heads, rows, cols)),
        vec![s[0], s[2], s[1], s[3]],
        layout.start_offset(),
    ))
}

/// A head-major `[b, heads, rows, cols]` CPU result, contiguous, as token-major `[b, rows, heads,
/// cols]`: a rayon task per token row.
fn cpu_token_major(
    out: &CpuStorage, (heads, rows, cols): (usize, usize, usize),
) -> Result<CpuStorage> {
    use rayon::prelude::*;
    Ok(crate::dispatch::with_float_cpu!(OP, out, |src| {
        let mut moved = src.clone();
        if heads * cols > 0 {
            moved
                .par_chunks_mut(heads * cols)
                .enumerate()
                .for_each(|(row, dst)| {
                    let (b, t) = (row / rows, row % rows);
                    for (h, d) in dst.chunks_mut(cols).enumerate() {
                        d.copy_from_slice(&src[((b * heads + h) * rows + t) * cols..][..cols]);
                    }
                });
        }
        candle_core::WithDType::to_cpu_storage_owned(moved)
    }))
}

/// The op of [`masked_attention_tokens`]: [`Attention`] on token-major operands, its output and
/// its gradients token-major.
struct TokenAttention {
    attention: Attention,
}

impl CustomOp3 for TokenAttention {
    fn name(&self) -> &'static str {
        "fastops-masked-attention-tokens"
    }

    fn cpu_fwd(
        &self, q: &CpuStorage, q_layout: &Layout, k: &CpuStorage, k_layout: &Layout,
        v: &CpuStorage, v_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (ql, kl, vl) = (
            heads_first(q_layout)?,
            heads_first(k_layout)?,
            heads_first(v_layout)?,
        );
        let (out, _) = self.attention.cpu_fwd(q, &ql, k, &kl, v, &vl)?;
        let p = &self.attention.p;
        let out = cpu_token_major(&out, (p.heads, p.m, p.dv))?;
        Ok((out, Shape::from((p.batch, p.m, p.heads, p.dv))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, q: &candle_core::CudaStorage, q_layout: &Layout, k: &candle_core::CudaStorage,
        k_layout: &Layout, v: &candle_core::CudaStorage, v_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (ql, kl, vl) = (
            heads_first(q_layout)?,
            heads_first(k_layout)?,
            heads_first(v_layout)?,
        );
        // The kernels write the output token-major.
        let out = self
            .attention
            .cuda_forward((q, &ql), (k, &kl), (v, &vl), cuda::Io::Tokens)?;
        let p = &self.attention.p;
        Ok((out, Shape::from((p.batch, p.m, p.heads, p.dv))))
    }

    fn bwd(
        &self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [q, k, v] = [q, k, v].map(|t| t.detach().transpose(1, 2));
        let (q, k, v) = (q?, k?, v?);
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            // The kernels read out and its gradient token-major and write the gradients so.
            let grads =
                self.attention
                    .cuda_backward((&q, &k, &v), out, grad_out, cuda::Io::Tokens)?;
            let cuda::Gradients::Parts(dq, dk, dv) = grads else {
                bail!("{OP}: internal error, the token-major backward gave a packed gradient");
            };
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let (out, grad_out) = (out.transpose(1, 2)?, grad_out.transpose(1, 2)?);
        let (Some(dq), Some(dk), Some(dv)) = self.attention.bwd(&q, &k, &v, &out, &grad_out)?
        else {
            bail!("{OP}: internal error, the backward left a gradient out");
        };
        let tokens = |t: Tensor| t.transpose(1, 2)?.contiguous();
        Ok((Some(tokens(dq)?), Some(tokens(dk)?), Some(tokens(dv)?)))
    }
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Problem {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub m: usize,
    pub n: usize,
    pub d: usize,
    pub dv: usize,
    pub scale: f64,
    /// Whether the backward must give identical bits run to run.
    pub deterministic: bool,
    /// Whether a forward whose operands track gradients prepares the Hopper backward's zeroed dq
    /// accumulator (`AttentionOptions::dq_in_forward`).
    pub dq_in_forward: bool,
}

/// The forward's log-sum-exp `[b, h, m]` (f64 on the CPU, f32 on a GPU), kept for the backward
/// and for `masked_attention_with_lse`.
type SavedLse = Arc<Mutex<Option<Tensor>>>;

fn attention(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, options: &AttentionOptions,
) -> Result<(Tensor, SavedLse)> {
    let p = problem(q, k, v, options)?;
    mask.check(p.batch, p.heads, p.m, p.n, q.device())?;
    if q.device().is_cuda() {
        return cuda_attention(q, k, v, mask, p);
    }
    let saved = SavedLse::default();
    let op = Attention {
        p,
        mask: mask.clone(),
        saved: saved.clone(),
        dq: DqCarry::default(),
    };
    Ok((q.apply_op3(k, v, op)?, saved))
}

/// The CUDA kernels need head dims that are a multiple of 8 and operands with unit column strides
/// (16-bit: 16-byte aligned rows): other head dims are padded with zeros (which change no score
/// and give output columns that are cut off), other layouts copied. The kernels take a positive
/// scale: softmax(scale q kᵀ) = softmax(-scale (-q) kᵀ). The padding and copies are candle ops,
/// so gradients flow back through them. Returns q, k, v so prepared and the problem they pose.
#[cfg(feature = "cuda")]
fn cuda_operands(q: &Tensor, k: &Tensor, v: &Tensor, p: Problem) -> Result<([Tensor; 3], Problem)> {
    let (d, dv) = (p.d.next_multiple_of(8), p.dv.next_multiple_of(8));
    let (q, scale) = if p.scale < 0.0 {
        (q.neg()?, -p.scale)
    } else {
        (q.clone(), p.scale)
    };
    let operands = [(&q, d), (k, d), (v, dv)].map(|(t, dim)| cuda::kernel_operand(pad_to(t, dim)?));
    let [q, k, v] = operands;
    Ok(([q?, k?, v?], Problem { d, dv, scale, ..p }))
}

/// `t` with its last dim padded with zeros to `dim`.
#[cfg(feature = "cuda")]
fn pad_to(t: &Tensor, dim: usize) -> Result<Tensor> {
    let last = t.dim(3)?;
    if last == dim {
        Ok(t.clone())
    } else {
        t.pad_with_zeros(3, 0, dim - last)
    }
}

#[cfg(feature = "cuda")]
fn cuda_attention(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask, p: Problem,
) -> Result<(Tensor, SavedLse)> {
    let ([q2, k2, v2], padded) = cuda_operands(q, k, v, p)?;
    let saved = SavedLse::default();
    let op = Attention {
        p: padded,
        mask: mask.clone(),
        saved: saved.clone(),
        dq: DqCarry::for_operands(&padded, &[&q2, &k2, &v2]),
    };
    let out = q2.apply_op3(&k2, &v2, op)?;
    let out = if padded.dv == p.dv {
        out
    } else {
        out.narrow(3, 0, p.dv)?
    };
    Ok((out, saved))
}

/// [`masked_attention_backward`] on CUDA: the operands prepared as the forward prepares them,
/// `out` and `grad_out` padded as v is (zero columns add nothing to rowsum(dO O)), the gradients
/// cut back to the problem's head dims.
#[cfg(feature = "cuda")]
fn cuda_attention_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor), (out, lse): (&Tensor, &Tensor), grad_out: &Tensor,
    mask: &AttentionMask, p: Problem,
) -> Result<(Tensor, Tensor, Tensor)> {
    let ([q2, k2, v2], padded) = cuda_operands(q, k, v, p)?;
    let op = Attention {
        p: padded,
        mask: mask.clone(),
        saved: Arc::new(Mutex::new(Some(lse.to_dtype(DType::F32)?.contiguous()?))),
        dq: DqCarry::default(),
    };
    let (out, grad_out) = (pad_to(out, padded.dv)?, pad_to(grad_out, padded.dv)?);
    let grads = op.cuda_backward((&q2, &k2, &v2), &out, &grad_out, cuda::Io::HeadMajor)?;
    let cuda::Gradients::Parts(dq, dk, dv) = grads else {
        bail!("{OP}: internal error, the backward gave a packed gradient");
    };
    let cut = |t: Tensor, dim: usize| -> Result<Tensor> {
        if t.dim(3)? == dim {
            Ok(t)
        } else {
            t.narrow(3, 0, dim)?.contiguous()
        }
    };
    let dq = cut(dq, p.d)?;
    let dq = if p.scale < 0.0 { dq.neg()? } else { dq };
    Ok((dq, cut(dk, p.d)?, cut(dv, p.dv)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_attention(
    _: &Tensor, _: &Tensor, _: &Tensor, _: &AttentionMask, _: Problem,
) -> Result<(Tensor, SavedLse)> {
    bail!("{OP}: this build has no CUDA support (the `cuda` feature)")
}

#[cfg(not(feature = "cuda"))]
fn cuda_attention_backward(
    _: (&Tensor, &Tensor, &Tensor), _: (&Tensor, &Tensor), _: &Tensor, _: &AttentionMask,
    _: Problem,
) -> Result<(Tensor, Tensor, Tensor)> {
    bail!("{OP}: this build has no CUDA support (the `cuda` feature)")
}

/// `t`'s four dims, or an error naming it and the `form` it must have.
fn rank4(t: &Tensor, name: &str, form: &str) -> Result<[usize; 4]> {
    match t.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        dims => bail!("{OP}: {name} must be {form}, got shape {dims:?}"),
    }
}

/// Checks the operands and returns the problem's sizes.
fn problem(q: &Tensor, k: &Tensor, v: &Tensor, options: &AttentionOptions) -> Result<Problem> {
    let [batch, heads, m, d] = rank4(q, "q", "[batch, heads, m, d]")?;
    let [kb, kv_heads, n, kd] = rank4(k, "k", "[batch, kv_heads, n, d]")?;
    let [vb, vh, vn, dv] = rank4(v, "v", "[batch, kv_heads, n, dv]")?;
    if kb != batch || vb != batch {
        bail!("{OP}: batch sizes differ: q {batch}, k {kb}, v {vb}");
    }
    if vh != kv_heads || vn != n {
        bail!(
            "{OP}: k {:?} and v {:?} must share batch, kv heads and length",
            k.dims(),
            v.dims()
        );
    }
    if kd != d {
        bail!("{OP}: head dims differ: q has {d}, k has {kd}");
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        bail!("{OP}: heads ({heads}) must be a multiple of kv_heads ({kv_heads}), at least 1");
    }
    for (name, dim) in [("d", d), ("dv", dv)] {
        if !(1..=MAX_HEAD_DIM).contains(&dim) {
            bail!("{OP}: head dim {name} = {dim} is outside 1..={MAX_HEAD_DIM}");
        }
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            bail!(
                "{OP}: dtype mismatch, q is {:?} but {name} is {:?}",
                q.dtype(),
                t.dtype()
            );
        }
        if !t.device().same_device(q.device()) {
            bail!(
                "{OP}: device mismatch, q is on {:?} but {name} on {:?}",
                q.device().location(),
                t.device().location()
            );
        }
    }
    match q.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => {}
        DType::F64 if q.device().is_cpu() => {}
        dtype => bail!("{OP}: unsupported dtype {dtype:?} (f32, f16, bf16; f64 on the CPU)"),
    }
    let scale = options.scale.unwrap_or(1.0 / (d as f64).sqrt());
    if !scale.is_finite() {
        bail!("{OP}: scale must be finite, got {scale}");
    }
    Ok(Problem {
        batch,
        heads,
        kv_heads,
        m,
        n,
        d,
        dv,
        scale,
        deterministic: options.deterministic.unwrap_or_else(crate::deterministic),
        dq_in_forward: options.dq_in_forward.unwrap_or(true),
    })
}

/// The op: q, k, v in, the attention out; the log-sum-exp is kept in `saved`.
struct Attention {
    p: Problem,
    mask: AttentionMask,
    saved: SavedLse,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dq: DqCarry,
}

/// The Hopper backward's dq accumulator, zeroed by the CUDA forward when an operand tracks
/// gradients, so that the backward needs no memset of its own (the forward's idle producer warps
/// write the zeros while its consumers compute). Held from the forward to the first backward,
/// which takes it; a later backward, or one that runs other kernels, allocates its own.
#[derive(Default)]
struct DqCarry {
    /// Whether the forward makes it: some operand tracks gradients (`Tensor::track_op`).
    #[cfg(feature = "cuda")]
    wanted: bool,
    #[cfg(feature = "cuda")]
    zeroed: Mutex<Option<cuda::ZeroedDq>>,
}

impl DqCarry {
    /// Wanted when `p` asks for it and an operand tracks gradients.
    #[cfg(feature = "cuda")]
    fn for_operands(p: &Problem, operands: &[&Tensor]) -> Self {
        Self {
            wanted: p.dq_in_forward && operands.iter().any(|t| t.track_op()),
            zeroed: Mutex::default(),
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn for_operands(_: &Problem, _: &[&Tensor]) -> Self {
        Self::default()
    }

    #[cfg(feature = "cuda")]
    fn keep(&self, dq: Option<cuda::ZeroedDq>) -> Result<()> {
        *locked(&self.zeroed)? = dq;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn take(&self) -> Result<Option<cuda::ZeroedDq>> {
        Ok(locked(&self.zeroed)?.take())
    }
}

/// The op state behind `m`, or an error when a panic poisoned it.
fn locked<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| candle_core::Error::Msg(format!("{OP}: poisoned state")))
}

/// A rank-4 strided view as a contiguous slice of the accumulator type: the data itself when it
/// is contiguous and of that type, a copy otherwise.
fn gather<'a, T: CpuFloat>(data: &'a [T], layout: &Layout) -> Result<Cow<'a, [T::Acc]>> {
    if layout.shape().elem_count() == 0 {
        // An empty view may start past the end of its (empty) storage.
        return Ok(Cow::Owned(Vec::new()));
    }
    if let Some((start, end)) = layout.contiguous_offsets() {
        let data = &data[start..end];
        return Ok(match T::as_acc(data) {
            Some(data) => Cow::Borrowed(data),
            None => Cow::Owned(data.iter().map(|&x| x.to_acc()).collect()),
        });
    }
    let (d0, d1, d2, d3) = layout.shape().dims4()?;
    let s = layout.stride();
    let start = layout.start_offset();
    let mut out = Vec::with_capacity(d0 * d1 * d2 * d3);
    for a in 0..d0 {
        for b in 0..d1 {
            for c in 0..d2 {
                let row = start + a * s[0] + b * s[1] + c * s[2];
                if s[3] == 1 {
                    out.extend(data[row..row + d3].iter().map(|&x| x.to_acc()));
                } else {
                    out.extend((0..d3).map(|e| data[row + e * s[3]].to_acc()));
                }
            }
        }
    }
    Ok(Cow::Owned(out))
}

impl Attention {
    fn keep_lse(&self, lse: Tensor) -> Result<()> {
        *locked(&self.saved)? = Some(lse);
        Ok(())
    }

    fn saved_lse(&self) -> Result<Tensor> {
        let lse = locked(&self.saved)?.clone();
        match lse {
            Some(lse) => Ok(lse),
            None => bail!("{OP}: internal error, the backward found no saved log-sum-exp"),
        }
    }

    /// Runs `f` with the CPU view of the mask for this problem.
    fn with_cpu_mask<R>(&self, f: impl FnOnce(&cpu::CpuMask<'_>) -> R) -> Result<R> {
        let p = &self.p;
        let tiles =
            self.mask
                .tile_data(cpu::ROWS, cpu::COLS, p.m, p.n, &candle_core::Device::Cpu)?;
        let kind = self.mask.kind();
        let mask::Kind::Dense { mask } = kind else {
            return Ok(f(&cpu::CpuMask {
                kind,
                tiles: tiles.as_deref(),
                dense: None,
            }));
        };
        let states = match tiles.as_deref() {
            Some(mask::TileData::DenseStates(states)) => states.flatten_all()?.to_vec1::<u8>()?,
            _ => bail!("{OP}: internal error, a dense mask without its tile states"),
        };
        let (mb, mh, _, _) = mask.dims4()?;
        let (storage, layout) = mask.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            bail!("{OP}: the dense mask is not on the CPU");
        };
        let s = layout.stride();
        let dense = cpu::DenseBytes {
            mask: storage.as_slice::<u8>()?,
            start: layout.start_offset(),
            strides: [s[0], s[1], s[2], s[3]],
            batch: mb,
            heads: mh,
            states: &states,
        };
        Ok(f(&cpu::CpuMask {
            kind,
            tiles: tiles.as_deref(),
            dense: Some(dense),
        }))
    }

    fn cpu_forward<T: CpuFloat>(
        &self, q: (&[T], &Layout), k: (&CpuStorage, &Layout), v: (&CpuStorage, &Layout),
    ) -> Result<CpuStorage>
    where
        T::Acc: cpu::AttentionFloat,
    {
        let p = &self.p;
        let q = gather(q.0, q.1)?;
        let k = gather(k.0.as_slice::<T>()?, k.1)?;
        let v = gather(v.0.as_slice::<T>()?, v.1)?;
        let mut out = vec![<T::Acc as num_traits::Zero>::zero(); p.batch * p.heads * p.m * p.dv];
        let mut lse = vec![0f64; p.batch * p.heads * p.m];
        self.with_cpu_mask(|mask| cpu::forward(p, mask, (&q, &k, &v), &mut out, &mut lse))?;
        let lse = Tensor::from_vec(lse, (p.batch, p.heads, p.m), &candle_core::Device::Cpu)?;
        self.keep_lse(lse)?;
        let out: Vec<T> = out.into_iter().map(T::from_acc).collect();
        Ok(T::to_cpu_storage_owned(out))
    }

    /// The CPU backward in the accumulator type `A` (f32, or f64 for f64 inputs).
    fn cpu_backward<A: cpu::AttentionFloat + WithDType>(
        &self, (q, k, v): (&Tensor, &Tensor, &Tensor), out: &Tensor, grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let p = &self.p;
        let flat =
            |t: &Tensor| -> Result<Vec<A>> { t.to_dtype(A::DTYPE)?.flatten_all()?.to_vec1::<A>() };
        let lse = self.saved_lse()?.flatten_all()?.to_vec1::<f64>()?;
        let (qv, kv, vv) = (flat(q)?, flat(k)?, flat(v)?);
        let (ov, gv) = (flat(out)?, flat(grad_out)?);
        let saved = cpu::Saved {
            q: &qv,
            k: &kv,
            v: &vv,
            out: &ov,
            lse: &lse,
            grad_out: &gv,
        };
        let mut dq = vec![A::zero(); qv.len()];
        let mut dk = vec![A::zero(); kv.len()];
        let mut dv = vec![A::zero(); vv.len()];
        self.with_cpu_mask(|mask| cpu::backward(p, mask, &saved, (&mut dq, &mut dk, &mut dv)))?;
        let dev = q.device();
        let cast = |g: Vec<A>, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(g, like.dims(), dev)?.to_dtype(like.dtype())
        };
        Ok((cast(dq, q)?, cast(dk, k)?, cast(dv, v)?))
    }
}

impl Attention {
    /// The CUDA forward: the output `[b, heads, m, dv]` laid out as `io` says (its storage).
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self, (q, q_layout): (&candle_core::CudaStorage, &Layout),
        (k, k_layout): (&candle_core::CudaStorage, &Layout),
        (v, v_layout): (&candle_core::CudaStorage, &Layout), io: cuda::Io,
    ) -> Result<candle_core::CudaStorage> {
        let p = &self.p;
        for (name, layout) in [("q", q_layout), ("k", k_layout), ("v", v_layout)] {
            let dtype = candle_core::backend::BackendStorage::dtype(q);
            if !cuda::operand_ok(layout, dtype) || !layout.dims()[3].is_multiple_of(8) {
                bail!("{OP}: internal error, {name} reached the kernels unprepared ({layout:?})");
            }
        }
        let device = candle_core::Device::Cuda(q.device.clone());
        let mask = cuda::DeviceMask::new(&self.mask, p, &device)?;
        let (out, lse, dq) = cuda::forward(
            p,
            &mask,
            (q, q_layout),
            (k, k_layout),
            (v, v_layout),
            io,
            self.dq.wanted,
        )?;
        self.keep_lse(lse)?;
        self.dq.keep(dq)?;
        Ok(out)
    }

    /// The CUDA backward (`out` and `grad_out` as the forward's `io` laid out the output): the
    /// Hopper, the one-pass or the two-pass kernels (`cuda::backward`).
    #[cfg(feature = "cuda")]
    fn cuda_backward(
        &self, (q, k, v): (&Tensor, &Tensor, &Tensor), out: &Tensor, grad_out: &Tensor,
        io: cuda::Io,
    ) -> Result<cuda::Gradients> {
        // Contiguous, with 16-byte aligned rows (a copy otherwise).
        let aligned = |t: &Tensor| cuda::kernel_operand(t.contiguous()?);
        let (out, go) = (aligned(out)?, aligned(grad_out)?);
        let lse = self.saved_lse()?;
        let mask = cuda::DeviceMask::new(&self.mask, &self.p, q.device())?;
        let inputs = cuda::BackwardInputs {
            q,
            k,
            v,
            out: &out,
            grad_out: &go,
            lse: &lse,
        };
        cuda::backward(&self.p, &mask, &inputs, io, self.dq.take()?)
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fastops-masked-attention"
    }

    fn cpu_fwd(
        &self, q: &CpuStorage, q_layout: &Layout, k: &CpuStorage, k_layout: &Layout,
        v: &CpuStorage, v_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.p;
        let (k, v) = ((k, k_layout), (v, v_layout));
        let out = match q {
            CpuStorage::F32(q) => self.cpu_forward((q.as_slice(), q_layout), k, v)?,
            CpuStorage::F64(q) => self.cpu_forward((q.as_slice(), q_layout), k, v)?,
            CpuStorage::F16(q) => self.cpu_forward((q.as_slice(), q_layout), k, v)?,
            CpuStorage::BF16(q) => self.cpu_forward((q.as_slice(), q_layout), k, v)?,
            other => bail!(
                "{OP}: unsupported dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((out, Shape::from((p.batch, p.heads, p.m, p.dv))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, q: &candle_core::CudaStorage, q_layout: &Layout, k: &candle_core::CudaStorage,
        k_layout: &Layout, v: &candle_core::CudaStorage, v_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let p = &self.p;
        let out = self.cuda_forward(
            (q, q_layout),
            (k, k_layout),
            (v, v_layout),
            cuda::Io::HeadMajor,
        )?;
        Ok((out, Shape::from((p.batch, p.heads, p.m, p.dv))))
    }

    fn bwd(
        &self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            let grads = self.cuda_backward((q, k, v), out, grad_out, cuda::Io::HeadMajor)?;
            let cuda::Gradients::Parts(dq, dk, dv) = grads else {
                bail!("{OP}: internal error, the backward gave a packed gradient");
            };
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let (dq, dk, dv) = if q.dtype() == DType::F64 {
            self.cpu_backward::<f64>((q, k, v), out, grad_out)?
        } else {
            self.cpu_backward::<f32>((q, k, v), out, grad_out)?
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
