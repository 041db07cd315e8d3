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
    /// summed from zero for every 8 of k and added to the f32 total with round-to-nearest adds.
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

/// Sets how f32 products run on CUDA (process-wide, like
/// `torch.set_float32_matmul_precision`); see [`F32Matmul`].
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

/// Output tile edge of the CUDA kernels, and the tile a [`crate::MaskPlan`] summarises.
pub(crate) const TILE: usize = 128;

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
    a: (&[A], &MatView),
    b: (&[A], &MatView),
    batch: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    dst: *mut A,
    dst_row_stride: usize,
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
pub(crate) mod cuda {
    use super::MatView;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::kernel_name;
    use candle_core::{DType, WithDType};

    /// Dynamic shared memory of the async core's kernels (`sizeof(AsyncStaging)` in the kernels).
    pub(crate) const ASYNC_SHARED_BYTES: usize = 81920;

    /// The kernel of `base` for `T` and `problem` (see [`core_kernel_name`]), loaded, and the
    /// configuration of a launch of `blocks` blocks of the core (one output tile or column group
    /// each; 256 threads, the dynamic shared memory of the async core). `op` names the caller in
    /// the error for a grid too large to launch.
    pub(crate) fn core_launch<T: WithDType>(
        dev: &candle_core::CudaDevice,
        op: &str,
        base: &str,
        problem: &ProblemArgs,
        blocks: usize,
    ) -> candle_core::Result<(crate::cuda::Kernel, LaunchConfig)> {
        use crate::cuda::{Kernel, Module};
        if blocks > i32::MAX as usize {
            candle_core::bail!("{op}: too many output tiles ({blocks})");
        }
        let (name, is_async) = core_kernel_name::<T>(base, problem);
        let kernel = Kernel::load(dev, Module::Matmul, &name)?;
        let shared_mem_bytes = if is_async {
            kernel.allow_dynamic_shared(ASYNC_SHARED_BYTES)?;
            ASYNC_SHARED_BYTES as u32
        } else {
            0
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes,
        };
        Ok((kernel, cfg))
    }

    /// The kernel of `base` (`masked_bmm`, `argmin_matmul`) for `T`, and whether it is one of the
    /// async core (16-byte `cp.async` copies, for operands that allow them: [`ProblemArgs::copyable`]).
    /// f16 / bf16: `_h16` (async) or `_tc` (register-staged TF32). f32 by [`super::f32_matmul`]:
    /// `_tf32x3` (async) or the FMA kernel when compensated, `_f32` (FMA), `_tf32` (async) or
    /// `_tc` for TF32. The `FASTOPS_MATMUL_ASYNC=0` tuning variable turns the async core off.
    fn core_kernel_name<T: WithDType>(base: &str, problem: &ProblemArgs) -> (String, bool) {
        use super::F32Matmul;
        let copyable = problem.copyable(T::DTYPE.size_in_bytes())
            && crate::cuda::tuning("FASTOPS_MATMUL_ASYNC").unwrap_or(1) != 0;
        let variant = match (T::DTYPE, super::f32_matmul(), copyable) {
            (DType::F32, F32Matmul::Fma, _) | (DType::F32, F32Matmul::Compensated, false) => "",
            (DType::F32, F32Matmul::Compensated, true) => "_tf32x3",
            (DType::F32, F32Matmul::Tf32, true) => "_tf32",
            (_, _, false) => "_tc",
            (_, _, true) => "_h16",
        };
        let is_async = copyable && !variant.is_empty() && variant != "_tc";
        (kernel_name::<T>(&format!("{base}{variant}")), is_async)
    }

    /// How a block's threads map onto an operand tile for coalesced loads.
    const K_CONTIGUOUS: i32 = 0;
    const OUTER_CONTIGUOUS: i32 = 1;
    const STRIDED: i32 = 2;

    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct OperandArgs {
        batch_stride: i64,
        outer_stride: i64,
        k_stride: i64,
        mode: i32,
        vectorised: i32,
    }

    impl OperandArgs {
        /// An operand whose tiles run along `outer` (m for A, n for B) and k, with strides in
        /// elements relative to the view's start.
        fn new(view: &MatView, outer_stride: usize, k_stride: usize, outer_len: usize) -> Self {
            // Whether runs of `group` elements along the contiguous dim, starting at multiples
            // of `group`, are aligned to `group` elements (4: the FMA / TF32 cores' vector
            // loads; 8: the 16-bit core's 16-byte copies of 2-byte elements).
            let aligned_to = |group: usize| {
                let aligned = |s: usize| s.is_multiple_of(group);
                let common = aligned(view.start) && (view.batch <= 1 || aligned(view.batch_stride));
                if k_stride == 1 {
                    common && (outer_len <= 1 || aligned(outer_stride))
                } else {
                    common && aligned(k_stride)
                }
            };
            let mode = if k_stride == 1 {
                K_CONTIGUOUS
            } else if outer_stride == 1 {
                OUTER_CONTIGUOUS
            } else {
                STRIDED
            };
            let vectorised = if mode == STRIDED {
                0
            } else if aligned_to(8) {
                2
            } else {
                aligned_to(4) as i32
            };
            Self {
                batch_stride: view.batch_stride as i64,
                outer_stride: outer_stride as i64,
                k_stride: k_stride as i64,
                mode,
                vectorised,
            }
        }
    }

    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct ProblemArgs {
        a: OperandArgs,
        b: OperandArgs,
        batch: i64,
        m: i64,
        n: i64,
        k: i64,
    }

    // SAFETY: plain-old-data structs laid out as their C mirrors.
    unsafe impl DeviceRepr for ProblemArgs {}

    impl ProblemArgs {
        /// Whether both operands suit the async core's 16-byte copies of `elem_bytes`-byte
        /// elements: a contiguous dim whose runs of 16 bytes are aligned.
        fn copyable(&self, elem_bytes: usize) -> bool {
            let needed = if elem_bytes == 4 { 1 } else { 2 };
            self.a.vectorised >= needed && self.b.vectorised >= needed
        }

        /// `a` `[batch, m, k]` times `b` `[batch, k, n]`; a broadcast `b` has batch stride 0.
        pub(crate) fn new(a: &MatView, b: &MatView) -> Self {
            Self {
                a: OperandArgs::new(a, a.row_stride, a.col_stride, a.rows),
                b: OperandArgs::new(b, b.col_stride, b.row_stride, b.cols),
                batch: a.batch as i64,
                m: a.rows as i64,
                n: b.cols as i64,
                k: a.cols as i64,
            }
        }
    }
}
