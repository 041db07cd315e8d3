//! [`NcclGroup`]: the collectives on GPUs through NCCL (cudarc's bindings).

use super::{rendezvous, Collectives, DistEnv, ReduceOp};
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::cuda_backend::cudarc::nccl::{
    result as nccl, Comm, Id, NcclType, ReduceOp as NcclOp,
};
use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CudaDevice, CudaStorage, DType, Device, Layout,
    Result, Shape, Tensor, Var,
};

/// A process group over GPUs, one rank per process (or per thread) and GPU, through NCCL. Its
/// operations run on the rank's candle device stream, so they are ordered with the model's own
/// kernels without host synchronisation.
///
/// Build it with [`NcclGroup::from_env`] in a process started by [`super::launch`] (or torchrun),
/// or with [`NcclGroup::from_unique_id`] when the ranks are threads of one process.
#[derive(Debug)]
pub struct NcclGroup {
    comm: Comm,
    device: Device,
    cuda: CudaDevice,
}

fn nccl_err(what: &str, e: nccl::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("dist: NCCL {what}: {:?}", e.0))
}

impl NcclGroup {
    /// The NCCL library's version as (major, minor, patch), or an error when no NCCL library is
    /// usable (e.g. the build stub on a machine without NCCL).
    pub fn nccl_version() -> Result<(u32, u32, u32)> {
        let v = nccl::get_nccl_version().map_err(|e| nccl_err("version", e))? as u32;
        Ok((v / 10000, (v / 100) % 100, v % 100))
    }

    /// A fresh NCCL unique id (made by rank 0, handed to every rank).
    pub fn unique_id() -> Result<[u8; 128]> {
        let id = Id::new().map_err(|e| nccl_err("unique id", e))?;
        Ok(id.internal().map(|c| c as u8))
    }

    /// Joins the group described by `env` on GPU `env.local_rank`: rank 0 makes the unique id
    /// and hands it to the others over the TCP rendezvous (deadline `FASTOPS_DIST_TIMEOUT_S`).
    pub fn from_env(env: &DistEnv) -> Result<Self> {
        let device = Device::new_cuda(env.local_rank)?;
        let id = if env.rank == 0 {
            Some(Self::unique_id()?)
        } else {
            None
        };
        let shared = rendezvous::share_from_rank0(
            env,
            id.as_ref().map(|id| id.as_slice()),
            128,
            rendezvous::timeout_from_env(),
        )?;
        let id: [u8; 128] = shared.try_into().expect("128 bytes");
        Self::from_unique_id(id, env.rank, env.world_size, &device)
    }

    /// Joins the group of `world_size` ranks identified by `id` as `rank`, on `device` (a CUDA
    /// device). Blocks until every rank has joined.
    pub fn from_unique_id(
        id: [u8; 128], rank: usize, world_size: usize, device: &Device,
    ) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            bail!(
                "dist: NcclGroup needs a CUDA device, got {:?}",
                device.location()
            );
        };
        if rank >= world_size {
            bail!("dist: rank {rank} is not below the world size {world_size}");
        }
        let stream = cuda.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("dist: {e:?}")))?;
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm =
            Comm::from_rank(stream, rank, world_size, id).map_err(|e| nccl_err("init", e))?;
        Ok(Self {
            comm,
            device: device.clone(),
            cuda: cuda.clone(),
        })
    }
}

/// The contiguous element range of `layout`, or an error naming the operation.
fn contiguous_range(layout: &Layout, what: &str) -> Result<(usize, usize)> {
    match layout.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("dist: {what} needs a contiguous tensor"),
    }
}

struct AllReduce<'a> {
    comm: &'a Comm,
    op: ReduceOp,
}

struct AllGather<'a> {
    comm: &'a Comm,
}

impl AllReduce<'_> {
    fn run<T: NcclType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
        &self, storage: &CudaStorage, layout: &Layout, dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        let (start, end) = contiguous_range(layout, "all_reduce")?;
        let src = storage.as_cuda_slice::<T>()?.slice(start..end);
        // SAFETY: NCCL writes every element before the stream runs anything that reads it.
        let mut dst = unsafe { dev.alloc::<T>(end - start)? };

        self.comm
            .all_reduce(&src, &mut dst, &self.nccl_op())
            .map_err(|e| nccl_err("all_reduce", e))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
    }
}

impl AllReduce<'_> {
    fn run_in_place<T: NcclType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
        &self, storage: &mut CudaStorage, layout: &Layout,
    ) -> Result<()> {
        let (start, end) = contiguous_range(layout, "all_reduce")?;
        let slice = storage.as_cuda_slice_mut::<T>()?;
        let mut view = slice.slice_mut(start..end);
        self.comm
            .all_reduce_in_place(&mut view, &self.nccl_op())
            .map_err(|e| nccl_err("all_reduce", e))?;
        Ok(())
    }

    fn nccl_op(&self) -> NcclOp {
        match self.op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Avg => NcclOp::Avg,
        }
    }

    fn check_dtype(&self, dtype: DType) -> Result<()> {
        let float = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
        if self.op == ReduceOp::Avg && !float {
            bail!("dist: all_reduce Avg of {dtype:?}");
        }
        Ok(())
    }
}

/// `with_nccl_type!(dtype, "what", T => expr)`: `expr` with `T` the element type of `dtype`, for
/// the dtypes the collectives move (f32, f64, f16, bf16, u32, i64); any other is an error naming
/// the collective.
macro_rules! with_nccl_type {
    ($dtype:expr, $what:expr, $t:ident => $body:expr) => {
        crate::dispatch::with_type_of!(
            $dtype,
            [F32 => f32, F64 => f64, F16 => half::f16, BF16 => half::bf16, U32 => u32, I64 => i64],
            $t => $body,
            dt => bail!("dist: {} of {dt:?}", $what)
        )
    };
}

impl candle_core::InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-in-place"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("dist: NcclGroup::all_reduce of a CPU tensor")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
        self.check_dtype(storage.dtype())?;
        with_nccl_type!(storage.dtype(), "all_reduce", T => self.run_in_place::<T>(storage, layout))
    }
}

impl candle_core::CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("dist: NcclGroup::all_reduce of a CPU tensor")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = &storage.device;
        self.check_dtype(storage.dtype())?;
        let out = with_nccl_type!(storage.dtype(), "all_reduce", T => self.run::<T>(storage, layout, dev))?;
        Ok((out, layout.shape().clone()))
    }
}

impl AllGather<'_> {
    fn run<T: NcclType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
        &self, storage: &CudaStorage, layout: &Layout, dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        let (start, end) = contiguous_range(layout, "all_gather")?;
        let src = storage.as_cuda_slice::<T>()?.slice(start..end);
        // SAFETY: NCCL writes every element (each rank's block) before anything reads it.
        let mut dst = unsafe { dev.alloc::<T>((end - start) * self.comm.world_size())? };
        self.comm
            .all_gather(&src, &mut dst)
            .map_err(|e| nccl_err("all_gather", e))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
    }
}

impl candle_core::CustomOp1 for AllGather<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-gather"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("dist: NcclGroup::all_gather of a CPU tensor")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = &storage.device;
        let out = with_nccl_type!(storage.dtype(), "all_gather", T => self.run::<T>(storage, layout, dev))?;
        let mut dims = vec![self.comm.world_size()];
        dims.extend_from_slice(layout.dims());
        Ok((out, Shape::from(dims)))
    }
}

/// One in-place broadcast, issued inside the caller's NCCL group.
struct BroadcastInPlace<'a> {
    comm: &'a Comm,
    root: usize,
}

impl BroadcastInPlace<'_> {
    fn run<T: NcclType + DeviceRepr + candle_core::cuda_backend::CudaDType>(
        &self, storage: &mut CudaStorage, layout: &Layout,
    ) -> Result<()> {
        let (start, end) = contiguous_range(layout, "broadcast")?;
        let slice = storage.as_cuda_slice_mut::<T>()?;
        let mut view = slice.slice_mut(start..end);
        self.comm
            .broadcast_in_place(&mut view, self.root as i32)
            .map_err(|e| nccl_err("broadcast", e))?;
        Ok(())
    }
}

impl candle_core::InplaceOp1 for BroadcastInPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("dist: NcclGroup::broadcast_vars of a CPU variable")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
        with_nccl_type!(storage.dtype(), "broadcast", T => self.run::<T>(storage, layout))
    }
}

impl NcclGroup {
    fn check_device(&self, t: &Tensor, what: &str) -> Result<()> {
        if !t.device().same_device(&self.device) {
            bail!(
                "dist: {what}: tensor on {:?}, the group's device is {:?}",
                t.device().location(),
                self.device.location()
            );
        }
        Ok(())
    }

    /// The CUDA device of this rank.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.cuda
    }
}

impl Collectives for NcclGroup {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.check_device(tensor, "all_reduce")?;
        tensor.contiguous()?.apply_op1_no_bwd(&AllReduce {
            comm: &self.comm,
            op,
        })
    }

    fn all_reduce_in_place(&self, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.check_device(&tensor, "all_reduce")?;
        if !tensor.is_contiguous() {
            return self.all_reduce(&tensor, op);
        }
        tensor.inplace_op1(&AllReduce {
            comm: &self.comm,
            op,
        })?;
        Ok(tensor)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.check_device(tensor, "all_gather")?;
        tensor
            .contiguous()?
            .apply_op1_no_bwd(&AllGather { comm: &self.comm })
    }

    fn broadcast_vars(&self, vars: &[(Var, usize)]) -> Result<()> {
        // Check everything before the group starts: an error inside it would leave NCCL's group
        // open.
        for (var, root) in vars {
            self.check_device(var.as_tensor(), "broadcast_vars")?;
            if *root >= self.world_size() {
                bail!(
                    "dist: broadcast root {root} is not a rank of {}",
                    self.world_size()
                );
            }
            if !var.is_contiguous() || !var.dtype().is_float() {
                bail!(
                    "dist: broadcast_vars needs contiguous float variables, got {:?} {:?}",
                    var.dims(),
                    var.dtype()
                );
            }
        }
        nccl::group_start().map_err(|e| nccl_err("group start", e))?;
        let mut result = Ok(());
        for (var, root) in vars {
            result = var.as_tensor().inplace_op1(&BroadcastInPlace {
                comm: &self.comm,
                root: *root,
            });
            if result.is_err() {
                break;
            }
        }
        let end = nccl::group_end().map_err(|e| nccl_err("group end", e));
        result.and(end.map(|_| ()))
    }
}
