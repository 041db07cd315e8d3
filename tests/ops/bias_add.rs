use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_fastops::{bias_add, bias_add_, bias_add_with, Activation, BiasAddOptions};

/// f64 reference: `xs[.., i, ..] + bias[i]` along `dim`, in row-major order.
pub(crate) fn reference(xs: &Tensor, bias: &Tensor, dim: usize) -> Result<Vec<f64>> {
    let x = to_f64(xs)?;
    let b = to_f64(bias)?;
    let inner: usize = xs.dims()[dim + 1..].iter().product();
    let channels = xs.dims()[dim];
    Ok(x.iter()
        .enumerate()
        .map(|(i, v)| v + b[(i / inner) % channels])
        .collect())
}

const SHAPES: &[&[usize]] = &[
    &[1],
    &[7],
    &[3, 5],
    &[4, 1031],
    &[2, 3, 5, 7],
    &[1, 1, 1],
    &[5, 13, 9, 9],
    &[0, 4],
    &[3, 0],
    &[2, 0, 3],
    &[257, 4099],
    &[3, 2, 2, 2, 3, 5],
    // More channels than fit in the kernel's 48 KiB shared-memory bias (f32 and half types).
    &[3, 13001],
    &[2, 24593],
];

#[test]
fn forward_matches_reference_every_shape_dim_dtype() {
    for_each_device(|dev| {
        let mut salt = 0;
        for dtype in float_dtypes(dev) {
            for shape in SHAPES {
                for dim in 0..shape.len() {
                    salt += 1;
                    let xs = rand_tensor(shape, 4.0, dtype, dev, salt)?;
                    let bias = rand_tensor(&[shape[dim]], 4.0, dtype, dev, salt + 1000)?;
                    let ys = bias_add(&xs, &bias, dim)?;
                    assert_eq!(ys.dims(), *shape);
                    assert_eq!(ys.dtype(), dtype);
                    let what = format!("{dtype:?} {shape:?} dim {dim}");
                    assert_close(
                        &to_f64(&ys)?,
                        &reference(&xs, &bias, dim)?,
                        tolerance(dtype),
                        &what,
                    );
                }
            }
        }
        Ok(())
    })
}

#[test]
fn forward_non_contiguous_and_offset_views() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            let base = rand_tensor(&[6, 37, 11], 3.0, dtype, dev, 7)?;
            let views: Vec<(&str, Tensor)> = vec![
                ("transposed", base.transpose(1, 2)?),
                ("permuted", base.permute((2, 0, 1))?),
                ("narrowed dim0 (offset)", base.narrow(0, 1, 4)?),
                ("narrowed last dim (strided)", base.narrow(2, 3, 5)?),
                (
                    "flat offset by one element",
                    base.flatten_all()?.narrow(0, 1, 6 * 37 * 11 - 3)?,
                ),
            ];
            for (name, xs) in views {
                for dim in 0..xs.rank() {
                    let bias = rand_tensor(&[xs.dim(dim)?], 3.0, dtype, dev, 100 + dim as u64)?;
                    let ys = bias_add(&xs, &bias, dim)?;
                    let what = format!("{dtype:?} {name} dim {dim}");
                    assert_close(
                        &to_f64(&ys)?,
                        &reference(&xs, &bias, dim)?,
                        tolerance(dtype),
                        &what,
                    );
                }
            }
            // A strided (every other element) bias view.
            let xs = rand_tensor(&[9, 10], 3.0, dtype, dev, 8)?;
            let wide = rand_tensor(&[10, 2], 3.0, dtype, dev, 9)?;
            let bias = wide.narrow(1, 1, 1)?.squeeze(1)?;
            assert!(!bias.is_contiguous());
            let ys = bias_add(&xs, &bias, 1)?;
            assert_close(
                &to_f64(&ys)?,
                &reference(&xs, &bias, 1)?,
                tolerance(dtype),
                "strided bias",
            );
        }
        Ok(())
    })
}

#[test]
fn in_place_matches_out_of_place_on_dense_views() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            for (shape, dim) in [
                (vec![33usize, 129], 1usize),
                (vec![4, 7, 5, 3], 1),
                (vec![1031], 0),
                (vec![8, 6, 5], 2),
            ] {
                let xs = rand_tensor(&shape, 2.0, dtype, dev, 21)?;
                let bias = rand_tensor(&[shape[dim]], 2.0, dtype, dev, 22)?;
                let expected = reference(&xs, &bias, dim)?;
                bias_add_(&xs, &bias, dim)?;
                assert_close(
                    &to_f64(&xs)?,
                    &expected,
                    tolerance(dtype),
                    &format!("in place {dtype:?} {shape:?}"),
                );
            }
            // A row-range view (contiguous at an offset): only the view changes.
            let parent = rand_tensor(&[10, 67], 2.0, dtype, dev, 23)?;
            let before = to_f64(&parent)?;
            let view = parent.narrow(0, 3, 5)?;
            let bias = rand_tensor(&[67], 2.0, dtype, dev, 24)?;
            let expected_view = reference(&view, &bias, 1)?;
            bias_add_(&view, &bias, 1)?;
            let after = to_f64(&parent)?;
            assert_close(
                &after[..3 * 67],
                &before[..3 * 67],
                0.0,
                "rows before the view",
            );
            assert_close(
                &after[8 * 67..],
                &before[8 * 67..],
                0.0,
                "rows after the view",
            );
            assert_close(
                &after[3 * 67..8 * 67],
                &expected_view,
                tolerance(dtype),
                "view rows",
            );
            // A permuted view of a contiguous tensor is dense: in place works along either dim.
            let xs = rand_tensor(&[12, 9], 2.0, dtype, dev, 25)?;
            let t = xs.t()?;
            let bias = rand_tensor(&[12], 2.0, dtype, dev, 26)?;
            let expected = reference(&t, &bias, 1)?;
            bias_add_(&t, &bias, 1)?;
            assert_close(
                &to_f64(&t)?,
                &expected,
                tolerance(dtype),
                "transposed in place",
            );
        }
        Ok(())
    })
}

#[test]
fn cpu_and_gpu_agree_exactly() -> Result<()> {
    // One f32 add (or f32 add + one rounding for half types) is deterministic: the devices must
    // give bit-identical results.
    let Some(gpu) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (shape, dim) in [
            (vec![1000usize, 4096], 1usize),
            (vec![16, 64, 28, 28], 1),
            (vec![3, 1031], 1),
        ] {
            let xs = rand_tensor(&shape, 8.0, dtype, &Device::Cpu, 31)?;
            let bias = rand_tensor(&[shape[dim]], 8.0, dtype, &Device::Cpu, 32)?;
            let cpu = to_f64(&bias_add(&xs, &bias, dim)?)?;
            let on_gpu = bias_add(&xs.to_device(&gpu)?, &bias.to_device(&gpu)?, dim)?;
            assert_close(
                &to_f64(&on_gpu)?,
                &cpu,
                0.0,
                &format!("cpu vs gpu {dtype:?} {shape:?}"),
            );
        }
    }
    Ok(())
}

/// Loss with random weights so every gradient element is distinct and nonzero.
fn weighted_sum(ys: &Tensor, salt: u64) -> Result<Tensor> {
    let w = rand_tensor(ys.dims(), 1.0, ys.dtype(), ys.device(), salt)?;
    (ys * w)?.sum_all()
}

#[test]
fn gradients_match_broadcast_add() {
    for_each_device(|dev| {
        for dtype in [DType::F32, DType::BF16] {
            for (shape, dim) in [
                (vec![6usize, 5, 4, 3], 1usize),
                (vec![9, 17], 1),
                (vec![9, 17], 0),
                (vec![13], 0),
            ] {
                let x0 = rand_tensor(&shape, 1.0, dtype, dev, 41)?;
                let b0 = rand_tensor(&[shape[dim]], 1.0, dtype, dev, 42)?;
                let (xs, bias) = (Var::from_tensor(&x0)?, Var::from_tensor(&b0)?);
                let ours = weighted_sum(&bias_add(&xs, &bias, dim)?, 43)?.backward()?;
                let mut bshape = vec![1; shape.len()];
                bshape[dim] = shape[dim];
                let theirs =
                    weighted_sum(&xs.broadcast_add(&bias.reshape(bshape)?)?, 43)?.backward()?;
                for (name, var) in [("xs", &xs), ("bias", &bias)] {
                    let ours = ours.get(var).expect("gradient present");
                    let theirs = theirs.get(var).expect("gradient present");
                    assert_eq!(ours.dims(), var.dims());
                    let tol = tolerance(dtype) * (shape.iter().product::<usize>() as f64).sqrt();
                    assert_close(
                        &to_f64(ours)?,
                        &to_f64(theirs)?,
                        tol,
                        &format!("grad {name} {dtype:?} {shape:?} dim {dim}"),
                    );
                }
            }
        }
        Ok(())
    })
}

fn clipped(ceiling: f32) -> BiasAddOptions {
    BiasAddOptions {
        activation: Activation::ClippedRelu { ceiling },
    }
}

/// f64 reference of the fused clipped ReLU: `clamp(xs + bias, 0, ceiling)` along `dim`.
fn clipped_reference(xs: &Tensor, bias: &Tensor, dim: usize, ceiling: f32) -> Result<Vec<f64>> {
    let ceiling = f64::from(ceiling);
    Ok(reference(xs, bias, dim)?
        .into_iter()
        .map(|v| v.clamp(0.0, ceiling))
        .collect())
}

#[test]
fn clipped_relu_forward_matches_reference() {
    for_each_device(|dev| {
        let mut salt = 500;
        for dtype in float_dtypes(dev) {
            // Ceilings exact in every dtype and not (0.3); inputs spread well past both bounds.
            for (shape, ceiling) in [
                (&[4usize, 1031][..], 1.0f32),
                (&[5, 13, 9, 9], 0.3),
                (&[257, 33], 2.5),
                (&[7], 1.0),
                (&[0, 4], 1.0),
                (&[2, 0, 3], 1.0),
            ] {
                for dim in 0..shape.len() {
                    salt += 1;
                    let xs = rand_tensor(shape, 2.0, dtype, dev, salt)?;
                    let bias = rand_tensor(&[shape[dim]], 1.0, dtype, dev, salt + 1000)?;
                    let ys = bias_add_with(&xs, &bias, dim, &clipped(ceiling))?;
                    assert_eq!((ys.dims(), ys.dtype()), (shape, dtype));
                    assert_close(
                        &to_f64(&ys)?,
                        &clipped_reference(&xs, &bias, dim, ceiling)?,
                        tolerance(dtype),
                        &format!("{dtype:?} {shape:?} dim {dim} ceiling {ceiling}"),
                    );
                }
            }
            // Views: transposed, offset, strided; the identity option is plain bias_add.
            let base = rand_tensor(&[6, 37, 11], 2.0, dtype, dev, salt + 7)?;
            for (name, xs) in [
                ("transposed", base.transpose(1, 2)?),
                ("narrowed (offset)", base.narrow(0, 1, 4)?),
                ("narrowed last dim (strided)", base.narrow(2, 3, 5)?),
            ] {
                let bias = rand_tensor(&[xs.dim(1)?], 1.0, dtype, dev, salt + 8)?;
                let ys = bias_add_with(&xs, &bias, 1, &clipped(1.0))?;
                assert_close(
                    &to_f64(&ys)?,
                    &clipped_reference(&xs, &bias, 1, 1.0)?,
                    tolerance(dtype),
                    &format!("{dtype:?} {name}"),
                );
                let plain = bias_add_with(&xs, &bias, 1, &BiasAddOptions::default())?;
                assert_eq!(to_f64(&plain)?, to_f64(&bias_add(&xs, &bias, 1)?)?);
            }
        }
        Ok(())
    })
}

#[test]
fn clipped_relu_gradients() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            for (shape, dim, ceiling) in [
                (vec![6usize, 5, 4, 3], 1usize, 1.0f32),
                (vec![129, 33], 1, 0.3),
                (vec![9, 17], 0, 2.5),
                (vec![131], 0, 1.0),
            ] {
                let what = format!("{dtype:?} {shape:?} dim {dim} ceiling {ceiling}");
                let x0 = rand_tensor(&shape, 2.0, dtype, dev, 61)?;
                let b0 = rand_tensor(&[shape[dim]], 1.0, dtype, dev, 62)?;
                let weights = rand_tensor(&shape, 1.0, dtype, dev, 63)?;
                let (xs, bias) = (Var::from_tensor(&x0)?, Var::from_tensor(&b0)?);
                let ys = bias_add_with(&xs, &bias, dim, &clipped(ceiling))?;
                let grads = (&ys * &weights)?.sum_all()?.backward()?;
                // Expected: the loss weights where the stored output is strictly inside
                // (0, ceiling rounded to the dtype), their sums over the other dims for bias.
                let top = Tensor::new(ceiling, &candle_core::Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                let y = to_f64(&ys)?;
                let w = to_f64(&weights)?;
                let grad_x: Vec<f64> = y
                    .iter()
                    .zip(&w)
                    .map(|(&y, &w)| if y > 0.0 && y < top { w } else { 0.0 })
                    .collect();
                let inner: usize = shape[dim + 1..].iter().product();
                let mut grad_b = vec![0f64; shape[dim]];
                for (i, g) in grad_x.iter().enumerate() {
                    grad_b[(i / inner) % shape[dim]] += g;
                }
                let passed = grad_x.iter().filter(|&&g| g != 0.0).count();
                assert!(
                    passed > 0 && passed < grad_x.len(),
                    "{what}: the inputs must reach both sides of the mask"
                );
                let got_x = grads.get(&xs).expect("gradient of xs");
                assert_eq!(got_x.dims(), &shape[..]);
                assert_close(&to_f64(got_x)?, &grad_x, 0.0, &format!("grad xs {what}"));
                let tol = tolerance(dtype) * (shape.iter().product::<usize>() as f64).sqrt();
                let got_b = grads.get(&bias).expect("gradient of bias");
                assert_close(&to_f64(got_b)?, &grad_b, tol, &format!("grad bias {what}"));
                if dtype == DType::F32 {
                    // Against candle's composed clamp (no random sum lands on a bound in f32).
                    let mut bshape = vec![1; shape.len()];
                    bshape[dim] = shape[dim];
                    let composed = xs
                        .broadcast_add(&bias.reshape(bshape)?)?
                        .clamp(0f32, ceiling)?;
                    let theirs = (&composed * &weights)?.sum_all()?.backward()?;
                    for (name, var) in [("xs", &xs), ("bias", &bias)] {
                        assert_close(
                            &to_f64(grads.get(var).expect("ours"))?,
                            &to_f64(theirs.get(var).expect("candle's"))?,
                            1e-5,
                            &format!("grad {name} against candle's clamp, {what}"),
                        );
                    }
                }
            }
        }
        // A NaN sum stays NaN forward and gets no gradient.
        let xs = Var::from_tensor(&Tensor::new(&[[f32::NAN, 0.5], [2.0, -1.0]], dev)?)?;
        let bias = Var::from_tensor(&Tensor::new(&[0.25f32, 0.25], dev)?)?;
        let ys = bias_add_with(&xs, &bias, 1, &clipped(1.0))?;
        let y = to_f64(&ys)?;
        assert!(y[0].is_nan());
        assert_eq!(&y[1..], &[0.75, 1.0, 0.0]);
        let grads = ys.sum_all()?.backward()?;
        assert_eq!(to_f64(grads.get(&xs).expect("grad"))?, [0.0, 1.0, 0.0, 0.0]);
        assert_eq!(to_f64(grads.get(&bias).expect("grad"))?, [0.0, 1.0]);
        Ok(())
    })
}

fn expect_err(result: Result<impl Sized>, needle: &str) {
    match result {
        Ok(_) => panic!("expected an error containing {needle:?}"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "error {e:?} does not mention {needle:?}"
        ),
    }
}

#[test]
fn bad_input_is_a_clear_error_and_writes_nothing() {
    for_each_device(|dev| {
        let xs = rand_tensor(&[4, 6], 1.0, DType::F32, dev, 51)?;
        let before = to_f64(&xs)?;
        let bias6 = rand_tensor(&[6], 1.0, DType::F32, dev, 52)?;
        let scalar = Tensor::new(1f32, dev)?;
        expect_err(bias_add(&scalar, &bias6, 0), "rank >= 1");
        expect_err(bias_add(&xs, &bias6, 2), "out of range");
        expect_err(bias_add(&xs, &bias6.reshape((2, 3))?, 1), "must be 1-D");
        expect_err(bias_add(&xs, &bias6, 0), "6 elements but xs has 4");
        for ceiling in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            expect_err(
                bias_add_with(&xs, &bias6, 1, &clipped(ceiling)),
                "ceiling must be finite and positive",
            );
        }
        expect_err(
            bias_add_with(&xs, &bias6, 0, &clipped(1.0)),
            "6 elements but xs has 4",
        );
        expect_err(
            bias_add(&xs, &bias6.to_dtype(DType::F16)?, 1),
            "dtype mismatch",
        );
        let ints = Tensor::zeros((4, 6), DType::U32, dev)?;
        expect_err(
            bias_add(&ints, &Tensor::zeros(6, DType::U32, dev)?, 1),
            "unsupported dtype",
        );
        for (result, needle) in [
            (bias_add_(&xs, &bias6, 0), "6 elements"),
            (bias_add_(&xs, &bias6, 5), "out of range"),
            (
                bias_add_(&xs, &bias6.to_dtype(DType::BF16)?, 1),
                "dtype mismatch",
            ),
        ] {
            expect_err(result, needle);
        }
        // A strided view with gaps cannot be updated in place.
        let wide = rand_tensor(&[4, 12], 1.0, DType::F32, dev, 53)?;
        let wide_before = to_f64(&wide)?;
        expect_err(bias_add_(&wide.narrow(1, 0, 6)?, &bias6, 1), "dense");
        assert_eq!(to_f64(&wide)?, wide_before, "nothing written on error");
        assert_eq!(to_f64(&xs)?, before, "nothing written on error");
        if dev.is_cuda() {
            expect_err(
                bias_add(&xs, &bias6.to_device(&Device::Cpu)?, 1),
                "device mismatch",
            );
            let x64 = xs.to_dtype(DType::F64)?;
            expect_err(bias_add(&x64, &bias6.to_dtype(DType::F64)?, 1), "CPU only");
        }
        Ok(())
    })
}
