use crate::cuda::{alloc_output, kernel_args, sm_count, tuning, FastDiv, Kernel, Module};
use crate::dispatch::mirrored_struct;
use crate::softmax::plan::{Block, ReducePlan, MAX_BLOCKS};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::{bail, CudaDevice, Result, WithDType};

/// Mirrors `ReduceLayout` in `softmax.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ReduceLayout {
    n_kept: u32,
    n_reduced: u32,
    kept_div: [FastDiv; MAX_BLOCKS],
    kept_stride: [u64; MAX_BLOCKS],
    reduced_div: [FastDiv; MAX_BLOCKS],
    reduced_stride: [u64; MAX_BLOCKS],
    lanes: FastDiv,
    num_groups: u32,
    group_size: u32,
}
// Mirrored by `ReduceLayout` in src/cuda/softmax.cu.
mirrored_struct!(ReduceLayout, 272, kernel_arg);

fn blocks_to_arrays(blocks: &[Block]) -> ([FastDiv; MAX_BLOCKS], [u64; MAX_BLOCKS]) {
    let mut divs = [FastDiv::default(); MAX_BLOCKS];
    let mut strides = [0u64; MAX_BLOCKS];
    for (i, b) in blocks.iter().enumerate() {
        divs[i] = FastDiv::new(b.size);
        strides[i] = b.stride as u64;
    }
    (divs, strides)
}

impl ReduceLayout {
    /// The plan's layout with group elements counted in units of `width` adjacent elements
    /// (the innermost reduced block must be contiguous and a multiple of `width` long).
    fn new(plan: &ReducePlan, width: usize) -> Self {
        let (kept_div, kept_stride) = blocks_to_arrays(plan.kept_blocks());
        let mut reduced = plan.reduced_blocks().to_vec();
        if let Some(inner) = reduced.last_mut() {
            inner.size /= width;
            inner.stride *= width;
        }
        let (reduced_div, reduced_stride) = blocks_to_arrays(&reduced);
        Self {
            n_kept: plan.kept_blocks().len() as u32,
            n_reduced: plan.reduced_blocks().len() as u32,
            kept_div,
            kept_stride,
            reduced_div,
            reduced_stride,
            lanes: FastDiv::new(plan.lanes()),
            num_groups: plan.num_groups() as u32,
            group_size: (plan.group_size() / width) as u32,
        }
    }
}

/// How a kernel thread moves data (see `softmax.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Scalar,
    /// 16-byte vectors of `n` elements along one group's contiguous run.
    Vec(usize),
    /// `LANE_WIDTH` adjacent groups' elements per access.
    Lanes,
}

use crate::kernel_constants::softmax::{
    CACHED_ELEMENTS, CACHED_VECTORS, LANE_WIDTH, ROW_BLOCK_MAX_THREADS, ROW_BLOCK_VECTORS,
    STAGED_BYTES, THREADS,
};

/// Contiguous rows of at least this many 16-byte vectors take a block each (`_row_block`);
/// shorter ones share a block in the `_cached` kernel.
const ROW_BLOCK_MIN_VECTORS: usize = 128;
/// Bytes of one staged run: the `_staged` kernel gives each block adjacent groups whose
/// elements span this many contiguous bytes (two sectors) per step when their shared memory
/// allows, and at least one sector (32 bytes).
const STAGED_RUN_BYTES: usize = 64;
const SECTOR_BYTES: usize = 32;

/// Column groups up to this size fit in the scalar kernels' registers (16 values x 8 y
/// threads) and run faster there than in the lanes form, whose four accumulators cost four
/// block reductions (BENCHMARKS.md, softmax).
const SCALAR_COLUMN_CACHE: usize = CACHED_ELEMENTS * MAX_COLUMN_LY;

/// Most y threads per column-like group, so a warp still reads whole sectors.
const MAX_COLUMN_LY: usize = 8;
/// Fewest elements a thread should stream per chunk before splitting groups pays.
const MIN_ELEMS_PER_THREAD: usize = 64;

/// `xs_start` is the element offset of `xs` in its allocation, for the alignment check of
/// the 16-byte path.
pub(super) fn launch_softmax<T: WithDType>(
    dev: &CudaDevice, plan: &ReducePlan, log: bool, xs: &CudaView<'_, T>, xs_start: usize,
    ys: &CudaSlice<T>,
) -> Result<()> {
    let (groups, lanes) = (plan.num_groups(), plan.lanes());
    if groups == 0 || plan.group_size() == 0 {
        return Ok(());
    }
    if groups >= 1 << 31 || plan.group_size() >= 1 << 31 {
        bail!("softmax_dims: groups of 2^31 or more elements, or 2^31 or more groups, are not supported on CUDA");
    }
    // Row-like groups whose innermost run is contiguous, a whole number of 16-byte vectors
    // long and 16-byte aligned move 16 bytes per access ("vec"); column-like groups whose
    // lane count is a multiple of 4 move 4 adjacent groups' elements per access ("lanes").
    let elem = std::mem::size_of::<T>();
    let vec_width = 16 / elem;
    let inner = plan
        .reduced_blocks()
        .last()
        .copied()
        .unwrap_or(Block { size: 1, stride: 1 });
    let form = if lanes == 1
        && inner.stride == 1
        && inner.size.is_multiple_of(vec_width)
        && (xs_start * elem).is_multiple_of(16)
    {
        Form::Vec(vec_width)
    } else if lanes > 1
        && lanes.is_multiple_of(LANE_WIDTH)
        && xs_start.is_multiple_of(LANE_WIDTH)
        && plan.group_size() > SCALAR_COLUMN_CACHE
    {
        Form::Lanes
    } else {
        Form::Scalar
    };
    // Units the kernel counts: elements of a group (j) and groups (x).
    let (size, group_units) = match form {
        Form::Vec(w) => (plan.group_size() / w, groups),
        Form::Lanes => (plan.group_size(), groups / LANE_WIDTH),
        Form::Scalar => (plan.group_size(), groups),
    };
    let mut layout = ReduceLayout::new(plan, if let Form::Vec(w) = form { w } else { 1 });
    let prefix = if log { "log_softmax" } else { "softmax" };
    // SAFETY (every launch below): the arguments match the kernel's signature; every access
    // is bounded by num_groups and group_size, whose offsets lie inside xs / ys by
    // construction of the plan for this shape.
    let contiguous_rows = plan.reduced_blocks().len() == 1 && inner.stride == 1;
    if matches!(form, Form::Vec(_))
        && contiguous_rows
        && (ROW_BLOCK_MIN_VECTORS..=ROW_BLOCK_VECTORS * ROW_BLOCK_MAX_THREADS).contains(&size)
    {
        // A block per row, each thread holding ROW_BLOCK_VECTORS vectors: one read, one write,
        // no persistent loop (a resident wave walking the rows measured 14% slower: BENCHMARKS.md).
        let threads = size.div_ceil(ROW_BLOCK_VECTORS).next_multiple_of(32);
        let cfg = LaunchConfig {
            grid_dim: (groups as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernel = Kernel::load_typed::<T>(dev, Module::Softmax, &[prefix, "row_block_vec"])?;
        return unsafe { kernel.launch(cfg, kernel_args!(xs, ys, &layout)) };
    }
    if form == Form::Lanes {
        // Column-like groups staged in shared memory when a run of at least a sector fits.
        let unit = LANE_WIDTH * elem;
        // The offset table (u32: the kernel needs every element's offset from its group's
        // first below 2^32), the staged units and the pairs.
        let span: usize = plan
            .reduced_blocks()
            .iter()
            .map(|b| (b.size - 1) * b.stride)
            .sum();
        let offsets_fit = span < 1 << 32;
        let shared_bytes =
            |lx: usize| (size * 4).next_multiple_of(16) + size * lx * unit + THREADS * 8;
        let lx = [STAGED_RUN_BYTES / unit, SECTOR_BYTES / unit]
            .into_iter()
            .find(|&lx| lx >= 1 && offsets_fit && shared_bytes(lx) <= STAGED_BYTES);
        if let Some(lx) = lx {
            let shared = shared_bytes(lx);
            let cfg = LaunchConfig {
                grid_dim: (group_units.div_ceil(lx) as u32, 1, 1),
                block_dim: (lx as u32, (THREADS / lx) as u32, 1),
                shared_mem_bytes: shared as u32,
            };
            layout.num_groups = group_units as u32;
            let kernel = Kernel::load_typed::<T>(dev, Module::Softmax, &[prefix, "staged_lanes"])?;
            kernel.allow_dynamic_shared(shared)?;
            return unsafe { kernel.launch(cfg, kernel_args!(xs, ys, &layout)) };
        }
    }
    let variant = match form {
        Form::Vec(_) => "vec",
        Form::Lanes => "lanes",
        Form::Scalar => "",
    };
    // Units per thread that fit in the `_cached` kernels' registers (the other kernels size
    // their blocks alike).
    let per_thread = if form == Form::Scalar {
        CACHED_ELEMENTS
    } else {
        CACHED_VECTORS
    };
    let max_ly = if lanes > 1 { MAX_COLUMN_LY } else { THREADS };
    let ly = size.div_ceil(per_thread).next_power_of_two().min(max_ly);
    let lx = THREADS / ly;
    if form != Form::Lanes && size <= per_thread * ly {
        // One read: persistent blocks, as many as fit on the device, walk the columns.
        // Rows: one resident wave that walks the columns, prefetching
        // (FASTOPS_SOFTMAX_BLOCKS_PER_SM overrides its size). Column-like groups: a block per
        // column (faster there: BENCHMARKS.md, softmax).
        let walk = if lanes == 1 { "rows" } else { "cols" };
        let kernel =
            Kernel::load_typed::<T>(dev, Module::Softmax, &[prefix, "cached", walk, variant])?;
        let columns = group_units.div_ceil(lx);
        let blocks = if lanes == 1 {
            let resident = kernel.resident_blocks_per_sm(THREADS as u32, lx * ly * 8)? as usize;
            let per_sm = tuning("FASTOPS_SOFTMAX_BLOCKS_PER_SM").map_or(resident, |b| b as usize);
            columns.min(per_sm.max(1) * sm_count(dev)? as usize)
        } else {
            columns
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (lx as u32, ly as u32, 1),
            shared_mem_bytes: (lx * ly * 8) as u32,
        };
        let columns = columns as u32;
        // SAFETY: arguments match `softmax_cached`; it touches only groups < num_groups and
        // elements < group_size, inside xs / ys by construction of the plan.
        return unsafe { kernel.launch(cfg, kernel_args!(xs, ys, &layout, &columns)) };
    }
    let blocks_x = group_units.div_ceil(lx);
    let target_blocks = 4 * sm_count(dev)? as usize;
    let mut chunks = 1;
    if blocks_x < target_blocks {
        chunks = target_blocks
            .div_ceil(blocks_x)
            .min((size / (ly * MIN_ELEMS_PER_THREAD)).max(1));
    }
    let chunk_len = size.div_ceil(chunks);
    let chunks = size.div_ceil(chunk_len);
    let cfg = LaunchConfig {
        grid_dim: (blocks_x as u32, chunks as u32, 1),
        block_dim: (lx as u32, ly as u32, 1),
        shared_mem_bytes: (lx * ly * 8) as u32,
    };
    if form == Form::Lanes {
        layout.num_groups = group_units as u32;
    }
    let chunk_len = chunk_len as u32;
    // SAFETY (all launches): arguments match the kernels' signatures; every access is
    // bounded by num_groups and group_size, whose offsets lie inside xs / ys by construction
    // of the plan for this shape.
    if chunks == 1 {
        let kernel = Kernel::load_typed::<T>(dev, Module::Softmax, &[prefix, "fused", variant])?;
        return unsafe { kernel.launch(cfg, kernel_args!(xs, ys, &layout, &chunk_len)) };
    }
    let partials = alloc_output::<f32>(dev, 2 * groups * chunks)?;
    let partial = Kernel::load_typed::<T>(dev, Module::Softmax, &["softmax_partial", variant])?;
    unsafe {
        partial.launch(cfg, kernel_args!(xs, &partials, &layout, &chunk_len))?;
    }
    let finish = Kernel::load_typed::<T>(dev, Module::Softmax, &[prefix, "finish", variant])?;
    unsafe { finish.launch(cfg, kernel_args!(xs, ys, &partials, &layout, &chunk_len)) }
}
