//! The data-parallel code with ranks as threads (`LocalGroup`), on the CPU and on one GPU:
//! gradient all-reduce, the start-up check, DDP losses against one rank with the whole batch,
//! the sharded learned optimizer, the rendezvous and the environment.

use crate::common::*;
use crate::dist_checks::*;
use candle_core::{DType, Device, Result};
use candle_fastops::dist::{
    partition_by_size, rendezvous, Collectives, DistEnv, LocalGroup, WireDType,
};
use std::time::Duration;

/// Runs `f` on every rank of a `LocalGroup` of `world` threads on `dev`; returns their results.
fn on_ranks<T: Send>(
    world: usize, dev: &Device, f: impl Fn(LocalGroup) -> Result<T> + Sync,
) -> Vec<T> {
    let groups = LocalGroup::new(world, dev);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.join() {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => panic!("rank {rank} on {:?}: {e}", dev.location()),
                Err(_) => panic!("rank {rank} on {:?} panicked", dev.location()),
            })
            .collect()
    })
}

#[test]
fn grad_all_reduce_is_the_mean_on_every_rank() {
    for dev in devices() {
        for world in [1, 2, 3] {
            for (dtype, wire) in [
                (DType::F32, WireDType::F32),
                (DType::BF16, WireDType::F32),
                (DType::F32, WireDType::Bf16),
                (DType::F16, WireDType::F32),
            ] {
                let salt = rng(world as u64).next_u64_compat();
                on_ranks(world, &dev, |g| {
                    check_grad_all_reduce(&g, dtype, wire, salt)
                });
            }
        }
    }
}

trait NextU64 {
    fn next_u64_compat(&mut self) -> u64;
}
impl<R: rand::Rng> NextU64 for R {
    fn next_u64_compat(&mut self) -> u64 {
        self.random::<u64>()
    }
}

#[test]
fn ranks_with_different_variables_fail_at_start_up() {
    for dev in devices() {
        on_ranks(2, &dev, |g| check_mismatch_is_an_error(&g));
    }
}

#[test]
fn two_ranks_match_one_rank_with_the_whole_batch() {
    for dev in devices() {
        let one = on_ranks(1, &dev, |g| ddp_losses(g, 16, 20)).remove(0);
        let two = on_ranks(2, &dev, |g| ddp_losses(g, 8, 20));
        assert_eq!(two[0], two[1], "both ranks report the same losses");
        for (step, (a, b)) in two[0].iter().zip(&one).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{:?} step {step}: 2 ranks {a}, 1 rank {b}",
                dev.location()
            );
        }
        assert!(one[19] < one[0], "the loss falls: {one:?}");
    }
}

#[test]
fn sharded_optimizers_match_the_unsharded_ones() {
    for dev in devices() {
        for world in [1, 2, 3] {
            let dir = std::env::temp_dir().join(format!(
                "fastops-zero-{}-{world}-{}",
                std::process::id(),
                dev.is_cuda()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            for deterministic in [true, false] {
                on_ranks(world, &dev, |g| {
                    check_sharded_small_fc_lopt(g, deterministic, &dir)
                });
            }
            on_ranks(world, &dev, |g| check_sharded_adamw(g, &dir));
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

#[test]
fn partition_is_balanced_and_the_same_for_the_same_sizes() {
    let sizes = [50usize, 7, 300, 1, 0, 120, 120, 33, 300, 9];
    for ranks in 1..=5 {
        let owners = partition_by_size(&sizes, ranks);
        assert_eq!(owners, partition_by_size(&sizes, ranks));
        assert!(owners.iter().all(|r| *r < ranks));
        let mut load = vec![0usize; ranks];
        for (s, r) in sizes.iter().zip(&owners) {
            load[*r] += s;
        }
        let total: usize = sizes.iter().sum();
        let max = *load.iter().max().unwrap();
        assert!(max <= total / ranks + 300, "{ranks} ranks: loads {load:?}");
        if ranks == 2 {
            assert_eq!(max, 470, "loads {load:?}");
        }
    }
}

#[test]
fn environment_is_parsed_with_clear_errors() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        DistEnv::from_lookup(move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    };
    assert_eq!(env(&[]).unwrap(), None);
    let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500")])
        .unwrap()
        .unwrap();
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.master_port),
        (1, 2, 1, 29500)
    );
    assert_eq!(e.master_addr, "127.0.0.1");
    for (pairs, needle) in [
        (&[("RANK", "0")][..], "WORLD_SIZE is not set"),
        (
            &[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..],
            "not below",
        ),
        (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "not a number"),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2")][..],
            "MASTER_PORT is not set",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")][..],
            "not a port",
        ),
    ] {
        let err = env(pairs).expect_err(needle).to_string();
        assert!(err.contains(needle), "{err}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn env_for(rank: usize, world: usize, port: u16) -> DistEnv {
    DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

#[test]
fn rendezvous_hands_rank0s_payload_to_every_rank() {
    let port = free_port();
    let payload: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(37)).collect();
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|rank| {
                let payload = payload.clone();
                s.spawn(move || {
                    let p = (rank == 0).then_some(payload.as_slice());
                    rendezvous::share_from_rank0(
                        &env_for(rank, 4, port),
                        p,
                        128,
                        Duration::from_secs(20),
                    )
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got.iter().all(|p| *p == payload));
}

#[test]
fn rendezvous_names_missing_ranks_after_the_timeout() {
    let port = free_port();
    let payload = [7u8; 128];
    // Rank 2 of 3 never comes.
    let (r0, r1) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            rendezvous::share_from_rank0(
                &env_for(0, 3, port),
                Some(&payload),
                128,
                Duration::from_millis(700),
            )
        });
        let b = s.spawn(|| {
            rendezvous::share_from_rank0(
                &env_for(1, 3, port),
                None,
                128,
                Duration::from_millis(700),
            )
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    let err = r0.expect_err("rank 2 is missing").to_string();
    assert!(err.contains("[2]") && err.contains("did not join"), "{err}");
    assert_eq!(
        r1.unwrap(),
        payload.to_vec(),
        "rank 1 was served before the timeout"
    );
    // A rank whose rank 0 never comes.
    let err = rendezvous::share_from_rank0(
        &env_for(1, 2, free_port()),
        None,
        128,
        Duration::from_millis(300),
    )
    .expect_err("no rank 0")
    .to_string();
    assert!(err.contains("could not reach rank 0"), "{err}");
    // A rank with another world size is refused.
    let port = free_port();
    let (r0, r1) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            rendezvous::share_from_rank0(
                &env_for(0, 2, port),
                Some(&payload),
                128,
                Duration::from_secs(5),
            )
        });
        let b = s.spawn(|| {
            rendezvous::share_from_rank0(&env_for(1, 3, port), None, 128, Duration::from_secs(5))
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(r0
        .expect_err("world sizes differ")
        .to_string()
        .contains("WORLD_SIZE 3"));
    assert!(r1.is_err());
}

#[test]
fn local_group_collectives() {
    for dev in devices() {
        let out = on_ranks(3, &dev, |g| {
            let t = candle_core::Tensor::new(&[g.rank() as f32 + 1.0, 10.0], g.device())?;
            let sum = g
                .all_reduce(&t, candle_fastops::dist::ReduceOp::Sum)?
                .to_vec1::<f32>()?;
            let all = g.all_gather(&t)?.to_vec2::<f32>()?;
            Ok((sum, all))
        });
        for (sum, all) in out {
            assert_eq!(sum, vec![6.0, 30.0]);
            assert_eq!(all, vec![vec![1.0, 10.0], vec![2.0, 10.0], vec![3.0, 10.0]]);
        }
    }
}
