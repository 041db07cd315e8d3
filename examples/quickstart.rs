//! Runs every implemented op (bias_add, bias_add_, softmax_dims, log_softmax_dims) once, on CUDA device 0 when the crate is built with `cuda` and a GPU
//! is present, on the CPU otherwise, checks each result against plain candle ops and prints what
//! it did.
//!
//! ```text
//! cargo run --release --example quickstart                   # CPU
//! cargo run --release --example quickstart --features cuda   # GPU when present
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

fn pick_device() -> Device {
    if cfg!(feature = "cuda") {
        match Device::new_cuda(0) {
            Ok(dev) => return dev,
            Err(e) => println!("no usable CUDA device ({e}); running on the CPU"),
        }
    }
    Device::Cpu
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?)
}

fn main() -> Result<()> {
    let dev = pick_device();
    println!("device: {:?}", dev.location());

    // bias_add, NCHW: a per-channel bias on a batch of feature maps, with gradients.
    let xs = Var::from_tensor(&Tensor::randn(0f32, 1., (8, 64, 28, 28), &dev)?)?;
    let bias = Var::from_tensor(&Tensor::randn(0f32, 1., 64, &dev)?)?;
    let ys = candle_fastops::bias_add(&xs, &bias, 1)?;
    let expected = xs.broadcast_add(&bias.reshape((64, 1, 1))?)?;
    println!(
        "bias_add     xs {:?} + bias {:?} along dim 1 -> {:?}, max |diff| vs broadcast_add = {:.2e}",
        xs.dims(),
        bias.dims(),
        ys.dims(),
        max_abs_diff(&ys, &expected)?
    );
    let grads = ys.sqr()?.sum_all()?.backward()?;
    let grad_bias = grads.get(&bias).expect("bias has a gradient");
    let expected_grad = (ys.affine(2., 0.)?).sum((0, 2, 3))?;
    println!(
        "bias_add     d(sum y^2)/d bias {:?}, max |diff| vs 2*sum(y) = {:.2e}",
        grad_bias.dims(),
        max_abs_diff(grad_bias, &expected_grad)?
    );

    // bias_add_, NHWC in place, bf16: the last-dim form, allocating nothing.
    let acts = Tensor::randn(0f32, 1., (256, 1024), &dev)?.to_dtype(DType::BF16)?;
    let before = acts.copy()?;
    let b = Tensor::randn(0f32, 1., 1024, &dev)?.to_dtype(DType::BF16)?;
    candle_fastops::bias_add_(&acts, &b, 1)?;
    println!(
        "bias_add_    in place, bf16 {:?} += bias {:?}, max |diff| vs broadcast_add = {:.2e}",
        acts.dims(),
        b.dims(),
        max_abs_diff(&acts, &before.broadcast_add(&b)?)?
    );

    // softmax_dims / log_softmax_dims: normalise over dims 0 and 2 together, in one op.
    let scores = Var::from_tensor(&Tensor::randn(0f32, 1., (4, 16, 128), &dev)?)?;
    let probs = candle_fastops::softmax_dims(&scores, [0, 2])?;
    let max = scores.max_keepdim(0)?.max_keepdim(2)?;
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let composite = exp.broadcast_div(&exp.sum_keepdim(0)?.sum_keepdim(2)?)?;
    let sums = probs.sum_keepdim(0)?.sum_keepdim(2)?.flatten_all()?;
    println!(
        "softmax_dims scores {:?} over dims [0, 2]: {} groups summing to 1 (max |sum - 1| = {:.2e}), max |diff| vs composite = {:.2e}",
        scores.dims(),
        sums.dim(0)?,
        max_abs_diff(&sums, &sums.ones_like()?)?,
        max_abs_diff(&probs, &composite)?
    );
    let log_probs = candle_fastops::log_softmax_dims(&scores, [0, 2])?;
    let grads = log_probs.narrow(1, 0, 1)?.sum_all()?.backward()?;
    println!(
        "log_softmax_dims max |diff| vs log(softmax_dims) = {:.2e}, gradient {:?}",
        max_abs_diff(&log_probs, &probs.log()?)?,
        grads.get(&scores).expect("scores have a gradient").dims()
    );
    Ok(())
}
