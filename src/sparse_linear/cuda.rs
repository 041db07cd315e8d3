use super::{Features, OP};
use crate::cuda::{grid_stride_config, kernel_args, l2_bytes, sm_count, tuning, Kernel, Module};
use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::{bail, CudaDevice, Result, Storage, StorageRef, WithDType};

/// Mirrors `SparseShape` in `src/cuda/sparse_linear.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SparseShape {
    error_flag: u64,
    batch: u64,
    num_inputs: u64,
    out_dim: u64,
    index_stride: u64,
    weight_stride: u64,
    stripe_begin: u64,
    stripe_end: u64,
    max_active: u32,
    perspectives: u32,
    ceiling: f32,
    clamped: u32,
}
// Mirrored by `SparseShape` in src/cuda/sparse_linear.cu.
mirrored_struct!(SparseShape, 80, kernel_arg);

/// Kernel name stems of the forward and backward.
const FWD: &str = "sparse_linear_fwd";
const BWD: &str = "sparse_linear_bwd";
const THREADS: u32 = crate::kernel_constants::sparse_linear::THREADS as u32;
const WARPS_PER_BLOCK: u64 = (THREADS / 32) as u64;

/// How a kernel is launched: its variant, the width of its column stripes, and how many
/// stripes one launch covers.
struct StripePlan {
    variant: &'static str,
    stripes: usize,
    stripes_per_launch: usize,
    blocks_per_sm: u32,
}

impl StripePlan {
    /// `elem` is the size of the matrix the stripes cut (weight forward, f32 gradient
    /// backward), `group` its columns per 16-byte (vector) or 4-byte (scalar) access and
    /// `loads` the 16-byte accesses per lane and row (1 or 2; the H200 sweeps in
    /// BENCHMARKS.md favour 1 for f32, 2 for 2-byte weights). A launch covers as many stripes
    /// as fit in the L2 with all their rows.
    fn new(
        dev: &CudaDevice, f: &Features, (vec, group, elem): (bool, usize, usize), loads: u32,
        blocks_per_sm: u32,
    ) -> Result<Self> {
        let loads = tuning("FASTOPS_SPARSE_LOADS").unwrap_or(loads).clamp(1, 2) as usize;
        let (variant, stripe_cols) = match (vec, loads) {
            (false, _) => ("scalar", 32 * 4),
            (true, 1) => ("vec1", 32 * group),
            (true, _) => ("vec2", 64 * group),
        };
        let stripes = f.out.div_ceil(stripe_cols);
        let budget = match tuning("FASTOPS_SPARSE_L2_BUDGET_MB") {
            Some(0) => usize::MAX,
            Some(mb) => (mb as usize) << 20,
            None => l2_bytes(dev)?,
        };
        let stripe_bytes = f.num_inputs.max(1).saturating_mul(stripe_cols * elem);
        let stripes_per_launch = (budget / stripe_bytes).clamp(1, stripes.max(1));
        Ok(Self {
            variant,
            stripes,
            stripes_per_launch,
            blocks_per_sm: tuning("FASTOPS_SPARSE_BLOCKS_PER_SM").unwrap_or(blocks_per_sm),
        })
    }

    fn config(&self, dev: &CudaDevice, tasks: u64) -> Result<LaunchConfig> {
        let wanted = tasks.div_ceil(WARPS_PER_BLOCK).max(1);
        let cap = sm_count(dev)? as u64 * self.blocks_per_sm.max(1) as u64;
        Ok(LaunchConfig {
            grid_dim: (wanted.min(cap) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// `[begin, end)` of each launch's stripes.
    fn launches(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.stripes).step_by(self.stripes_per_launch).map(|b| {
            (
                b as u64,
                (b + self.stripes_per_launch).min(self.stripes) as u64,
            )
        })
    }
}

/// Device views of a call's feature tensors, borrowed for one launch.
struct FeatureViews<'a> {
    locks: Vec<Option<StorageRef<'a>>>,
    starts: Vec<usize>,
}

impl<'a> FeatureViews<'a> {
    fn new(f: &'a Features) -> Self {
        let mut tensors: Vec<Option<&candle_core::Tensor>> = Vec::with_capacity(5);
        for p in 0..2 {
            tensors.push(f.sides.get(p).map(|s| &s.indices));
        }
        for p in 0..2 {
            tensors.push(f.sides.get(p).and_then(|s| s.values.as_ref()));
        }
        tensors.push(f.side_first.as_ref());
        let mut locks = Vec::with_capacity(5);
        let mut starts = Vec::with_capacity(5);
        for t in tensors {
            match t {
                Some(t) => {
                    let (storage, layout) = t.storage_and_layout();
                    starts.push(layout.start_offset());
                    locks.push(Some(storage));
                }
                None => {
                    starts.push(0);
                    locks.push(None);
                }
            }
        }
        Self { locks, starts }
    }

    fn view<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
        &self, slot: usize,
    ) -> Result<Option<CudaView<'_, T>>> {
        match &self.locks[slot] {
            None => Ok(None),
            Some(storage) => match &**storage {
                Storage::Cuda(s) => Ok(Some(s.as_cuda_slice::<T>()?.slice(self.starts[slot]..))),
                _ => bail!("{OP}: internal error, a feature tensor is not on the GPU"),
            },
        }
    }
}

/// The feature tensors as kernel arguments (absent ones as null pointers).
struct FeatureArgs<'a> {
    indices: [Option<CudaView<'a, i32>>; 2],
    values: [Option<CudaView<'a, f32>>; 2],
    side_first: Option<CudaView<'a, u8>>,
    null: u64,
}

impl<'a> FeatureArgs<'a> {
    fn new(views: &'a FeatureViews<'_>) -> Result<Self> {
        Ok(Self {
            indices: [views.view::<i32>(0)?, views.view::<i32>(1)?],
            values: [views.view::<f32>(2)?, views.view::<f32>(3)?],
            side_first: views.view::<u8>(4)?,
            null: 0,
        })
    }

    /// Pushes the arguments shared by both kernels: shape, idx0, idx1, val0, val1, stm.
    fn push<'s>(&'s self, args: &mut LaunchArgs<'s>, shape: &'s SparseShape) {
        args.arg(shape);
        for view in &self.indices {
            match view {
                Some(v) => args.arg(v),
                None => args.arg(&self.null),
            };
        }
        for view in &self.values {
            match view {
                Some(v) => args.arg(v),
                None => args.arg(&self.null),
            };
        }
        match &self.side_first {
            Some(v) => args.arg(v),
            None => args.arg(&self.null),
        };
    }
}

/// The kernels' shape arguments; `error_flag` is the device address of the call's bad-index
/// word (0: bad indices are skipped unreported).
fn shape(
    f: &Features, error_flag: u64, weight_stride: usize, stripe_begin: u64, stripe_end: u64,
) -> Result<SparseShape> {
    Ok(SparseShape {
        error_flag,
        batch: f.batch as u64,
        num_inputs: f.num_inputs as u64,
        out_dim: f.out as u64,
        index_stride: f.max_active as u64,
        weight_stride: weight_stride as u64,
        stripe_begin,
        stripe_end,
        max_active: u32::try_from(f.max_active)
            .map_err(|_| candle_core::Error::Msg(format!("{OP}: max_active too large")))?,
        perspectives: f.sides.len() as u32,
        ceiling: f.clip_ceiling.unwrap_or(0.0),
        clamped: u32::from(f.clip_ceiling.is_some()),
    })
}

/// `launch_striped!(dev, f, plan, stem, weight_stride, |args| tail)`: launches the `stem`
/// kernel of `plan` for `T` once per L2-sized range of stripes, `tail` pushing the arguments
/// after the shape and the features; with `f.check_indices` (forward only) a bad index makes
/// it return the error, after one synchronisation. A macro because the tail borrows the
/// caller's buffers for the launch's lifetime. The caller states the safety of the tail.
macro_rules! launch_striped {
    ($t:ty, $dev:expr, $f:expr, $plan:expr, $stem:expr, $weight_stride:expr, |$args:ident| $tail:expr) => {{
        let (dev, f, plan): (&CudaDevice, &Features, &StripePlan) = ($dev, $f, $plan);
        let tasks = (f.batch * f.sides.len()) as u64;
        if tasks == 0 || f.out == 0 {
            return Ok(());
        }
        let kernel = Kernel::load_typed::<$t>(dev, Module::SparseLinear, &[$stem, plan.variant])?;
        let cfg = plan.config(dev, tasks)?;
        let views = FeatureViews::new(f);
        let features = FeatureArgs::new(&views)?;
        // The call's own bad-index word, zeroed on the stream before the kernels.
        let flag = if f.check_indices && $stem == FWD {
            Some(dev.alloc_zeros::<u32>(1)?)
        } else {
            None
        };
        let stream = dev.cuda_stream();
        let flag_ptr = flag.as_ref().map(|flag| flag.device_ptr(&stream));
        let flag_addr = flag_ptr.as_ref().map_or(0, |(addr, _)| *addr);
        for (begin, end) in plan.launches() {
            let shape = shape(f, flag_addr, $weight_stride, begin, end)?;
            kernel.launch(cfg, |$args| {
                features.push($args, &shape);
                $tail;
            })?;
        }
        drop(flag_ptr);
        if let Some(flag) = flag {
            // One synchronisation: the copy waits for the kernels.
            if dev.clone_dtoh(&flag)?[0] != 0 {
                return Err(bad_index_error(f));
            }
        }
        Ok(())
    }};
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, weight: &CudaView<'_, T>, weight_start: usize,
    weight_stride: usize, bias: &CudaView<'_, T>, bias_start: usize, out: &CudaSlice<T>,
) -> Result<()> {
    let elem = std::mem::size_of::<T>();
    let width = 16 / elem;
    let vec = [f.out, weight_stride, weight_start, bias_start]
        .iter()
        .all(|&n| n % width == 0);
    // 72-96 registers per thread leave room for 2-3 blocks of 256 per SM (H200 sweeps in
    // BENCHMARKS.md: 3 for f32 with one load per lane, 2 for 2-byte weights with two).
    let (loads, blocks) = if elem == 4 { (1, 3) } else { (2, 2) };
    let plan = StripePlan::new(dev, f, (vec, width, elem), loads, blocks)?;
    // SAFETY: the arguments match `sparse_linear_fwd_*(shape, idx0, idx1, val0, val1,
    // side_first, weight, bias, out)`. Index rows hold max_active entries for batch rows, weight
    // rows are read only at indices checked against num_inputs, with weight_stride and out
    // columns inside the views, and out holds batch x perspectives x out elements.
    unsafe {
        launch_striped!(T, dev, f, &plan, FWD, weight_stride, |args| args
            .arg(weight)
            .arg(bias)
            .arg(out))
    }
}

/// The error for a call whose kernel raised the bad-index flag, naming the first bad index
/// (found on the host: this path is taken only for bad input).
fn bad_index_error(f: &Features) -> candle_core::Error {
    for side in &f.sides {
        let host = side
            .indices
            .flatten_all()
            .and_then(|t| t.to_device(&candle_core::Device::Cpu))
            .and_then(|t| t.to_vec1::<i32>());
        match host {
            Ok(host) => {
                if let Err(e) = super::validate_rows(&host, f.batch, f.max_active, f.num_inputs) {
                    return e;
                }
            }
            Err(e) => return e,
        }
    }
    candle_core::Error::Msg(format!(
        "{OP}: the kernel reported an index outside [-1, {}) that the host could not find",
        f.num_inputs
    ))
}

/// The backward's view of the forward output behind a fused clipped ReLU (`None`: no
/// activation), with its element offset in its buffer.
pub(super) type ActivationOutput<'a, T> = Option<(CudaView<'a, T>, usize)>;

/// The default (non-deterministic) backward: by feature (a list built on the GPU, each weight
/// gradient row written once) when the output gradient is not masked by a fused activation,
/// vector atomics per slot otherwise (BENCHMARKS.md, sparse_linear: the gather reads the
/// activation beside the gradient, which costs more than the atomics it saves).
/// `FASTOPS_SPARSE_BWD=1` forces the atomic form, `2` the gather (tuning builds).
pub(super) fn backward<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, grad_out: &CudaView<'_, T>, grad_start: usize,
    act_out: &ActivationOutput<'_, T>, grad: &CudaSlice<f32>,
) -> Result<()> {
    let entries = (f.batch * f.sides.len()).saturating_mul(f.max_active + 1);
    let gather = match tuning("FASTOPS_SPARSE_BWD") {
        Some(1) => false,
        Some(2) => true,
        _ => act_out.is_none(),
    };
    if gather && entries < u32::MAX as usize && f.num_inputs < u32::MAX as usize - 1 {
        backward_by_feature(dev, f, grad_out, grad_start, act_out, grad)
    } else {
        backward_atomic(dev, f, grad_out, grad_start, act_out, grad)
    }
}

/// Atomic backward: a warp per (position, perspective) adds value x output gradient into each
/// active feature's gradient row (16-byte atomics).
fn backward_atomic<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, grad_out: &CudaView<'_, T>, grad_start: usize,
    act_out: &ActivationOutput<'_, T>, grad: &CudaSlice<f32>,
) -> Result<()> {
    let act_start = act_out.as_ref().map_or(0, |(_, start)| *start);
    let vec =
        f.out.is_multiple_of(4) && grad_start.is_multiple_of(4) && act_start.is_multiple_of(4);
    let plan = StripePlan::new(dev, f, (vec, 4, 4), 1, 4)?;
    let null = 0u64;
    // SAFETY: the arguments match `sparse_linear_bwd_*(shape, idx0, idx1, val0, val1,
    // side_first, grad_out, act_out, grad)`; grad_out (and act_out, read only when the shape
    // says clamped) hold batch x perspectives x out elements and grad (num_inputs + 1) x out,
    // written only at rows checked against num_inputs.
    unsafe {
        launch_striped!(T, dev, f, &plan, BWD, f.out, |args| {
            args.arg(grad_out);
            match act_out {
                Some((view, _)) => args.arg(view),
                None => args.arg(&null),
            };
            args.arg(grad)
        })
    }
}

/// Backward by feature, the work list built on the GPU (see `count_features` in
/// sparse_linear.cu): count, scan, scatter, cut, then the deterministic backward's gather, whose
/// multi-piece features add their pieces atomically. `grad` must be zeroed. No host
/// synchronisation: the gather's grid covers an upper bound of the pieces and reads their number
/// on the device.
fn backward_by_feature<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, grad_out: &CudaView<'_, T>, grad_start: usize,
    act_out: &ActivationOutput<'_, T>, grad: &CudaSlice<f32>,
) -> Result<()> {
    let tasks = f.batch * f.sides.len();
    if tasks == 0 || f.out == 0 {
        return Ok(());
    }
    let keys = f.num_inputs + 1;
    // Every slot active, plus one bias entry per row.
    let most_entries = tasks * (f.max_active + 1);
    let most_pieces = most_entries.div_ceil(PIECE) + keys.min(most_entries);
    let counts = dev.alloc_zeros::<u32>(keys)?;
    let offsets = dev.alloc_zeros::<u32>(keys + 1)?;
    let cursor = dev.alloc_zeros::<u32>(keys)?;
    let piece_first = dev.alloc_zeros::<u32>(keys + 1)?;
    // SAFETY (allocations): every element is written by the scatter / cut kernels before the
    // gather reads it (the gather reads only pieces below the device count, and entries in
    // their [begin, end)).
    let rows = unsafe { dev.alloc::<u32>(most_entries.max(1))? };
    let values = unsafe { dev.alloc::<f32>(most_entries.max(1))? };
    let pieces = unsafe { dev.alloc::<u32>(4 * most_pieces.max(1))? };
    let views = FeatureViews::new(f);
    let features = FeatureArgs::new(&views)?;
    let shape = shape(f, 0, f.out, 0, 0)?;
    let per_task = grid_stride_config(dev, tasks as u64 * 32, THREADS, 8, 0)?;
    let per_key = grid_stride_config(dev, keys as u64 * 32, THREADS, 8, 0)?;
    let (keys32, bias_count, piece) = (keys as u32, tasks as u32, PIECE as u32);
    let count = Kernel::load(dev, Module::SparseLinear, &[BWD, "count"])?;
    let plan = Kernel::load(dev, Module::SparseLinear, &[BWD, "plan"])?;
    let scatter = Kernel::load(dev, Module::SparseLinear, &[BWD, "scatter"])?;
    let cut = Kernel::load(dev, Module::SparseLinear, &[BWD, "cut"])?;
    let single_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (SCAN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: each launch's arguments match its kernel (`sparse_linear_bwd_count(shape,
    // features.., counts)`, `_plan(counts, keys, bias_count, piece, offsets, cursor,
    // piece_first)`, `_scatter(shape, features.., offsets, cursor, rows, values)`,
    // `_cut(offsets, piece_first, keys, piece, pieces)`); counts hold num_inputs + 1 keys,
    // offsets / piece_first one more, rows / values every active slot plus a bias entry per
    // task, pieces 4 x the most pieces those entries make.
    unsafe {
        count.launch(per_task, |args| {
            features.push(args, &shape);
            args.arg(&counts);
        })?;
        plan.launch(
            single_block,
            kernel_args!(
                &counts,
                &keys32,
                &bias_count,
                &piece,
                &offsets,
                &cursor,
                &piece_first
            ),
        )?;
        scatter.launch(per_task, |args| {
            features.push(args, &shape);
            args.arg(&offsets).arg(&cursor).arg(&rows).arg(&values);
        })?;
        cut.launch(
            per_key,
            kernel_args!(&offsets, &piece_first, &keys32, &piece, &pieces),
        )?;
    }
    // The piece count sits at piece_first[keys].
    let piece_count = piece_first.slice(keys..);
    // SAFETY: the pieces below the device count (piece_count) were built by the kernels above
    // from rows / values of every active slot; multi-piece keys add atomically (no scratch).
    unsafe {
        launch_gather(
            dev,
            f,
            (grad_out, grad_start),
            act_out,
            grad,
            GatherList {
                pieces: &pieces,
                num_pieces: most_pieces as u64,
                rows: &rows,
                values: &values,
                scratch: None,
                piece_count: Some(&piece_count),
            },
        )
    }
}

/// A work list of the gather kernel (`sparse_linear_bwd_sorted_*`): pieces `[key, begin, end,
/// scratch row or NO_SCRATCH / ATOMIC_SLOT]` over `rows` / `values`, and where the number of
/// pieces lives when the GPU built the list (it bounds `num_pieces` on the device).
struct GatherList<'a> {
    pieces: &'a CudaSlice<u32>,
    num_pieces: u64,
    rows: &'a CudaSlice<u32>,
    values: &'a CudaSlice<f32>,
    scratch: Option<&'a CudaSlice<f32>>,
    piece_count: Option<&'a CudaView<'a, u32>>,
}

/// Launches the gather of `list` (both backwards by feature: the GPU-built and the sorted one).
///
/// # Safety
/// Every piece below the count lies in `rows` / `values`, its rows index `grad_out`'s (and
/// `act_out`'s) batch x perspectives rows, its key is at most `num_inputs` (grad has
/// `num_inputs + 1` rows) and its scratch row, if any, is inside `scratch`.
unsafe fn launch_gather<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, (grad_out, grad_start): (&CudaView<'_, T>, usize),
    act_out: &ActivationOutput<'_, T>, grad: &CudaSlice<f32>, list: GatherList<'_>,
) -> Result<()> {
    let act_start = act_out.as_ref().map_or(0, |(_, start)| *start);
    let vec =
        f.out.is_multiple_of(4) && grad_start.is_multiple_of(4) && act_start.is_multiple_of(4);
    let variant = if vec { "vec" } else { "scalar" };
    let gather = Kernel::load_typed::<T>(dev, Module::SparseLinear, &[BWD, "sorted", variant])?;
    let cfg = grid_stride_config(dev, list.num_pieces * 32, THREADS, 8, 0)?;
    let out_dim = f.out as u64;
    let ceiling = f.clip_ceiling.unwrap_or(0.0);
    let null = 0u64;
    // SAFETY (the caller's contract): the arguments match `sparse_linear_bwd_sorted_*(pieces,
    // num_pieces, rows, values, grad_out, act_out, ceiling, out_dim, grad, scratch,
    // piece_count)`.
    unsafe {
        gather.launch(cfg, |args| {
            args.arg(list.pieces)
                .arg(&list.num_pieces)
                .arg(list.rows)
                .arg(list.values)
                .arg(grad_out);
            match act_out {
                Some((view, _)) => args.arg(view),
                None => args.arg(&null),
            };
            args.arg(&ceiling).arg(&out_dim).arg(grad);
            match list.scratch {
                Some(scratch) => args.arg(scratch),
                None => args.arg(&null),
            };
            match list.piece_count {
                Some(count) => args.arg(count),
                None => args.arg(&null),
            };
        })
    }
}

/// Entries per piece of a feature's sorted run in the deterministic backward: short enough
/// to spread a frequent feature over many warps, long enough to amortise a piece.
const PIECE: usize = 32;
const NO_SCRATCH: u32 = u32::MAX;
const SCAN_THREADS: u32 = crate::kernel_constants::sparse_linear::SCAN_THREADS as u32;

/// The deterministic backward's work list, built on the host: every active (feature, output
/// gradient row, value) sorted by feature in batch order, cut into pieces.
#[derive(Debug, Default)]
struct SortedEntries {
    rows: Vec<u32>,
    values: Vec<f32>,
    /// `[key, begin, end, scratch row or NO_SCRATCH]` per piece.
    pieces: Vec<u32>,
    /// `[key, first scratch row, scratch rows]` per feature with several pieces.
    groups: Vec<u32>,
    scratch_rows: usize,
}

fn sort_entries(dev: &CudaDevice, f: &Features, views: &FeatureViews) -> Result<SortedEntries> {
    let (perspectives, a, n) = (f.sides.len(), f.max_active, f.num_inputs);
    let grad_rows = f.batch * perspectives;
    if grad_rows
        .checked_mul(a + 1)
        .is_none_or(|total| total >= u32::MAX as usize)
    {
        bail!("{OP}: deterministic backward supports fewer than 2^32 feature slots");
    }
    let mut indices = Vec::with_capacity(perspectives);
    let mut values = Vec::with_capacity(perspectives);
    for p in 0..perspectives {
        let idx = views
            .view::<i32>(p)?
            .expect("one index tensor per perspective");
        indices.push(dev.clone_dtoh(&idx)?);
        values.push(match views.view::<f32>(2 + p)? {
            Some(v) => Some(dev.clone_dtoh(&v)?),
            None => None,
        });
    }
    let side_first = match views.view::<u8>(4)? {
        Some(v) => Some(dev.clone_dtoh(&v)?),
        None => None,
    };
    // (position, perspective, row of the output gradient) for each task, in batch order.
    let mut tasks = Vec::with_capacity(grad_rows);
    for b in 0..f.batch {
        let first = side_first.as_ref().is_none_or(|s| s[b] != 0);
        for p in 0..perspectives {
            let half = if perspectives == 2 && !first {
                1 - p
            } else {
                p
            };
            tasks.push((b, p, (b * perspectives + half) as u32));
        }
    }
    let active = |b: usize, p: usize| {
        let row = &indices[p][b * a..(b + 1) * a];
        row.iter()
            .take_while(|&&i| i != -1)
            .enumerate()
            .filter(|(_, &i)| i >= 0 && (i as usize) < n)
            .map(move |(k, &i)| (k, i as usize))
    };
    // Counting sort by feature; the bias is feature n, fed by every row with value 1.
    let mut counts = vec![0usize; n + 2];
    for &(b, p, _) in &tasks {
        for (_, key) in active(b, p) {
            counts[key + 1] += 1;
        }
    }
    counts[n + 1] = grad_rows;
    for key in 0..=n {
        counts[key + 1] += counts[key];
    }
    let total = counts[n + 1];
    let mut cursor = counts.clone();
    let mut sorted = SortedEntries {
        rows: vec![0; total],
        values: vec![0.0; total],
        ..Default::default()
    };
    for &(b, p, grad_row) in &tasks {
        for (k, key) in active(b, p) {
            let at = cursor[key];
            cursor[key] += 1;
            sorted.rows[at] = grad_row;
            sorted.values[at] = values[p].as_ref().map_or(1.0, |v| v[b * a + k]);
        }
        let at = cursor[n];
        cursor[n] += 1;
        sorted.rows[at] = grad_row;
        sorted.values[at] = 1.0;
    }
    for key in 0..=n {
        let (begin, end) = (counts[key], counts[key + 1]);
        let pieces = (end - begin).div_ceil(PIECE);
        if pieces == 1 {
            sorted
                .pieces
                .extend([key as u32, begin as u32, end as u32, NO_SCRATCH]);
        } else if pieces > 1 {
            let first = sorted.scratch_rows;
            for piece in 0..pieces {
                let b = begin + piece * PIECE;
                let e = (b + PIECE).min(end);
                let slot = (first + piece) as u32;
                sorted.pieces.extend([key as u32, b as u32, e as u32, slot]);
            }
            sorted.scratch_rows += pieces;
            sorted
                .groups
                .extend([key as u32, first as u32, pieces as u32]);
        }
    }
    Ok(sorted)
}

/// The deterministic form of [`backward`] (see [`crate::set_deterministic`]).
pub(super) fn backward_sorted<T: WithDType + DeviceRepr>(
    dev: &CudaDevice, f: &Features, grad_out: &CudaView<'_, T>, grad_start: usize,
    act_out: &ActivationOutput<'_, T>, grad: &CudaSlice<f32>,
) -> Result<()> {
    if f.batch * f.sides.len() == 0 || f.out == 0 {
        return Ok(());
    }
    let views = FeatureViews::new(f);
    let sorted = sort_entries(dev, f, &views)?;
    let upload_u32 = |v: &[u32]| dev.clone_htod(if v.is_empty() { &[0u32][..] } else { v });
    let rows = upload_u32(&sorted.rows)?;
    let values = dev.clone_htod(if sorted.values.is_empty() {
        &[0f32][..]
    } else {
        &sorted.values
    })?;
    let pieces = upload_u32(&sorted.pieces)?;
    let groups = upload_u32(&sorted.groups)?;
    let scratch = dev.alloc_zeros::<f32>((sorted.scratch_rows * f.out).max(1))?;
    let (num_pieces, num_groups) = (
        (sorted.pieces.len() / 4) as u64,
        (sorted.groups.len() / 3) as u64,
    );
    // SAFETY: sort_entries built the pieces from every active slot: each piece's [begin, end)
    // lies in rows and values, rows index grad_out's batch x perspectives rows, keys are at
    // most num_inputs and scratch rows are below scratch_rows.
    unsafe {
        launch_gather(
            dev,
            f,
            (grad_out, grad_start),
            act_out,
            grad,
            GatherList {
                pieces: &pieces,
                num_pieces,
                rows: &rows,
                values: &values,
                scratch: Some(&scratch),
                piece_count: None,
            },
        )?;
    }
    let out_dim = f.out as u64;
    if num_groups > 0 {
        let combine = Kernel::load(dev, Module::SparseLinear, &[BWD, "combine"])?;
        let cfg = grid_stride_config(dev, num_groups * out_dim, THREADS, 8, 0)?;
        // SAFETY: the arguments match `sparse_linear_bwd_combine(groups, num_groups,
        // scratch, out_dim, grad)`; each group's scratch rows lie in scratch, its key in grad.
        unsafe {
            combine.launch(
                cfg,
                kernel_args!(&groups, &num_groups, &scratch, &out_dim, grad),
            )?;
        }
    }
    Ok(())
}
