//! Data-parallel training: one process (or thread) per device, gradients averaged across them,
//! and the learned optimizer's state sharded ZeRO-1 style.
//!
//! * [`Collectives`] is what a process group offers: all-reduce, all-gather and grouped
//!   broadcasts of candle tensors. `NcclGroup` (feature `nccl`) runs them on GPUs through NCCL
//!   (cudarc's bindings, on candle's own CUDA stream, so they order with the model's kernels);
//!   [`LocalGroup`] runs them between threads of one process (CPU or one GPU), for tests and for
//!   trying the data-parallel code on any machine.
//! * [`DistEnv`] reads the torchrun-style environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`, `MASTER_PORT`); [`launch`] starts one process per GPU with it, as torchrun
//!   does, and fails cleanly (every rank stopped, the failed rank named) when one rank dies. The
//!   NCCL unique id travels from rank 0 over a small TCP exchange with a timeout
//!   ([`rendezvous`]).
//! * [`GradAllReduce`] averages a `GradStore`'s gradients over the ranks in flat buckets (25 MiB
//!   by default, f32 or bf16 on the wire), with the variables ordered by name so that every rank
//!   buckets them the same way; at start-up the ranks compare a hash of their names, shapes and
//!   dtypes and fail with a clear error when they differ.
//! * [`DataParallel`] wraps any [`candle_nn::Optimizer`] (AdamW included): backward, all-reduce,
//!   step. [`Sharded`] ([`ShardedSmallFcLOpt`], [`ShardedAdamW`]) keeps an optimizer's state
//!   only for the tensors a rank owns (a size-balanced partition of whole tensors), steps them,
//!   and broadcasts the updated parameters from their owners.
//!
//! Overlap: candle's `Tensor::backward` returns the whole `GradStore` at its end and offers no
//! per-gradient hook, so the all-reduce cannot start while the backward is still running. The
//! buckets are queued on the device's stream back to back (NCCL's kernels run behind the
//! packing of the next bucket); the host waits for the device only where a variable has no
//! gradient on its rank (to learn whether another rank had one).
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_fastops::dist::{BucketConfig, DataParallel, LocalGroup};
//! use candle_nn::{Optimizer, ParamsAdamW};
//! // Two ranks as two threads on the CPU; with the `nccl` feature `NcclGroup` takes their place.
//! let groups = LocalGroup::new(2, &Device::Cpu);
//! let weights: Vec<f32> = std::thread::scope(|s| {
//!     let handles: Vec<_> = groups
//!         .into_iter()
//!         .map(|group| {
//!             s.spawn(move || -> candle_core::Result<Vec<f32>> {
//!                 let w = Var::from_tensor(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?)?;
//!                 let adamw = candle_nn::AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
//!                 let vars = vec![("w".to_string(), w.clone())];
//!                 let mut ddp = DataParallel::new(adamw, vars, group, BucketConfig::default())?;
//!                 // Each rank sees its own data; the step uses the average gradient.
//!                 let x = Tensor::new(&[1f32 + ddp.rank() as f32; 3], &Device::Cpu)?;
//!                 ddp.backward_step(&(w.as_tensor() * x)?.sum_all()?)?;
//!                 w.as_tensor().to_vec1::<f32>()
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect::<Vec<_>>()
//! })
//! .concat();
//! assert_eq!(weights[..3], weights[3..]); // every rank holds the same parameters
//! # Ok::<(), candle_core::Error>(())
//! ```

mod data_parallel;
mod grads;
mod launch;
mod local;
#[cfg(feature = "nccl")]
mod nccl;
mod partition;
pub mod rendezvous;
mod zero;

pub use data_parallel::DataParallel;
pub use grads::{BucketConfig, GradAllReduce, WireDType};
pub use launch::{launch, DistEnv};
pub use local::LocalGroup;
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
pub use partition::partition_by_size;
pub use zero::{ShardableOptimizer, Sharded, ShardedAdamW, ShardedSmallFcLOpt};

use candle_core::{Device, Result, Tensor, Var};

/// How [`Collectives::all_reduce`] combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The element-wise sum.
    Sum,
    /// The element-wise mean (the sum divided by the world size).
    Avg,
}

/// The collective operations of a process group. Every rank must call the same operations in
/// the same order with tensors of the same shapes and dtypes (the usual contract of NCCL and
/// `torch.distributed`); a rank that does not take part makes the others wait.
pub trait Collectives {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// The device this rank's tensors live on.
    fn device(&self) -> &Device;
    /// The element-wise sum (or mean) of `tensor` over the ranks, as a new contiguous tensor of
    /// its shape. f32, f64, f16, bf16, u32 and i64 are accepted.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// [`Collectives::all_reduce`] that may reduce in `tensor`'s own storage and return it, as
    /// `torch.distributed.all_reduce` does (no output allocation or copy; NCCL reduces a
    /// contiguous tensor in place). Pass a tensor nothing else reads: any other tensor that
    /// shares its storage sees the result.
    fn all_reduce_in_place(&self, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.all_reduce(&tensor, op)
    }
    /// The ranks' `tensor`s concatenated along a new leading dim: `[world_size, ..shape]`.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor>;
    /// For each `(var, root)`: every rank's `var` takes `root`'s values, in place. The calls are
    /// issued as one group (one NCCL group call for every variable).
    fn broadcast_vars(&self, vars: &[(Var, usize)]) -> Result<()>;
}

/// A shared group (`Rc` / `Arc` of one) is a group: several wrappers (a `DataParallel`, a sharded
/// optimizer, the training loop) can hold the same one.
macro_rules! shared_group {
    ($pointer:ty) => {
        impl<C: Collectives + ?Sized> Collectives for $pointer {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn device(&self) -> &Device {
                (**self).device()
            }
            fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
                (**self).all_reduce(tensor, op)
            }
            fn all_reduce_in_place(&self, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
                (**self).all_reduce_in_place(tensor, op)
            }
            fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
                (**self).all_gather(tensor)
            }
            fn broadcast_vars(&self, vars: &[(Var, usize)]) -> Result<()> {
                (**self).broadcast_vars(vars)
            }
        }
    };
}
shared_group!(std::rc::Rc<C>);
shared_group!(std::sync::Arc<C>);

/// Checks that every rank passed the same `value` (e.g. a hash of its variables): gathers it
/// from all ranks and names the first rank that differs from rank 0.
pub(crate) fn check_same_on_every_rank<C: Collectives + ?Sized>(
    group: &C, value: u64, what: &str,
) -> Result<()> {
    let words = Tensor::new(&[value as u32, (value >> 32) as u32], group.device())?;
    let all = group.all_gather(&words)?.to_vec2::<u32>()?;
    let values: Vec<u64> = all
        .iter()
        .map(|w| w[0] as u64 | ((w[1] as u64) << 32))
        .collect();
    if let Some((rank, other)) = values.iter().enumerate().find(|(_, v)| **v != values[0]) {
        candle_core::bail!(
            "dist: rank {rank} holds different {what} than rank 0 (hash {other:#018x} against \
             {:#018x}); every rank must pass the same names, shapes and dtypes",
            values[0]
        );
    }
    Ok(())
}
