//! Causal self-attention three ways, checked against each other and timed:
//! `candle_fastops::masked_attention` (one fused, tiled op), `masked_bmm` + `softmax_dims` (scores with `-inf` above the
//! diagonal, upper tiles skipped), and the composite a candle user writes today (full matmul,
//! `where_cond`, softmax).
//!
//! ```text
//! cargo run --release --example causal_attention
//! cargo run --release --example causal_attention --features cuda
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

fn attention_fastops(
    q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, plan: &candle_fastops::MaskPlan,
) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(2)? as f64).sqrt();
    let scores = candle_fastops::masked_bmm_with_plan(
        q,
        &k.transpose(1, 2)?,
        mask,
        plan,
        f64::NEG_INFINITY,
    )?;
    let probs = candle_fastops::softmax_dims(&(scores * scale)?, [2])?;
    Ok(probs.matmul(v)?)
}

fn attention_composite(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(2)? as f64).sqrt();
    let scores = (q.matmul(&k.transpose(1, 2)?.contiguous()?)? * scale)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, scores.shape(), q.device())?;
    let scores = mask
        .broadcast_as(scores.shape())?
        .where_cond(&scores, &neg_inf)?;
    Ok(candle_nn::ops::softmax_last_dim(&scores)?.matmul(v)?)
}

fn time_ms(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let start = Instant::now();
    let reps = 5;
    for _ in 0..reps {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

fn main() -> Result<()> {
    let dev = if cfg!(feature = "cuda") {
        Device::cuda_if_available(0)?
    } else {
        Device::Cpu
    };
    let (heads, seq, head_dim) = if dev.is_cuda() {
        (64, 2048, 64)
    } else {
        (8, 512, 64)
    };
    println!(
        "causal attention on {:?}: {heads} heads, {seq} tokens, head dim {head_dim}",
        dev.location()
    );
    let q = Tensor::randn(0f32, 1.0, (heads, seq, head_dim), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (heads, seq, head_dim), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (heads, seq, head_dim), &dev)?;
    let mask = Tensor::tril2(seq, DType::U8, &dev)?;
    let plan = candle_fastops::MaskPlan::new(&mask)?;
    let [empty, partial, full] = plan.tile_counts()?;
    println!("mask plan: {empty} empty, {partial} partial, {full} full tiles of 128 x 128");

    let ours = attention_fastops(&q, &k, &v, &mask, &plan)?;
    let reference = attention_composite(&q, &k, &v, &mask)?;
    let diff = (ours - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("max |masked_bmm route - composite| = {diff:.2e}");
    anyhow::ensure!(diff < 1e-4, "attention outputs differ by {diff}");
    // masked_attention takes [batch, heads, seq, d].
    let fused = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let scale = 1.0 / (head_dim as f64).sqrt();
        let causal = candle_fastops::AttentionMask::causal();
        let (q, k, v) = (q.unsqueeze(0)?, k.unsqueeze(0)?, v.unsqueeze(0)?);
        Ok(candle_fastops::masked_attention(&q, &k, &v, &causal, scale)?.squeeze(0)?)
    };
    let out = fused(&q, &k, &v)?;
    let diff = (out - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("max |masked_attention - composite| = {diff:.2e}");
    anyhow::ensure!(diff < 1e-4, "attention outputs differ by {diff}");
    let t_fused = time_ms(&dev, || fused(&q, &k, &v))?;
    println!("masked_attention {t_fused:.2} ms");

    let t_ours = time_ms(&dev, || attention_fastops(&q, &k, &v, &mask, &plan))?;
    let t_ref = time_ms(&dev, || attention_composite(&q, &k, &v, &mask))?;
    println!(
        "masked_bmm route {t_ours:.2} ms, composite {t_ref:.2} ms ({:.2}x)",
        t_ref / t_ours
    );
    Ok(())
}
