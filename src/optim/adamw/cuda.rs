//! The CUDA step (`src/cuda/adamw.cu`): the tensors grouped by dtype, up to [`GROUP`] per launch,
//! every parameter and moment written in place (write-locked through candle's in-place path
//! for the whole step).

use super::{Hyper, VarState, OP};
use crate::cuda::{kernel_args, Kernel, Module};
use crate::dispatch::mirrored_struct;
use crate::kernel_constants::adamw::{CHUNK, GROUP, THREADS};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Mirrors `AdamWTensors` in the kernel (no padding: 2120 bytes of u64 and u32 fields).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AdamWTensors {
    param: [u64; GROUP],
    grad: [u64; GROUP],
    m: [u64; GROUP],
    v: [u64; GROUP],
    n: [u64; GROUP],
    chunk_start: [u32; GROUP + 1],
    count: u32,
}
mirrored_struct!(AdamWTensors, 5 * 8 * GROUP + 4 * (GROUP + 2), kernel_arg);

/// Mirrors `AdamWHyper` in the kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct AdamWHyper {
    lr: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    scale_m: f32,
    scale_v: f32,
    eps: f32,
    pad: f32,
}
mirrored_struct!(AdamWHyper, 32, kernel_arg);

/// One step over `work` (state index, gradient contiguous in the variable's dtype).
pub(super) fn step(
    dev: &CudaDevice, states: &[VarState], work: &[(usize, Tensor)], h: Hyper,
) -> Result<()> {
    if work.is_empty() {
        return Ok(());
    }
    for (i, _) in work {
        if states[*i].var.dtype() == DType::F64 {
            bail!(
                "{OP}: f64 variables step on the CPU only (`{}`)",
                states[*i].name
            );
        }
    }
    // Locked in order: per tensor (grad read, param / m / v written).
    let mut locked: Vec<(&Tensor, bool)> = Vec::with_capacity(4 * work.len());
    for (i, g) in work {
        let s = &states[*i];
        locked.extend([
            (g, false),
            (s.var.as_tensor(), true),
            (&s.m, true),
            (&s.v, true),
        ]);
    }
    let hyper = AdamWHyper {
        lr: h.lr as f32,
        decay: h.decay as f32,
        beta1: h.beta1 as f32,
        beta2: h.beta2 as f32,
        scale_m: h.scale_m as f32,
        scale_v: h.scale_v as f32,
        eps: h.eps as f32,
        pad: 0.0,
    };
    crate::cuda::locks::with_locked_addresses(OP, dev, &locked, |addrs| {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let of_dtype: Vec<usize> = (0..work.len())
                .filter(|&k| states[work[k].0].var.dtype() == dtype)
                .collect();
            if of_dtype.is_empty() {
                continue;
            }
            let kernel = Kernel::load(dev, Module::AdamW, &["adamw_step", dtype.as_str()])?;
            for group in of_dtype.chunks(GROUP) {
                let mut t = AdamWTensors {
                    param: [0; GROUP],
                    grad: [0; GROUP],
                    m: [0; GROUP],
                    v: [0; GROUP],
                    n: [0; GROUP],
                    chunk_start: [0; GROUP + 1],
                    count: group.len() as u32,
                };
                let mut chunks = 0usize;
                for (slot, &k) in group.iter().enumerate() {
                    let n = states[work[k].0].var.elem_count();
                    t.grad[slot] = addrs[4 * k];
                    t.param[slot] = addrs[4 * k + 1];
                    t.m[slot] = addrs[4 * k + 2];
                    t.v[slot] = addrs[4 * k + 3];
                    t.n[slot] = n as u64;
                    t.chunk_start[slot] = chunks as u32;
                    chunks += n.div_ceil(CHUNK);
                }
                if chunks > u32::MAX as usize {
                    bail!("{OP}: {chunks} chunks in one launch");
                }
                t.chunk_start[group.len()] = chunks as u32;
                let cfg = LaunchConfig {
                    grid_dim: (chunks as u32, 1, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: every address is the first element of a locked, contiguous tensor of
                // `n` elements of the kernel's dtype (moments f32); block b touches only chunk b
                // of the tensor the chunk starts index, inside its `n` elements.
                unsafe { kernel.launch(cfg, kernel_args!(&t, &hyper)) }?;
            }
        }
        Ok(())
    })
}
