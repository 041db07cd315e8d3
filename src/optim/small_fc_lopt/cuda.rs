//! The CUDA step of small_fc_lopt over every tensor at once (`src/cuda/small_fc_lopt.cu`).
//!
//! The optimizer state of all tensors lives in a few flat f32 buffers, allocated once and updated
//! in place (the per-tensor state tensors are views into them); a static table describes each
//! tensor (sizes, offsets, index divisors) and splits it into fixed-size chunks. A step is then
//! four or five launches per group of up to [`GROUP`] tensors (the gradient and parameter
//! addresses of a group travel as a kernel argument), whatever the tensor count: square sums (by
//! chunks, and by row / column tiles for wide 2-D matrices), Adafactor factors, feature statistics
//! (taken with this step's accumulators, of which this memory-bound pass stores only vectors'
//! Adafactor accumulators), MLP + parameter update (which computes the momenta and rms again and
//! stores them with the parameter). Everything is written in place.
//!
//! Deterministic steps replace the float atomics of the reductions: the square sums are taken by
//! `lopt_square_sums_ordered` (each row or column sum in a fixed order), the factors'
//! batch sums in index order, and the feature sums per chunk, then added in chunk order by
//! `lopt_chunk_sums`.

use super::cpu::{Decays, Hyper, FEATURES, MLP_FLOATS};
use crate::cuda::{kernel_args, FastDiv, Kernel, Module};
use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, DType, Device, Result, Tensor};

use super::OP;

/// The backend switches of a CUDA step, resolved.
#[derive(Debug, Clone, Copy)]
pub(super) struct Backend {
    /// The MLP on f16 tensor cores (split operands) rather than f32 FMAs.
    pub tensor_cores: bool,
    /// Every sum in a fixed order (ordered square sums, batch sums and feature sums).
    pub deterministic: bool,
}
use crate::kernel_constants::small_fc_lopt::{CHUNK, GROUP, TILE_COLS};
const THREADS: u32 = crate::kernel_constants::small_fc_lopt::THREADS as u32;
const SQUARE_SUM_RUN: u32 = crate::kernel_constants::small_fc_lopt::SQUARE_SUM_RUN as u32;
/// Rows of a square-sum tile of a 2-D gradient.
const TILE_ROWS: usize = 256;
/// The narrowest row the tiled square sums take (narrower matrices keep the chunk walk, which
/// does not leave most of a block idle).
const TILE_MIN_COLS: usize = 512;

/// A per-tensor divisor: [`FastDiv`]'s multiply-high for 32-bit dividends, the plain 64-bit
/// divisor for tensors of 2^32 elements or more (`wide`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Divisor {
    d: u64,
    magic: u32,
    shift: u32,
}
// Mirrored by `Divisor` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(Divisor, 16);

impl Divisor {
    fn new(d: usize) -> Self {
        let d = d.max(1);
        if d > u32::MAX as usize {
            // Only tensors of 2^32 elements or more have such axes, and those divide in 64 bits.
            return Self {
                d: d as u64,
                ..Default::default()
            };
        }
        let fast = FastDiv::new(d);
        Self {
            d: d as u64,
            magic: fast.multiplier,
            shift: fast.shift,
        }
    }
}

/// Mirrors `LoptMeta` in the kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct LoptMeta {
    n: u64,
    elem: u64,
    full: u64,
    row: u64,
    col: u64,
    row_sum: u64,
    col_sum: u64,
    batch: u64,
    rows: u64,
    cols: u64,
    batches: u64,
    inner0: Divisor,
    outer0: Divisor,
    inner1: Divisor,
    outer1: Divisor,
    row_inner1: Divisor,
    row_outer1: Divisor,
    inv_size0: f32,
    inv_size1: f32,
    factored: u32,
    wide: u32,
    tiled: u32,
    pad: u32,
}
// Mirrored by `LoptMeta` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(LoptMeta, 208);

/// Mirrors `SumTile` in the kernels: rows `row_start..row_start + rows` and columns
/// `col_start..col_start + TILE_COLS` of a 2-D gradient with `cols` columns.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct SumTile {
    tensor: u32,
    rows: u32,
    row_start: u64,
    col_start: u32,
    cols: u32,
    /// Whether the per-row sums are the column accumulator's (d0 = 0) or the row one's.
    rows_into_col_sum: u32,
    pad: u32,
}
// Mirrored by `SumTile` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(SumTile, 32);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Chunk {
    tensor: u32,
    pad: u32,
    start: u64,
}
// Mirrored by `Chunk` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(Chunk, 16);

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct StepTensors {
    grad: [u64; GROUP],
    param: [u64; GROUP],
}
// Mirrored by `StepTensors` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(StepTensors, 2048, kernel_arg);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Buffers {
    elem: u64,
    full: u64,
    row: u64,
    col: u64,
    row_factor: u64,
    col_factor: u64,
    row_sum: u64,
    col_sum: u64,
    batch_sum: u64,
    feat_sum: u64,
}
// Mirrored by `Buffers` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(Buffers, 80, kernel_arg);

/// A tensor's shape (rank >= 1) and, for matrices, its Adafactor axes (d0, d1).
pub(super) type TensorShape = (Vec<usize>, Option<(usize, usize)>);

/// How one tensor's state sits in the flat buffers.
#[derive(Debug, Clone)]
pub(super) struct TensorSlots {
    pub n: usize,
    /// `[4, n]` (momentum 0..2, rms) at this offset of the element buffer.
    pub elem: usize,
    pub kind: SlotKind,
}

#[derive(Debug, Clone)]
pub(super) enum SlotKind {
    /// `[3, rows]` at `row` of the row buffer (shape `row_shape`: axis d0 kept with size 1),
    /// `[3, cols]` at `col` of the column buffer (`col_shape`: axis d1 kept with size 1).
    Matrix {
        row: usize,
        row_shape: Vec<usize>,
        col: usize,
        col_shape: Vec<usize>,
    },
    /// `[3, n]` at `full` of the vector-accumulator buffer.
    Vector { full: usize },
}

/// One launch group: tensors `first..first + count`, their chunks and their square-sum tiles.
#[derive(Debug)]
struct Group {
    first: usize,
    count: usize,
    chunks: Tensor,
    n_chunks: u32,
    tiles: Tensor,
    n_tiles: u32,
    /// Whether any matrix of the group takes the chunk-walking square sums (not tiled).
    chunked_matrices: bool,
    /// Whether any tensor of the group is a matrix.
    matrices: bool,
    /// The most blocks a matrix of the group takes in `lopt_square_sums_ordered`.
    ordered_blocks: usize,
    /// u32 `[count + 1]`: tensor `first + i`'s chunks are `chunk_starts[i]..chunk_starts[i + 1]`.
    chunk_starts: Tensor,
}

/// The state of every tensor in flat device buffers, and the static tables of the kernels.
#[derive(Debug)]
pub(super) struct DeviceState {
    pub slots: Vec<TensorSlots>,
    /// The optimizer state, updated in place by the kernels.
    pub elem: Tensor,
    pub full: Tensor,
    pub row: Tensor,
    pub col: Tensor,
    /// Derived each step.
    row_factor: Tensor,
    col_factor: Tensor,
    /// Row sums | column sums | batch sums | feature sums, zeroed at the start of each step.
    scratch: Tensor,
    scratch_at: [usize; 4],
    /// Deterministic steps: the feature sums of each chunk of a group (`FEATURES` per chunk).
    chunk_sums: Tensor,
    meta: Tensor,
    groups: Vec<Group>,
}

/// The tensors a step locks, in order: their positions in the list of device addresses that
/// `launch_step` receives. The groups' chunk tables, their tile tables, their chunk starts and
/// then the (gradient, parameter) pairs follow.
#[derive(Debug, Clone, Copy)]
enum Locked {
    Elem,
    Full,
    Row,
    Col,
    RowFactor,
    ColFactor,
    Scratch,
    ChunkSums,
    Meta,
    Mlp,
}
const FIXED_LOCKED: usize = Locked::Mlp as usize + 1;

/// The update pass's kernel. The tensor-core MLP splits the f16 operands of both layers (tuning
/// builds may choose fewer: `FASTOPS_LOPT_SPLIT`, bit 1 the input layer, bit 0 the hidden
/// layer); with both split, on compute capability 9.0, its products run on wgmma
/// (`lopt_update_wgmma`, `src/cuda/sm90/small_fc_lopt.cu`, the same contract) unless
/// `CANDLE_FASTOPS_LOPT_KERNELS=portable` (read once per process; the test suite runs both).
fn update_kernel(dev: &candle_core::CudaDevice, backend: Backend) -> Result<Kernel> {
    if !backend.tensor_cores {
        return Kernel::load(dev, Module::SmallFcLOpt, &["lopt_update_fma"]);
    }
    static HOPPER_CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let hopper_chosen = *HOPPER_CHOSEN
        .get_or_init(|| std::env::var("CANDLE_FASTOPS_LOPT_KERNELS").as_deref() != Ok("portable"));
    let split = crate::cuda::tuning("FASTOPS_LOPT_SPLIT").unwrap_or(3) & 3;
    // Tuning builds: FASTOPS_LOPT_WGMMA=0 takes the portable kernel (A/B jobs in one binary).
    let wgmma = crate::cuda::tuning("FASTOPS_LOPT_WGMMA").unwrap_or(1);
    if split == 3 && hopper_chosen && wgmma != 0 && crate::cuda::is_hopper(dev)? {
        return Kernel::load(dev, Module::SmallFcLOptSm90, &["lopt_update_wgmma"]);
    }
    Kernel::load(
        dev,
        Module::SmallFcLOpt,
        &["lopt_update_mma", ["00", "01", "10", "11"][split as usize]],
    )
}

/// The blocks of `lopt_square_sums_ordered` for a matrix: its row sums, then its column sums,
/// 8 sums per block over a contiguous axis (a warp each), 32 over a strided one.
fn ordered_sum_blocks(meta: &LoptMeta) -> usize {
    let blocks = |count: u64, inner: &Divisor| {
        let per_block = if inner.d == 1 { THREADS / 32 } else { 32 };
        count.div_ceil(per_block as u64) as usize
    };
    if meta.factored == 0 {
        return 0;
    }
    blocks(meta.rows, &meta.inner0) + blocks(meta.cols, &meta.inner1)
}

/// Uploads `items` (padding-free repr(C) structs) as a u32 tensor.
fn upload<T: bytemuck::Pod>(items: &[T], dev: &Device) -> Result<Tensor> {
    let data: Vec<u32> = bytemuck::cast_slice::<T, u32>(items).to_vec();
    let words = data.len();
    if data.is_empty() {
        return Tensor::zeros(1, DType::U32, dev);
    }
    Tensor::from_vec(data, words, dev)
}

impl DeviceState {
    /// Lays out the zero-initialised state of tensors of the given shapes on `dev`.
    pub fn new(shapes: &[TensorShape], dev: &Device) -> Result<Self> {
        if shapes.len() > u32::MAX as usize {
            bail!("{OP}: too many tensors");
        }
        let (mut elem, mut full, mut row, mut col) = (0usize, 0usize, 0usize, 0usize);
        let (mut row_sums, mut col_sums, mut batches) = (0usize, 0usize, 0usize);
        let mut slots = Vec::with_capacity(shapes.len());
        let mut metas = Vec::with_capacity(shapes.len());
        for (shape, axes) in shapes {
            let n: usize = shape.iter().product();
            let mut meta = LoptMeta {
                n: n as u64,
                elem: elem as u64,
                wide: (n > u32::MAX as usize) as u32,
                ..Default::default()
            };
            let kind = match axes {
                Some((d0, d1)) => {
                    let stride = |d: usize| shape[d + 1..].iter().product::<usize>();
                    let mut row_shape = shape.clone();
                    row_shape[*d0] = 1;
                    let mut col_shape = shape.clone();
                    col_shape[*d1] = 1;
                    let rows: usize = row_shape.iter().product();
                    let cols: usize = col_shape.iter().product();
                    // Batches of the row accumulator: the row shape with d1 removed as well.
                    let row_stride1 = row_shape[d1 + 1..].iter().product::<usize>();
                    let batch_count = rows / shape[*d1].max(1);
                    meta.row = row as u64;
                    meta.col = col as u64;
                    meta.row_sum = row_sums as u64;
                    meta.col_sum = col_sums as u64;
                    meta.batch = batches as u64;
                    meta.rows = rows as u64;
                    meta.cols = cols as u64;
                    meta.batches = batch_count as u64;
                    meta.inner0 = Divisor::new(stride(*d0));
                    meta.outer0 = Divisor::new(stride(*d0) * shape[*d0]);
                    meta.inner1 = Divisor::new(stride(*d1));
                    meta.outer1 = Divisor::new(stride(*d1) * shape[*d1]);
                    meta.row_inner1 = Divisor::new(row_stride1);
                    meta.row_outer1 = Divisor::new(row_stride1 * shape[*d1]);
                    meta.inv_size0 = 1.0 / shape[*d0] as f32;
                    meta.inv_size1 = 1.0 / shape[*d1] as f32;
                    meta.factored = 1;
                    meta.tiled = (shape.len() == 2
                        && shape[1] >= TILE_MIN_COLS
                        && shape[1] <= u32::MAX as usize) as u32;
                    let kind = SlotKind::Matrix {
                        row,
                        row_shape,
                        col,
                        col_shape,
                    };
                    row += 3 * rows;
                    col += 3 * cols;
                    row_sums += rows;
                    col_sums += cols;
                    batches += 3 * batch_count;
                    kind
                }
                None => {
                    meta.full = full as u64;
                    let kind = SlotKind::Vector { full };
                    full += 3 * n;
                    kind
                }
            };
            slots.push(TensorSlots { n, elem, kind });
            metas.push(meta);
            elem += 4 * n;
        }
        let zeros = |len: usize| Tensor::zeros(len.max(1), DType::F32, dev);
        let scratch_at = [
            0,
            row_sums,
            row_sums + col_sums,
            row_sums + col_sums + batches,
        ];
        let scratch_len = scratch_at[3] + FEATURES * shapes.len();
        let mut groups = Vec::new();
        let mut max_chunks = 0;
        for first in (0..shapes.len()).step_by(GROUP) {
            let count = GROUP.min(shapes.len() - first);
            let chunks: Vec<Chunk> = (first..first + count)
                .flat_map(|t| {
                    (0..slots[t].n).step_by(CHUNK).map(move |start| Chunk {
                        tensor: t as u32,
                        pad: 0,
                        start: start as u64,
                    })
                })
                .collect();
            let mut tiles = Vec::new();
            for t in first..first + count {
                if metas[t].tiled == 0 {
                    continue;
                }
                let (shape, axes) = &shapes[t];
                let (rows, cols) = (shape[0], shape[1]);
                for row_start in (0..rows).step_by(TILE_ROWS) {
                    for col_start in (0..cols).step_by(TILE_COLS) {
                        tiles.push(SumTile {
                            tensor: t as u32,
                            rows: TILE_ROWS.min(rows - row_start) as u32,
                            row_start: row_start as u64,
                            col_start: col_start as u32,
                            cols: cols as u32,
                            rows_into_col_sum: matches!(axes, Some((0, _))) as u32,
                            pad: 0,
                        });
                    }
                }
            }
            if chunks.len() > u32::MAX as usize || tiles.len() > u32::MAX as usize {
                bail!("{OP}: too many chunks in one launch");
            }
            let mut chunk_starts = vec![0u32];
            for slot in &slots[first..first + count] {
                let last = *chunk_starts.last().unwrap_or(&0);
                chunk_starts.push(last + slot.n.div_ceil(CHUNK) as u32);
            }
            let ordered_blocks = metas[first..first + count]
                .iter()
                .map(ordered_sum_blocks)
                .max()
                .unwrap_or(0);
            max_chunks = max_chunks.max(chunks.len());
            groups.push(Group {
                first,
                count,
                n_chunks: chunks.len() as u32,
                chunks: upload(&chunks, dev)?,
                n_tiles: tiles.len() as u32,
                chunked_matrices: (first..first + count)
                    .any(|t| metas[t].factored != 0 && metas[t].tiled == 0),
                matrices: (first..first + count).any(|t| metas[t].factored != 0),
                ordered_blocks,
                chunk_starts: upload(&chunk_starts, dev)?,
                tiles: upload(&tiles, dev)?,
            });
        }
        Ok(Self {
            slots,
            elem: zeros(elem)?,
            full: zeros(full)?,
            row: zeros(row)?,
            col: zeros(col)?,
            row_factor: zeros(row)?,
            col_factor: zeros(col)?,
            scratch: zeros(scratch_len)?,
            scratch_at,
            chunk_sums: zeros(max_chunks * FEATURES)?,
            meta: upload(&metas, dev)?,
            groups,
        })
    }

    /// One step. `work[i]` is tensor i's (gradient, parameter), both contiguous f32 with the
    /// tensor's element count, or `None` to leave the tensor untouched; the parameter is
    /// overwritten with its new value.
    pub fn step(
        &self, work: &[Option<(Tensor, Tensor)>], decays: Decays, mlp: &Tensor, hyper: Hyper,
        backend: Backend,
    ) -> Result<()> {
        let Device::Cuda(dev) = self.elem.device() else {
            bail!("{OP}: internal error, the flat state is not on a GPU");
        };
        debug_assert_eq!(work.len(), self.slots.len());
        debug_assert_eq!(mlp.elem_count(), MLP_FLOATS);
        // Every tensor the kernels touch, in a fixed order: the state buffers and the parameters
        // are written (write-locked through candle's in-place path), the rest only read.
        let fixed: [(&Tensor, bool); FIXED_LOCKED] = [
            (&self.elem, true),
            (&self.full, true),
            (&self.row, true),
            (&self.col, true),
            (&self.row_factor, true),
            (&self.col_factor, true),
            (&self.scratch, true),
            (&self.chunk_sums, true),
            (&self.meta, false),
            (mlp, false),
        ];
        let mut tensors = fixed.to_vec();
        tensors.extend(self.groups.iter().map(|g| (&g.chunks, false)));
        tensors.extend(self.groups.iter().map(|g| (&g.tiles, false)));
        tensors.extend(self.groups.iter().map(|g| (&g.chunk_starts, false)));
        for (g, p) in work.iter().flatten() {
            tensors.push((g, false));
            tensors.push((p, true));
        }
        crate::cuda::locks::with_locked_addresses(OP, dev, &tensors, |views| {
            self.launch_step(dev, work, views, decays, hyper, backend)
        })
    }

    /// The launches of [`Self::step`], given the device address of each tensor's first element
    /// (in `step`'s order), all held locked by the caller.
    fn launch_step(
        &self, dev: &candle_core::CudaDevice, work: &[Option<(Tensor, Tensor)>], views: &[u64],
        decays: Decays, hyper: Hyper, backend: Backend,
    ) -> Result<()> {
        let ptr = |i: usize| views[i];
        let fixed = |slot: Locked| views[slot as usize];
        let scratch = fixed(Locked::Scratch);
        let at = |k: usize| scratch + 4 * self.scratch_at[k] as u64;
        let buffers = Buffers {
            elem: fixed(Locked::Elem),
            full: fixed(Locked::Full),
            row: fixed(Locked::Row),
            col: fixed(Locked::Col),
            row_factor: fixed(Locked::RowFactor),
            col_factor: fixed(Locked::ColFactor),
            row_sum: at(0),
            col_sum: at(1),
            batch_sum: at(2),
            feat_sum: at(3),
        };
        let (meta, mlp_ptr) = (fixed(Locked::Meta), fixed(Locked::Mlp));
        let chunk_sums = if backend.deterministic {
            fixed(Locked::ChunkSums)
        } else {
            0
        };
        let chunk_ptrs = FIXED_LOCKED;
        let tile_ptrs = chunk_ptrs + self.groups.len();
        let start_ptrs = tile_ptrs + self.groups.len();
        let mut step_ptrs = Vec::with_capacity(self.slots.len());
        let mut next = start_ptrs + self.groups.len();
        for w in work {
            step_ptrs.push(match w {
                Some(_) => {
                    next += 2;
                    (ptr(next - 2), ptr(next - 1))
                }
                None => (0, 0),
            });
        }
        let scratch_bytes = 4 * self.scratch.elem_count();
        // SAFETY: `scratch` addresses the scratch tensor's f32 elements (write-locked by the
        // caller; only this step's kernels use it, on the device's stream).
        unsafe { crate::cuda::fill_bytes_at(dev, scratch, scratch_bytes, 0) }?;
        let square_sums = Kernel::load(dev, Module::SmallFcLOpt, &["lopt_square_sums"])?;
        let square_sums_tiled =
            Kernel::load(dev, Module::SmallFcLOpt, &["lopt_square_sums_tiled"])?;
        let factors = Kernel::load(dev, Module::SmallFcLOpt, &["lopt_factors"])?;
        let stats = Kernel::load(dev, Module::SmallFcLOpt, &["lopt_stats"])?;
        let square_sums_ordered =
            Kernel::load(dev, Module::SmallFcLOpt, &["lopt_square_sums_ordered"])?;
        let chunk_sums_kernel = Kernel::load(dev, Module::SmallFcLOpt, &["lopt_chunk_sums"])?;
        let deterministic = backend.deterministic as u32;
        let update = update_kernel(dev, backend)?;
        // Grid caps (resident blocks of each kernel), queried once per step.
        let sms = crate::cuda::sm_count(dev)?;
        let cap = |kernel: &Kernel| -> Result<u32> {
            Ok(sms * kernel.resident_blocks_per_sm(THREADS, 0)?)
        };
        let caps = [
            cap(&square_sums)?,
            cap(&factors)?,
            cap(&stats)?,
            cap(&update)?,
            cap(&square_sums_tiled)?,
        ];
        let grid = |cap: u32, blocks: u32| LaunchConfig {
            grid_dim: (blocks.clamp(1, cap), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        for (gi, group) in self.groups.iter().enumerate() {
            let mut tensors = StepTensors {
                grad: [0; GROUP],
                param: [0; GROUP],
            };
            for (k, &(g, p)) in step_ptrs[group.first..group.first + group.count]
                .iter()
                .enumerate()
            {
                tensors.grad[k] = g;
                tensors.param[k] = p;
            }
            if tensors.grad.iter().all(|&g| g == 0) {
                continue;
            }
            let (chunks, tiles) = (ptr(chunk_ptrs + gi), ptr(tile_ptrs + gi));
            let chunk_starts = ptr(start_ptrs + gi);
            let (first, count, n_chunks) = (group.first as u32, group.count as u32, group.n_chunks);
            let n_tiles = group.n_tiles;
            // SAFETY (all four launches): the arguments match the kernels' signatures; `meta`
            // and `chunks` are the tables built for these tensors, every address in `tensors`
            // is a live contiguous f32 buffer of its tensor's element count, and the state,
            // factor and scratch buffers were sized from the same table.
            unsafe {
                if backend.deterministic && group.matrices {
                    let blocks_x = group.ordered_blocks;
                    if blocks_x > i32::MAX as usize {
                        bail!("{OP}: a matrix has too many rows and columns");
                    }
                    let cfg = LaunchConfig {
                        grid_dim: (blocks_x as u32, count, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    square_sums_ordered
                        .launch(cfg, kernel_args!(&meta, &first, &tensors, &buffers))?;
                }
                if group.chunked_matrices && !backend.deterministic {
                    let runs = n_chunks.div_ceil(SQUARE_SUM_RUN);
                    square_sums.launch(
                        grid(caps[0], runs),
                        kernel_args!(&meta, &chunks, &n_chunks, &first, &tensors, &buffers),
                    )?;
                }
                if n_tiles > 0 && !backend.deterministic {
                    square_sums_tiled.launch(
                        grid(caps[4], n_tiles),
                        kernel_args!(&meta, &tiles, &n_tiles, &first, &tensors, &buffers),
                    )?;
                }
                factors.launch(
                    grid(caps[1], count),
                    kernel_args!(
                        &meta,
                        &first,
                        &count,
                        &tensors,
                        &buffers,
                        &decays,
                        &deterministic
                    ),
                )?;
                stats.launch(
                    grid(caps[2], n_chunks),
                    kernel_args!(
                        &meta,
                        &chunks,
                        &n_chunks,
                        &first,
                        &tensors,
                        &buffers,
                        &decays,
                        &chunk_sums
                    ),
                )?;
                if backend.deterministic {
                    chunk_sums_kernel.launch(
                        grid(caps[1], count),
                        kernel_args!(
                            &chunk_starts,
                            &first,
                            &count,
                            &tensors,
                            &buffers,
                            &chunk_sums
                        ),
                    )?;
                }
                update.launch(
                    grid(caps[3], n_chunks),
                    kernel_args!(
                        &meta, &chunks, &n_chunks, &first, &tensors, &buffers, &mlp_ptr, &decays,
                        &hyper
                    ),
                )?;
            }
        }
        Ok(())
    }
}
