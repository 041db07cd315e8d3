use super::{CacheHint, ChannelMap};
use crate::cuda::{FastDiv64, Kernel, Module};
use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::{CudaDevice, Result, WithDType};

const THREADS: u32 = crate::kernel_constants::bias_add::THREADS as u32;

/// Mirrors `BiasAddShape` in `bias_add.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BiasAddShape {
    n: u64,
    inner: FastDiv64,
    channels: FastDiv64,
    /// The fused clipped ReLU's ceiling (read when `clamped` is nonzero).
    ceiling: f32,
    clamped: u32,
}
mirrored_struct!(BiasAddShape, 64, kernel_arg);

/// Where the kernel reads and writes.
pub(super) enum SrcDst<'v, 's, T> {
    Separate(&'v CudaView<'s, T>, &'v CudaSlice<T>),
    InPlace(&'v mut CudaViewMut<'s, T>),
}

/// Launches `bias_add_<dtype>` over the `map.len` elements of `src_dst`: a thread per 16-byte
/// vector (a grid-stride loop takes what lies past 2^31 - 1 blocks), the sums clamped to
/// `[0, ceiling]` when `clip_ceiling` is given.
pub(super) fn launch_bias_add<T: WithDType>(
    dev: &CudaDevice, hint: CacheHint, map: &ChannelMap, bias: &CudaView<'_, T>,
    clip_ceiling: Option<f32>, src_dst: SrcDst<'_, '_, T>,
) -> Result<()> {
    if map.len == 0 {
        return Ok(());
    }
    let base = match (hint, T::DTYPE) {
        (CacheHint::Volatile, candle_core::DType::F32) => "bias_add_volatile",
        (CacheHint::Plain, candle_core::DType::F32) => "bias_add_plain",
        _ => "bias_add",
    };
    let vec_width = 16 / std::mem::size_of::<T>() as u64;
    // Threads for the vectors, and at least one for each scalar of the head and the tail.
    let work = (map.len as u64 / vec_width).max(vec_width);
    let blocks = work.div_ceil(THREADS as u64).min(i32::MAX as u64) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let shape = BiasAddShape {
        n: map.len as u64,
        inner: FastDiv64::new(map.inner as u64),
        channels: FastDiv64::new(map.channels as u64),
        ceiling: clip_ceiling.unwrap_or(0.0),
        clamped: u32::from(clip_ceiling.is_some()),
    };
    // SAFETY: the arguments match `bias_add_*(src, dst, bias, shape)`; src/dst hold `n`
    // elements, bias `channels`, and the kernel bounds every access by `n` and `channels`.
    // A null source tells the kernel to read from the destination.
    let in_place_src = 0u64;
    let kernel = Kernel::load_typed::<T>(dev, Module::BiasAdd, &[base])?;
    unsafe {
        kernel.launch(cfg, |args| {
            match src_dst {
                SrcDst::Separate(src, dst) => args.arg(src).arg(dst),
                SrcDst::InPlace(dst) => args.arg(&in_place_src).arg(dst),
            };
            args.arg(bias).arg(&shape);
        })
    }
}

/// Launches `bias_add_clipped_relu_grad_<dtype>`: `out = grad` where `0 < ys < ceiling`, else 0, over
/// the `ys.len()` elements of three buffers of one length (16-byte vectors when all three are
/// aligned; a grid-stride loop).
pub(super) fn launch_clipped_relu_grad<T: WithDType>(
    dev: &CudaDevice, ys: &CudaView<'_, T>, grad: &CudaView<'_, T>, out: &CudaSlice<T>,
    ceiling: f32,
) -> Result<()> {
    let n = ys.len() as u64;
    if grad.len() as u64 != n || out.len() as u64 != n {
        candle_core::bail!(
            "bias_add: internal error, the clipped ReLU's gradient buffers differ in length"
        );
    }
    if n == 0 {
        return Ok(());
    }
    let vec_width = 16 / std::mem::size_of::<T>() as u64;
    let cfg = crate::cuda::grid_stride_config(dev, n.div_ceil(vec_width), THREADS, 8, 0)?;
    let kernel = Kernel::load_typed::<T>(dev, Module::BiasAdd, &["bias_add_clipped_relu_grad"])?;
    // SAFETY: the arguments match `bias_add_clipped_relu_grad_*(ys, grad, out, n, ceiling)`; each buffer
    // holds `n` elements and the kernel bounds every access by `n`.
    unsafe { kernel.launch(cfg, crate::cuda::kernel_args!(ys, grad, out, &n, &ceiling)) }
}
