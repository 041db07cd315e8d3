use crate::cuda::{alloc_output, is_hopper, kernel_args, Kernel, Module};
use crate::dispatch::mirrored_struct;
use crate::kernel_constants::span_sm90 as SPAN_SM90;
use crate::matmul::core::cuda::{core_launch, uses_async_core, ProblemArgs};
use crate::matmul::core::{MatView, TILE};
use crate::matmul::masked_bmm::cuda::{mask_grad, MaskGradArgs};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::{bail, CudaDevice, CudaStorage, Result, WithDType};

/// `SpanArgs` in `src/cuda/matmul_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct SpanArgs {
    spans_batch_stride: i64,
    mask_batch_stride: i64,
    mask_row_stride: i64,
    mask_col_stride: i64,
    plan_batch_stride: i64,
    plan_col_tiles: i64,
    by_cols: i32,
    masked: i32,
}
// Mirrored by `SpanArgs` in src/cuda/matmul_common.cuh.
mirrored_struct!(SpanArgs, 56, kernel_arg);

/// The mask of the gradient operand (`a` for grad_a, `b` for grad_b when `by_cols`), applied on
/// the way in: the u8 mask and the plan's tile states as views from their first elements, the
/// mask's element strides (`batch_stride` 0 when shared) and the plan's tiles between batch
/// entries (0 when shared).
pub(super) struct GradMaskView<'a> {
    pub(super) mask: CudaView<'a, u8>,
    pub(super) states: CudaView<'a, u8>,
    pub(super) strides: [usize; 3],
    pub(super) plan_batch_stride: usize,
}

/// The span product `a . b` (`[batch, m, k] . [batch, k, n]`) of the masked_bmm backward: each
/// output tile reduces over its span of `spans` (`spans_batch_stride` span pairs per batch entry;
/// a span per column tile with `by_cols`, per row tile otherwise). With `mask`, the gradient
/// operand is the unmasked output gradient (contiguous): the async core masks its stages as they
/// land; the other cores get a masked copy first.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, a: &CudaSlice<T>, b: &CudaSlice<T>, spans: &CudaView<'_, u32>,
    (av, bv): (&MatView, &MatView), (spans_batch_stride, by_cols): (usize, bool),
    mode: crate::F32Matmul, mask: Option<&GradMaskView<'_>>,
) -> Result<CudaStorage> {
    let (batch, m, n) = (av.batch, av.rows, bv.cols);
    let problem = ProblemArgs::new(av, bv, a.len(), b.len());
    let mut args = SpanArgs {
        spans_batch_stride: 2 * spans_batch_stride as i64,
        by_cols: by_cols as i32,
        ..Default::default()
    };
    if let Some(gm) = mask {
        // The gradient operand is g [batch, rows, cols].
        let (g, gv) = if by_cols { (b, bv) } else { (a, av) };
        let (rows, cols) = (gv.rows, gv.cols);
        if uses_async_core::<T>(&problem, mode) {
            let [bs, rs, cs] = gm.strides;
            args.mask_batch_stride = bs as i64;
            args.mask_row_stride = rs as i64;
            args.mask_col_stride = cs as i64;
            args.plan_batch_stride = gm.plan_batch_stride as i64;
            args.plan_col_tiles = cols.div_ceil(TILE) as i64;
            args.masked = 1;
        } else {
            let contiguous = gv.col_stride == 1
                && gv.row_stride == cols
                && (gv.batch <= 1 || gv.batch_stride == rows * cols);
            if !contiguous {
                bail!("masked_bmm backward: internal error, the gradient is not contiguous");
            }
            let [bs, rs, cs] = gm.strides;
            let grad_args = MaskGradArgs {
                mask_batch_stride: bs as i64,
                mask_row_stride: rs as i64,
                mask_col_stride: cs as i64,
                plan_batch_stride: gm.plan_batch_stride as i64,
                batch: gv.batch as u64,
                rows: rows as u64,
                cols: cols as u64,
                row_tiles: rows.div_ceil(TILE) as u64,
                col_tiles: cols.div_ceil(TILE) as u64,
            };
            let len = gv.batch * rows * cols;
            let masked = mask_grad(
                dev,
                &g.slice(gv.start..gv.start + len),
                gv.start,
                &gm.mask,
                &gm.states,
                &grad_args,
            )?;
            // The products again, on the masked copy in place of the gradient operand.
            let copy = MatView { start: 0, ..*gv };
            let (a, b, views) = if by_cols {
                (a, &masked, (av, &copy))
            } else {
                (&masked, b, (&copy, bv))
            };
            return launch(
                dev,
                a,
                b,
                spans,
                views,
                (spans_batch_stride, by_cols),
                mode,
                None,
            );
        }
    }
    let out = alloc_output::<T>(dev, batch * m * n)?;
    let blocks = batch * m.div_ceil(TILE) * n.div_ceil(TILE);
    if blocks > 0 {
        let (a, b) = (a.slice(av.start..), b.slice(bv.start..));
        // A Hopper kernel where one takes the problem, else the core's span kernel: the same
        // arguments.
        let (kernel, cfg) =
            if let Some((name, shared)) = hopper_kernel::<T>(dev, &problem, by_cols, mode)? {
                let kernel = Kernel::load(dev, Module::SpanSm90, &[name])?;
                kernel.allow_dynamic_shared(shared)?;
                let cfg = LaunchConfig {
                    grid_dim: (blocks as u32, 1, 1),
                    block_dim: (SPAN_SM90::THREADS as u32, 1, 1),
                    shared_mem_bytes: shared as u32,
                };
                (kernel, cfg)
            } else {
                core_launch::<T>(
                    dev,
                    "masked_bmm backward",
                    "span_matmul",
                    &problem,
                    mode,
                    blocks,
                )?
            };
        // SAFETY: arguments match `span_matmul_*(a, b, spans, mask, plan, out, Problem,
        // SpanArgs)` and the Hopper kernels' (the same list; `hopper_kernel` checked that T is
        // f32, the output at most COLS wide (grad_a) or high (grad_b) so that a block per tile of
        // the other dim covers it, and the operands' layouts their 16-byte copies need); the spans
        // hold a pair per output tile along the spanned dim (checked by the caller) and the
        // kernels clamp each span to the reduction length. A masked launch reads the mask at
        // (row, col) of g through its layout's strides and the plan at g's tiles; an unmasked one
        // reads neither (the spans' address stands in for both).
        unsafe {
            match mask {
                Some(gm) if args.masked == 1 => kernel.launch(
                    cfg,
                    kernel_args!(&a, &b, spans, &gm.mask, &gm.states, &out, &problem, &args),
                )?,
                _ => kernel.launch(
                    cfg,
                    kernel_args!(&a, &b, spans, spans, spans, &out, &problem, &args),
                )?,
            };
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

// The Hopper kernels' shared memory, as their layout checks too. grad_a: STAGES raw stages of a
// TILE-row and a COLS-row tile (rows of 80 bytes) and of the mask's TILE rows (16 bytes each),
// and two split buffers of the second tile (big and small, 64 bytes a row each). grad_b: STAGES
// raw stages of 16 rows of a (COLS f32 padded to 288 bytes), of g (TILE f32) and of the mask
// (TILE bytes), and two split buffers of g's (TILE rows of 64 bytes, big and small).
const _: () = assert!(
    SPAN_SM90::SHARED_BYTES
        == SPAN_SM90::STAGES * ((TILE + SPAN_SM90::COLS) * 80 + TILE * 16)
            + 4 * SPAN_SM90::COLS * 64
);
const _: () = assert!(
    SPAN_SM90::GRAD_B_SHARED_BYTES
        == SPAN_SM90::STAGES * 16 * (SPAN_SM90::COLS * 4 + 32 + TILE * 4 + TILE) + 4 * TILE * 64
);

/// The Hopper kernel (`src/cuda/sm90/span.cu`) that computes this span product, with its dynamic
/// shared memory, if one does: f32 in the compensated mode on compute capability 9.0, unless
/// `CANDLE_FASTOPS_MATMUL_KERNELS=portable` (read once per process; the test suite runs both).
/// grad_a (spans by row tile): an output of at most `span_sm90::COLS` columns (masked_bmm's k),
/// both operands k-contiguous with 16-byte aligned rows (the output gradient and `b` row-major,
/// as masked_bmm's forward takes them). grad_b (spans by column tile): an output of at most
/// `COLS` rows, both operands outer-contiguous with 16-byte aligned rows (`a` and the output
/// gradient row-major).
fn hopper_kernel<T: WithDType>(
    dev: &CudaDevice, problem: &ProblemArgs, by_cols: bool, mode: crate::F32Matmul,
) -> Result<Option<(&'static str, usize)>> {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let chosen = *CHOSEN.get_or_init(|| {
        std::env::var("CANDLE_FASTOPS_MATMUL_KERNELS").as_deref() != Ok("portable")
    });
    if !chosen || T::DTYPE != candle_core::DType::F32 || mode != crate::F32Matmul::Compensated {
        return Ok(None);
    }
    let kernel = if by_cols {
        (problem.m() <= SPAN_SM90::COLS && problem.both_outer_aligned_f32()).then_some((
            "span_grad_b_sm90_tf32x3_f32",
            SPAN_SM90::GRAD_B_SHARED_BYTES,
        ))
    } else {
        (problem.n() <= SPAN_SM90::COLS && problem.both_rows_aligned_f32())
            .then_some(("span_grad_a_sm90_tf32x3_f32", SPAN_SM90::SHARED_BYTES))
    };
    Ok(match kernel {
        Some(k) if is_hopper(dev)? => Some(k),
        _ => None,
    })
}
