use super::Geometry;
use crate::cuda::{alloc_output, grid_stride_config, kernel_args, Kernel, Module};
use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{CudaStorage, Result};

/// Mirrors `TileSummaryArgs` in `src/cuda/tile_summary.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct TileSummaryArgs {
    batch_stride: i64,
    row_stride: i64,
    col_stride: i64,
    rows: u64,
    cols: u64,
    row_tiles: u64,
    col_tiles: u64,
    tiles: u64,
    tile_rows: u32,
    tile_cols: u32,
}
// Mirrored by `TileSummaryArgs` in src/cuda/tile_summary.cu.
mirrored_struct!(TileSummaryArgs, 72, kernel_arg);

const THREADS: u32 = crate::kernel_constants::tile_summary::THREADS as u32;

pub(super) fn launch(
    storage: &CudaStorage, g: &Geometry, tile_rows: usize, tile_cols: usize,
) -> Result<CudaStorage> {
    let dev = &storage.device;
    let tiles = g.batch * g.row_tiles * g.col_tiles;
    let out = alloc_output::<u8>(dev, tiles)?;
    if tiles > 0 {
        let mask = storage.as_cuda_slice::<u8>()?.slice(g.start..);
        let args = TileSummaryArgs {
            batch_stride: g.strides[0] as i64,
            row_stride: g.strides[1] as i64,
            col_stride: g.strides[2] as i64,
            rows: g.rows as u64,
            cols: g.cols as u64,
            row_tiles: g.row_tiles as u64,
            col_tiles: g.col_tiles as u64,
            tiles: tiles as u64,
            tile_rows: tile_rows as u32,
            tile_cols: tile_cols as u32,
        };
        let kernel = Kernel::load(dev, Module::TileSummary, &["tile_summary"])?;
        let cfg = grid_stride_config(dev, tiles as u64 * THREADS as u64, THREADS, 8, 0)?;
        // SAFETY: the arguments match `tile_summary(mask, states, args)`; every element the
        // kernel reads is inside the mask's layout (rows x cols of each batch entry from its
        // start, by its strides) and it writes one state per tile of `out`.
        unsafe {
            kernel.launch(cfg, kernel_args!(&mask, &out, &args))?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
