//! The backward products of [`crate::masked_bmm`], with the empty tiles of the mask skipped:
//! `grad_a = (g masked) . b^T` and `grad_b = a^T . (g masked)`.
//!
//! The masked gradient is zero outside the mask, so in `grad_a` a row tile of the mask only needs
//! the reduction over its non-empty column tiles, and in `grad_b` a column tile only needs its
//! non-empty row tiles. A [`crate::MaskPlan`] records, per row tile and per column tile, the span
//! `[first, end)` from the first to one past the last non-empty tile; each output tile reduces
//! over its span alone. On a causal mask that halves the work; on a mask with holes inside a span
//! the zeros of the masked gradient keep the result exact.
//!
//! On CUDA the products read the unmasked gradient and mask it as it lands in shared memory (by
//! the plan's tile states: full tiles untouched, empty ones cleared, partial ones through the
//! mask), so the masked gradient is never written out; on the CPU one pass writes it first.

use crate::matmul::core::{cpu_block_product, row_tile_output, CpuGemm, F32Matmul, MatView, TILE};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

const OP: &str = "masked_bmm backward";

/// The spans of non-empty tiles of a plan's tile states (u8 `[plan_batch, row_tiles,
/// col_tiles]`): per row tile over its column tiles, and per column tile over its row tiles,
/// each u32 `[plan_batch, tiles, 2]` holding `[first, end)` (`first >= end` when all are empty).
pub(crate) fn tile_spans(states: &Tensor) -> Result<(Tensor, Tensor)> {
    let (plan_batch, row_tiles, col_tiles) = states.dims3()?;
    if plan_batch * row_tiles * col_tiles == 0 {
        let zeros =
            |tiles: usize| Tensor::zeros((plan_batch, tiles, 2), DType::U32, states.device());
        return Ok((zeros(row_tiles)?, zeros(col_tiles)?));
    }
    let non_empty = states.ne(&states.zeros_like()?)?;
    // Along `dim` of the states: the lowest index of a non-empty tile, and one past the highest.
    let span = |dim: usize| -> Result<Tensor> {
        let len = states.dim(dim)?;
        let mut index_shape = vec![1, 1, 1];
        index_shape[dim] = len;
        let indices = |from: u32| {
            Tensor::arange(from, from + len as u32, states.device())?
                .reshape(index_shape.as_slice())?
                .broadcast_as(states.shape())
        };
        let past = Tensor::full(len as u32, states.shape(), states.device())?;
        let none = Tensor::zeros(states.shape(), DType::U32, states.device())?;
        let first = non_empty
            .where_cond(&indices(0)?, &past)?
            .min_keepdim(dim)?;
        let end = non_empty
            .where_cond(&indices(1)?, &none)?
            .max_keepdim(dim)?;
        Tensor::cat(&[first, end], dim)
    };
    // Row spans reduce over the column tiles (dim 2); column spans over the row tiles (dim 1),
    // moved last.
    let row_spans = span(2)?.contiguous()?;
    let col_spans = span(1)?.transpose(1, 2)?.contiguous()?;
    Ok((row_spans, col_spans))
}

/// `a . b` for `a` `[batch, m, r]` and `b` `[batch, r, n]` where output tile `t` (row tiles, or
/// column tiles when `by_cols`) reduces only over its span of `TILE`-wide blocks of `r`:
/// `spans` u32 `[1 or batch, tiles, 2]` from [`tile_spans`].
/// `mode` is the f32 mode on CUDA (the forward call's). `mask` (CUDA only): the gradient operand
/// (`a`, or `b` when `by_cols`) is the unmasked output gradient and the product applies the mask
/// to it on the way in.
pub(crate) fn span_matmul(
    a: &Tensor, b: &Tensor, spans: &Tensor, by_cols: bool, mode: F32Matmul, mask: Option<&GradMask>,
) -> Result<Tensor> {
    let (batch, m, _) = a.dims3()?;
    let n = b.dim(2)?;
    let (span_batch, tiles, _) = spans.dims3()?;
    let expected_tiles = if by_cols { n } else { m }.div_ceil(TILE);
    if tiles != expected_tiles || (span_batch != 1 && span_batch != batch) {
        bail!(
            "{OP}: internal error, spans {:?} for a [{batch}, {m}, {n}] output",
            spans.dims()
        );
    }
    if let Some(gm) = mask {
        let g = if by_cols { b } else { a };
        let (mask_batch, rows, cols) = gm.mask.dims3()?;
        if !g.device().is_cuda()
            || g.dims()[1..] != [rows, cols]
            || !(mask_batch == 1 || mask_batch == batch)
        {
            bail!(
                "{OP}: internal error, mask {:?} for a gradient {:?}",
                gm.mask.dims(),
                g.dims()
            );
        }
    }
    let op = SpanMatmul {
        spans: spans.contiguous()?,
        by_cols,
        mode,
        mask: mask.cloned(),
    };
    let operand = |t: &Tensor| -> Result<Tensor> {
        if MatView::from_layout(t.layout()).is_some() {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    let (a, b) = (operand(a)?, operand(b)?);
    if a.device().is_cpu() && matches!(a.dtype(), DType::F16 | DType::BF16) {
        // The CPU product runs in f32 for half types.
        let out = a
            .to_dtype(DType::F32)?
            .apply_op2_no_bwd(&b.to_dtype(DType::F32)?, &op)?;
        return out.to_dtype(a.dtype());
    }
    a.apply_op2_no_bwd(&b, &op)
}

/// The mask a span product applies to its gradient operand (see [`span_matmul`]): the u8 mask
/// `[1 or batch, rows, cols]` of the gradient and its plan's tile states
/// (`[1 or batch, row tiles, col tiles]`).
#[derive(Clone)]
pub(crate) struct GradMask {
    pub(crate) mask: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) states: Tensor,
}

struct SpanMatmul {
    spans: Tensor,
    by_cols: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    mode: F32Matmul,
    /// Applied on CUDA only (`span_matmul` refuses it elsewhere).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    mask: Option<GradMask>,
}

impl SpanMatmul {
    /// Pairs between batch entries of the spans (0: one set for every entry).
    fn spans_batch_stride(&self, batch: usize) -> Result<usize> {
        let (span_batch, tiles, _) = self.spans.dims3()?;
        Ok(if span_batch == 1 || batch <= 1 {
            0
        } else {
            tiles
        })
    }

    fn views(a: &Layout, b: &Layout) -> Result<(MatView, MatView)> {
        let (Some(a), Some(b)) = (MatView::from_layout(a), MatView::from_layout(b)) else {
            bail!("{OP}: internal error, operands are not rank 3");
        };
        Ok((a, b))
    }

    fn cpu_product<A: CpuGemm + candle_core::WithDType>(
        &self, a: (&[A], &MatView), b: (&[A], &MatView),
    ) -> Result<Vec<A>> {
        let ((a, av), (b, bv)) = (a, b);
        av.check_within(a.len(), OP)?;
        bv.check_within(b.len(), OP)?;
        let lock = self.spans.storage_and_layout();
        let spans: &[u32] = crate::cpu::locked_slice(&lock, OP)?;
        let (batch, m, n, r) = (av.batch, av.rows, bv.cols, av.cols);
        let spans_batch_stride = self.spans_batch_stride(batch)?;
        let col_tiles = n.div_ceil(TILE);
        // The reduction of tile `t` of batch entry `bi`, clamped to `r`.
        let span = |bi: usize, t: usize| {
            let pair = &spans[2 * (bi * spans_batch_stride + t)..][..2];
            let k0 = (pair[0] as usize * TILE).min(r);
            (k0, (pair[1] as usize * TILE).clamp(k0, r))
        };
        let fill = |bi: usize, ti: usize, out_rows: &mut [std::mem::MaybeUninit<A>]| {
            let rows = ti * TILE..((ti + 1) * TILE).min(m);
            let dst = out_rows.as_mut_ptr().cast::<A>();
            let product = |cols: std::ops::Range<usize>, (k0, k1): (usize, usize)| {
                // The operands narrowed to the span along the reduction.
                let a_span = MatView {
                    start: av.start + k0 * av.col_stride,
                    cols: k1 - k0,
                    ..*av
                };
                let b_span = MatView {
                    start: bv.start + k0 * bv.row_stride,
                    rows: k1 - k0,
                    ..*bv
                };
                // SAFETY: the narrowed views lie inside the checked ones; the block
                // written is rows `rows` x columns `cols` of this task's own chunk.
                unsafe {
                    cpu_block_product(
                        (a, &a_span),
                        (b, &b_span),
                        bi,
                        rows.clone(),
                        cols.clone(),
                        dst.add(cols.start),
                        n,
                    )
                }
            };
            if self.by_cols {
                for tj in 0..col_tiles {
                    product(tj * TILE..((tj + 1) * TILE).min(n), span(bi, tj));
                }
            } else {
                product(0..n, span(bi, ti));
            }
        };
        // SAFETY: the products cover every row and column of each task's rows (an empty span
        // writes zeros).
        Ok(unsafe { row_tile_output::<A>((batch, m, n), fill) })
    }
}

impl CustomOp2 for SpanMatmul {
    fn name(&self) -> &'static str {
        "fastops-masked-bmm-backward"
    }

    fn cpu_fwd(
        &self, a: &CpuStorage, a_layout: &Layout, b: &CpuStorage, b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (av, bv) = Self::views(a_layout, b_layout)?;
        let shape = Shape::from((av.batch, av.rows, bv.cols));
        let out = crate::dispatch::with_cpu_gemm_pair!(
            OP,
            a,
            b,
            storage(|a, b| self.cpu_product((a, &av), (b, &bv))?)
        );
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, a: &candle_core::CudaStorage, a_layout: &Layout, b: &candle_core::CudaStorage,
        b_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (av, bv) = Self::views(a_layout, b_layout)?;
        let shape = Shape::from((av.batch, av.rows, bv.cols));
        let lock = self.spans.storage_and_layout();
        let candle_core::Storage::Cuda(spans) = &*lock.0 else {
            bail!("{OP}: the spans are not on the GPU");
        };
        let spans = spans.as_cuda_slice::<u32>()?.slice(lock.1.start_offset()..);
        let stride = self.spans_batch_stride(av.batch)?;
        let dev = &a.device;
        let mask_locks = self
            .mask
            .as_ref()
            .map(|gm| (gm.mask.storage_and_layout(), gm.states.storage_and_layout()));
        let mask_view = match &mask_locks {
            Some(((mask, mask_layout), (states, states_layout))) => {
                let (candle_core::Storage::Cuda(mask), candle_core::Storage::Cuda(states)) =
                    (&**mask, &**states)
                else {
                    bail!("{OP}: the mask or its plan is not on the GPU");
                };
                let (mask_batch, rows, cols) = mask_layout.shape().dims3()?;
                let s = mask_layout.stride();
                let tiles = rows.div_ceil(TILE) * cols.div_ceil(TILE);
                let states_len = states_layout.shape().elem_count();
                Some(cuda::GradMaskView {
                    mask: mask
                        .as_cuda_slice::<u8>()?
                        .slice(mask_layout.start_offset()..),
                    states: states
                        .as_cuda_slice::<u8>()?
                        .slice(states_layout.start_offset()..),
                    strides: [if mask_batch == 1 { 0 } else { s[0] }, s[1], s[2]],
                    plan_batch_stride: crate::matmul::masked_bmm::plan_batch_stride(
                        states_len, tiles,
                    ),
                })
            }
            None => None,
        };
        let out = crate::dispatch::with_float_cuda_pair!(OP, &a.slice, &b.slice, |a, b| {
            cuda::launch(
                dev,
                a,
                b,
                &spans,
                (&av, &bv),
                (stride, self.by_cols),
                self.mode,
                mask_view.as_ref(),
            )?
        });
        Ok((out, shape))
    }
}

#[cfg(feature = "cuda")]
mod cuda;
