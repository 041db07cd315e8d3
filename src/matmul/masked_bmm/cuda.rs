use super::{Dims, TILE};
use crate::cuda::{alloc_output, grid_stride_config, kernel_args, Kernel, Module};
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
        let mask_args = MaskArgs {
            mask_batch_stride: dims.mask_batch_stride as i64,
            plan_batch_stride: super::plan_batch_stride(states.len(), row_tiles * col_tiles) as i64,
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

/// `MaskGradArgs` in `src/cuda/matmul.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MaskGradArgs {
    pub(crate) mask_batch_stride: i64,
    pub(crate) mask_row_stride: i64,
    pub(crate) mask_col_stride: i64,
    pub(crate) plan_batch_stride: i64,
    pub(crate) batch: u64,
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) row_tiles: u64,
    pub(crate) col_tiles: u64,
}
// Mirrored by `MaskGradArgs` in src/cuda/matmul.cu.
mirrored_struct!(MaskGradArgs, 72, kernel_arg);

/// The output gradient behind the mask (`mask_grad_*` in `src/cuda/matmul.cu`): `grad` is the
/// contiguous gradient from its element offset `grad_start`, `mask` and `states` views from
/// their first elements.
pub(crate) fn mask_grad<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, grad: &CudaView<'_, T>, grad_start: usize, mask: &CudaView<'_, u8>,
    states: &CudaView<'_, u8>, args: &MaskGradArgs,
) -> Result<CudaSlice<T>> {
    let len = (args.batch * args.rows * args.cols) as usize;
    let out = alloc_output::<T>(dev, len)?;
    let tiles = args.batch * args.row_tiles * args.col_tiles;
    if tiles > 0 {
        let width = 16 / std::mem::size_of::<T>();
        let vec = (args.cols as usize).is_multiple_of(width) && grad_start.is_multiple_of(width);
        let variant = if vec {
            "mask_grad_vec"
        } else {
            "mask_grad_scalar"
        };
        let kernel = Kernel::load_typed::<T>(dev, Module::Matmul, &[variant])?;
        let threads = crate::kernel_constants::matmul::THREADS as u32;
        let cfg = grid_stride_config(dev, tiles * threads as u64, threads, 8, 0)?;
        // SAFETY: the arguments match `mask_grad_*(g, mask, plan, out, args)`; g and out hold
        // batch x rows x cols elements, the mask and plan are read at indices inside their
        // layouts (strides from the layouts, batch strides 0 when shared).
        unsafe {
            kernel.launch(cfg, kernel_args!(grad, mask, states, &out, args))?;
        }
    }
    Ok(out)
}
