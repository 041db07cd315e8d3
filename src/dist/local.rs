//! [`LocalGroup`]: the collectives between threads of one process.

use super::{Collectives, ReduceOp};
use candle_core::{bail, Device, Result, Tensor, Var};
use std::sync::{Arc, Barrier, Mutex};

/// A process group whose ranks are threads of this process, each with its own device (the CPU,
/// or one GPU shared by every rank). Sums run in rank order, so every rank gets the same bits.
/// Meant for tests and for trying data-parallel code without several GPUs: every rank must call
/// the same collectives in the same order, and a rank that stops (returns or panics) leaves the
/// others waiting, as with any process group.
///
/// On CUDA every collective first waits for the calling rank's queued work (candle's devices
/// queue each thread's work on that thread's own stream, so tensors handed between rank threads
/// must be complete): a collective is a synchronisation point, as a blocking NCCL call is.
#[derive(Clone)]
pub struct LocalGroup {
    rank: usize,
    world_size: usize,
    device: Device,
    shared: Arc<Shared>,
}

struct Shared {
    /// One deposit per rank for the collective in progress.
    slots: Mutex<Vec<Vec<Option<Tensor>>>>,
    barrier: Barrier,
}

impl std::fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device.location())
            .finish()
    }
}

impl LocalGroup {
    /// `world_size` ranks on one device; hand one to each thread.
    pub fn new(world_size: usize, device: &Device) -> Vec<LocalGroup> {
        Self::with_devices(vec![device.clone(); world_size.max(1)])
    }

    /// One rank per device of `devices` (rank `i` on `devices[i]`).
    pub fn with_devices(devices: Vec<Device>) -> Vec<LocalGroup> {
        let world_size = devices.len();
        let shared = Arc::new(Shared {
            slots: Mutex::new(vec![Vec::new(); world_size]),
            barrier: Barrier::new(world_size),
        });
        devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| LocalGroup {
                rank,
                world_size,
                device,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Deposits this rank's tensors, waits for every rank, and returns every rank's deposit.
    /// The second barrier keeps a rank from overwriting its slot (in the next collective) while
    /// another still reads it.
    ///
    /// On CUDA each rank thread queues its work on its own stream (candle's devices use the
    /// per-thread default stream), so a rank finishes the work that produces its deposit before
    /// handing it over: another rank's kernels will read it from another stream. The deposits
    /// are shared handles, so a buffer stays allocated while any rank still holds it.
    fn exchange(&self, deposit: Vec<Option<Tensor>>) -> Result<Vec<Vec<Option<Tensor>>>> {
        self.device.synchronize()?;
        self.lock()?[self.rank] = deposit;
        self.shared.barrier.wait();
        let all = self.lock()?.clone();
        self.shared.barrier.wait();
        Ok(all)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<Vec<Option<Tensor>>>>> {
        self.shared
            .slots
            .lock()
            .map_err(|_| candle_core::Error::Msg("dist: a LocalGroup rank panicked".into()))
    }

    /// Every rank's single tensor, checked to agree in shape and dtype with this rank's.
    fn gather_checked(&self, tensor: &Tensor, what: &str) -> Result<Vec<Tensor>> {
        let all = self.exchange(vec![Some(tensor.clone())])?;
        let mut out = Vec::with_capacity(self.world_size);
        for (rank, deposit) in all.into_iter().enumerate() {
            let Some(Some(t)) = deposit.into_iter().next() else {
                bail!("dist: rank {rank} took part in another collective than {what}");
            };
            if t.dims() != tensor.dims() || t.dtype() != tensor.dtype() {
                bail!(
                    "dist: {what}: rank {rank} passed {:?} {:?}, rank {} {:?} {:?}",
                    t.dims(),
                    t.dtype(),
                    self.rank,
                    tensor.dims(),
                    tensor.dtype()
                );
            }
            out.push(t.to_device(&self.device)?);
        }
        Ok(out)
    }
}

impl Collectives for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let all = self.gather_checked(tensor, "all_reduce")?;
        let mut sum = all[0].clone();
        for t in &all[1..] {
            sum = (sum + t)?;
        }
        match op {
            ReduceOp::Sum => sum.contiguous(),
            ReduceOp::Avg if tensor.dtype().is_float() => {
                sum.affine(1.0 / self.world_size as f64, 0.0)
            }
            ReduceOp::Avg => bail!("dist: all_reduce Avg of {:?}", tensor.dtype()),
        }
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        Tensor::stack(&self.gather_checked(tensor, "all_gather")?, 0)
    }

    fn broadcast_vars(&self, vars: &[(Var, usize)]) -> Result<()> {
        if let Some((var, root)) = vars.iter().find(|(_, root)| *root >= self.world_size) {
            bail!(
                "dist: broadcast root {root} (variable of shape {:?}) is not a rank of {}",
                var.dims(),
                self.world_size
            );
        }
        let deposit = vars
            .iter()
            .map(|(var, root)| (*root == self.rank).then(|| var.as_tensor().clone()))
            .collect();
        // The roots' values final before another rank's stream reads them (see `exchange`).
        self.device.synchronize()?;
        self.lock()?[self.rank] = deposit;
        self.shared.barrier.wait();
        // Copy while the roots wait at the second barrier, so their variables stay unchanged.
        let result = (|| -> Result<()> {
            let all = self.lock()?.clone();
            for (i, (var, root)) in vars.iter().enumerate() {
                if *root == self.rank {
                    continue;
                }
                match all[*root].get(i) {
                    Some(Some(t)) if t.dims() == var.dims() => {
                        var.set(&t.to_device(&self.device)?.to_dtype(var.dtype())?)?
                    }
                    _ => bail!(
                        "dist: broadcast: rank {root} did not send variable {i} of shape {:?}",
                        var.dims()
                    ),
                }
            }
            // The copies done before the roots, past the barrier, change their variables.
            self.device.synchronize()
        })();
        self.shared.barrier.wait();
        result
    }
}
