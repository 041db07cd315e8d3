//! The tiled matrix product shared by [`crate::masked_bmm`] and [`crate::argmin_matmul`]: operand
//! views read in place from candle layouts (any strides, so transposed or sliced operands are not
//! copied), the CPU block product (the `gemm` crate candle itself uses, one call per run of
//! tiles) and, with the `cuda` feature, the kernel arguments of `src/cuda/matmul.cu`, whose core
//! computes one `TILE x TILE` output tile per block.

use candle_core::{bail, Layout, Result};
use std::sync::atomic::{AtomicBool, Ordering};

static TF32: AtomicBool = AtomicBool::new(false);

/// Lets the CUDA kernels of [`crate::masked_bmm`] and [`crate::argmin_matmul`] (and
/// [`crate::kmeans_assign`]) run f32 products on tensor cores in TF32 (off by default): inputs are
/// rounded to a 10-bit mantissa (relative error about 5e-4 per product), accumulation stays f32.
/// Like `torch.backends.cuda.matmul.allow_tf32`, it is process-wide. f16 / bf16 inputs always use
/// tensor cores (their values are exact in TF32, so nothing is rounded); the CPU always computes
/// in full f32 (f64 for f64).
///
/// ```
/// candle_fastops::set_matmul_tf32(true);
/// assert!(candle_fastops::matmul_tf32());
/// candle_fastops::set_matmul_tf32(false);
/// ```
pub fn set_matmul_tf32(on: bool) {
    TF32.store(on, Ordering::Relaxed);
}

/// Whether [`set_matmul_tf32`] is on.
pub fn matmul_tf32() -> bool {
    TF32.load(Ordering::Relaxed)
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
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    use candle_core::cuda_backend::kernel_name;
    use candle_core::{DType, WithDType};

    /// The kernel of `base` (`masked_bmm`, `argmin_matmul`) for `T`: the tensor-core form for
    /// f16 / bf16, and for f32 when [`super::matmul_tf32`] is on; the FMA form otherwise.
    /// f16 / bf16 operands that suit 16-byte copies take the 16-bit core (`_h16`), unless the
    /// `FASTOPS_MATMUL_H16=0` tuning variable is set.
    /// Dynamic shared memory of the 16-bit core's kernels (`sizeof(Staging16)` in the kernels).
    pub(crate) const H16_SHARED_BYTES: usize = 81920;

    /// The kernel for `T` and `problem` (see [`core_kernel_name`]), loaded, and the dynamic
    /// shared memory its launches need.
    pub(crate) fn core_kernel<T: WithDType>(
        dev: &candle_core::CudaDevice,
        base: &str,
        problem: &ProblemArgs,
    ) -> candle_core::Result<(crate::cuda::Kernel, u32)> {
        use crate::cuda::{Kernel, Module};
        let name = core_kernel_name::<T>(base, problem);
        let kernel = Kernel::load(dev, Module::Matmul, &name)?;
        let shared = if name.contains("_h16") {
            kernel.allow_dynamic_shared(H16_SHARED_BYTES)?;
            H16_SHARED_BYTES as u32
        } else {
            0
        };
        Ok((kernel, shared))
    }

    fn core_kernel_name<T: WithDType>(base: &str, problem: &ProblemArgs) -> String {
        if T::DTYPE == DType::F32 && !super::matmul_tf32() {
            kernel_name::<T>(base)
        } else if T::DTYPE != DType::F32
            && problem.copyable_16()
            && crate::cuda::tuning("FASTOPS_MATMUL_H16").unwrap_or(1) != 0
        {
            kernel_name::<T>(&format!("{base}_h16"))
        } else {
            kernel_name::<T>(&format!("{base}_tc"))
        }
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
        /// Whether both operands suit the 16-bit core's 16-byte copies (a contiguous dim whose
        /// runs are aligned to 8 elements).
        fn copyable_16(&self) -> bool {
            self.a.vectorised == 2 && self.b.vectorised == 2
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
