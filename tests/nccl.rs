//! The data-parallel code on GPUs through NCCL, ranks as threads of this process (one GPU
//! each). Built only with the `nccl` feature; each test says SKIPPED and passes where NCCL or
//! enough GPUs are missing (CI compiles these without a GPU). One test runs a group of one rank
//! on a single GPU; the others need two.

#[path = "shared/dist_checks.rs"]
mod dist_checks;

use candle_core::{DType, Device, Result};
use candle_fastops::dist::{Collectives, NcclGroup, ReduceOp, WireDType};
use dist_checks::*;
use std::rc::Rc;

fn gpus_with_nccl(needed: usize) -> bool {
    let version = match NcclGroup::nccl_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("note: NCCL unavailable ({e}): NCCL test SKIPPED");
            return false;
        }
    };
    let count = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap_or(0)
        as usize;
    if count < needed {
        eprintln!("note: {count} GPU(s), this test needs {needed}: SKIPPED (NCCL {version:?})");
        return false;
    }
    eprintln!("note: NCCL {version:?}, {count} GPU(s)");
    true
}

/// Runs `f` on `world` ranks, rank `r` a thread on GPU `r` with its own NCCL communicator.
fn on_gpus<T: Send>(world: usize, f: impl Fn(Rc<NcclGroup>) -> Result<T> + Sync) -> Vec<T> {
    let id = NcclGroup::unique_id().expect("NCCL unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let dev = Device::new_cuda(rank)?;
                    let group = NcclGroup::from_unique_id(id, rank, world, &dev)?;
                    f(Rc::new(group))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.join() {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => panic!("rank {rank}: {e}"),
                Err(_) => panic!("rank {rank} panicked"),
            })
            .collect()
    })
}

fn all_checks(world: usize) {
    for (dtype, wire) in [
        (DType::F32, WireDType::F32),
        (DType::BF16, WireDType::F32),
        (DType::F32, WireDType::Bf16),
        (DType::F16, WireDType::F32),
    ] {
        on_gpus(world, |g| {
            check_grad_all_reduce(&*g, dtype, wire, 0x5eed ^ world as u64)
        });
    }
    // Sum and gather of integers and floats.
    let out = on_gpus(world, |g| {
        let t = candle_core::Tensor::new(&[g.rank() as u32 + 1, 7], g.device())?;
        let sum = g.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<u32>()?;
        let all = g.all_gather(&t.to_dtype(DType::F32)?)?.to_vec2::<f32>()?;
        Ok((sum, all))
    });
    let n = world as u32;
    for (sum, all) in out {
        assert_eq!(sum, vec![n * (n + 1) / 2, 7 * n]);
        let want: Vec<Vec<f32>> = (0..world).map(|r| vec![r as f32 + 1.0, 7.0]).collect();
        assert_eq!(all, want);
    }
    let dir =
        std::env::temp_dir().join(format!("fastops-nccl-zero-{}-{world}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for deterministic in [true, false] {
        on_gpus(world, |g| {
            check_sharded_small_fc_lopt(g, deterministic, &dir)
        });
    }
    on_gpus(world, |g| check_sharded_adamw(g, &dir));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn one_rank_on_one_gpu() {
    if gpus_with_nccl(1) {
        all_checks(1);
    }
}

#[test]
fn two_ranks_on_two_gpus() {
    if gpus_with_nccl(2) {
        all_checks(2);
        on_gpus(2, |g| check_mismatch_is_an_error(&*g));
    }
}

#[test]
fn two_gpus_match_one_gpu_with_the_whole_batch() {
    if !gpus_with_nccl(2) {
        return;
    }
    let one = on_gpus(1, |g| ddp_losses(g, 16, 20)).remove(0);
    let two = on_gpus(2, |g| ddp_losses(g, 8, 20));
    assert_eq!(two[0], two[1], "both ranks report the same losses");
    for (step, (a, b)) in two[0].iter().zip(&one).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "step {step}: 2 GPUs {a}, 1 GPU {b}"
        );
    }
    assert!(one[19] < one[0], "the loss falls: {one:?}");
}
