//! Data-parallel training of the NNUE of `nnue_train` on several GPUs (NCCL, one process per
//! GPU, started by `dist::launch`) or on several CPU threads (`LocalGroup`). Each rank trains on
//! its own shard of positions (`--dataset` batches of `--batch`, made before training), the gradients are averaged over the ranks in flat
//! buckets, and AdamW (`DataParallel`) or the sharded learned optimizer (`ShardedSmallFcLOpt`,
//! ZeRO-1) steps. Rank 0 prints the loss (averaged over the ranks) and the aggregate
//! positions/s; `--gpus 1` is the single-GPU baseline at the same per-GPU batch.
//!
//! ```text
//! cargo run --release --example ddp_train                                  # 2 CPU ranks (threads)
//! cargo run --release --example ddp_train --features nccl -- --gpus 2      # 2 GPUs
//! cargo run --release --example ddp_train --features nccl -- --gpus 1      # the 1-GPU baseline
//! cargo run --release --example ddp_train --features nccl -- --gpus 2 --optimizer lopt
//! cargo run --release --example ddp_train --features nccl -- --gpus 2 --allreduce-bench 256
//! ```

#[path = "nnue_train.rs"]
#[allow(dead_code)]
mod nnue;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_fastops::dist::{
    BucketConfig, Collectives, DataParallel, LocalGroup, ReduceOp, ShardedAdamW,
    ShardedSmallFcLOpt, WireDType,
};
use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use nnue::{Config, Dataset, Nnue, Rng};
use std::time::Instant;

#[derive(Debug, Clone)]
struct Args {
    /// GPUs (one process each, NCCL); 0 runs `ranks` CPU threads instead.
    gpus: usize,
    ranks: usize,
    nnue: Config,
    optimizer: String,
    bucket: BucketConfig,
    /// Time the all-reduce of a buffer of this many MiB instead of training.
    allreduce_bench_mib: Option<usize>,
    /// Time the sharded learned optimizer's step on GPT-2-medium's 354M parameters in 289
    /// tensors instead of training.
    zero_bench: bool,
}

fn parse() -> Result<Args> {
    let mut args = Args {
        gpus: 0,
        ranks: 2,
        nnue: Config {
            steps: 200,
            log_every: 50,
            out: None,
            ..Config::default()
        },
        optimizer: "adamw".into(),
        bucket: BucketConfig::default(),
        allreduce_bench_mib: None,
        zero_bench: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--gpus" => args.gpus = value()?.parse()?,
            "--ranks" => args.ranks = value()?.parse()?,
            "--steps" => args.nnue.steps = value()?.parse()?,
            "--dataset" => args.nnue.dataset_batches = value()?.parse()?,
            "--batch" => args.nnue.batch = value()?.parse()?,
            "--inputs" => args.nnue.num_inputs = value()?.parse()?,
            "--hidden" => args.nnue.hidden = value()?.parse()?,
            "--lr" => args.nnue.learning_rate = value()?.parse()?,
            "--log-every" => args.nnue.log_every = value()?.parse()?,
            "--optimizer" => args.optimizer = value()?,
            "--bucket-mib" => args.bucket.bucket_bytes = value()?.parse::<usize>()? << 20,
            "--wire" => {
                args.bucket.wire = match value()?.as_str() {
                    "f32" => WireDType::F32,
                    "bf16" => WireDType::Bf16,
                    other => bail!("--wire {other}: f32 or bf16"),
                }
            }
            "--allreduce-bench" => args.allreduce_bench_mib = Some(value()?.parse()?),
            "--zero-bench" => args.zero_bench = true,
            other => bail!(
                "unknown argument {other} (try --gpus, --ranks, --steps, --dataset, --batch, --inputs, \
                 --hidden, --lr, --log-every, --optimizer adamw|fused-adamw|zero-adamw|lopt, \
                 --bucket-mib, --wire, \
                 --allreduce-bench MIB, --zero-bench)"
            ),
        }
    }
    if !matches!(
        args.optimizer.as_str(),
        "adamw" | "fused-adamw" | "zero-adamw" | "lopt"
    ) {
        bail!(
            "--optimizer {}: adamw (candle_nn's), fused-adamw (optim::AdamW), zero-adamw \
             (optim::AdamW sharded) or lopt (small_fc_lopt sharded)",
            args.optimizer
        );
    }
    Ok(args)
}

fn main() -> Result<()> {
    let args = parse()?;
    if args.gpus > 0 {
        return on_gpus(&args);
    }
    let groups = LocalGroup::new(args.ranks.max(1), &Device::Cpu);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let args = &args;
                s.spawn(move || run(g, args))
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
        }
        Ok(())
    })
}

#[cfg(feature = "nccl")]
fn on_gpus(args: &Args) -> Result<()> {
    // The launcher returns None once every rank it started has finished.
    let Some(env) = candle_fastops::dist::launch(args.gpus)? else {
        return Ok(());
    };
    let group = std::rc::Rc::new(candle_fastops::dist::NcclGroup::from_env(&env)?);
    run(group, args)
}

#[cfg(not(feature = "nccl"))]
fn on_gpus(_: &Args) -> Result<()> {
    bail!("--gpus needs the `nccl` feature (cargo run --example ddp_train --features nccl)")
}

fn named(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// One rank: the same teacher and student on every rank (rank 0's, broadcast), its own data.
fn run<C: Collectives + Clone>(group: C, args: &Args) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let dev = group.device().clone();
    if let Some(mib) = args.allreduce_bench_mib {
        return allreduce_bench(&group, mib);
    }
    if args.zero_bench {
        return zero_bench(group);
    }
    let cfg = &args.nnue;
    let teacher_map = VarMap::new();
    let teacher = Nnue::new(cfg, VarBuilder::from_varmap(&teacher_map, DType::F32, &dev))?;
    for var in teacher_map.all_vars() {
        var.set(&(var.as_tensor() * 2.0)?)?;
    }
    let varmap = VarMap::new();
    let student = Nnue::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let everything: Vec<(Var, usize)> = named(&teacher_map)
        .into_iter()
        .chain(named(&varmap))
        .map(|(_, v)| (v, 0))
        .collect();
    group.broadcast_vars(&everything)?;

    enum Opt<C> {
        AdamW(DataParallel<AdamW, C>),
        Fused(DataParallel<candle_fastops::optim::AdamW, C>),
        ZeroAdamW(Box<ShardedAdamW<C>>),
        Lopt(Box<ShardedSmallFcLOpt<C>>),
    }
    let adamw_params = ParamsAdamW {
        lr: cfg.learning_rate,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = match args.optimizer.as_str() {
        "fused-adamw" => {
            let fused = candle_fastops::optim::AdamW::new_named(named(&varmap), adamw_params)?;
            Opt::Fused(DataParallel::new(
                fused,
                named(&varmap),
                group.clone(),
                args.bucket,
            )?)
        }
        "zero-adamw" => Opt::ZeroAdamW(Box::new(ShardedAdamW::new(
            named(&varmap),
            adamw_params,
            group.clone(),
            args.bucket,
        )?)),
        "adamw" => {
            let params = adamw_params;
            let adamw = AdamW::new(varmap.all_vars(), params)?;
            Opt::AdamW(DataParallel::new(
                adamw,
                named(&varmap),
                group.clone(),
                args.bucket,
            )?)
        }
        _ => {
            let mlp = MlpWeights::from_safetensors(
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/tests/fixtures/small_fc_lopt_mlp.safetensors"
                ),
                &dev,
            )?;
            // The fixture's MLP (random test weights) takes steps far too large at the
            // published lr of 1.0 (see the learned_optimizer example): --lr, 2e-3 by default.
            let params = ParamsSmallFcLOpt {
                lr: cfg.learning_rate,
                ..ParamsSmallFcLOpt::new(mlp)
            };
            Opt::Lopt(Box::new(ShardedSmallFcLOpt::new(
                named(&varmap),
                params,
                group.clone(),
                args.bucket,
            )?))
        }
    };
    if rank == 0 {
        let params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
        println!(
            "{world} rank(s) on {:?}: NNUE {}x2 -> {} -> 32 -> 1 ({params} parameters), {} \
             positions a rank a step, {} steps, {}",
            dev.location(),
            cfg.num_inputs,
            cfg.hidden,
            cfg.batch,
            cfg.steps,
            args.optimizer
        );
    }
    // Each rank its own shard of the data, made once before training.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((rank as u64 + 1) << 40));
    let data = Dataset::generate(cfg, &teacher, &mut rng, &dev, cfg.dataset_batches)?;
    let mut window = (Instant::now(), 0usize);
    let mut timed = (None::<Instant>, 0usize);
    for step in 1..=cfg.steps {
        let (batch, target) = data.get(step - 1);
        let loss = (student.forward(batch)? - target)?.sqr()?.mean_all()?;
        match &mut opt {
            Opt::AdamW(ddp) => ddp.backward_step(&loss)?,
            Opt::Fused(ddp) => ddp.backward_step(&loss)?,
            Opt::ZeroAdamW(sharded) => sharded.backward_step(&loss)?,
            Opt::Lopt(sharded) => sharded.backward_step(&loss)?,
        }
        window.1 += cfg.batch * world;
        if step == 5 {
            // The throughput counts from here: warm-up (PTX loading, first allocations) excluded.
            dev.synchronize()?;
            timed = (Some(Instant::now()), 0);
        } else if step > 5 {
            timed.1 += 1;
        }
        if step % cfg.log_every == 0 || step == 1 || step == cfg.steps {
            let mean = group.all_reduce(&loss.reshape(1)?, ReduceOp::Avg)?;
            let mean = mean.to_vec1::<f32>()?[0];
            let rate = window.1 as f64 / window.0.elapsed().as_secs_f64();
            if rank == 0 {
                println!("step {step:>5}  loss {mean:.6}  {rate:>11.0} positions/s (all ranks)");
            }
            window = (Instant::now(), 0);
        }
    }
    dev.synchronize()?;
    if let (Some(start), steps) = timed {
        let secs = start.elapsed().as_secs_f64();
        if rank == 0 && steps > 0 {
            println!(
                "ranks {world}: {:.3} ms a step, {:.0} positions/s aggregate ({} a rank a step)",
                secs * 1e3 / steps as f64,
                (steps * cfg.batch * world) as f64 / secs,
                cfg.batch
            );
        }
    }
    if let Opt::Lopt(sharded) = &opt {
        println!(
            "rank {rank}: learned-optimizer state {:.1} MiB",
            sharded.state_bytes() as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}

/// All-reduce (sum, in place) of `mib` MiB of f32, 5 warm-up and 20 timed calls; prints the median and
/// the bus bandwidth `2 (n - 1) / n * bytes / time` (NCCL's convention) on rank 0.
fn allreduce_bench<C: Collectives>(group: &C, mib: usize) -> Result<()> {
    let n = (mib << 20) / 4;
    let dev = group.device();
    // In place, as torch.distributed.all_reduce (the anchor) works.
    let mut buf = Tensor::ones(n, DType::F32, dev)?;
    let mut times = Vec::new();
    for i in 0..25 {
        dev.synchronize()?;
        let start = Instant::now();
        buf = group.all_reduce_in_place(buf, ReduceOp::Sum)?;
        dev.synchronize()?;
        if i >= 5 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let world = group.world_size() as f64;
    let bus = 2.0 * (world - 1.0) / world * (n * 4) as f64 / median / 1e9;
    if group.rank() == 0 {
        println!(
            "all_reduce {mib} MiB f32 on {world} ranks: median {:.1} us, bus bandwidth {bus:.1} GB/s",
            median * 1e6
        );
    }
    Ok(())
}

/// GPT-2-medium's parameter shapes: 354M parameters in 289 tensors.
fn gpt2_medium_shapes() -> Vec<Vec<usize>> {
    let (vocab, width) = (50257, 1024);
    let mut shapes = vec![vec![vocab, width]];
    for _ in 0..24 {
        shapes.extend([
            vec![width],
            vec![width],
            vec![width, 3 * width],
            vec![3 * width],
            vec![width, width],
            vec![width],
            vec![width],
            vec![width],
            vec![width, 4 * width],
            vec![4 * width],
            vec![4 * width, width],
            vec![width],
        ]);
    }
    shapes
}

fn median_ms(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2] * 1e3
}

/// The sharded small_fc_lopt on 354M parameters / 289 tensors: the step on gradients already
/// averaged (the rank's own tensors, then the broadcast from the owners; 3 warm-up and 10 timed
/// calls), the same with the gradient all-reduce, and each rank's state bytes.
fn zero_bench<C: Collectives + Clone>(group: C) -> Result<()> {
    let dev = group.device().clone();
    let (rank, world) = (group.rank(), group.world_size());
    let mut vars = Vec::new();
    let mut grads = Vec::new();
    for (i, shape) in gpt2_medium_shapes().into_iter().enumerate() {
        let var = Var::from_tensor(&(Tensor::randn(0f32, 0.02, shape.as_slice(), &dev)?))?;
        grads.push((
            var.clone(),
            Tensor::randn(0f32, 1e-3, shape.as_slice(), &dev)?,
        ));
        vars.push((format!("p{i:03}"), var));
    }
    // A fresh store each call: the all-reduce replaces the gradients in place.
    let store = || {
        let mut store = candle_core::backprop::GradStore::default();
        for (var, grad) in &grads {
            store.insert(var.as_tensor(), grad.clone());
        }
        store
    };
    let params: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let mlp = MlpWeights::from_safetensors(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/small_fc_lopt_mlp.safetensors"
        ),
        &dev,
    )?;
    let mut opt = ShardedSmallFcLOpt::new(
        vars,
        ParamsSmallFcLOpt::new(mlp),
        group.clone(),
        BucketConfig::default(),
    )?;
    let mut time = |with_all_reduce: bool| -> Result<f64> {
        let mut times = Vec::new();
        for i in 0..13 {
            let mut g = store();
            dev.synchronize()?;
            let start = Instant::now();
            if with_all_reduce {
                opt.step(&mut g)?;
            } else {
                opt.step_averaged(&g)?;
            }
            dev.synchronize()?;
            if i >= 3 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        Ok(median_ms(times))
    };
    let step = time(false)?;
    let with_all_reduce = time(true)?;
    let state = opt.state_bytes();
    println!(
        "rank {rank} of {world}: sharded small_fc_lopt, {params} parameters in 289 tensors: step \
         (own tensors + broadcast) {step:.2} ms median, with the gradient all-reduce \
         {with_all_reduce:.2} ms; state {:.1} MiB",
        state as f64 / (1 << 20) as f64
    );
    Ok(())
}
