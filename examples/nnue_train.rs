//! Trains a small NNUE evaluation network with the crate's feature transformer: the pair forward
//! (both perspectives, side to move first) with its [0, 1] clamp fused in, two small dense layers.
//! Positions are synthetic (random active features per side, random side to move) and their
//! targets come from a fixed random teacher network of the same shape, so the loss has a known
//! floor of zero. The dataset (`--dataset` batches, positions and targets) is made and validated
//! once, on the training device, before training, as a real dataset would be loaded: the timed
//! loop is the model's step alone (forward, backward, optimizer), with no host synchronisation.
//! Prints step, loss and positions/s, then saves the trained weights as safetensors.
//!
//! ```text
//! cargo run --release --example nnue_train                   # CPU, well under a minute
//! cargo run --release --example nnue_train --features cuda   # GPU when present
//! cargo run --release --example nnue_train -- --steps 2000 --batch 4096 --out nnue.safetensors
//! cargo run --release --example nnue_train --features cuda -- --profile   # time each phase
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_fastops::{
    bias_add_with, check_sparse_indices, Activation, BiasAddOptions, FeatureTransformer,
    IndexCheck, SparseLinearOptions,
};
use candle_nn::{AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use std::time::Instant;

/// Network and run sizes.
#[derive(Debug, Clone)]
pub struct Config {
    pub num_inputs: usize,
    pub hidden: usize,
    pub max_active: usize,
    pub batch: usize,
    pub steps: usize,
    /// Distinct batches in the dataset; the steps cycle through them.
    pub dataset_batches: usize,
    pub learning_rate: f64,
    pub log_every: usize,
    pub out: Option<std::path::PathBuf>,
    /// The crate's fused `optim::AdamW` instead of candle_nn's `AdamW` (same formula).
    pub fused_adamw: bool,
    /// Time each phase of a step (device synchronised between phases) and print the split.
    pub profile: bool,
    /// The dense layers' f32 matrix products on TF32 tensor cores (candle's
    /// `set_gemm_reduced_precision_f32`, PyTorch's `allow_tf32`); CUDA only.
    pub tf32: bool,
    /// How the first dense layer is written (the same function each way; for comparison).
    pub l1: L1Mode,
}

/// How the network computes `clamp(l1(ft_pair(x)), 0, 1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum L1Mode {
    /// `FeatureTransformer::forward_pair_linear` (the activations never a node of the graph),
    /// then the bias and the clamp in one `bias_add_with`.
    #[default]
    Fused,
    /// `forward_pair`, `matmul`, then the bias and the clamp in one `bias_add_with`.
    BiasClamp,
    /// `forward_pair`, candle_nn's `Linear`, candle's `clamp(0, 1)`.
    Candle,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_inputs: 4096,
            hidden: 128,
            max_active: 32,
            batch: 1024,
            steps: 400,
            dataset_batches: 256,
            learning_rate: 2e-3,
            log_every: 50,
            out: Some("nnue.safetensors".into()),
            fused_adamw: true,
            profile: false,
            tf32: false,
            l1: L1Mode::Fused,
        }
    }
}

/// NNUE's activation: the clipped ReLU to [0, 1], fused into the op before it.
const CLIPPED_RELU: Activation = Activation::ClippedRelu { ceiling: 1.0 };

/// The network: feature transformer (shared by both perspectives) with its clamp to [0, 1]
/// fused, 2*hidden -> 32 (by default multiplied inside the transformer's op, its bias and clamp
/// in one `bias_add_with`), clamp, 32 -> 1.
pub struct Nnue {
    ft: FeatureTransformer,
    l1: Linear,
    l2: Linear,
    l1_mode: L1Mode,
}

impl Nnue {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        // Indices are validated once, when the dataset is made: no per-call check (on CUDA a
        // check is a stream synchronisation).
        let options = SparseLinearOptions {
            index_check: IndexCheck::Unchecked,
            activation: CLIPPED_RELU,
            ..Default::default()
        };
        Ok(Self {
            ft: FeatureTransformer::new(cfg.num_inputs, cfg.hidden, vb.pp("ft"))?
                .with_options(options),
            l1: candle_nn::linear(2 * cfg.hidden, 32, vb.pp("l1"))?,
            l2: candle_nn::linear(32, 1, vb.pp("l2"))?,
            l1_mode: cfg.l1,
        })
    }

    pub fn forward(&self, batch: &Batch) -> Result<Tensor> {
        let (white, black, stm) = (&batch.white, &batch.black, &batch.stm);
        // The bias and the clamp in one kernel forward and one backward (candle's clamp takes
        // two forward and about thirty small ones backward).
        let l1_bias = self
            .l1
            .bias()
            .ok_or_else(|| anyhow::anyhow!("l1 has a bias"))?;
        let clipped = BiasAddOptions {
            activation: CLIPPED_RELU,
        };
        let h = match self.l1_mode {
            L1Mode::Fused => {
                let h = self
                    .ft
                    .forward_pair_linear(white, black, stm, self.l1.weight())?;
                bias_add_with(&h, l1_bias, D::Minus1, &clipped)?
            }
            L1Mode::BiasClamp => {
                let h = self.ft.forward_pair(white, black, stm)?;
                let h = h.matmul(&self.l1.weight().t()?)?;
                bias_add_with(&h, l1_bias, D::Minus1, &clipped)?
            }
            L1Mode::Candle => {
                let h = self.ft.forward_pair(white, black, stm)?;
                self.l1.forward(&h)?.clamp(0f32, 1f32)?
            }
        };
        Ok(self.l2.forward(&h)?.squeeze(D::Minus1)?)
    }
}

/// A batch of positions: active features per side (-1 padded) and the side to move.
pub struct Batch {
    pub white: Tensor,
    pub black: Tensor,
    pub stm: Tensor,
}

/// Random positions: each side has between max_active / 2 and max_active distinct-ish features.
pub fn random_batch(cfg: &Config, rng: &mut Rng, dev: &Device) -> Result<Batch> {
    let mut side = || {
        let mut idx = vec![-1i32; cfg.batch * cfg.max_active];
        for row in idx.chunks_mut(cfg.max_active) {
            let active = cfg.max_active / 2 + rng.below(cfg.max_active / 2 + 1);
            for slot in &mut row[..active] {
                *slot = rng.below(cfg.num_inputs) as i32;
            }
        }
        Tensor::from_vec(idx, (cfg.batch, cfg.max_active), dev)
    };
    let (white, black) = (side()?, side()?);
    let stm: Vec<u8> = (0..cfg.batch).map(|_| rng.below(2) as u8).collect();
    Ok(Batch {
        white,
        black,
        stm: Tensor::from_vec(stm, cfg.batch, dev)?,
    })
}

/// Random positions labelled by a teacher: made once, on the training device, validated once.
pub struct Dataset {
    batches: Vec<(Batch, Tensor)>,
}

impl Dataset {
    /// `count` (at least one) random batches with the teacher's evaluations as targets.
    pub fn generate(
        cfg: &Config, teacher: &Nnue, rng: &mut Rng, dev: &Device, count: usize,
    ) -> Result<Self> {
        let mut batches = Vec::with_capacity(count.max(1));
        for _ in 0..count.max(1) {
            let batch = random_batch(cfg, rng, dev)?;
            check_sparse_indices(&batch.white, cfg.num_inputs)?;
            check_sparse_indices(&batch.black, cfg.num_inputs)?;
            let target = teacher.forward(&batch)?.detach();
            batches.push((batch, target));
        }
        Ok(Self { batches })
    }

    /// The batch and targets of training step `step` (the dataset cycles).
    pub fn get(&self, step: usize) -> &(Batch, Tensor) {
        &self.batches[step % self.batches.len()]
    }
}

/// A small xorshift generator: the example needs reproducible data, not statistical quality.
pub struct Rng(pub u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One optimizer step over a gradient store (either AdamW).
type StepFn = dyn FnMut(&candle_core::backprop::GradStore) -> candle_core::Result<()>;

/// Per-phase wall time of the profiled steps (device synchronised at each phase's end).
#[derive(Default)]
struct Phases {
    steps: usize,
    forward: f64,
    backward: f64,
    optimizer: f64,
}

impl Phases {
    fn print(&self) {
        let n = self.steps.max(1) as f64;
        let ms = |t: f64| t * 1e3 / n;
        let total = self.forward + self.backward + self.optimizer;
        println!(
            "profile over {} steps, ms a step (synchronised): forward + loss {:.3}  backward \
             {:.3}  optimizer {:.3}  total {:.3}",
            self.steps,
            ms(self.forward),
            ms(self.backward),
            ms(self.optimizer),
            ms(total)
        );
    }
}

/// Laps between device synchronisations; free when not timing.
struct PhaseClock<'a> {
    dev: &'a Device,
    last: Option<Instant>,
}

impl<'a> PhaseClock<'a> {
    fn start(dev: &'a Device, timing: bool) -> Result<Self> {
        let last = if timing {
            dev.synchronize()?;
            Some(Instant::now())
        } else {
            None
        };
        Ok(Self { dev, last })
    }

    fn lap(&mut self) -> Result<f64> {
        let Some(last) = self.last else {
            return Ok(0.0);
        };
        self.dev.synchronize()?;
        let now = Instant::now();
        self.last = Some(now);
        Ok((now - last).as_secs_f64())
    }
}

/// What a run produced: the training loss at each logged step, and the loss on a fixed
/// held-out batch before and after training (the steady measure of progress).
pub struct Report {
    pub losses: Vec<(usize, f32)>,
    pub held_out_before: f32,
    pub held_out_after: f32,
    pub positions_per_second: f64,
}

pub fn train(cfg: &Config, dev: &Device) -> Result<Report> {
    // The teacher: same shape, weights at twice the init scale, never trained.
    let teacher_map = VarMap::new();
    let teacher_vb = VarBuilder::from_varmap(&teacher_map, DType::F32, dev);
    let teacher = Nnue::new(cfg, teacher_vb)?;
    for var in teacher_map.all_vars() {
        let scaled = (var.as_tensor() * 2.0)?;
        var.set(&scaled)?;
    }

    let varmap = VarMap::new();
    let student = Nnue::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    let params = ParamsAdamW {
        lr: cfg.learning_rate,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt: Box<StepFn> = if cfg.fused_adamw {
        let mut opt = candle_fastops::optim::AdamW::from_varmap(&varmap, params)?;
        Box::new(move |g| opt.step(g))
    } else {
        let mut opt = AdamW::new(varmap.all_vars(), params)?;
        Box::new(move |g| opt.step(g))
    };

    let held_out = random_batch(cfg, &mut Rng(0x2545_F491_4F6C_DD1D), dev)?;
    let held_out_target = teacher.forward(&held_out)?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let data = Dataset::generate(cfg, &teacher, &mut rng, dev, cfg.dataset_batches)?;
    let held_out_loss = |net: &Nnue| -> Result<f32> {
        let diff = (net.forward(&held_out)? - &held_out_target)?;
        Ok(diff.sqr()?.mean_all()?.to_scalar::<f32>()?)
    };
    let held_out_before = held_out_loss(&student)?;

    let mut losses = Vec::new();
    let mut window = (Instant::now(), 0usize);
    // Steady-state throughput counts from step WARMUP on (PTX loading, first allocations
    // excluded), between two device synchronisations.
    const WARMUP: usize = 5;
    let mut timed = (Instant::now(), 0usize);
    let mut phases = Phases::default();
    for step in 1..=cfg.steps {
        let timing = cfg.profile && step > WARMUP;
        let mut clock = PhaseClock::start(dev, timing)?;
        let (batch, target) = data.get(step - 1);
        let prediction = student.forward(batch)?;
        let loss = (prediction - target)?.sqr()?.mean_all()?;
        phases.forward += clock.lap()?;
        let grads = loss.backward()?;
        phases.backward += clock.lap()?;
        opt(&grads)?;
        phases.optimizer += clock.lap()?;
        phases.steps += usize::from(timing);
        window.1 += cfg.batch;
        if step == WARMUP.min(cfg.steps) {
            dev.synchronize()?;
            timed = (Instant::now(), 0);
        } else if step > WARMUP {
            timed.1 += 1;
        }
        if step % cfg.log_every == 0 || step == 1 || step == cfg.steps {
            let loss = loss.to_scalar::<f32>()?;
            let rate = window.1 as f64 / window.0.elapsed().as_secs_f64();
            println!("step {step:>5}  loss {loss:.6}  {rate:>10.0} positions/s");
            losses.push((step, loss));
            window = (Instant::now(), 0);
        }
    }
    dev.synchronize()?;
    let positions_per_second = (timed.1 * cfg.batch) as f64 / timed.0.elapsed().as_secs_f64();
    if cfg.profile {
        phases.print();
    }
    let held_out_after = held_out_loss(&student)?;
    if let Some(path) = &cfg.out {
        varmap.save(path)?;
        println!("saved the trained weights to {}", path.display());
    }
    Ok(Report {
        losses,
        held_out_before,
        held_out_after,
        positions_per_second,
    })
}

#[allow(dead_code)] // the test includes this file for `train` only
fn main() -> Result<()> {
    let mut cfg = Config::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--steps" => cfg.steps = value()?.parse()?,
            "--dataset" => cfg.dataset_batches = value()?.parse()?,
            "--batch" => cfg.batch = value()?.parse()?,
            "--inputs" => cfg.num_inputs = value()?.parse()?,
            "--hidden" => cfg.hidden = value()?.parse()?,
            "--lr" => cfg.learning_rate = value()?.parse()?,
            "--out" => cfg.out = Some(value()?.into()),
            "--log-every" => cfg.log_every = value()?.parse()?,
            "--optimizer" => {
                cfg.fused_adamw = match value()?.as_str() {
                    "fused-adamw" => true,
                    "adamw" => false,
                    other => anyhow::bail!("--optimizer {other}: expected fused-adamw or adamw"),
                }
            }
            "--profile" => cfg.profile = true,
            "--tf32" => cfg.tf32 = true,
            "--l1" => {
                cfg.l1 = match value()?.as_str() {
                    "fused" => L1Mode::Fused,
                    "bias-clamp" => L1Mode::BiasClamp,
                    "candle" => L1Mode::Candle,
                    other => anyhow::bail!("--l1 {other}: expected fused, bias-clamp or candle"),
                }
            }
            other => anyhow::bail!(
                "unknown argument {other} (try --steps, --batch, --dataset, --inputs, --hidden, \
                 --lr, --out, --log-every, --optimizer fused-adamw|adamw, --profile, --tf32, \
                 --l1 fused|bias-clamp|candle)"
            ),
        }
    }
    let dev = if cfg!(feature = "cuda") {
        Device::cuda_if_available(0)?
    } else {
        Device::Cpu
    };
    println!(
        "training a {}x2 -> {} -> 32 -> 1 NNUE on {:?}: {} steps of {} positions over a \
         dataset of {} batches, {}",
        cfg.num_inputs,
        cfg.hidden,
        dev.location(),
        cfg.steps,
        cfg.batch,
        cfg.dataset_batches.max(1),
        if cfg.fused_adamw {
            "optim::AdamW"
        } else {
            "candle_nn::AdamW"
        }
    );
    candle_core::cuda::set_gemm_reduced_precision_f32(cfg.tf32);
    let report = train(&cfg, &dev)?;
    let (before, after) = (report.held_out_before, report.held_out_after);
    println!(
        "held-out loss {before:.6} -> {after:.6} ({:.1}x lower), {:.0} positions/s after warm-up",
        before / after,
        report.positions_per_second
    );
    Ok(())
}
