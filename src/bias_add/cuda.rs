use super::{CacheHint, ChannelMap};
use crate::cuda::{grid_stride_config, Kernel, Module};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use candle_core::{CudaDevice, Result, WithDType};

/// The kernel keeps the bias in the default 48 KiB of dynamic shared memory when it fits
/// (12288 f32 channels) and reads it through L1 otherwise.
const MAX_SHARED_BIAS_BYTES: usize = 48 * 1024;
const THREADS: u32 = crate::kernel_constants::bias_add::THREADS as u32;
/// Blocks per SM in the grid: 58 registers per thread allow at most 4 resident blocks of 256
/// threads; a sweep of 1..8 on the H200 (BENCHMARKS.md) was best at 2 for 4-byte and 3 for
/// 2-byte types. `FASTOPS_BIAS_ADD_BLOCKS_PER_SM` overrides it for tuning runs.
fn blocks_per_sm(elem_bytes: usize) -> u32 {
    crate::cuda::tuning("FASTOPS_BIAS_ADD_BLOCKS_PER_SM")
        .filter(|&b| b > 0)
        .unwrap_or(if elem_bytes >= 4 { 2 } else { 3 })
}

/// 16-byte vectors each thread loads before using the first.
const UNROLL: u64 = crate::kernel_constants::bias_add::UNROLL as u64;

/// Where the kernel reads and writes.
pub(super) enum SrcDst<'v, 's, T> {
    Separate(&'v CudaView<'s, T>, &'v CudaSlice<T>),
    InPlace(&'v mut CudaViewMut<'s, T>),
}

/// Launches `bias_add_<dtype>` over the `map.len` elements of `src_dst`.
pub(super) fn launch_bias_add<T: WithDType>(
    dev: &CudaDevice, hint: CacheHint, map: &ChannelMap, bias: &CudaView<'_, T>,
    src_dst: SrcDst<'_, '_, T>,
) -> Result<()> {
    if map.len == 0 {
        return Ok(());
    }
    let base = match (hint, T::DTYPE) {
        (CacheHint::Volatile, candle_core::DType::F32) => "bias_add_volatile",
        (CacheHint::Plain, candle_core::DType::F32) => "bias_add_plain",
        _ => "bias_add",
    };
    let elem = std::mem::size_of::<T>();
    let bias_bytes = map.channels * elem;
    let bias_in_smem = bias_bytes <= MAX_SHARED_BIAS_BYTES;
    let vectors = (map.len / (16 / elem)) as u64;
    let cfg = grid_stride_config(
        dev,
        vectors.div_ceil(UNROLL),
        THREADS,
        blocks_per_sm(elem),
        if bias_in_smem { bias_bytes as u32 } else { 0 },
    )?;
    let (n, inner) = (map.len as u64, map.inner as u64);
    let (channels, bias_in_smem) = (map.channels as u32, bias_in_smem as u32);
    // SAFETY: the arguments match `bias_add_*(src, dst, bias, n, inner, channels,
    // bias_in_smem)`; src/dst hold `n` elements, bias `channels`, and the kernel bounds every
    // access by `n` and `channels`.
    // A null source tells the kernel to read from the destination.
    let in_place_src = 0u64;
    let kernel = Kernel::load_typed::<T>(dev, Module::BiasAdd, &[base])?;
    unsafe {
        kernel.launch(cfg, |args| {
            match src_dst {
                SrcDst::Separate(src, dst) => args.arg(src).arg(dst),
                SrcDst::InPlace(dst) => args.arg(&in_place_src).arg(dst),
            };
            args.arg(bias)
                .arg(&n)
                .arg(&inner)
                .arg(&channels)
                .arg(&bias_in_smem);
        })
    }
}
