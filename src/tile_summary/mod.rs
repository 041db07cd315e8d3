//! The tile summary of a mask: per `tile_rows x tile_cols` tile, whether none, some or all of its
//! elements are kept (nonzero). `MaskPlan` and the attention masks skip or fully take tiles by it.
//! One read of the mask in place (any strides), no temporary tensors.

use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
mod cuda;

const OP: &str = "tile summary";

/// A tile with no kept element, some, or all (the values the kernels read).
pub(crate) use crate::kernel_constants::matmul::{TILE_EMPTY, TILE_FULL, TILE_PARTIAL};

/// The summary of u8 `mask` `[batch, rows, cols]` (any layout) per tile: u8
/// `[batch, ceil(rows / tile_rows), ceil(cols / tile_cols)]` of [`TILE_EMPTY`],
/// [`TILE_PARTIAL`] or [`TILE_FULL`], on the mask's device.
pub(crate) fn tile_summary(mask: &Tensor, tile_rows: usize, tile_cols: usize) -> Result<Tensor> {
    if mask.dtype() != DType::U8 || mask.rank() != 3 {
        bail!(
            "{OP}: internal error, expected a u8 [batch, rows, cols] mask, got {:?} {:?}",
            mask.dtype(),
            mask.dims()
        );
    }
    if tile_rows == 0
        || tile_cols == 0
        || tile_rows > u32::MAX as usize
        || tile_cols > u32::MAX as usize
    {
        bail!("{OP}: internal error, tile {tile_rows} x {tile_cols}");
    }
    mask.apply_op1_no_bwd(&TileSummary {
        tile_rows,
        tile_cols,
    })
}

/// The op: a summary has no gradient.
struct TileSummary {
    tile_rows: usize,
    tile_cols: usize,
}

/// Shape and strides of the mask and of its summary.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    start: usize,
    strides: [usize; 3],
    batch: usize,
    rows: usize,
    cols: usize,
    row_tiles: usize,
    col_tiles: usize,
}

impl TileSummary {
    fn geometry(&self, layout: &Layout) -> Result<Geometry> {
        let (batch, rows, cols) = layout.shape().dims3()?;
        let strides = layout.stride();
        Ok(Geometry {
            start: layout.start_offset(),
            strides: [strides[0], strides[1], strides[2]],
            batch,
            rows,
            cols,
            row_tiles: rows.div_ceil(self.tile_rows),
            col_tiles: cols.div_ceil(self.tile_cols),
        })
    }

    fn out_shape(g: &Geometry) -> Shape {
        Shape::from((g.batch, g.row_tiles, g.col_tiles))
    }
}

/// The state of one tile from its count of kept elements out of `total` (at least 1).
fn state(kept: usize, total: usize) -> u8 {
    match kept {
        0 => TILE_EMPTY,
        k if k == total => TILE_FULL,
        _ => TILE_PARTIAL,
    }
}

impl CustomOp1 for TileSummary {
    fn name(&self) -> &'static str {
        "fastops-tile-summary"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry(layout)?;
        let mask = storage.as_slice::<u8>()?;
        let (tr, tc) = (self.tile_rows, self.tile_cols);
        let [bs, rs, cs] = g.strides;
        let mut states = vec![TILE_EMPTY; g.batch * g.row_tiles * g.col_tiles];
        if g.col_tiles > 0 {
            // A task per row of tiles: one pass over its rows, counting kept elements per tile.
            states
                .par_chunks_mut(g.col_tiles)
                .enumerate()
                .for_each(|(task, out)| {
                    let (b, ti) = (task / g.row_tiles, task % g.row_tiles);
                    let rows = ti * tr..((ti + 1) * tr).min(g.rows);
                    let mut kept = vec![0usize; g.col_tiles];
                    for r in rows.clone() {
                        let row = g.start + b * bs + r * rs;
                        for c in 0..g.cols {
                            kept[c / tc] += (mask[row + c * cs] != 0) as usize;
                        }
                    }
                    for (tj, (out, &k)) in out.iter_mut().zip(&kept).enumerate() {
                        let cols = ((tj + 1) * tc).min(g.cols) - tj * tc;
                        *out = state(k, rows.len() * cols);
                    }
                });
        }
        Ok((CpuStorage::U8(states), Self::out_shape(&g)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, storage: &candle_core::CudaStorage, layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(layout)?;
        let out = cuda::launch(storage, &g, self.tile_rows, self.tile_cols)?;
        Ok((out, Self::out_shape(&g)))
    }
}
