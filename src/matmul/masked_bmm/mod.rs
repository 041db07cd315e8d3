//! Masked batched matmul: `(a . b)` where a u8 mask keeps it, `fill` elsewhere, with the work of
//! fully masked tiles skipped (a causal mask skips almost half of the product).
//!
//! The mask is summarised once into a [`MaskPlan`] (one state per 128 x 128 output tile: empty,
//! partial or full) that can be reused while the mask is unchanged. Empty tiles are written with
//! `fill` and do no loads or math, full tiles never read the mask, partial tiles read it. The
//! product itself is the core in `src/matmul_core.rs` / `src/cuda/matmul.cu`.

use crate::dispatch::check_float_operands;
use crate::matmul::backward::{span_matmul, tile_spans, GradMask};
use crate::matmul::core::{
    cpu_block_product, row_tile_output, CpuGemm, F32Matmul, MatView, MatmulOptions, TILE,
};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::sync::{Arc, OnceLock};

const OP: &str = "masked_bmm";

/// Tile states of a [`MaskPlan`], as stored in its tensor and read by the kernels.
use crate::tile_summary::{TILE_EMPTY as EMPTY, TILE_PARTIAL as PARTIAL};

/// A summary of a mask per 128 x 128 output tile (empty / partial / full), built once and reused
/// by [`masked_bmm_with_plan`] while the mask's contents are unchanged.
///
/// Building it reads the mask once on its device (in place, any strides); with a shared
/// `[m, n]` mask that is small next to one product. The plan records the mask's shape,
/// not its contents: after changing the mask, build a new plan (a stale plan makes tiles it
/// calls full ignore the mask and tiles it calls empty return `fill`).
///
/// ```
/// use candle_core::{Device, Tensor, DType};
/// let dev = Device::Cpu;
/// let causal = Tensor::tril2(300, DType::U8, &dev)?;
/// let plan = candle_fastops::MaskPlan::new(&causal)?;
/// // 3 x 3 tiles of 128: 3 on the diagonal are partial, 3 above it empty, 3 below full.
/// assert_eq!(plan.tile_counts()?, [3, 3, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MaskPlan {
    /// u8 `[plan_batch, row_tiles, col_tiles]` on the mask's device.
    states: Tensor,
    /// The backward's reduction spans (`masked_bmm_grad::tile_spans`: u32 `[plan_batch,
    /// row_tiles, 2]` and `[plan_batch, col_tiles, 2]`), computed on the first backward and
    /// shared by the plan's clones, so forward-only calls never pay for them.
    spans: Arc<OnceLock<(Tensor, Tensor)>>,
    mask_dims: Vec<usize>,
}

impl MaskPlan {
    /// Summarises `mask` (u8, `[batch, m, n]` or `[m, n]`, nonzero = keep).
    pub fn new(mask: &Tensor) -> Result<Self> {
        check_mask_dtype(mask)?;
        if !(2..=3).contains(&mask.rank()) {
            bail!(
                "{OP}: mask must be [batch, m, n] or [m, n], got shape {:?}",
                mask.dims()
            );
        }
        let mask3 = as_rank3(mask)?;
        let states = crate::tile_summary::tile_summary(&mask3, TILE, TILE)?;
        Ok(Self {
            states,
            spans: Arc::default(),
            mask_dims: mask.dims().to_vec(),
        })
    }

    /// Number of `[empty, partial, full]` tiles (reads the plan back to the host).
    pub fn tile_counts(&self) -> Result<[usize; 3]> {
        let mut counts = [0; 3];
        for s in self.states.flatten_all()?.to_vec1::<u8>()? {
            counts[(s as usize).min(2)] += 1;
        }
        Ok(counts)
    }

    /// The backward's spans of non-empty tiles, per row tile and per column tile.
    fn spans(&self) -> Result<&(Tensor, Tensor)> {
        if let Some(spans) = self.spans.get() {
            return Ok(spans);
        }
        let spans = tile_spans(&self.states)?;
        Ok(self.spans.get_or_init(|| spans))
    }

    /// The shape of the mask the plan was built from.
    pub fn mask_dims(&self) -> &[usize] {
        &self.mask_dims
    }
}

/// `(a . b)` masked by `mask`: `out[b, i, j] = (a[b] . b[b])[i, j]` where `mask[(b,) i, j] != 0`,
/// `fill` elsewhere (`f64::NEG_INFINITY` for attention scores, `0.0` for a masked product).
///
/// * `a` `[batch, m, k]`, `b` `[batch, k, n]`, `mask` u8 `[batch, m, n]` or `[m, n]` (shared by
///   the batch); the result is `[batch, m, n]` in the dtype of `a` and `b`.
/// * Any layout: transposed or sliced `a` and `b` are read in place (on CUDA with vector loads
///   when aligned); a mask whose rows are not contiguous is copied.
/// * Precision: f32 on CUDA as [`crate::set_f32_matmul`] says: by default f32-accurate
///   error-compensated tensor-core products ([`crate::F32Matmul::Compensated`]: three TF32 passes
///   with f32 accumulation, for operands whose rows start on 4-element boundaries; f32 FMAs
///   otherwise), or plain f32 FMAs ([`crate::F32Matmul::Fma`]), or TF32 (inputs rounded to 10
///   mantissa bits). f16 and bf16 run on tensor cores with exact products and f32
///   accumulation: native 16-bit `mma.m16n8k16` (operands copied with `cp.async`, fragments by
///   `ldmatrix`) when both operands have a contiguous dim whose rows start on 8-element
///   boundaries (any contiguous or transposed tensor with sizes that are multiples of 8),
///   otherwise the TF32 kernels (their values are exact in TF32). f64 in f64, CPU only. The CPU
///   computes f16/bf16 in f32 and ignores the f32 mode.
/// * Autograd: `grad_a = (g masked) . b^T`, `grad_b = a^T . (g masked)` on the same core, each
///   output tile reducing only over the span of non-empty mask tiles along its row (grad_a) or
///   column (grad_b) of tiles: a causal mask halves the backward's work too.
///
/// Builds a [`MaskPlan`] on every call; reuse one with [`masked_bmm_with_plan`].
///
/// ```
/// use candle_core::{Device, Tensor, DType};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (2, 5, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (2, 5, 8), &dev)?;
/// let causal = Tensor::tril2(5, DType::U8, &dev)?;
/// let scores = candle_fastops::masked_bmm(&q, &k.transpose(1, 2)?, &causal, f64::NEG_INFINITY)?;
/// assert_eq!(scores.dims(), [2, 5, 5]);
/// let row0 = scores.get(0)?.get(0)?.to_vec1::<f32>()?;
/// assert!(row0[0].is_finite() && row0[1..].iter().all(|v| *v == f32::NEG_INFINITY));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn masked_bmm(a: &Tensor, b: &Tensor, mask: &Tensor, fill: f64) -> Result<Tensor> {
    masked_bmm_with(a, b, mask, fill, None, &MatmulOptions::default())
}

/// [`masked_bmm`] with a [`MaskPlan`] built earlier from the same mask.
pub fn masked_bmm_with_plan(
    a: &Tensor, b: &Tensor, mask: &Tensor, plan: &MaskPlan, fill: f64,
) -> Result<Tensor> {
    masked_bmm_with(a, b, mask, fill, Some(plan), &MatmulOptions::default())
}

/// [`masked_bmm`] with an optional [`MaskPlan`] (built here when `None`) and per-call options
/// (the f32 mode on CUDA, used by the backward products too).
pub fn masked_bmm_with(
    a: &Tensor, b: &Tensor, mask: &Tensor, fill: f64, plan: Option<&MaskPlan>,
    options: &MatmulOptions,
) -> Result<Tensor> {
    check_args(a, b, mask)?;
    let built;
    let plan = match plan {
        Some(plan) => plan,
        None => {
            built = MaskPlan::new(mask)?;
            &built
        }
    };
    if plan.mask_dims != mask.dims() {
        bail!(
            "{OP}: the plan was built for a mask of shape {:?}, the mask is {:?}",
            plan.mask_dims,
            mask.dims()
        );
    }
    if !plan.states.device().same_device(mask.device()) {
        bail!("{OP}: the plan is on a different device than the mask");
    }
    let mask3 = as_rank3(mask)?;
    let (_, m, n) = mask3.dims3()?;
    let rows_contiguous = n <= 1 || mask3.stride()[2] == 1 && (m <= 1 || mask3.stride()[1] == n);
    let mask3 = if rows_contiguous {
        mask3
    } else {
        mask3.contiguous()?
    };
    let op = MaskedBmm {
        fill,
        plan: plan.clone(),
        mode: options.resolved_f32(),
    };
    if a.device().is_cpu() && matches!(a.dtype(), DType::F16 | DType::BF16) {
        // The CPU product runs in f32 for half types: widen once, narrow the result once.
        let out = a
            .to_dtype(DType::F32)?
            .apply_op3(&b.to_dtype(DType::F32)?, &mask3, op)?;
        return out.to_dtype(a.dtype());
    }
    a.apply_op3(b, &mask3, op)
}

/// Plan states between batch entries: `tiles` (one plan entry's tile count) for a per-batch plan
/// of `plan_len` states, 0 for one plan shared by the batch.
pub(crate) fn plan_batch_stride(plan_len: usize, tiles: usize) -> usize {
    if plan_len > tiles {
        tiles
    } else {
        0
    }
}

fn check_mask_dtype(mask: &Tensor) -> Result<()> {
    if mask.dtype() != DType::U8 {
        bail!(
            "{OP}: mask must be u8 (nonzero = keep), got {:?}; convert a bool-like mask with `.ne(0)?`",
            mask.dtype()
        );
    }
    Ok(())
}

fn as_rank3(mask: &Tensor) -> Result<Tensor> {
    if mask.rank() == 2 {
        mask.unsqueeze(0)
    } else {
        Ok(mask.clone())
    }
}

fn check_args(a: &Tensor, b: &Tensor, mask: &Tensor) -> Result<()> {
    if a.rank() != 3 || b.rank() != 3 {
        bail!(
            "{OP}: a must be [batch, m, k] and b [batch, k, n], got shapes {:?} and {:?}",
            a.dims(),
            b.dims()
        );
    }
    let (batch, m, k) = a.dims3()?;
    let (b_batch, b_k, n) = b.dims3()?;
    if b_batch != batch || b_k != k {
        bail!(
            "{OP}: shape mismatch, a is {:?} but b is {:?} (expected [{batch}, {k}, n])",
            a.dims(),
            b.dims()
        );
    }
    check_mask_dtype(mask)?;
    let mask_ok = match mask.dims() {
        [mm, mn] => (*mm, *mn) == (m, n),
        [mbatch, mm, mn] => (*mbatch, *mm, *mn) == (batch, m, n),
        _ => false,
    };
    if !mask_ok {
        bail!(
            "{OP}: mask must be [{batch}, {m}, {n}] or [{m}, {n}], got {:?}",
            mask.dims()
        );
    }
    check_float_operands(OP, ("a", a), &[("b", b)], &[("mask", mask)])
}

/// The shapes of one call, from the three layouts.
struct Dims {
    a: MatView,
    b: MatView,
    /// Elements between batch entries of the mask (0 for a shared mask).
    mask_batch_stride: usize,
    mask_start: usize,
}

impl Dims {
    fn new(a: &Layout, b: &Layout, mask: &Layout) -> Result<Self> {
        let (Some(a), Some(b)) = (MatView::from_layout(a), MatView::from_layout(b)) else {
            bail!("{OP}: internal error, operands are not rank 3");
        };
        let mask_batch_stride = if mask.dims()[0] == 1 {
            0
        } else {
            mask.stride()[0]
        };
        Ok(Self {
            a,
            b,
            mask_batch_stride,
            mask_start: mask.start_offset(),
        })
    }

    fn out_shape(&self) -> Shape {
        Shape::from((self.a.batch, self.a.rows, self.b.cols))
    }
}

struct MaskedBmm {
    fill: f64,
    plan: MaskPlan,
    /// The f32 mode on CUDA, resolved at the call (the backward uses it too).
    mode: F32Matmul,
}

impl MaskedBmm {
    fn cpu_product<A: CpuGemm + candle_core::WithDType>(
        &self, a: &[A], b: &[A], mask: &[u8], dims: &Dims,
    ) -> Result<Vec<A>> {
        let lock = self.plan.states.storage_and_layout();
        let states: &[u8] = crate::cpu::locked_slice(&lock, OP)?;
        let (batch, m, n) = (dims.a.batch, dims.a.rows, dims.b.cols);
        dims.a.check_within(a.len(), OP)?;
        dims.b.check_within(b.len(), OP)?;
        let fill = A::from_f64(self.fill);
        let (row_tiles, col_tiles) = (m.div_ceil(TILE), n.div_ceil(TILE));
        let plan_batch_stride = plan_batch_stride(states.len(), row_tiles * col_tiles);
        let fill = |bi: usize, ti: usize, out_rows: &mut [std::mem::MaybeUninit<A>]| {
            let row0 = ti * TILE;
            let rows = row0..(row0 + TILE).min(m);
            let tile_states = &states[bi * plan_batch_stride + ti * col_tiles..][..col_tiles];
            let mask_rows =
                &mask[dims.mask_start + bi * dims.mask_batch_stride + row0 * n..][..rows.len() * n];
            let mut tj = 0;
            while tj < col_tiles {
                let cols = |t: usize| t * TILE..((t + 1) * TILE).min(n);
                if tile_states[tj] == EMPTY {
                    for r in 0..rows.len() {
                        for c in cols(tj) {
                            out_rows[r * n + c].write(fill);
                        }
                    }
                    tj += 1;
                    continue;
                }
                // One product for the whole run of non-empty tiles.
                let run_end = (tj..col_tiles)
                    .find(|&t| tile_states[t] == EMPTY)
                    .unwrap_or(col_tiles);
                let span = cols(tj).start..cols(run_end - 1).end;
                // SAFETY: the views were checked against their buffers; the
                // block written is rows `rows` x columns `span` of this task's
                // own chunk of the output.
                unsafe {
                    cpu_block_product(
                        (a, &dims.a),
                        (b, &dims.b),
                        bi,
                        rows.clone(),
                        span.clone(),
                        out_rows.as_mut_ptr().cast::<A>().add(span.start),
                        n,
                    )
                };
                for (t, _) in tile_states
                    .iter()
                    .enumerate()
                    .take(run_end)
                    .skip(tj)
                    .filter(|(_, &s)| s == PARTIAL)
                {
                    for r in 0..rows.len() {
                        for c in cols(t) {
                            if mask_rows[r * n + c] == 0 {
                                out_rows[r * n + c].write(fill);
                            }
                        }
                    }
                }
                tj = run_end;
            }
        };
        // SAFETY: every element lies in an empty tile (filled) or in a run (written by the block
        // product).
        Ok(unsafe { row_tile_output::<A>((batch, m, n), fill) })
    }
}

impl CustomOp3 for MaskedBmm {
    fn name(&self) -> &'static str {
        "fastops-masked-bmm"
    }

    fn cpu_fwd(
        &self, a: &CpuStorage, a_layout: &Layout, b: &CpuStorage, b_layout: &Layout,
        mask: &CpuStorage, mask_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::new(a_layout, b_layout, mask_layout)?;
        let mask = mask.as_slice::<u8>()?;
        let out = crate::dispatch::with_cpu_gemm_pair!(
            OP,
            a,
            b,
            storage(|a, b| self.cpu_product(a, b, mask, &dims)?)
        );
        Ok((out, dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, a: &candle_core::CudaStorage, a_layout: &Layout, b: &candle_core::CudaStorage,
        b_layout: &Layout, mask: &candle_core::CudaStorage, mask_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = Dims::new(a_layout, b_layout, mask_layout)?;
        let dev = &a.device;
        let lock = self.plan.states.storage_and_layout();
        let candle_core::Storage::Cuda(states) = &*lock.0 else {
            bail!("{OP}: the plan is not on the GPU");
        };
        let states = states.as_cuda_slice::<u8>()?.slice(lock.1.start_offset()..);
        let mask = mask.as_cuda_slice::<u8>()?.slice(dims.mask_start..);
        let out = crate::dispatch::with_float_cuda_pair!(OP, &a.slice, &b.slice, |a, b| {
            cuda::launch(dev, a, b, &mask, &states, &dims, self.fill, self.mode)?
        });
        Ok((out, dims.out_shape()))
    }

    fn bwd(
        &self, a: &Tensor, b: &Tensor, mask: &Tensor, _res: &Tensor, grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Only the spans of non-empty mask tiles contribute: along the mask's columns for
        // grad_a (per row tile), along its rows for grad_b (per column tile). The gradient
        // behind the mask: on CUDA the products mask it as they read it; on the CPU one pass
        // writes it first.
        let grad = grad.contiguous()?;
        let (grad, in_products) = if grad.device().is_cuda() {
            let gm = GradMask {
                mask: mask.clone(),
                states: self.plan.states.clone(),
            };
            (grad, Some(gm))
        } else {
            (grad.apply_op2_no_bwd(mask, &MaskGrad)?, None)
        };
        let (row_spans, col_spans) = self.plan.spans()?;
        let (bt, at) = (b.transpose(1, 2)?, a.transpose(1, 2)?);
        let gm = in_products.as_ref();
        let grad_a = span_matmul(&grad, &bt, row_spans, false, self.mode, gm)?;
        let grad_b = span_matmul(&at, &grad, col_spans, true, self.mode, gm)?;
        Ok((Some(grad_a), Some(grad_b), None))
    }
}

/// The output gradient behind the mask on the CPU: `keep ? g : 0` (`grad` contiguous `[batch, m,
/// n]`, the mask u8 `[1 or batch, m, n]`), one rayon pass. (On CUDA the backward's products
/// apply the mask as they read the gradient.)
struct MaskGrad;

impl MaskGrad {
    /// `(batch, m, n)` of the gradient and the mask's `[batch, row, col]` strides (batch 0 when
    /// shared), checked against each other.
    fn geometry(grad: &Layout, mask: &Layout) -> Result<((usize, usize, usize), [usize; 3])> {
        let (batch, m, n) = grad.shape().dims3()?;
        let (mask_batch, mask_m, mask_n) = mask.shape().dims3()?;
        if (mask_m, mask_n) != (m, n) || !(mask_batch == 1 || mask_batch == batch) {
            bail!(
                "{OP}: internal error, gradient {:?} against mask {:?}",
                grad.dims(),
                mask.dims()
            );
        }
        let s = mask.stride();
        let batch_stride = if mask_batch == 1 { 0 } else { s[0] };
        Ok(((batch, m, n), [batch_stride, s[1], s[2]]))
    }
}

impl candle_core::CustomOp2 for MaskGrad {
    fn name(&self) -> &'static str {
        "fastops-masked-bmm-mask-grad"
    }

    fn cpu_fwd(
        &self, grad: &CpuStorage, grad_layout: &Layout, mask: &CpuStorage, mask_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let ((batch, m, n), [bs, rs, cs]) = Self::geometry(grad_layout, mask_layout)?;
        let Some((start, end)) = grad_layout.contiguous_offsets() else {
            bail!("{OP}: internal error, the gradient is not contiguous");
        };
        let mask = &mask.as_slice::<u8>()?[mask_layout.start_offset()..];
        let out = crate::dispatch::with_float_cpu!(OP, grad, |grad| {
            let grad = &grad[start..end];
            let mut out = grad.to_vec();
            if n > 0 {
                out.par_chunks_mut(n).enumerate().for_each(|(row, dst)| {
                    let (b, i) = (row / m, row % m);
                    let keep = &mask[b * bs + i * rs..];
                    for (j, d) in dst.iter_mut().enumerate() {
                        if keep[j * cs] == 0 {
                            *d = candle_core::WithDType::from_f64(0.0);
                        }
                    }
                });
            }
            candle_core::WithDType::to_cpu_storage_owned(out)
        });
        Ok((out, Shape::from((batch, m, n))))
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
