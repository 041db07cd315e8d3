//! The CUDA side shared by every op: the PTX modules built from `src/cuda/*.cu`, the one launch
//! helper, output allocation and device queries.

use crate::dispatch::mirrored_struct;
use candle_core::cuda_backend::cudarc::driver::{self, CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use std::sync::Arc;

pub(crate) mod locks;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
    include!(concat!(env!("OUT_DIR"), "/ptx_sm90.rs"));
}

/// The kernel names each module's PTX defines, read from the PTX by `build.rs`.
mod entries {
    include!(concat!(env!("OUT_DIR"), "/entries.rs"));
}

/// One PTX module per kernel file. Names are prefixed with the crate name so they cannot collide
/// with other custom modules in candle's per-device module cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Module {
    BiasAdd,
    Softmax,
    SparseLinear,
    SmallFcLOpt,
    AdamW,
    Matmul,
    TileSummary,
    Attention,
    /// `src/cuda/sm90/attention.cu`: PTX for `compute_90a`, loadable on compute capability 9.0
    /// only ([`is_hopper`]).
    AttentionSm90,
    /// `src/cuda/sm90/argmin.cu`: the Hopper argmin_matmul, loadable on compute capability 9.0
    /// only ([`is_hopper`]).
    ArgminSm90,
    /// `src/cuda/sm90/span.cu`: the Hopper grad_a product of the masked_bmm backward, loadable
    /// on compute capability 9.0 only ([`is_hopper`]).
    SpanSm90,
    /// `src/cuda/sm90/small_fc_lopt.cu`: small_fc_lopt's update pass on wgmma, loadable on
    /// compute capability 9.0 only ([`is_hopper`]).
    SmallFcLOptSm90,
}

impl Module {
    fn name(self) -> &'static str {
        match self {
            Module::BiasAdd => "candle_fastops_bias_add",
            Module::Softmax => "candle_fastops_softmax",
            Module::SparseLinear => "candle_fastops_sparse_linear",
            Module::SmallFcLOpt => "candle_fastops_small_fc_lopt",
            Module::AdamW => "candle_fastops_adamw",
            Module::Matmul => "candle_fastops_matmul",
            Module::TileSummary => "candle_fastops_tile_summary",
            Module::Attention => "candle_fastops_attention",
            Module::AttentionSm90 => "candle_fastops_attention_sm90",
            Module::ArgminSm90 => "candle_fastops_argmin_sm90",
            Module::SpanSm90 => "candle_fastops_span_sm90",
            Module::SmallFcLOptSm90 => "candle_fastops_small_fc_lopt_sm90",
        }
    }

    fn entries(self) -> &'static [&'static str] {
        match self {
            Module::BiasAdd => entries::BIAS_ADD,
            Module::Softmax => entries::SOFTMAX,
            Module::SparseLinear => entries::SPARSE_LINEAR,
            Module::SmallFcLOpt => entries::SMALL_FC_LOPT,
            Module::AdamW => entries::ADAMW,
            Module::Matmul => entries::MATMUL,
            Module::TileSummary => entries::TILE_SUMMARY,
            Module::Attention => entries::ATTENTION,
            Module::AttentionSm90 => entries::SM90_ATTENTION,
            Module::ArgminSm90 => entries::SM90_ARGMIN,
            Module::SpanSm90 => entries::SM90_SPAN,
            Module::SmallFcLOptSm90 => entries::SM90_SMALL_FC_LOPT,
        }
    }

    fn ptx(self) -> &'static str {
        match self {
            Module::BiasAdd => ptx::BIAS_ADD,
            Module::Softmax => ptx::SOFTMAX,
            Module::SparseLinear => ptx::SPARSE_LINEAR,
            Module::SmallFcLOpt => ptx::SMALL_FC_LOPT,
            Module::AdamW => ptx::ADAMW,
            Module::Matmul => ptx::MATMUL,
            Module::TileSummary => ptx::TILE_SUMMARY,
            Module::Attention => ptx::ATTENTION,
            Module::AttentionSm90 => ptx::SM90_ATTENTION,
            Module::ArgminSm90 => ptx::SM90_ARGMIN,
            Module::SpanSm90 => ptx::SM90_SPAN,
            Module::SmallFcLOptSm90 => ptx::SM90_SMALL_FC_LOPT,
        }
    }
}

/// `kernel_args!(x, y, ..)`: the `push_args` of [`Kernel::launch`] that pushes the given
/// references in order (each one must match the kernel's parameter at its position).
macro_rules! kernel_args {
    ($($arg:expr),* $(,)?) => {
        |args| {
            $(args.arg($arg);)*
        }
    };
}
pub(crate) use kernel_args;

/// A loaded kernel and the stream it launches on.
pub(crate) struct Kernel {
    func: driver::CudaFunction,
    stream: Arc<driver::CudaStream>,
}

impl Kernel {
    /// Loads the kernel named by `parts` joined with `_` (empty parts left out) from `module`,
    /// compiling the module's PTX on its first use on this device. Every kernel name of the
    /// crate is assembled here, and checked against the names the PTX defines.
    pub(crate) fn load(dev: &CudaDevice, module: Module, parts: &[&str]) -> Result<Self> {
        let name = parts
            .iter()
            .filter(|part| !part.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join("_");
        if module.entries().binary_search(&name.as_str()).is_err() {
            candle_core::bail!(
                "candle-fastops: no kernel `{name}` in {} (this build has {:?})",
                module.name(),
                module.entries()
            );
        }
        let func = dev.get_or_load_custom_func(&name, module.name(), module.ptx())?;
        Ok(Self {
            func: func.into_cuda_function(),
            stream: dev.cuda_stream(),
        })
    }

    /// [`Kernel::load`] of the `T` instance of a kernel built for every float dtype (the name
    /// gets `T`'s dtype as its last part: `bias_add_f32`, `softmax_fused_vec_bf16`).
    pub(crate) fn load_typed<T: candle_core::WithDType>(
        dev: &CudaDevice, module: Module, parts: &[&str],
    ) -> Result<Self> {
        let mut parts = parts.to_vec();
        parts.push(T::DTYPE.as_str());
        Self::load(dev, module, &parts)
    }

    /// The one launch path of the crate: pushes the kernel's arguments and launches it on the
    /// device's stream.
    ///
    /// # Safety
    /// The arguments pushed by `push_args` must match the kernel's signature, and the launch
    /// configuration must keep every access of the kernel inside the buffers it is given.
    pub(crate) unsafe fn launch<'a>(
        &'a self, cfg: LaunchConfig, push_args: impl FnOnce(&mut driver::LaunchArgs<'a>),
    ) -> Result<()> {
        let mut builder = self.stream.launch_builder(&self.func);
        push_args(&mut builder);
        builder.launch(cfg).w()?;
        Ok(())
    }

    /// Lets the kernel launch with up to `bytes` of dynamic shared memory (past the 48 KiB a
    /// kernel gets without asking).
    pub(crate) fn allow_dynamic_shared(&self, bytes: usize) -> Result<()> {
        use driver::sys::CUfunction_attribute_enum as Attr;
        self.func
            .set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .w()
    }

    /// How many blocks of `threads` threads and `shared_mem_bytes` of dynamic shared memory fit
    /// on one multiprocessor at once (registers, shared memory and thread limits), at least 1.
    pub(crate) fn resident_blocks_per_sm(
        &self, threads: u32, shared_mem_bytes: usize,
    ) -> Result<u32> {
        let blocks = self
            .func
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared_mem_bytes, None)
            .w()?;
        Ok(blocks.max(1))
    }
}

/// A launch parameter forced through the environment for tuning runs (`benches/` sweeps), read
/// once per name; `None` when unset or unparsable, and always `None` without the `tuning` cargo
/// feature (release builds read no environment variable that changes what the ops compute).
#[cfg(not(feature = "tuning"))]
pub(crate) fn tuning(_name: &'static str) -> Option<u32> {
    None
}

/// See the other cfg of this function.
#[cfg(feature = "tuning")]
pub(crate) fn tuning(name: &'static str) -> Option<u32> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static VALUES: OnceLock<Mutex<HashMap<&'static str, Option<u32>>>> = OnceLock::new();
    let mut values = VALUES.get_or_init(Default::default).lock().ok()?;
    *values
        .entry(name)
        .or_insert_with(|| std::env::var(name).ok().and_then(|v| v.parse().ok()))
}

/// Allocates an output buffer the kernel is expected to overwrite completely.
pub(crate) fn alloc_output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the kernel writes every element (and tests check it with poisoning on).
    let mut out = unsafe { dev.alloc::<T>(len)? };
    if crate::poison::poison_outputs() {
        fill_bytes(dev, &mut out, 0xFF)?;
    }
    Ok(out)
}

/// Sets every byte of `buf` to `byte`, asynchronously on the device's stream.
pub(crate) fn fill_bytes<T: DeviceRepr>(
    dev: &CudaDevice, buf: &mut CudaSlice<T>, byte: u8,
) -> Result<()> {
    let bytes = buf.len() * std::mem::size_of::<T>();
    if bytes == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    let (ptr, _guard) = driver::DevicePtrMut::device_ptr_mut(buf, &stream);
    // SAFETY: `ptr` addresses `bytes` bytes owned by `buf`.
    unsafe { fill_bytes_at(dev, ptr, bytes, byte) }
}

/// Sets `bytes` bytes from device address `ptr` to `byte`, asynchronously on the device's stream.
///
/// # Safety
/// `ptr` must address at least `bytes` bytes of live device memory that nothing reads or writes
/// concurrently outside the device's stream.
pub(crate) unsafe fn fill_bytes_at(
    dev: &CudaDevice, ptr: u64, bytes: usize, byte: u8,
) -> Result<()> {
    let stream = dev.cuda_stream();
    // SAFETY: guaranteed by the caller.
    unsafe { driver::result::memset_d8_async(ptr, byte, bytes, stream.cu_stream()) }.w()?;
    Ok(())
}

/// Number of streaming multiprocessors, for sizing persistent / grid-stride launches.
pub(crate) fn sm_count(dev: &CudaDevice) -> Result<u32> {
    use driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
    Ok(device_attribute(dev, SMS)?.max(1) as u32)
}

/// Size of the device's L2 cache in bytes, for sizing the working set of gather kernels.
pub(crate) fn l2_bytes(dev: &CudaDevice) -> Result<usize> {
    use driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE as L2;
    Ok(device_attribute(dev, L2)?.max(0) as usize)
}

/// The most dynamic shared memory one block may opt into on the device, in bytes.
pub(crate) fn max_shared_per_block(dev: &CudaDevice) -> Result<usize> {
    use driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
    Ok(device_attribute(dev, OPTIN)?.max(0) as usize)
}

/// Whether the device is compute capability 9.0 (H100, H200), the one GPU the `compute_90a` PTX
/// of [`Module::AttentionSm90`], [`Module::ArgminSm90`], [`Module::SpanSm90`] and
/// [`Module::SmallFcLOptSm90`] loads on.
pub(crate) fn is_hopper(dev: &CudaDevice) -> Result<bool> {
    use driver::sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    Ok(device_attribute(dev, MAJOR)? == 9 && device_attribute(dev, MINOR)? == 0)
}

fn device_attribute(dev: &CudaDevice, attribute: driver::sys::CUdevice_attribute) -> Result<i32> {
    dev.cuda_stream().context().attribute(attribute).w()
}

/// A 1-D launch of `threads`-wide blocks covering `work` items with a grid-stride loop: at most
/// `blocks_per_sm` resident blocks per multiprocessor, never more blocks than there is work.
pub(crate) fn grid_stride_config(
    dev: &CudaDevice, work: u64, threads: u32, blocks_per_sm: u32, shared_mem_bytes: u32,
) -> Result<LaunchConfig> {
    let wanted = work.div_ceil(threads as u64).max(1);
    let cap = sm_count(dev)? as u64 * blocks_per_sm as u64;
    Ok(LaunchConfig {
        grid_dim: (wanted.min(cap) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    })
}

/// Division by a launch constant as the kernels do it: `(umulhi(n, multiplier) + n) >> shift`
/// (Granlund & Montgomery's round-up method). Exact for every 32-bit `n` when the addition is
/// done in 64 bits, for `n < 2^31` in 32 bits. Divisors up to `u32::MAX`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FastDiv {
    pub divisor: u32,
    pub multiplier: u32,
    pub shift: u32,
}
// Mirrored by `FastDiv` in src/cuda/softmax.cu.
mirrored_struct!(FastDiv, 12);

impl FastDiv {
    pub(crate) fn new(divisor: usize) -> Self {
        let d = divisor.clamp(1, u32::MAX as usize) as u64;
        let shift = 64 - (d - 1).leading_zeros() as u64; // ceil(log2(d)); 0 for d = 1
        let multiplier = (((1u64 << 32) * ((1u64 << shift) - d)) / d + 1) as u32;
        Self {
            divisor: d as u32,
            multiplier,
            shift: shift as u32,
        }
    }

    /// The kernels' quotient with the 64-bit addition (tests compare it with `/`).
    #[cfg(test)]
    fn div(&self, n: u32) -> u64 {
        let hi = (n as u64 * self.multiplier as u64) >> 32;
        (hi + n as u64) >> self.shift
    }
}

/// Division of any 64-bit `n` by a launch constant (Granlund & Montgomery's round-up method):
/// `t = umulhi(multiplier, n)`, `q = (t + ((n - t) >> shift1)) >> shift2`. Exact for every
/// divisor from 1 to `u64::MAX`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FastDiv64 {
    pub divisor: u64,
    pub multiplier: u64,
    pub shift1: u32,
    pub shift2: u32,
}
// Mirrored by `FastDiv64` in src/cuda/bias_add.cu.
mirrored_struct!(FastDiv64, 24);

impl FastDiv64 {
    pub(crate) fn new(divisor: u64) -> Self {
        let d = divisor.max(1);
        let l = 64 - (d - 1).leading_zeros(); // ceil(log2(d)); 0 for d = 1
                                              // floor(2^64 (2^l - d) / d) + 1 < 2^64, since 2^l - d < d.
        let multiplier = (((1u128 << 64) * ((1u128 << l) - d as u128)) / d as u128 + 1) as u64;
        Self {
            divisor: d,
            multiplier,
            shift1: l.min(1),
            shift2: l.max(1) - 1,
        }
    }

    /// The kernels' quotient (tests compare it with `/`).
    #[cfg(test)]
    fn div(&self, n: u64) -> u64 {
        let t = ((self.multiplier as u128 * n as u128) >> 64) as u64;
        (t + ((n - t) >> self.shift1)) >> self.shift2
    }
}

#[cfg(test)]
mod tests {
    use super::{FastDiv, FastDiv64};

    #[test]
    fn fast_div_quotients_are_exact() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut divisors: Vec<u64> = (1..=70).collect();
        divisors.extend([
            255,
            256,
            257,
            1023,
            1024,
            4097,
            50257,
            (1 << 31) - 1,
            1 << 31,
            (1 << 31) + 1,
            u32::MAX as u64 - 1,
            u32::MAX as u64,
        ]);
        divisors.extend((0..200).map(|_| 1 + next() % u32::MAX as u64));
        for d in divisors {
            let v = FastDiv::new(d as usize);
            let mut ns: Vec<u32> = vec![0, 1, u32::MAX, u32::MAX - 1, d as u32];
            ns.extend((0..500).map(|_| next() as u32));
            ns.extend((0..50).map(|_| ((next() % 1024) as u32).wrapping_mul(d as u32)));
            for n in ns {
                assert_eq!(v.div(n), n as u64 / d, "{n} / {d}");
            }
        }
    }

    #[test]
    fn fast_div64_quotients_are_exact() {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut divisors: Vec<u64> = (1..=70).collect();
        divisors.extend([
            255,
            256,
            257,
            4097,
            50257,
            (1 << 31) + 1,
            (1 << 32) - 1,
            1 << 32,
        ]);
        divisors.extend([
            (1 << 63) - 1,
            1 << 63,
            (1 << 63) + 1,
            u64::MAX - 1,
            u64::MAX,
        ]);
        divisors.extend((0..200).map(|_| next() >> (next() % 64)).filter(|&d| d > 0));
        for d in divisors {
            let fd = FastDiv64::new(d);
            let mut numerators = vec![0, 1, d - 1, d, d.wrapping_add(1), u64::MAX, u64::MAX - 1];
            numerators.extend((1..4).map(|k| d.wrapping_mul(k)));
            numerators.extend((0..300).map(|_| next() >> (next() % 64)));
            for n in numerators {
                assert_eq!(fd.div(n), n / d, "{n} / {d}");
            }
        }
    }
}
