use crate::cuda::{
    alloc_output, fill_bytes, grid_stride_config, is_hopper, kernel_args, sm_count, tuning, Kernel,
    Module,
};
use crate::dispatch::mirrored_struct;
use crate::kernel_constants::argmin_sm90 as sm90;
use crate::matmul::core::{
    cuda::{core_launch, ProblemArgs},
    F32Matmul, MatView, TILE,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::{CudaDevice, CudaStorage, DType, Result, WithDType};

/// `ArgminArgs` in `src/cuda/matmul_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ArgminArgs {
    col_groups: i64,
    scale: f32,
}
// Mirrored by `ArgminArgs` in src/cuda/matmul_common.cuh.
mirrored_struct!(ArgminArgs, 16, kernel_arg);

/// The split copy of `b` that the Hopper kernels read (`SplitArgs` in src/cuda/sm90/argmin.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SplitArgs {
    padded_k: i64,
    padded_cols: i64,
    batch_stride: i64,
}
// Mirrored by `SplitArgs` in src/cuda/sm90/argmin.cu.
mirrored_struct!(SplitArgs, 24, kernel_arg);

use crate::kernel_constants::matmul::BLOCKS_PER_SM;

#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: WithDType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
    dev: &CudaDevice, a: &CudaSlice<T>, b: &CudaSlice<T>, bias: &CudaView<'_, f32>, av: &MatView,
    bv: &MatView, mode: F32Matmul, scale: f32,
) -> Result<CudaStorage> {
    let (batch, m) = (av.batch, av.rows);
    let rows = batch * m;
    let out = alloc_output::<u32>(dev, rows)?;
    if rows == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    }
    // All ones: the largest key, above any real score.
    // SAFETY: filled below before any read.
    let mut keys = unsafe { dev.alloc::<u64>(rows)? };
    fill_bytes(dev, &mut keys, 0xFF)?;
    let problem = ProblemArgs::new(av, bv, a.len(), b.len());
    let a = a.slice(av.start..);
    let b = b.slice(bv.start..);
    let call = ArgminCall {
        a: &a,
        b: &b,
        bias,
        keys: &keys,
        problem: &problem,
        av,
        bv,
        mode,
        scale,
    };
    if use_hopper::<T>(dev, &problem, av.cols, mode)? {
        launch_hopper(dev, &call)?;
    } else {
        launch_portable(dev, &call)?;
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

/// One call's operands (views from their starts), its key buffer and its arguments, as both
/// product launches take them.
struct ArgminCall<'a, T> {
    a: &'a CudaView<'a, T>,
    b: &'a CudaView<'a, T>,
    bias: &'a CudaView<'a, f32>,
    keys: &'a CudaSlice<u64>,
    problem: &'a ProblemArgs,
    av: &'a MatView,
    bv: &'a MatView,
    mode: F32Matmul,
    scale: f32,
}

/// Column groups (blocks sharing a row tile, each taking every `col_groups`-th column tile) for
/// `wanted` blocks over `row_tiles` row tiles of each batch entry.
fn col_groups(wanted: usize, batch: usize, row_tiles: usize, col_tiles: usize) -> usize {
    wanted.div_ceil(batch * row_tiles).clamp(1, col_tiles)
}

fn launch_portable<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, call: &ArgminCall<'_, T>,
) -> Result<()> {
    let (batch, m, n) = (call.av.batch, call.av.rows, call.bv.cols);
    let (row_tiles, col_tiles) = (m.div_ceil(TILE), n.div_ceil(TILE));
    // Enough blocks for four waves: split the column tiles of each row tile between blocks
    // when there are few row tiles.
    let wanted = 4 * BLOCKS_PER_SM * sm_count(dev)? as usize;
    let col_groups = col_groups(wanted, batch, row_tiles, col_tiles);
    let blocks = batch * row_tiles * col_groups;
    let argmin_args = ArgminArgs {
        col_groups: col_groups as i64,
        scale: call.scale,
    };
    let (product, cfg) = core_launch::<T>(
        dev,
        "argmin_matmul",
        "argmin_matmul",
        call.problem,
        call.mode,
        blocks,
    )?;
    let ArgminCall {
        a,
        b,
        bias,
        keys,
        problem,
        ..
    } = *call;
    // SAFETY: arguments match `argmin_matmul_*(a, b, bias, keys, Problem, ArgminArgs)`;
    // bias holds n floats, keys batch * m, and the kernel bounds every access by the problem.
    unsafe { product.launch(cfg, kernel_args!(a, b, bias, keys, problem, &argmin_args)) }
}

/// Whether the Hopper kernels (`src/cuda/sm90/argmin.cu`) take this call: f16 / bf16, or f32 in
/// the compensated or TF32 mode; `a`'s rows k-contiguous and 16-byte aligned; k >= 1 and a row
/// of at most `MAX_ROW_BYTES` (k <= 128 in f32, 256 in 16 bits); compute capability 9.0.
/// `FASTOPS_ARGMIN_SM90=0` turns them off (tuning builds).
fn use_hopper<T: WithDType>(
    dev: &CudaDevice, problem: &ProblemArgs, k: usize, mode: F32Matmul,
) -> Result<bool> {
    let elem = T::DTYPE.size_in_bytes();
    let dtype_ok = match T::DTYPE {
        DType::F32 => matches!(mode, F32Matmul::Compensated | F32Matmul::Tf32),
        DType::F16 | DType::BF16 => true,
        _ => false,
    };
    Ok(dtype_ok
        && k >= 1
        && padded_k(k, elem) * elem <= sm90::MAX_ROW_BYTES
        && problem.a_rows_aligned(elem)
        && tuning("FASTOPS_ARGMIN_SM90") != Some(0)
        && is_hopper(dev)?)
}

/// k rounded up to a stage of `b` (`STAGE_K_BYTES` of elements of `elem` bytes).
fn padded_k(k: usize, elem: usize) -> usize {
    k.next_multiple_of(sm90::STAGE_K_BYTES / elem)
}

/// Splits `b` into a padded copy in the stage layout (f32: TF32 big, and small in the compensated
/// mode; 16-bit: as it is), then runs the wgmma kernel: a block per 128 rows of `a` (or per
/// column group of them), one atomicMin per row.
fn launch_hopper<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, call: &ArgminCall<'_, T>,
) -> Result<()> {
    let ArgminCall {
        a,
        b,
        bias,
        keys,
        problem,
        av,
        bv,
        mode,
        scale,
    } = *call;
    let (batch, m, n, k) = (av.batch, av.rows, bv.cols, av.cols);
    let (variant, parts) = match (T::DTYPE, mode) {
        (DType::F16, _) => ("f16", 1),
        (DType::BF16, _) => ("bf16", 1),
        (_, F32Matmul::Tf32) => ("tf32", 1),
        _ => ("tf32x3", 2),
    };
    let elem = T::DTYPE.size_in_bytes();
    let (padded_k, padded_cols) = (padded_k(k, elem), n.next_multiple_of(sm90::COLS));
    let part = padded_cols * padded_k;
    let split_args = SplitArgs {
        padded_k: padded_k as i64,
        padded_cols: padded_cols as i64,
        batch_stride: (parts * part) as i64,
    };
    let entries = problem.b_entries();
    // SAFETY: the split kernel writes every element (entries x parts x part), laid out as the
    // main kernel's stages.
    let split = unsafe { dev.alloc::<T>(entries * parts * part)? };
    let split_kernel = Kernel::load(dev, Module::ArgminSm90, &["argmin_split_b_sm90", variant])?;
    let cfg = grid_stride_config(dev, (entries * part) as u64, 256, 8, 0)?;
    // SAFETY: `argmin_split_b_sm90_*(b, problem, split_args, out)`: b is read at the problem's
    // strides inside its view, out holds entries x parts x padded_cols x padded_k elements.
    unsafe {
        split_kernel.launch(cfg, kernel_args!(b, problem, &split_args, &split))?;
    }

    let (row_tiles, col_tiles) = (m.div_ceil(sm90::ROWS), n.div_ceil(sm90::COLS));
    // One block an SM fits; two waves at least, splitting column tiles when rows are few.
    let col_groups = col_groups(2 * sm_count(dev)? as usize, batch, row_tiles, col_tiles);
    let blocks = batch * row_tiles * col_groups;
    if blocks > i32::MAX as usize {
        candle_core::bail!("argmin_matmul: too many row tiles ({blocks})");
    }
    // The row tile and the stages of each part, then two 8-byte mbarriers per stage.
    let shared = parts
        * (sm90::ROWS * padded_k * elem + sm90::STAGES * sm90::COLS * sm90::STAGE_K_BYTES)
        + 16 * sm90::STAGES;
    let kernel = Kernel::load(dev, Module::ArgminSm90, &["argmin_matmul_sm90", variant])?;
    kernel.allow_dynamic_shared(shared)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (sm90::THREADS as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let argmin_args = ArgminArgs {
        col_groups: col_groups as i64,
        scale,
    };
    // SAFETY: `argmin_matmul_sm90_*(a, b_split, bias, keys, problem, argmin, split)`: a's rows
    // are read inside the problem (rows < m, k < p.k), the split copy is padded to whole tiles,
    // bias holds n floats, keys batch x m.
    unsafe {
        kernel.launch(
            cfg,
            kernel_args!(a, &split, bias, keys, problem, &argmin_args, &split_args),
        )
    }
}
