//! The tiled matrix product shared by [`crate::masked_bmm`] and [`crate::argmin_matmul`]: operand
//! views read in place from candle layouts (any strides, so transposed or sliced operands are not
//! copied), the CPU block product (the `gemm` crate candle itself uses, one call per run of
//! tiles) and, with the `cuda` feature, the kernel arguments of `src/cuda/matmul.cu`, whose core
//! computes one `TILE x TILE` output tile per block.

use candle_core::{bail, Layout, Result};
use std::sync::atomic::{AtomicU8, Ordering};

/// How the CUDA kernels of [`crate::masked_bmm`], [`crate::argmin_matmul`] and
/// [`crate::kmeans_assign`] multiply f32 operands. f16 / bf16 always use tensor cores with exact
/// products and f32 accumulation; the CPU always computes in full f32 (f64 for f64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F32Matmul {
    /// f32-accurate tensor-core products (the default): each operand is split into its TF32
    /// part and the remainder, and three TF32 products (small.big + big.small + big.big) are
    /// summed from zero for every 8 of k and added to the f32 total with round-to-nearest adds
    /// (on compute capability 9.0 the masked_bmm backward's `grad_a` sums them per 16 of k, the
    /// small terms first: as many truncations, one of them on a sum up to twice as large).
    /// The dropped small.small term and the remainder's own truncation leave at most about
    /// 2^-21 relative error per product, the order of the f32 rounding of the accumulation
    /// itself: measured against f64 on the H200 its worst error was 0.6-0.8x the f32 FMA
    /// kernel's (k = 64 to 512; `tests/matmul_f32_modes.rs` fails above 4x). Used when both
    /// operands have a contiguous dim whose rows start on 16-byte boundaries; other layouts run
    /// [`Self::Fma`]. An infinite operand element makes its products NaN here (its split is
    /// inf - inf); [`Self::Fma`] keeps IEEE infinities.
    #[default]
    Compensated,
    /// Plain f32 FMAs on the CUDA cores (true f32 arithmetic, one rounding per FMA). On an H200
    /// it is 1.5x slower than [`Self::Compensated`] for k-means and within 0.9-1.2x of it for
    /// causal `masked_bmm` (BENCHMARKS.md).
    Fma,
    /// TF32 tensor cores: inputs rounded to a 10-bit mantissa (relative error about 5e-4 per
    /// product), f32 accumulation; like PyTorch's `allow_tf32`.
    Tf32,
}

static F32_MATMUL: AtomicU8 = AtomicU8::new(0);

/// Sets how f32 products run on CUDA by default (process-wide, like
/// `torch.set_float32_matmul_precision`); see [`F32Matmul`]. A call's [`MatmulOptions`]
/// override it, which is what code running beside other threads should use.
///
/// ```
/// use candle_fastops::{f32_matmul, set_f32_matmul, F32Matmul};
/// assert_eq!(f32_matmul(), F32Matmul::Compensated);
/// set_f32_matmul(F32Matmul::Fma);
/// assert_eq!(f32_matmul(), F32Matmul::Fma);
/// set_f32_matmul(F32Matmul::default());
/// ```
pub fn set_f32_matmul(mode: F32Matmul) {
    let code = match mode {
        F32Matmul::Compensated => 0,
        F32Matmul::Fma => 1,
        F32Matmul::Tf32 => 2,
    };
    F32_MATMUL.store(code, Ordering::Relaxed);
}

/// The mode set by [`set_f32_matmul`].
pub fn f32_matmul() -> F32Matmul {
    match F32_MATMUL.load(Ordering::Relaxed) {
        1 => F32Matmul::Fma,
        2 => F32Matmul::Tf32,
        _ => F32Matmul::Compensated,
    }
}

/// Shorthand for [`set_f32_matmul`]: `true` selects [`F32Matmul::Tf32`], `false` the default
/// [`F32Matmul::Compensated`].
///
/// ```
/// candle_fastops::set_matmul_tf32(true);
/// assert!(candle_fastops::matmul_tf32());
/// candle_fastops::set_matmul_tf32(false);
/// ```
pub fn set_matmul_tf32(on: bool) {
    set_f32_matmul(if on {
        F32Matmul::Tf32
    } else {
        F32Matmul::Compensated
    });
}

/// Whether f32 products run in TF32 ([`F32Matmul::Tf32`]).
pub fn matmul_tf32() -> bool {
    f32_matmul() == F32Matmul::Tf32
}

/// Per-call options of the matmul family ([`crate::masked_bmm_with`], [`crate::argmin_matmul_with`]).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_fastops::{F32Matmul, MatmulOptions};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (2, 5, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1., (2, 5, 8), &dev)?;
/// let causal = Tensor::tril2(5, DType::U8, &dev)?;
/// let fma = MatmulOptions::with_f32(F32Matmul::Fma); // this call only, whatever the global
/// let scores = candle_fastops::masked_bmm_with(&q, &k.t()?, &causal, f64::NEG_INFINITY, None, &fma)?;
/// assert_eq!(scores.dims(), [2, 5, 5]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatmulOptions {
    /// How f32 products run on CUDA; `None` (default) follows [`set_f32_matmul`]. The CPU always
    /// computes in f32 (f64 for f64).
    pub f32_mode: Option<F32Matmul>,
}

impl MatmulOptions {
    /// Options with the given f32 mode.
    pub fn with_f32(mode: F32Matmul) -> Self {
        Self {
            f32_mode: Some(mode),
        }
    }

    /// The f32 mode this call uses: its own, else the process-wide one.
    pub(crate) fn resolved_f32(&self) -> F32Matmul {
        self.f32_mode.unwrap_or_else(f32_matmul)
    }
}

/// Output tile edge of the CUDA kernels, and the tile a [`crate::MaskPlan`] summarises.
pub(crate) use crate::kernel_constants::matmul::TILE;

/// A batch of matrices `[batch, rows, cols]` in a storage buffer, in element strides. A batch
/// stride of 0 repeats one matrix for every batch entry (broadcast).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MatView {
    pub start: usize,
    pub batch: usize,
    pub rows: usize,
    pub cols: usize,
    pub batch_stride: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl MatView {
    /// The view of a layout `[leading.., rows, cols]` whose leading dims step through memory with
    /// one stride (contiguous leading dims, a single one, broadcast ones or none); `None` when
    /// they do not, and the caller copies the tensor first.
    pub(crate) fn from_layout(layout: &Layout) -> Option<Self> {
        let dims = layout.dims();
        let strides = layout.stride();
        let rank = dims.len();
        if rank < 2 {
            return None;
        }
        let (lead_dims, lead_strides) = (&dims[..rank - 2], &strides[..rank - 2]);
        let batch: usize = lead_dims.iter().product();
        // Walk the leading dims from the innermost: each must step by the stride of the one
        // inside it times that one's size (dims of size 1 impose nothing).
        let mut batch_stride = None::<usize>;
        let mut expected = None::<usize>;
        for (&d, &s) in lead_dims.iter().zip(lead_strides).rev() {
            if d == 1 {
                continue;
            }
            match expected {
                None => batch_stride = Some(s),
                Some(e) if e != s => return None,
                Some(_) => {}
            }
            expected = Some(s * d);
        }
        let norm = |size: usize, stride: usize| if size == 1 { 0 } else { stride };
        Some(Self {
            start: layout.start_offset(),
            batch,
            rows: dims[rank - 2],
            cols: dims[rank - 1],
            batch_stride: norm(batch, batch_stride.unwrap_or(0)),
            row_stride: norm(dims[rank - 2], strides[rank - 2]),
            col_stride: norm(dims[rank - 1], strides[rank - 1]),
        })
    }

    /// One past the largest element offset the view reaches (its start when it is empty).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn end(&self) -> usize {
        if self.batch == 0 || self.rows == 0 || self.cols == 0 {
            return self.start;
        }
        self.offset(self.batch - 1, self.rows - 1, self.cols - 1) + 1
    }

    /// Element offset of `(batch, row, col)`; `batch` wraps to 0 for a broadcast view.
    pub(crate) fn offset(&self, batch: usize, row: usize, col: usize) -> usize {
        self.start + batch * self.batch_stride + row * self.row_stride + col * self.col_stride
    }

    /// Whether `len` elements from `start` fit in a buffer of `buffer_len` (checked before any
    /// raw-pointer product touches it).
    pub(crate) fn check_within(&self, buffer_len: usize, op: &str) -> Result<()> {
        if self.batch == 0 || self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = self.offset(self.batch - 1, self.rows - 1, self.cols - 1);
        if last >= buffer_len {
            bail!("{op}: internal error, a view reaches past its storage ({last} >= {buffer_len})");
        }
        Ok(())
    }
}

/// A `[batch, m, n]` output written in parallel, one task per (batch entry, tile of `TILE` rows):
/// `fill(batch_entry, row_tile, rows)` gets the task's rows (`min(TILE, m - TILE * row_tile)`
/// rows of `n` elements, contiguous).
///
/// # Safety
/// `fill` must initialise every element of the rows it is given.
pub(crate) unsafe fn row_tile_output<A: Send>(
    (batch, m, n): (usize, usize, usize),
    fill: impl Fn(usize, usize, &mut [std::mem::MaybeUninit<A>]) + Sync,
) -> Vec<A> {
    use rayon::prelude::*;
    let len = batch * m * n;
    if len == 0 {
        return Vec::new();
    }
    let write_all = |spare: &mut [std::mem::MaybeUninit<A>]| {
        spare
            .par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(bi, out_b)| {
                out_b
                    .par_chunks_mut(TILE * n)
                    .enumerate()
                    .for_each(|(ti, rows)| fill(bi, ti, rows))
            })
    };
    // SAFETY: the chunks cover the output; `fill` writes each, as the caller guarantees.
    unsafe { crate::cpu::written_output::<A>(len, write_all) }
}

/// CPU block product over the `gemm` crate: `dst[rows, cols] = lhs[rows, k] . rhs[k, cols]`,
/// single-threaded (callers parallelise over blocks).
pub(crate) trait CpuGemm: Copy + Send + Sync + num_traits::Float + 'static {}
impl CpuGemm for f32 {}
impl CpuGemm for f64 {}

/// One block of the product: rows `rows` of batch entry `batch` of `a` (`[batch, m, k]`) times
/// columns `cols` of `b` (`[batch, k, n]`), written to `dst` with row stride `dst_row_stride`.
///
/// # Safety
/// `a` and `b` must hold their views ([`MatView::check_within`]) and `dst` must be valid for
/// writes of `rows.len()` rows of `cols.len()` elements at stride `dst_row_stride`.
pub(crate) unsafe fn cpu_block_product<A: CpuGemm>(
    a: (&[A], &MatView), b: (&[A], &MatView), batch: usize, rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>, dst: *mut A, dst_row_stride: usize,
) {
    let ((a, av), (b, bv)) = (a, b);
    let (m, n, k) = (rows.len(), cols.len(), av.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for r in 0..m {
            for c in 0..n {
                dst.add(r * dst_row_stride + c).write(A::zero());
            }
        }
        return;
    }
    let (ab, bb) = (batch % av.batch.max(1), batch % bv.batch.max(1));
    let lhs = a.as_ptr().add(av.offset(ab, rows.start, 0));
    let rhs = b.as_ptr().add(bv.offset(bb, 0, cols.start));
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_row_stride as isize,
        false,
        lhs,
        av.col_stride as isize,
        av.row_stride as isize,
        rhs,
        bv.col_stride as isize,
        bv.row_stride as isize,
        A::zero(),
        A::one(),
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// The CUDA kernels' view of the problem (`Operand` / `Problem` in `src/cuda/matmul.cu`).
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
