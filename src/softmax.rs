//! Softmax and log-softmax over any set of dims of a tensor of any rank, in one or two passes
//! over memory, driven by a [`ReducePlan`].

use crate::cpu::output_vec;
use crate::dispatch::{check_float_operands, with_float_cpu};
use crate::reduce_plan::ReducePlan;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
use std::sync::Arc;

/// Softmax over the sub-tensors spanned by `dims`: every group of elements that share their
/// indices along the other dims is normalised to sum to 1. `dims` may come in any order;
/// all dims of the tensor means softmax over the whole tensor.
///
/// * Max-subtracted; f16/bf16 accumulate in f32, f32 in f32, f64 (CPU only) in f64.
/// * A group whose entries are all `-inf` gives zeros, not NaN (fully masked attention rows).
///   A NaN in a group makes that group NaN and no other.
/// * Any layout (a non-contiguous input is copied first). Autograd:
///   `grad_x = y * (g - sum_over_dims(g * y))`.
/// * Errors: rank 0, empty `dims`, duplicate or out-of-range dims, unsupported dtype; on CUDA
///   also groups of 2^31 or more elements or 2^31 or more groups (offsets themselves are 64-bit).
/// * The backward pass is composed from candle ops (a multiply, a sum over `dims`, a broadcast);
///   only the forward pass has its own kernels.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 3, 4))?;
/// // Normalise each of the three [2, 4] slices.
/// let ys = candle_fastops::softmax_dims(&xs, &[0, 2])?;
/// let sums = ys.sum_keepdim(0)?.sum_keepdim(2)?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-6));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn softmax_dims(xs: &Tensor, dims: &[usize]) -> Result<Tensor> {
    apply(xs, dims, false)
}

/// Log-softmax over `dims`: `x - max - log(sum(exp(x - max)))` per group, with the semantics of
/// [`softmax_dims`]; a group whose entries are all `-inf` gives `-inf`. Autograd:
/// `grad_x = g - exp(y) * sum_over_dims(g)`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let ys = candle_fastops::log_softmax_dims(&xs, &[0])?;
/// let expected = (xs.clone() - xs.exp()?.sum_keepdim(0)?.log()?.broadcast_as((2, 2))?)?;
/// let diff = (ys - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn log_softmax_dims(xs: &Tensor, dims: &[usize]) -> Result<Tensor> {
    apply(xs, dims, true)
}

fn apply(xs: &Tensor, dims: &[usize], log: bool) -> Result<Tensor> {
    let op = if log {
        "log_softmax_dims"
    } else {
        "softmax_dims"
    };
    if xs.rank() == 0 {
        bail!("{op}: rank-0 tensors have no dims to normalise over");
    }
    check_float_operands(op, ("xs", xs), &[], &[])?;
    let plan = ReducePlan::cached(xs.dims(), dims).map_err(|e| e.context(op))?;
    xs.contiguous()?.apply_op1(SoftmaxDims { plan, log })
}

struct SoftmaxDims {
    plan: Arc<ReducePlan>,
    log: bool,
}

impl SoftmaxDims {
    fn op_name(&self) -> &'static str {
        if self.log {
            "log_softmax_dims"
        } else {
            "softmax_dims"
        }
    }

    fn contiguous_start(&self, layout: &Layout) -> Result<usize> {
        match layout.contiguous_offsets() {
            Some((start, _)) if layout.dims() == self.plan.shape() => Ok(start),
            _ => bail!(
                "{}: internal error, input reached the kernel non-contiguous",
                self.op_name()
            ),
        }
    }
}

impl CustomOp1 for SoftmaxDims {
    fn name(&self) -> &'static str {
        if self.log {
            "fastops-log-softmax-dims"
        } else {
            "fastops-softmax-dims"
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let start = self.contiguous_start(layout)?;
        let n = layout.shape().elem_count();
        let out = with_float_cpu!(self.op_name(), storage, |xs| {
            let xs = &xs[start..start + n];
            WithDType::to_cpu_storage_owned(cpu::softmax(xs, &self.plan, self.log))
        });
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let start = self.contiguous_start(layout)?;
        let n = layout.shape().elem_count();
        let dev = &storage.device;
        let out = crate::dispatch::with_float_cuda!(self.op_name(), &storage.slice, |xs| {
            let xs = xs.slice(start..start + n);
            let ys = crate::cuda::alloc_output(dev, n)?;
            cuda::launch_softmax(dev, &self.plan, self.log, &xs, start, &ys)?;
            candle_core::CudaStorage::wrap_cuda_slice(ys, dev.clone())
        });
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _xs: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dims = self.plan.dims().to_vec();
        let grad = if self.log {
            let total = grad_res.sum_keepdim(dims)?;
            (grad_res - res.exp()?.broadcast_mul(&total)?)?
        } else {
            let dot = (grad_res * res)?.sum_keepdim(dims)?;
            (res * grad_res.broadcast_sub(&dot)?)?
        };
        Ok(Some(grad))
    }
}

mod cpu {
    use super::*;
    use crate::cpu::CpuFloat;
    use num_traits::Float;

    /// Lanes per task in column mode, so a plan with one huge kept block still spreads over
    /// every core.
    const LANE_CHUNK: usize = 1024;

    /// Output pointer shared by tasks that write disjoint element sets.
    #[derive(Clone, Copy)]
    struct OutPtr<T>(*mut T);
    // SAFETY: each task writes only the elements of its own groups; the plan maps every element
    // to exactly one group.
    unsafe impl<T> Send for OutPtr<T> {}
    unsafe impl<T> Sync for OutPtr<T> {}

    impl<T> OutPtr<T> {
        /// Taking `self` makes closures capture the whole (Send) wrapper, not the raw field.
        fn get(self) -> *mut T {
            self.0
        }
    }

    /// Max of a group, NaN if it holds one. The compare-select max and the separate NaN flag
    /// compile to packed max / unordered-compare instructions.
    fn max_and_nan<C: Float>(values: impl Iterator<Item = C>) -> C {
        let (mut m, mut nan) = (C::neg_infinity(), false);
        for v in values {
            m = if v > m { v } else { m };
            nan |= v.is_nan();
        }
        if nan {
            C::nan()
        } else {
            m
        }
    }

    /// The output of one element given its group's max `m` and `log_s = ln(sum(exp(x - m)))`.
    fn normalise<C: Float>(x: C, m: C, inv_s: C, log_s: C, log: bool) -> C {
        match (m == C::neg_infinity(), log) {
            (true, true) => C::neg_infinity(),
            (true, false) => C::zero(),
            (false, true) => x - m - log_s,
            (false, false) => (x - m).exp() * inv_s,
        }
    }

    /// Softmax of contiguous `xs` over the plan's groups, accumulating in `T::Acc`.
    pub(super) fn softmax<T: CpuFloat>(xs: &[T], plan: &ReducePlan, log: bool) -> Vec<T> {
        let n = xs.len();
        let mut ys = output_vec::<T>(n);
        let (groups, size) = (plan.num_groups(), plan.group_size());
        if groups > 0 && size > 0 {
            let out = OutPtr(ys.as_mut_ptr());
            let lanes = plan.lanes();
            if lanes == 1 {
                (0..groups)
                    .into_par_iter()
                    .for_each_init(Vec::new, |buf, g| {
                        row_group(xs, out.get(), plan, g, log, buf)
                    });
            } else {
                let outer = groups / lanes;
                let chunks = lanes.div_ceil(LANE_CHUNK);
                (0..outer * chunks).into_par_iter().for_each(|task| {
                    let (g_outer, chunk) = (task / chunks, task % chunks);
                    let first = chunk * LANE_CHUNK;
                    let width = LANE_CHUNK.min(lanes - first);
                    column_group(xs, out.get(), plan, g_outer * lanes + first, width, log)
                });
            }
        }
        // SAFETY: the groups above cover every element of the tensor and write each once.
        unsafe { ys.set_len(n) };
        ys
    }

    /// One group whose innermost reduced block is contiguous: gathered run by run into `buf`
    /// (one read of the input), normalised there, scattered back (one write).
    fn row_group<T: CpuFloat>(
        xs: &[T],
        ys: *mut T,
        plan: &ReducePlan,
        g: usize,
        log: bool,
        buf: &mut Vec<T::Acc>,
    ) {
        let run = plan.reduced_blocks().last().map_or(1, |b| b.size);
        let runs = plan.group_size() / run;
        let base = plan.group_base(g);
        let offsets = (0..runs).map(|r| base + plan.reduced_offset(r * run));
        buf.clear();
        for off in offsets.clone() {
            buf.extend(xs[off..off + run].iter().map(|&x| x.to_acc()));
        }
        let m = max_and_nan(buf.iter().copied());
        let s: T::Acc = if log {
            buf.iter().map(|&x| (x - m).exp()).sum()
        } else {
            buf.iter_mut()
                .map(|x| {
                    *x = (*x - m).exp();
                    *x
                })
                .sum()
        };
        let (inv_s, log_s) = (s.recip(), s.ln());
        let masked = m == <T::Acc as Float>::neg_infinity();
        for (r, off) in offsets.enumerate() {
            // SAFETY: `off..off + run` are elements of group `g`, written by this task only.
            let out = unsafe {
                std::slice::from_raw_parts_mut(ys.add(off) as *mut std::mem::MaybeUninit<T>, run)
            };
            let vals = &buf[r * run..(r + 1) * run];
            match (masked, log) {
                (true, _) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                    o.write(T::from_acc(normalise(v, m, inv_s, log_s, log)));
                }),
                (false, true) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                    o.write(T::from_acc(v - m - log_s));
                }),
                (false, false) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                    o.write(T::from_acc(v * inv_s));
                }),
            }
        }
    }

    /// `width` adjacent groups starting at `g0` whose elements are strided: for each reduced
    /// index the groups form a contiguous run of `width` values.
    fn column_group<T: CpuFloat>(
        xs: &[T],
        ys: *mut T,
        plan: &ReducePlan,
        g0: usize,
        width: usize,
        log: bool,
    ) {
        let base = plan.group_base(g0);
        let offsets = (0..plan.group_size()).map(|j| base + plan.reduced_offset(j));
        let neg_inf = <T::Acc as Float>::neg_infinity();
        let mut m = vec![neg_inf; width];
        let mut nan = vec![false; width];
        for off in offsets.clone() {
            for ((m, nan), &x) in m.iter_mut().zip(&mut nan).zip(&xs[off..off + width]) {
                let x = x.to_acc();
                *m = m.max(x);
                *nan |= x.is_nan();
            }
        }
        for (m, &nan) in m.iter_mut().zip(&nan) {
            if nan {
                *m = <T::Acc as Float>::nan();
            }
        }
        let mut s = vec![<T::Acc as num_traits::Zero>::zero(); width];
        for off in offsets.clone() {
            for ((s, &m), &x) in s.iter_mut().zip(&m).zip(&xs[off..off + width]) {
                *s = *s + (x.to_acc() - m).exp();
            }
        }
        let inv_s: Vec<T::Acc> = s.iter().map(|s| s.recip()).collect();
        let log_s: Vec<T::Acc> = s.iter().map(|s| s.ln()).collect();
        for off in offsets {
            for (lane, &x) in xs[off..off + width].iter().enumerate() {
                let y = normalise(x.to_acc(), m[lane], inv_s[lane], log_s[lane], log);
                // SAFETY: element `lane` of the run belongs to group `g0 + lane`, owned here.
                unsafe { ys.add(off + lane).write(T::from_acc(y)) };
            }
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{alloc_output, sm_count, tuning, FastDiv, Kernel, Module};
    use crate::reduce_plan::{Block, ReducePlan, MAX_BLOCKS};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::kernel_name;
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

    // SAFETY: plain-old-data with the same C layout as the kernel's parameter.
    unsafe impl DeviceRepr for ReduceLayout {}

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

    /// Groups per access in the "lanes" form (`_lanes_` kernels are built with W = 4).
    const LANE_WIDTH: usize = 4;
    /// Column groups up to this size fit in the scalar kernels' registers (16 values x 8 y
    /// threads) and run faster there than in the lanes form, whose four accumulators cost four
    /// block reductions (H200: dims [0] of [32, 1024, 4096], 0.39 ms scalar, 0.47 ms lanes).
    const SCALAR_COLUMN_CACHE: usize = CACHED_ELEMENTS * MAX_COLUMN_LY;

    /// Threads per block; a block is `lx` groups wide and `ly` threads deep per group.
    const THREADS: usize = 256;
    /// What one thread of the `_cached` kernels holds (`cached_units` in `softmax.cu`): single
    /// elements, or 16-byte vectors.
    const CACHED_ELEMENTS: usize = 16;
    /// Most y threads per column-like group, so a warp still reads whole sectors.
    const MAX_COLUMN_LY: usize = 8;
    const CACHED_VECTORS: usize = 4;
    /// Fewest elements a thread should stream per chunk before splitting groups pays.
    const MIN_ELEMS_PER_THREAD: usize = 64;

    /// `xs_start` is the element offset of `xs` in its allocation, for the alignment check of
    /// the 16-byte path.
    pub(super) fn launch_softmax<T: WithDType>(
        dev: &CudaDevice,
        plan: &ReducePlan,
        log: bool,
        xs: &CudaView<'_, T>,
        xs_start: usize,
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
        let variant = match form {
            Form::Vec(_) => "_vec",
            Form::Lanes => "_lanes",
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
            // column, which measured faster there (H200, dims [0] of [32, 1024, 4096]: see
            // BENCHMARKS.md).
            let walk = if lanes == 1 { "rows" } else { "cols" };
            let kernel = Kernel::load(
                dev,
                Module::Softmax,
                &kernel_name::<T>(&format!("{prefix}_cached_{walk}{variant}")),
            )?;
            let columns = group_units.div_ceil(lx);
            let blocks = if lanes == 1 {
                let resident = kernel.resident_blocks_per_sm(THREADS as u32, lx * ly * 8)? as usize;
                let per_sm =
                    tuning("FASTOPS_SOFTMAX_BLOCKS_PER_SM").map_or(resident, |b| b as usize);
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
            return unsafe {
                kernel.launch(cfg, |args| {
                    args.arg(xs).arg(ys).arg(&layout).arg(&columns);
                })
            };
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
            let kernel = Kernel::load(
                dev,
                Module::Softmax,
                &kernel_name::<T>(&format!("{prefix}_fused{variant}")),
            )?;
            return unsafe {
                kernel.launch(cfg, |args| {
                    args.arg(xs).arg(ys).arg(&layout).arg(&chunk_len);
                })
            };
        }
        let partials = alloc_output::<f32>(dev, 2 * groups * chunks)?;
        let partial = Kernel::load(
            dev,
            Module::Softmax,
            &kernel_name::<T>(&format!("softmax_partial{variant}")),
        )?;
        unsafe {
            partial.launch(cfg, |args| {
                args.arg(xs).arg(&partials).arg(&layout).arg(&chunk_len);
            })?;
        }
        let finish = Kernel::load(
            dev,
            Module::Softmax,
            &kernel_name::<T>(&format!("{prefix}_finish{variant}")),
        )?;
        unsafe {
            finish.launch(cfg, |args| {
                args.arg(xs)
                    .arg(ys)
                    .arg(&partials)
                    .arg(&layout)
                    .arg(&chunk_len);
            })
        }
    }
}
