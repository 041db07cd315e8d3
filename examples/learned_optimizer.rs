//! Trains the same small MLP on a synthetic regression task twice, with candle's AdamW and with
//! the small_fc_lopt learned optimizer, and prints both loss curves side by side.
//!
//! ```text
//! cargo run --release --example learned_optimizer                         # the test fixture's MLP, lr 0.01
//! cargo run --release --example learned_optimizer -- path/to/weights.safetensors   # e.g. μLO_M, lr 1.0
//! cargo run --release --example learned_optimizer -- --lr 0.05
//! cargo run --release --example learned_optimizer --features cuda         # on the GPU when present
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};

const STEPS: usize = 300;
const LOG_EVERY: usize = 25;

/// A 16 -> 64 -> 64 -> 1 SiLU MLP.
fn model(vb: VarBuilder) -> Result<impl Module> {
    Ok(candle_nn::seq()
        .add(candle_nn::linear(16, 64, vb.pp("l0"))?)
        .add(candle_nn::Activation::Silu)
        .add(candle_nn::linear(64, 64, vb.pp("l1"))?)
        .add(candle_nn::Activation::Silu)
        .add(candle_nn::linear(64, 1, vb.pp("l2"))?))
}

/// Trains a fresh model with the optimizer `make` builds; returns the loss every LOG_EVERY steps.
fn train<O: Optimizer>(
    dev: &Device, data: &(Tensor, Tensor), make: impl FnOnce(Vec<candle_core::Var>) -> Result<O>,
) -> Result<Vec<f32>> {
    let varmap = VarMap::new();
    let net = model(VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    let mut opt = make(varmap.all_vars())?;
    let mut losses = Vec::new();
    for step in 0..=STEPS {
        let loss = (net.forward(&data.0)? - &data.1)?.sqr()?.mean_all()?;
        if step % LOG_EVERY == 0 {
            losses.push(loss.to_scalar::<f32>()?);
        }
        if step < STEPS {
            opt.backward_step(&loss)?;
        }
    }
    Ok(losses)
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut weights, mut lr) = (None, None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--lr" => {
                let value = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--lr needs a value"))?;
                lr = Some(value.parse::<f64>()?);
            }
            path => weights = Some(path.to_string()),
        }
    }
    // The test fixture is the MLP the golden vectors were made with, not a tuned optimizer: its
    // steps are about 100x too large for this task (it diverges at the published lr of 1.0), so
    // it runs at lr 0.01 unless told otherwise. Published weights (e.g. μLO_M) use lr 1.0.
    let lr = lr.unwrap_or(if weights.is_some() { 1.0 } else { 0.01 });
    let weights = weights.unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/small_fc_lopt_mlp.safetensors"
        )
        .into()
    });
    let dev = if cfg!(feature = "cuda") {
        Device::cuda_if_available(0)?
    } else {
        Device::Cpu
    };
    // Targets from a fixed random smooth function of the inputs.
    let x = Tensor::randn(0f32, 1., (512, 16), &dev)?;
    let w = Tensor::randn(0f32, 0.5, (16, 1), &dev)?;
    let y = (x.matmul(&w)?.sin()? + x.narrow(1, 0, 1)?.sqr()? * 0.5)?;
    let data = (x, y);

    let mlp = MlpWeights::from_safetensors(&weights, &dev)?;
    println!(
        "small_fc_lopt MLP from {weights} (lr {lr}); {STEPS} full-batch steps on {:?}",
        dev.location()
    );
    let adamw = train(&dev, &data, |vars| {
        let params = ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        };
        Ok(AdamW::new(vars, params)?)
    })?;
    let lopt = train(&dev, &data, |vars| {
        let mut params = ParamsSmallFcLOpt::new(mlp);
        params.lr = lr;
        Ok(SmallFcLOpt::new(vars, params)?)
    })?;
    println!(
        "{:>6}  {:>12}  {:>14}",
        "step", "AdamW loss", "small_fc_lopt"
    );
    for (i, (a, l)) in adamw.iter().zip(&lopt).enumerate() {
        println!("{:>6}  {a:>12.6}  {l:>14.6}", i * LOG_EVERY);
    }
    Ok(())
}
