//! optim::AdamW against candle_nn::AdamW (f32) and an f64 reference (16-bit and f64 variables),
//! on the CPU and CUDA: several launches' worth of tensors, ragged chunks, 0-d and empty
//! variables, a variable without a gradient, state saved and reloaded by name.

use crate::common::*;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_fastops::optim::AdamW;
use candle_nn::{Optimizer, ParamsAdamW};

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 3e-2,
        beta1: 0.85,
        beta2: 0.99,
        eps: 1e-6,
        weight_decay: 0.05,
    }
}

/// Odd shapes: more tensors than one launch takes (48), one spanning several chunks with a
/// ragged tail, a 0-d scalar.
fn shapes() -> Vec<Vec<usize>> {
    let mut shapes = vec![vec![3, 8197], vec![], vec![1], vec![13, 7]];
    for i in 0..60 {
        shapes.push(vec![1 + (i * 37) % 101]);
    }
    shapes
}

fn vars(dev: &Device, dtype: DType, salt: u64) -> Result<Vec<Var>> {
    shapes()
        .iter()
        .enumerate()
        .map(|(i, s)| Var::from_tensor(&rand_tensor(s, 1.0, dtype, dev, salt + i as u64)?))
        .collect()
}

fn grads(vars: &[Var], step: usize, salt: u64) -> Result<GradStore> {
    let mut g = GradStore::default();
    // The last variable never gets a gradient: both optimizers must leave it alone.
    for (i, v) in vars[..vars.len() - 1].iter().enumerate() {
        let scale = if i % 3 == 0 { 1e-3 } else { 1.0 };
        let t = rand_tensor(
            v.dims(),
            scale,
            v.dtype(),
            v.device(),
            salt + 1000 * step as u64 + i as u64,
        )?;
        g.insert(v.as_tensor(), t);
    }
    Ok(g)
}

fn values(vars: &[Var]) -> Result<Vec<Vec<f64>>> {
    vars.iter().map(|v| to_f64(v.as_tensor())).collect()
}

/// Agreement within `tol` times each tensor's path maximum ([`grow_path_max`], at least the
/// learning rate, the size of one update).
fn close(a: &[Vec<f64>], b: &[Vec<f64>], scales: &[f64], tol: f64, what: &str) {
    for (i, ((x, y), scale)) in a.iter().zip(b).zip(scales).enumerate() {
        for (j, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= tol * scale,
                "{what}: tensor {i}[{j}] {p} against {q} (tolerance {tol} x {scale})"
            );
        }
    }
}

#[test]
fn f32_matches_candle_nn_adamw() {
    for_each_device(|dev| {
        let salt = 0xada;
        let ours_vars = vars(dev, DType::F32, salt)?;
        let theirs_vars = vars(dev, DType::F32, salt)?;
        let untouched = to_f64(ours_vars.last().unwrap().as_tensor())?;
        let mut ours = AdamW::new(ours_vars.clone(), params())?;
        let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), params())?;
        let mut scales = Vec::new();
        grow_path_max(&mut scales, &values(&ours_vars)?, params().lr);
        for step in 0..6 {
            ours.step(&grads(&ours_vars, step, salt)?)?;
            theirs.step(&grads(&theirs_vars, step, salt)?)?;
            let (a, b) = (values(&ours_vars)?, values(&theirs_vars)?);
            grow_path_max(&mut scales, &a, params().lr);
            grow_path_max(&mut scales, &b, params().lr);
            close(&a, &b, &scales, 2e-5, &format!("step {step}"));
        }
        assert_eq!(to_f64(ours_vars.last().unwrap().as_tensor())?, untouched);
        assert_eq!(ours.steps_taken(), 6);
        Ok(())
    });
}

/// f64 AdamW on parameters rounded to `dtype` after every step (the moments kept in f64).
fn reference(
    init: &[Vec<f64>], grads: &[Vec<Vec<f64>>], dtype: DType, p: &ParamsAdamW,
) -> Result<Vec<Vec<f64>>> {
    let mut theta = init.to_vec();
    let mut m: Vec<Vec<f64>> = init.iter().map(|x| vec![0.0; x.len()]).collect();
    let mut v = m.clone();
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as f64;
        let (sm, sv) = (1.0 / (1.0 - p.beta1.powf(t)), 1.0 / (1.0 - p.beta2.powf(t)));
        for (i, gi) in g.iter().enumerate() {
            for j in 0..gi.len() {
                m[i][j] = p.beta1 * m[i][j] + (1.0 - p.beta1) * gi[j];
                v[i][j] = p.beta2 * v[i][j] + (1.0 - p.beta2) * gi[j] * gi[j];
                let upd = (m[i][j] * sm) / ((v[i][j] * sv).sqrt() + p.eps);
                theta[i][j] = theta[i][j] * (1.0 - p.lr * p.weight_decay) - p.lr * upd;
            }
            let rounded = Tensor::new(theta[i].as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            theta[i] = rounded.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        }
    }
    Ok(theta)
}

#[test]
fn every_dtype_matches_an_f64_reference() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            let salt = 0xbeef + dtype.size_in_bytes() as u64;
            let vs = vars(dev, dtype, salt)?;
            let init = values(&vs)?;
            let mut scales = Vec::new();
            grow_path_max(&mut scales, &init, params().lr);
            let mut opt = AdamW::new(vs.clone(), params())?;
            let mut all_grads = Vec::new();
            for step in 0..4 {
                let g = grads(&vs, step, salt)?;
                all_grads.push(
                    vs.iter()
                        .map(|v| {
                            g.get(v.as_tensor())
                                .map_or(Ok(vec![0.0; v.elem_count()]), to_f64)
                        })
                        .collect::<Result<Vec<_>>>()?,
                );
                opt.step(&g)?;
                grow_path_max(&mut scales, &values(&vs)?, params().lr);
            }
            // The variable without gradients: the reference must skip it too.
            let n = vs.len() - 1;
            let want = reference(
                &init[..n],
                &all_grads
                    .iter()
                    .map(|g| g[..n].to_vec())
                    .collect::<Vec<_>>(),
                dtype,
                &params(),
            )?;
            let tol = match dtype {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                // A rounding to the dtype may land one step away from the reference's.
                _ => 2.0 * tolerance(dtype),
            };
            grow_path_max(&mut scales, &want, params().lr);
            close(
                &values(&vs)?[..n],
                &want,
                &scales,
                tol,
                &format!("{dtype:?}"),
            );
            assert_eq!(
                values(&vs)?[n],
                init[n],
                "{dtype:?}: a variable without gradients"
            );
        }
        Ok(())
    });
}

#[test]
fn state_reloads_by_name_and_bad_state_changes_nothing() {
    for_each_device(|dev| {
        let salt = 0x5a7e;
        let vs = vars(dev, DType::F32, salt)?;
        let named: Vec<(String, Var)> = vs
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("layer{i}.w"), v.clone()))
            .collect();
        let mut opt = AdamW::new_named(named.clone(), params())?;
        for step in 0..3 {
            opt.step(&grads(&vs, step, salt)?)?;
        }
        let dir = std::env::temp_dir().join(format!(
            "fastops-adamw-{}-{}",
            std::process::id(),
            dev.is_cuda()
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("state.safetensors");
        opt.save_state(&path)?;
        let snapshot = values(&vs)?;
        for step in 3..5 {
            opt.step(&grads(&vs, step, salt)?)?;
        }
        let after = values(&vs)?;
        // Back to step 3, a new optimizer over the variables in reverse order, the state loaded.
        for (v, x) in vs.iter().zip(&snapshot) {
            v.set(
                &Tensor::new(x.as_slice(), &Device::Cpu)?
                    .to_dtype(DType::F32)?
                    .reshape(v.dims())?
                    .to_device(dev)?,
            )?;
        }
        let mut reversed = named.clone();
        reversed.reverse();
        let mut resumed = AdamW::new_named(reversed, params())?;
        resumed.load_state(&path)?;
        assert_eq!(resumed.steps_taken(), 3);
        for step in 3..5 {
            resumed.step(&grads(&vs, step, salt)?)?;
        }
        assert_eq!(
            values(&vs)?,
            after,
            "a resumed run repeats the original bit for bit"
        );
        // Another variable set: an error naming the mismatch, nothing changed.
        let other = vec![("layer0.w".to_string(), Var::zeros((2, 2), DType::F32, dev)?)];
        let mut wrong = AdamW::new_named(other, params())?;
        let err = wrong
            .load_state(&path)
            .expect_err("other variables")
            .to_string();
        assert!(err.contains("layer0.w") || err.contains("holds"), "{err}");
        assert_eq!(wrong.steps_taken(), 0);
        // A gradient of the wrong shape: an error before any variable changes.
        let before = values(&vs)?;
        let mut g = grads(&vs, 9, salt)?;
        g.insert(vs[1].as_tensor(), Tensor::zeros(7, DType::F32, dev)?);
        let err = resumed.step(&g).expect_err("wrong shape").to_string();
        assert!(err.contains("layer1.w"), "{err}");
        assert_eq!(values(&vs)?, before);
        std::fs::remove_dir_all(&dir).ok();
        Ok(())
    });
}
