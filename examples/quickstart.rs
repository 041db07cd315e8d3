//! Runs every implemented op once, on CUDA device 0 when the crate is built with `cuda` and a GPU
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
    Ok(())
}
