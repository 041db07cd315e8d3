//! Locking many tensors at once for a multi-tensor kernel step (small_fc_lopt, AdamW): written tensors through
//! candle's in-place op path (write locks), read ones through read locks, in candle's lock order.

use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::{bail, DType, Result, Storage, Tensor};

/// Calls `f` with the device address of the first element of each of `tensors` (u32, f32, f16
/// or bf16), every one held locked meanwhile: `(tensor, true)` write-locked through candle's
/// in-place op path (the kernels write it), `(tensor, false)` read-locked. Write locks are taken
/// in the order of their storages' addresses, as candle orders its own, so two threads never wait
/// on each other. Two written tensors sharing a storage, or a read one sharing a written one's (a
/// gradient that is a view of its parameter, say), are an error: the kernels would race.
///
/// Each write lock is one level of nested in-place ops, so the locks are taken by a helper thread
/// whose stack grows with the number of written tensors (a few KiB each; one thread per step
/// costs tens of microseconds against a step of milliseconds); `f` runs on the calling thread.
pub(crate) fn with_locked_addresses(
    op: &str, dev: &candle_core::CudaDevice, tensors: &[(&Tensor, bool)],
    f: impl FnOnce(&[u64]) -> Result<()>,
) -> Result<()> {
    // Storage identity: the address of the storage behind each tensor's lock.
    let mut keyed: Vec<(usize, bool)> = tensors
        .iter()
        .map(|&(t, write)| {
            let (storage, _) = t.storage_and_layout();
            (&*storage as *const Storage as usize, write)
        })
        .collect();
    let keys: Vec<usize> = keyed.iter().map(|k| k.0).collect();
    keyed.sort_unstable();
    for pair in keyed.windows(2) {
        if pair[0].0 == pair[1].0 && (pair[0].1 || pair[1].1) {
            bail!(
                "{op}: two tensors of one step share memory (a gradient that is a view of a \
                 parameter, say); the step would write what it reads"
            );
        }
    }
    // Read locks first, flat; then the write locks, nested.
    let reads: Vec<_> = tensors
        .iter()
        .enumerate()
        .filter(|(_, (_, write))| !write)
        .map(|(i, (t, _))| (i, t.storage_and_layout()))
        .collect();
    let mut addrs = vec![0u64; tensors.len()];
    for (i, (storage, layout)) in &reads {
        let Storage::Cuda(s) = &**storage else {
            bail!("{op}: internal error, a tensor of the step is not on the GPU");
        };
        addrs[*i] = first_element_address(op, s, layout)?;
    }
    let mut writes: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].1).collect();
    writes.sort_by_key(|&i| keys[i]);
    // A helper thread takes the nested write locks and holds them while this thread (the one
    // that queued the gradients) queues the launches, so the launches keep the caller's place in
    // the stream's order.
    let stack = (1 << 20) + writes.len() * (8 << 10);
    let ctx = dev.cuda_stream().context().clone();
    let (addrs_tx, addrs_rx) = std::sync::mpsc::channel::<Result<Vec<u64>>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let result = std::thread::scope(|scope| {
        let holder = std::thread::Builder::new()
            .stack_size(stack)
            .spawn_scoped(scope, move || {
                let sent = std::cell::Cell::new(false);
                let mut hold = |addrs: &[u64]| -> Result<()> {
                    sent.set(true);
                    let _ = addrs_tx.send(Ok(addrs.to_vec()));
                    // Every lock stays held until the caller has queued the launches (or
                    // dropped its end).
                    let _ = done_rx.recv();
                    Ok(())
                };
                let locked = candle_core::cuda_backend::WrapErr::w(ctx.bind_to_thread())
                    .and_then(|()| lock_next(op, tensors, &writes, &mut addrs, &mut hold));
                if let Err(e) = locked {
                    if !sent.get() {
                        let _ = addrs_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| candle_core::Error::Msg(format!("{op}: cannot start the step: {e}")))?;
        let result = match addrs_rx.recv() {
            Ok(Ok(addrs)) => f(&addrs),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(candle_core::Error::Msg(format!(
                "{op}: internal error, the locking thread stopped"
            ))),
        };
        drop(done_tx);
        holder
            .join()
            .map_err(|_| candle_core::Error::Msg(format!("{op}: the locking thread panicked")))?;
        result
    });
    drop(reads);
    result
}

/// Write-locks `tensors[order[0]]`, records its address, and recurses on the rest of `order`;
/// calls `leaf` with every lock held.
fn lock_next(
    op: &str, tensors: &[(&Tensor, bool)], order: &[usize], addrs: &mut [u64],
    leaf: &mut dyn FnMut(&[u64]) -> Result<()>,
) -> Result<()> {
    let Some((&i, rest)) = order.split_first() else {
        return leaf(addrs);
    };
    let locked = WriteLocked {
        op,
        tensors,
        index: i,
        rest,
        state: std::cell::RefCell::new((addrs, leaf)),
    };
    tensors[i].0.inplace_op1(&locked)
}

/// The address of the first element of a CUDA storage's view (f32 or u32 buffers).
fn first_element_address(
    op: &str, s: &candle_core::CudaStorage, layout: &candle_core::Layout,
) -> Result<u64> {
    let stream = s.device.cuda_stream();
    let dtype = candle_core::backend::BackendStorage::dtype(s);
    let base = match dtype {
        DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::F16 => s.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        other => bail!("{op}: internal error, a {other:?} buffer in the step"),
    };
    Ok(base + (dtype.size_in_bytes() * layout.start_offset()) as u64)
}

/// The in-place op through which [`lock_next`] holds a written tensor's write lock while it
/// locks the rest: candle's sanctioned mutable access to a storage.
struct WriteLocked<'a, 'b> {
    op: &'a str,
    tensors: &'a [(&'a Tensor, bool)],
    index: usize,
    rest: &'a [usize],
    #[allow(clippy::type_complexity)]
    state: std::cell::RefCell<(&'b mut [u64], &'b mut dyn FnMut(&[u64]) -> Result<()>)>,
}

impl candle_core::InplaceOp1 for WriteLocked<'_, '_> {
    fn name(&self) -> &'static str {
        "fastops-multi-tensor-step"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &candle_core::Layout) -> Result<()> {
        bail!(
            "{}: internal error, the multi-tensor step runs on CUDA only",
            self.op
        )
    }

    fn cuda_fwd(
        &self, storage: &mut candle_core::CudaStorage, layout: &candle_core::Layout,
    ) -> Result<()> {
        let mut state = self.state.borrow_mut();
        let (addrs, leaf) = &mut *state;
        addrs[self.index] = first_element_address(self.op, storage, layout)?;
        lock_next(self.op, self.tensors, self.rest, addrs, *leaf)
    }
}
