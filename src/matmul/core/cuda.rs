use super::MatView;
use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, WithDType};

/// Dynamic shared memory of the async core's kernels (`sizeof(AsyncStaging)` in the kernels).
pub(crate) use crate::kernel_constants::matmul::ASYNC_SHARED_BYTES;

/// The kernel of `base` for `T` and `problem` (see [`core_variant`]), loaded, and the
/// configuration of a launch of `blocks` blocks of the core (one output tile or column group
/// each; `THREADS` threads, the dynamic shared memory of the async core). `op` names the caller in
/// the error for a grid too large to launch.
pub(crate) fn core_launch<T: WithDType>(
    dev: &candle_core::CudaDevice, op: &str, base: &str, problem: &ProblemArgs,
    mode: super::F32Matmul, blocks: usize,
) -> candle_core::Result<(crate::cuda::Kernel, LaunchConfig)> {
    use crate::cuda::{Kernel, Module};
    if blocks > i32::MAX as usize {
        candle_core::bail!("{op}: too many output tiles ({blocks})");
    }
    let (variant, is_async) = core_variant::<T>(problem, mode);
    let kernel = Kernel::load_typed::<T>(dev, Module::Matmul, &[base, variant])?;
    let shared_mem_bytes = if is_async {
        kernel.allow_dynamic_shared(ASYNC_SHARED_BYTES)?;
        ASYNC_SHARED_BYTES as u32
    } else {
        0
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (crate::kernel_constants::matmul::THREADS as u32, 1, 1),
        shared_mem_bytes,
    };
    Ok((kernel, cfg))
}

/// Whether `core_launch` runs `problem` on the async core (what the masked_bmm backward's products
/// need to mask their gradient operand in the kernel).
pub(crate) fn uses_async_core<T: WithDType>(problem: &ProblemArgs, mode: super::F32Matmul) -> bool {
    core_variant::<T>(problem, mode).1
}

/// The kernel variant of the core for `T` (a kernel is `{base}_{variant}_{dtype}`, `base` being
/// `masked_bmm`, `argmin_matmul`...), and whether it is one of the async core (16-byte `cp.async` copies, for operands that allow them: [`ProblemArgs::copyable`]).
/// f16 / bf16: `_h16` (async) or `_tc` (register-staged TF32). f32 by `mode`:
/// `_tf32x3` (async) or the FMA kernel when compensated, `_f32` (FMA), `_tf32` (async) or
/// `_tc` for TF32. The `FASTOPS_MATMUL_ASYNC=0` tuning variable turns the async core off.
fn core_variant<T: WithDType>(
    problem: &ProblemArgs, mode: super::F32Matmul,
) -> (&'static str, bool) {
    use super::F32Matmul;
    let copyable = problem.copyable(T::DTYPE.size_in_bytes())
        && crate::cuda::tuning("FASTOPS_MATMUL_ASYNC").unwrap_or(1) != 0;
    let variant = match (T::DTYPE, mode, copyable) {
        (DType::F32, F32Matmul::Fma, _) | (DType::F32, F32Matmul::Compensated, false) => "",
        (DType::F32, F32Matmul::Compensated, true) => "tf32x3",
        (DType::F32, F32Matmul::Tf32, true) => "tf32",
        (_, _, false) => "tc",
        (_, _, true) => "h16",
    };
    let is_async = copyable && !variant.is_empty() && variant != "tc";
    (variant, is_async)
}

/// How a block's threads map onto an operand tile for coalesced loads.
use crate::kernel_constants::matmul::{K_CONTIGUOUS, OUTER_CONTIGUOUS, STRIDED};

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct OperandArgs {
    batch_stride: i64,
    outer_stride: i64,
    k_stride: i64,
    mode: i32,
    vectorised: i32,
}
// Mirrored by `Operand` in src/cuda/matmul.cu.
mirrored_struct!(OperandArgs, 32);

impl OperandArgs {
    /// An operand whose tiles run along `outer` (m for A, n for B) and k, with strides in
    /// elements relative to the view's start, in a buffer of `buffer_len` elements.
    ///
    /// The vector paths read whole aligned runs of `group` elements (16-byte `cp.async`
    /// copies, 16-byte loads), masking the elements past the operand's edge. A run is only
    /// allowed where it stays inside the buffer: an operand whose last run would reach past
    /// the buffer's end (a single unaligned row at the end of its allocation, e.g. `[7, 1]`
    /// f32) takes the scalar path, so no access ever leaves the allocation.
    fn new(
        view: &MatView, outer_stride: usize, k_stride: usize, outer_len: usize, buffer_len: usize,
    ) -> Self {
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
        let end = view.end();
        let runs_fit = |group: usize| end.next_multiple_of(group) <= buffer_len;
        let vectorised = if mode == STRIDED {
            0
        } else if aligned_to(8) && runs_fit(8) {
            2
        } else {
            (aligned_to(4) && runs_fit(4)) as i32
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
// Mirrored by `Problem` in src/cuda/matmul.cu.
mirrored_struct!(ProblemArgs, 96, kernel_arg);

impl ProblemArgs {
    /// Whether both operands suit the async core's 16-byte copies of `elem_bytes`-byte
    /// elements: a contiguous dim whose runs of 16 bytes are aligned.
    fn copyable(&self, elem_bytes: usize) -> bool {
        let needed = if elem_bytes == 4 { 1 } else { 2 };
        self.a.vectorised >= needed && self.b.vectorised >= needed
    }

    /// Whether `a`'s rows are k-contiguous and start on 16-byte boundaries for elements of
    /// `elem_bytes` (4 or 2), inside the buffer: what the Hopper argmin's row-tile copies need.
    pub(crate) fn a_rows_aligned(&self, elem_bytes: usize) -> bool {
        let needed = if elem_bytes == 4 { 1 } else { 2 };
        self.a.mode == K_CONTIGUOUS && self.a.vectorised >= needed
    }

    /// Whether both operands are k-contiguous with rows on 16-byte boundaries of f32 elements,
    /// inside their buffers: what the Hopper span product's copies need.
    pub(crate) fn both_rows_aligned_f32(&self) -> bool {
        self.a_rows_aligned(4) && self.b.mode == K_CONTIGUOUS && self.b.vectorised >= 1
    }

    /// Whether both operands are outer-contiguous (m for `a`, n for `b`) with runs of four f32
    /// on 16-byte boundaries along it, inside their buffers: what the Hopper grad_b span
    /// product's copies need.
    pub(crate) fn both_outer_aligned_f32(&self) -> bool {
        [&self.a, &self.b]
            .iter()
            .all(|o| o.mode == OUTER_CONTIGUOUS && o.vectorised >= 1)
    }

    /// The product's m (rows of the output).
    pub(crate) fn m(&self) -> usize {
        self.m as usize
    }

    /// The product's n (columns of the output).
    pub(crate) fn n(&self) -> usize {
        self.n as usize
    }

    /// The batch entries of `b` in memory: 1 when every batch entry shares it (batch stride 0).
    pub(crate) fn b_entries(&self) -> usize {
        if self.b.batch_stride == 0 {
            1
        } else {
            self.batch as usize
        }
    }

    /// `a` `[batch, m, k]` times `b` `[batch, k, n]`; a broadcast `b` has batch stride 0.
    /// `a_len` / `b_len` are the element counts of the buffers the views index.
    pub(crate) fn new(a: &MatView, b: &MatView, a_len: usize, b_len: usize) -> Self {
        Self {
            a: OperandArgs::new(a, a.row_stride, a.col_stride, a.rows, a_len),
            b: OperandArgs::new(b, b.col_stride, b.row_stride, b.cols, b_len),
            batch: a.batch as i64,
            m: a.rows as i64,
            n: b.cols as i64,
            k: a.cols as i64,
        }
    }
}
