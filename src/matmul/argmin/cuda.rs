use crate::cuda::{
    alloc_output, fill_bytes, grid_stride_config, kernel_args, sm_count, Kernel, Module,
};
use crate::dispatch::mirrored_struct;
use crate::matmul::core::{
    cuda::{core_launch, ProblemArgs},
    MatView, TILE,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::{CudaDevice, CudaStorage, Result, WithDType};

/// `ArgminArgs` in `src/cuda/matmul.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ArgminArgs {
    col_groups: i64,
    scale: f32,
}
// Mirrored by `ArgminArgs` in src/cuda/matmul.cu.
mirrored_struct!(ArgminArgs, 16, kernel_arg);

use crate::kernel_constants::matmul::BLOCKS_PER_SM;

#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, a: &CudaSlice<T>, b: &CudaSlice<T>, bias: &CudaView<'_, f32>, av: &MatView,
    bv: &MatView, mode: crate::F32Matmul, scale: f32,
) -> Result<CudaStorage> {
    let (batch, m, n) = (av.batch, av.rows, bv.cols);
    let rows = batch * m;
    let out = alloc_output::<u32>(dev, rows)?;
    if rows == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    }
    // All ones: the largest key, above any real score.
    // SAFETY: filled below before any read.
    let mut keys = unsafe { dev.alloc::<u64>(rows)? };
    fill_bytes(dev, &mut keys, 0xFF)?;
    let (row_tiles, col_tiles) = (m.div_ceil(TILE), n.div_ceil(TILE));
    // Enough blocks for four waves: split the column tiles of each row tile between blocks
    // when there are few row tiles.
    let wanted = 4 * BLOCKS_PER_SM * sm_count(dev)? as usize;
    let col_groups = wanted.div_ceil(batch * row_tiles).clamp(1, col_tiles);
    let blocks = batch * row_tiles * col_groups;
    let problem = ProblemArgs::new(av, bv, a.len(), b.len());
    let argmin_args = ArgminArgs {
        col_groups: col_groups as i64,
        scale,
    };
    let a = a.slice(av.start..);
    let b = b.slice(bv.start..);
    let (product, cfg) = core_launch::<T>(
        dev,
        "argmin_matmul",
        "argmin_matmul",
        &problem,
        mode,
        blocks,
    )?;
    // SAFETY: arguments match `argmin_matmul_*(a, b, bias, keys, Problem, ArgminArgs)`;
    // bias holds n floats, keys batch * m, and the kernel bounds every access by the problem.
    unsafe {
        product.launch(
            cfg,
            kernel_args!(&a, &b, bias, &keys, &problem, &argmin_args),
        )?;
    }
    let rows64 = rows as u64;
    let cfg = grid_stride_config(dev, rows64, 256, 4, 0)?;
    let finish = Kernel::load(dev, Module::Matmul, &["argmin_keys_to_index"])?;
    // SAFETY: `argmin_keys_to_index(keys, out, rows)` with both buffers `rows` long.
    unsafe {
        finish.launch(cfg, kernel_args!(&keys, &out, &rows64))?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
