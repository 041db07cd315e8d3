use super::{Dims, TILE};
use crate::cuda::{alloc_output, kernel_args};
use crate::dispatch::mirrored_struct;
use crate::matmul::core::cuda::{core_launch, ProblemArgs};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::{CudaDevice, CudaStorage, Result, WithDType};

/// `MaskArgs` in `src/cuda/matmul.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MaskArgs {
    mask_batch_stride: i64,
    plan_batch_stride: i64,
    fill: f32,
}
// Mirrored by `MaskArgs` in src/cuda/matmul.cu.
mirrored_struct!(MaskArgs, 24, kernel_arg);

#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, a: &CudaSlice<T>, b: &CudaSlice<T>, mask: &CudaView<'_, u8>,
    states: &CudaView<'_, u8>, dims: &Dims, fill: f64, mode: crate::F32Matmul,
) -> Result<CudaStorage> {
    let (batch, m, n) = (dims.a.batch, dims.a.rows, dims.b.cols);
    let out = alloc_output::<T>(dev, batch * m * n)?;
    let (row_tiles, col_tiles) = (m.div_ceil(TILE), n.div_ceil(TILE));
    let blocks = batch * row_tiles * col_tiles;
    if blocks > 0 {
        let plan_tiles = row_tiles * col_tiles;
        let mask_args = MaskArgs {
            mask_batch_stride: dims.mask_batch_stride as i64,
            plan_batch_stride: if states.len() > plan_tiles {
                plan_tiles as i64
            } else {
                0
            },
            fill: fill as f32,
        };
        let problem = ProblemArgs::new(&dims.a, &dims.b, a.len(), b.len());
        let a = a.slice(dims.a.start..);
        let b = b.slice(dims.b.start..);
        let (kernel, cfg) =
            core_launch::<T>(dev, "masked_bmm", "masked_bmm", &problem, mode, blocks)?;
        // SAFETY: arguments match `masked_bmm_*(a, b, mask, plan, out, Problem, MaskArgs)`;
        // the kernel bounds every access by the problem's sizes and strides, which come
        // from the operands' layouts.
        unsafe {
            kernel.launch(
                cfg,
                kernel_args!(&a, &b, mask, states, &out, &problem, &mask_args),
            )?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
