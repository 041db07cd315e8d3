use crate::cuda::{alloc_output, kernel_args};
use crate::dispatch::mirrored_struct;
use crate::matmul::core::cuda::{core_launch, ProblemArgs};
use crate::matmul::core::{MatView, TILE};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::{CudaDevice, CudaStorage, Result, WithDType};

/// `SpanArgs` in `src/cuda/matmul.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SpanArgs {
    spans_batch_stride: i64,
    by_cols: i32,
}
// Mirrored by `SpanArgs` in src/cuda/matmul.cu.
mirrored_struct!(SpanArgs, 16, kernel_arg);

/// The span product `a . b` (`[batch, m, k] . [batch, k, n]`) of the masked_bmm backward: each
/// output tile reduces over its span of `spans` (`spans_batch_stride` span pairs per batch entry;
/// a span per column tile with `by_cols`, per row tile otherwise).
pub(super) fn launch<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, a: &CudaSlice<T>, b: &CudaSlice<T>, spans: &CudaView<'_, u32>,
    (av, bv): (&MatView, &MatView), (spans_batch_stride, by_cols): (usize, bool),
    mode: crate::F32Matmul,
) -> Result<CudaStorage> {
    let (batch, m, n) = (av.batch, av.rows, bv.cols);
    let out = alloc_output::<T>(dev, batch * m * n)?;
    let blocks = batch * m.div_ceil(TILE) * n.div_ceil(TILE);
    if blocks > 0 {
        let problem = ProblemArgs::new(av, bv, a.len(), b.len());
        let args = SpanArgs {
            spans_batch_stride: 2 * spans_batch_stride as i64,
            by_cols: by_cols as i32,
        };
        let (a, b) = (a.slice(av.start..), b.slice(bv.start..));
        let (kernel, cfg) = core_launch::<T>(
            dev,
            "masked_bmm backward",
            "span_matmul",
            &problem,
            mode,
            blocks,
        )?;
        // SAFETY: arguments match `span_matmul_*(a, b, spans, out, Problem, SpanArgs)`; the
        // spans hold a pair per output tile along the spanned dim (checked by the caller)
        // and the kernel clamps each span to the reduction length.
        unsafe {
            kernel.launch(cfg, kernel_args!(&a, &b, spans, &out, &problem, &args))?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
