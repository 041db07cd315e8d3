//! The CUDA side shared by every op: the PTX modules built from `src/cuda/*.cu`, the one launch
//! helper, output allocation and device queries.

use candle_core::cuda_backend::cudarc::driver::{self, CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use std::sync::Arc;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// One PTX module per kernel file. Names are prefixed with the crate name so they cannot collide
/// with other custom modules in candle's per-device module cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Module {
    BiasAdd,
    Softmax,
}

impl Module {
    fn name(self) -> &'static str {
        match self {
            Module::BiasAdd => "candle_fastops_bias_add",
            Module::Softmax => "candle_fastops_softmax",
        }
    }

    fn ptx(self) -> &'static str {
        match self {
            Module::BiasAdd => ptx::BIAS_ADD,
            Module::Softmax => ptx::SOFTMAX,
        }
    }
}

/// A loaded kernel and the stream it launches on.
pub(crate) struct Kernel {
    func: driver::CudaFunction,
    stream: Arc<driver::CudaStream>,
}

impl Kernel {
    /// Loads `name` from `module`, compiling the module's PTX on its first use on this device.
    pub(crate) fn load(dev: &CudaDevice, module: Module, name: &str) -> Result<Self> {
        let func = dev.get_or_load_custom_func(name, module.name(), module.ptx())?;
        Ok(Self {
            func: func.into_cuda_function(),
            stream: dev.cuda_stream(),
        })
    }

    /// The one launch path of the crate: pushes the kernel's arguments and launches it on the
    /// device's stream.
    ///
    /// # Safety
    /// The arguments pushed by `push_args` must match the kernel's signature, and the launch
    /// configuration must keep every access of the kernel inside the buffers it is given.
    pub(crate) unsafe fn launch<'a>(
        &'a self,
        cfg: LaunchConfig,
        push_args: impl FnOnce(&mut driver::LaunchArgs<'a>),
    ) -> Result<()> {
        let mut builder = self.stream.launch_builder(&self.func);
        push_args(&mut builder);
        builder.launch(cfg).w()?;
        Ok(())
    }
}

/// Allocates an output buffer the kernel is expected to overwrite completely.
pub(crate) fn alloc_output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the kernel writes every element (and tests check it with poisoning on).
    let mut out = unsafe { dev.alloc::<T>(len)? };
    if crate::poison::poison_outputs() && len > 0 {
        let stream = dev.cuda_stream();
        let bytes = len * std::mem::size_of::<T>();
        let (ptr, _guard) = driver::DevicePtrMut::device_ptr_mut(&mut out, &stream);
        // SAFETY: `ptr` addresses `bytes` bytes owned by `out`, on `stream`.
        unsafe { driver::result::memset_d8_async(ptr, 0xFF, bytes, stream.cu_stream()) }.w()?;
    }
    Ok(out)
}

/// Number of streaming multiprocessors, for sizing persistent / grid-stride launches.
pub(crate) fn sm_count(dev: &CudaDevice) -> Result<u32> {
    let count = dev
        .cuda_stream()
        .context()
        .attribute(driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(count.max(1) as u32)
}

/// A 1-D launch of `threads`-wide blocks covering `work` items with a grid-stride loop: at most
/// `blocks_per_sm` resident blocks per multiprocessor, never more blocks than there is work.
pub(crate) fn grid_stride_config(
    dev: &CudaDevice,
    work: u64,
    threads: u32,
    blocks_per_sm: u32,
    shared_mem_bytes: u32,
) -> Result<LaunchConfig> {
    let wanted = work.div_ceil(threads as u64).max(1);
    let cap = sm_count(dev)? as u64 * blocks_per_sm as u64;
    Ok(LaunchConfig {
        grid_dim: (wanted.min(cap) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    })
}
