//! Checks of the data-parallel code that run inside each rank of any process group (threads
//! with `LocalGroup` in the `ops` tests, GPUs with `NcclGroup` in the `nccl` tests). Every rank
//! can rebuild every other rank's inputs (seeded by rank), so each checks its own results
//! against an f64 reference over all ranks.
#![allow(dead_code)]

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_fastops::dist::{
    BucketConfig, Collectives, DataParallel, GradAllReduce, ShardableOptimizer, Sharded, WireDType,
};
use candle_fastops::optim::{AdamW, MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
use candle_nn::{Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

pub const MLP: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/small_fc_lopt_mlp.safetensors"
);

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1f32..1f32)).collect()
}

/// Odd shapes, a 0-d scalar, an empty tensor and one large enough for a bucket of its own.
pub fn shapes() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("a.weight", vec![13, 11]),
        ("a.bias", vec![13]),
        ("b.empty", vec![0, 4]),
        ("b.scalar", vec![]),
        ("c.cube", vec![2, 3, 5]),
        ("d.big", vec![97, 31]),
        ("e.one", vec![1]),
        ("f.rank0_only", vec![7]),
        ("g.nobody", vec![3]),
    ]
}

/// Gradients averaged over the ranks equal the f64 mean on every rank: several buckets, odd
/// sizes, a gradient present on rank 0 only, one present nowhere.
pub fn check_grad_all_reduce<C: Collectives>(
    group: &C, dtype: DType, wire: WireDType, salt: u64,
) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let dev = group.device().clone();
    let shapes = shapes();
    let vars: Vec<(String, Var)> = shapes
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let t = Tensor::from_vec(values(salt ^ 0xabc, n), shape.as_slice(), &Device::Cpu)?;
            Ok((
                name.to_string(),
                Var::from_tensor(&t.to_dtype(dtype)?.to_device(&dev)?)?,
            ))
        })
        .collect::<Result<_>>()?;
    // Reversed order on odd ranks: the names, not the order given, decide the buckets.
    let mut given = vars.clone();
    if rank % 2 == 1 {
        given.reverse();
    }
    let config = BucketConfig {
        bucket_bytes: 256,
        wire,
    };
    let reducer = GradAllReduce::new(given, config, group)?;
    assert!(
        reducer.num_buckets() >= 4,
        "{} buckets",
        reducer.num_buckets()
    );
    let grad_of =
        |r: usize, i: usize, n: usize| values(salt ^ ((r as u64) << 32) ^ (i as u64 + 1), n);
    let mut grads = GradStore::default();
    for (i, ((name, shape), (_, var))) in shapes.iter().zip(&vars).enumerate() {
        let has = match *name {
            "f.rank0_only" => rank == 0,
            "g.nobody" => false,
            _ => true,
        };
        if has {
            let n: usize = shape.iter().product();
            let g = Tensor::from_vec(grad_of(rank, i, n), shape.as_slice(), &Device::Cpu)?;
            grads.insert(var.as_tensor(), g.to_dtype(dtype)?.to_device(&dev)?);
        }
    }
    reducer.all_reduce(&mut grads, group)?;
    let wire_tol = match wire {
        WireDType::F32 => 0.0,
        WireDType::Bf16 => 1.6e-2 * (world as f64).log2().ceil().max(1.0),
    };
    let tol = round_tol(dtype) + wire_tol;
    for (i, ((name, shape), (_, var))) in shapes.iter().zip(&vars).enumerate() {
        let got = grads.get(var.as_tensor());
        if *name == "b.empty" {
            // Nothing to average: the rank's own (empty) gradient stays.
            assert_eq!(got.map(|g| g.dims().to_vec()), Some(vec![0, 4]), "{name}");
            continue;
        }
        if *name == "g.nobody" {
            assert!(
                got.is_none(),
                "{name}: no rank had a gradient, yet one was inserted"
            );
            continue;
        }
        let got = got.unwrap_or_else(|| panic!("{name}: gradient missing after all_reduce"));
        assert_eq!(got.dims(), shape.as_slice(), "{name}");
        assert_eq!(got.dtype(), dtype, "{name}");
        let n: usize = shape.iter().product();
        let ranks: Vec<usize> = if *name == "f.rank0_only" {
            vec![0]
        } else {
            (0..world).collect()
        };
        let mut want = vec![0f64; n];
        let mut magnitude = vec![0f64; n];
        for r in ranks {
            // The inputs as the ranks held them: rounded to `dtype`.
            let g = Tensor::new(grad_of(r, i, n).as_slice(), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?;
            for ((w, m), x) in want.iter_mut().zip(magnitude.iter_mut()).zip(g) {
                *w += x / world as f64;
                *m += x.abs() / world as f64;
            }
        }
        let got = got
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        for (j, ((g, w), m)) in got.iter().zip(&want).zip(&magnitude).enumerate() {
            // Rounding errors scale with the terms summed, not with their (cancelling) sum.
            let err = (g - w).abs();
            assert!(
                err <= tol * m + 1e-7,
                "rank {rank}: {name}[{j}] = {g}, mean over ranks {w} ({dtype:?}, {wire:?})"
            );
        }
    }
    Ok(())
}

pub fn round_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 2e-6,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// Rank `r` passes a variable of another shape: every rank gets an error naming a rank.
pub fn check_mismatch_is_an_error<C: Collectives>(group: &C) -> Result<()> {
    let dev = group.device().clone();
    let n = if group.rank() == group.world_size() - 1 {
        5
    } else {
        4
    };
    let var = Var::zeros(n, DType::F32, &dev)?;
    let err = GradAllReduce::new(vec![("w".into(), var)], BucketConfig::default(), group)
        .expect_err("different shapes on the ranks must be an error");
    let msg = err.to_string();
    assert!(
        msg.contains("rank") && msg.contains("names, shapes"),
        "{msg}"
    );
    Ok(())
}

/// A small regression model, the same initial weights on every rank.
pub struct Model {
    pub varmap: VarMap,
    l1: candle_nn::Linear,
    l2: candle_nn::Linear,
}

impl Model {
    pub fn new(dev: &Device) -> Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
        let l1 = candle_nn::linear(8, 16, vb.pp("l1"))?;
        let l2 = candle_nn::linear(16, 1, vb.pp("l2"))?;
        // Deterministic weights, whatever the initialiser's generator did.
        let mut sorted: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        for (i, (_, var)) in sorted.iter().enumerate() {
            let t = Tensor::from_vec(
                values(77 + i as u64, var.elem_count()),
                var.dims(),
                &Device::Cpu,
            )?;
            var.set(&(t * 0.3)?.to_device(dev)?)?;
        }
        Ok(Self { varmap, l1, l2 })
    }

    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut v: Vec<(String, Var)> = self
            .varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    pub fn loss(&self, xs: &Tensor, ys: &Tensor) -> Result<Tensor> {
        let h = self.l1.forward(xs)?.tanh()?;
        let out = self.l2.forward(&h)?.squeeze(D::Minus1)?;
        (out - ys)?.sqr()?.mean_all()
    }
}

/// This rank's slice of the global batch of `step`.
pub fn batch(
    step: usize, rank: usize, per_rank: usize, world: usize, dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let total = per_rank * world;
    let xs = Tensor::from_vec(
        values(1000 + step as u64, total * 8),
        (total, 8),
        &Device::Cpu,
    )?;
    let ys = Tensor::from_vec(values(5000 + step as u64, total), total, &Device::Cpu)?;
    let xs = xs.narrow(0, rank * per_rank, per_rank)?.to_device(dev)?;
    let ys = ys.narrow(0, rank * per_rank, per_rank)?.to_device(dev)?;
    Ok((xs, ys))
}

/// `steps` AdamW steps through `DataParallel` with `per_rank` samples a rank; returns the mean
/// loss over the ranks at every step.
pub fn ddp_losses<C: Collectives>(group: C, per_rank: usize, steps: usize) -> Result<Vec<f64>> {
    let dev = group.device().clone();
    let (rank, world) = (group.rank(), group.world_size());
    let model = Model::new(&dev)?;
    let vars = model.named_vars();
    let adamw = candle_nn::AdamW::new(
        vars.iter().map(|(_, v)| v.clone()).collect(),
        ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    let mut ddp = DataParallel::new(adamw, vars, group, BucketConfig::default())?;
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (xs, ys) = batch(step, rank, per_rank, world, &dev)?;
        let loss = model.loss(&xs, &ys)?;
        let mean = ddp
            .group()
            .all_reduce(&loss.reshape(1)?, candle_fastops::dist::ReduceOp::Avg)?;
        losses.push(mean.to_dtype(DType::F64)?.to_vec1::<f64>()?[0]);
        ddp.backward_step(&loss)?;
    }
    Ok(losses)
}

fn lopt_params(dev: &Device, deterministic: bool) -> Result<ParamsSmallFcLOpt> {
    let mut params = ParamsSmallFcLOpt::new(MlpWeights::from_safetensors(MLP, dev)?);
    params.backend.deterministic = Some(deterministic);
    Ok(params)
}

/// Named variables of assorted sizes (balanced enough for a two-way split within 0.55).
fn lopt_vars(dev: &Device) -> Result<Vec<(String, Var)>> {
    let shapes: [(&str, &[usize]); 8] = [
        ("emb", &[56, 48]),
        ("l0.w", &[48, 40]),
        ("l0.b", &[40]),
        ("l1.w", &[40, 44]),
        ("l1.b", &[44]),
        ("head.w", &[44, 36]),
        ("head.b", &[36]),
        ("scale", &[]),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let t = Tensor::from_vec(values(300 + i as u64, n), *shape, &Device::Cpu)?;
            Ok((name.to_string(), Var::from_tensor(&t.to_device(dev)?)?))
        })
        .collect()
}

fn lopt_grads(vars: &[(String, Var)], step: usize) -> Result<GradStore> {
    let mut grads = GradStore::default();
    for (i, (_, var)) in vars.iter().enumerate() {
        let g = Tensor::from_vec(
            values(900 + 31 * step as u64 + i as u64, var.elem_count()),
            var.dims(),
            &Device::Cpu,
        )?;
        grads.insert(var.as_tensor(), (g * 0.1)?.to_device(var.device())?);
    }
    Ok(grads)
}

fn snapshot(vars: &[(String, Var)]) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()
        })
        .collect()
}

fn compare(a: &[Vec<f32>], b: &[Vec<f32>], tol: f64, what: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        // Relative to the tensor's largest element: a gradient rounded differently moves every
        // element by about the same absolute amount.
        let scale = y.iter().fold(0f64, |m, q| m.max((*q as f64).abs()));
        for (j, (p, q)) in x.iter().zip(y).enumerate() {
            let err = (*p as f64 - *q as f64).abs();
            assert!(
                err <= tol * scale,
                "{what}: tensor {i}[{j}]: {p} against {q}"
            );
        }
    }
}

/// The sharded optimizer gives the unsharded parameters (bit for bit in deterministic mode and
/// on the CPU, else within 1e-6 of each tensor's largest element), holds at most 0.55x of the
/// state on each of 2+ ranks, and its saved shards resume (exactly where deterministic).
pub fn check_sharded_small_fc_lopt<C: Collectives + Clone>(
    group: C, deterministic: bool, dir: &std::path::Path,
) -> Result<()> {
    let dev = group.device().clone();
    let tol: f64 = if deterministic || dev.is_cpu() {
        0.0
    } else {
        1e-6
    };
    check_sharded::<SmallFcLOpt, C>(group, &|| lopt_params(&dev, deterministic), tol, dir)
}

/// [`check_sharded_small_fc_lopt`] for AdamW: elementwise, so bit-identical everywhere.
pub fn check_sharded_adamw<C: Collectives + Clone>(group: C, dir: &std::path::Path) -> Result<()> {
    let config = || {
        Ok(ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..Default::default()
        })
    };
    check_sharded::<AdamW, C>(group, &config, 0.0, dir)
}

fn check_sharded<O: ShardableOptimizer, C: Collectives + Clone>(
    group: C, config: &dyn Fn() -> Result<O::Config>, tol: f64, dir: &std::path::Path,
) -> Result<()> {
    let dev = group.device().clone();
    let (rank, world) = (group.rank(), group.world_size());
    // The unsharded reference on this rank, from the same initial values.
    let ref_vars = lopt_vars(&dev)?;
    let mut reference = O::new_named(ref_vars.clone(), config()?)?;
    let vars = lopt_vars(&dev)?;
    let mut given = vars.clone();
    let shift = rank % given.len();
    given.rotate_left(shift);
    let mut sharded =
        Sharded::<O, C>::new(given, config()?, group.clone(), BucketConfig::default())?;
    let mut after_two = None;
    for step in 0..4 {
        reference.step(&lopt_grads(&ref_vars, step)?)?;
        // Steps 0 and 1 take the gradients as they are; 2 and 3 average them over the ranks
        // first: the mean of equal values is exact only for some world sizes (3g / 3 rounds).
        let tol = if step < 2 {
            sharded.step_averaged(&lopt_grads(&vars, step)?)?;
            tol
        } else {
            sharded.step(&mut lopt_grads(&vars, step)?)?;
            tol.max(1e-6)
        };
        compare(
            &snapshot(&vars)?,
            &snapshot(&ref_vars)?,
            tol,
            &format!("rank {rank} step {step}"),
        );
        if step == 1 {
            sharded.save_state(dir.join("lopt.safetensors"))?;
            after_two = Some(snapshot(&vars)?);
        }
    }
    let unsharded_bytes = reference.state_bytes();
    if world >= 2 {
        let ratio = sharded.state_bytes() as f64 / unsharded_bytes as f64;
        assert!(
            ratio <= 0.55,
            "rank {rank}: {ratio:.3} of the unsharded state"
        );
    }
    assert_eq!(sharded.steps_taken(), 4);
    // Resume from the saved shards: the same parameters after steps 2 and 3.
    let final_params = snapshot(&vars)?;
    for ((_, var), values) in vars.iter().zip(after_two.unwrap()) {
        var.set(&Tensor::from_vec(values, var.dims(), &Device::Cpu)?.to_device(&dev)?)?;
    }
    let mut resumed = Sharded::<O, C>::new(
        vars.clone(),
        config()?,
        group.clone(),
        BucketConfig::default(),
    )?;
    resumed.load_state(dir.join("lopt.safetensors"))?;
    assert_eq!(resumed.steps_taken(), 2);
    for step in 2..4 {
        resumed.step(&mut lopt_grads(&vars, step)?)?;
    }
    compare(
        &snapshot(&vars)?,
        &final_params,
        tol,
        &format!("rank {rank} resumed"),
    );
    // Another world size has no shard for this rank under that name.
    let shard = Sharded::<O, C>::shard_path(dir.join("lopt.safetensors"), rank, world);
    assert!(shard.exists(), "{}", shard.display());
    let before = snapshot(&vars)?;
    let err = resumed
        .load_state(dir.join("lopt2.safetensors"))
        .expect_err("no such shard");
    assert!(err.to_string().contains("world size"), "{err}");
    assert_eq!(resumed.steps_taken(), 4);
    compare(
        &snapshot(&vars)?,
        &before,
        0.0,
        "a failed load changes nothing",
    );
    Ok(())
}
