//! Randomized agreement (proptest): every op over random shapes (size-1 and empty dims
//! included), views (contiguous, transposed, offset), dtypes and dims. The CPU is checked against
//! an f64 reference on every `cargo test`; CUDA against the CPU when a GPU is present. A failing
//! case is shrunk and printed.
//!
//! The seed and the case count are pinned (CI must not be flaky): `FASTOPS_PROPTEST_CASES`
//! changes the count (default 24), `FASTOPS_PROPTEST_FRESH=1` draws a fresh seed (printed, so a
//! failure can be replayed with `FASTOPS_PROPTEST_SEED`).

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

fn runner() -> TestRunner {
    let cases = std::env::var("FASTOPS_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let seed: u64 = match std::env::var("FASTOPS_PROPTEST_SEED") {
        Ok(v) => v.parse().expect("FASTOPS_PROPTEST_SEED is a u64"),
        Err(_) if std::env::var("FASTOPS_PROPTEST_FRESH").is_ok_and(|v| v == "1") => {
            let s = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64);
            eprintln!("proptest seed: FASTOPS_PROPTEST_SEED={s}");
            s
        }
        Err(_) => 0x05ee_dfa5_70b5,
    };
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// Runs `check` on every generated case, panicking with the shrunk failing case.
fn run<S: Strategy>(strategy: S, check: impl Fn(S::Value) -> Result<()>)
where
    S::Value: std::fmt::Debug,
{
    let result = runner().run(&strategy, |case| {
        check(case).map_err(|e| TestCaseError::fail(e.to_string()))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A property failure as a candle error (so `?` works inside checks).
fn fail(what: String) -> candle_core::Error {
    candle_core::Error::Msg(what)
}

/// `|a - e| <= tol * max(|e|, 1)` everywhere (NaN only where expected), as an error.
fn close(actual: &[f64], expected: &[f64], tol: f64, what: &str) -> Result<()> {
    if actual.len() != expected.len() {
        return Err(fail(format!(
            "{what}: {} elements, expected {}",
            actual.len(),
            expected.len()
        )));
    }
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let ok = if e.is_nan() {
            a.is_nan()
        } else if e.is_infinite() {
            a == e
        } else {
            (a - e).abs() <= tol * e.abs().max(1.0)
        };
        if !ok {
            return Err(fail(format!(
                "{what}: element {i} is {a}, expected {e} (tol {tol:.1e})"
            )));
        }
    }
    Ok(())
}

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// How an operand is laid out: 0 contiguous, 1 a transposed view (last two dims), 2 an offset
/// view (a narrow of a wider last dim).
fn view(shape: &[usize], dtype: DType, dev: &Device, salt: u64, kind: usize) -> Result<Tensor> {
    let r = shape.len();
    match kind {
        1 if r >= 2 => {
            let mut swapped = shape.to_vec();
            swapped.swap(r - 2, r - 1);
            rand_tensor(&swapped, 1.0, dtype, dev, salt)?.transpose(r - 2, r - 1)
        }
        2 if r >= 1 => {
            let mut wider = shape.to_vec();
            wider[r - 1] += 2;
            rand_tensor(&wider, 1.0, dtype, dev, salt)?.narrow(r - 1, 1, shape[r - 1])
        }
        _ => rand_tensor(shape, 1.0, dtype, dev, salt),
    }
}

/// The devices a case runs on beside the CPU reference: the GPU when present, for f32/f16/bf16.
fn gpus(dtype: DType) -> Vec<Device> {
    gpu().into_iter().filter(|_| dtype != DType::F64).collect()
}

#[test]
fn bias_add_agrees() {
    let strategy = (1usize..=4).prop_flat_map(|rank| {
        (
            proptest::collection::vec(0usize..=6, rank),
            0..rank,
            0..DTYPES.len(),
            0usize..3,
            any::<u64>(),
        )
    });
    run(strategy, |(shape, dim, dt, kind, salt)| {
        let dtype = DTYPES[dt];
        let ys_of = |dev: &Device| -> Result<(Tensor, Tensor, Tensor)> {
            let xs = view(&shape, dtype, dev, salt, kind)?;
            let bias = rand_tensor(&[shape[dim]], 1.0, dtype, dev, salt ^ 1)?;
            let ys = candle_fastops::bias_add(&xs, &bias, dim)?;
            Ok((xs, bias, ys))
        };
        let (xs, bias, ys) = ys_of(&Device::Cpu)?;
        let expected = crate::bias_add::reference(&xs, &bias, dim)?;
        let cpu = to_f64(&ys)?;
        close(&cpu, &expected, tolerance(dtype), "bias_add CPU vs f64")?;
        for dev in gpus(dtype) {
            close(
                &to_f64(&ys_of(&dev)?.2)?,
                &cpu,
                tolerance(dtype),
                "bias_add CUDA vs CPU",
            )?;
        }
        Ok(())
    });
}

#[test]
fn softmax_dims_agrees() {
    let strategy = (1usize..=4).prop_flat_map(|rank| {
        (
            proptest::collection::vec(0usize..=6, rank),
            proptest::collection::vec(any::<bool>(), rank),
            0..DTYPES.len(),
            0usize..3,
            any::<bool>(),
            any::<u64>(),
        )
    });
    run(strategy, |(shape, pick, dt, kind, log, salt)| {
        let dtype = DTYPES[dt];
        let mut dims: Vec<usize> = (0..shape.len()).filter(|&d| pick[d]).collect();
        if dims.is_empty() {
            dims.push(shape.len() - 1);
        }
        let op = |xs: &Tensor| {
            if log {
                candle_fastops::log_softmax_dims(xs, &dims)
            } else {
                candle_fastops::softmax_dims(xs, &dims)
            }
        };
        let xs = view(&shape, dtype, &Device::Cpu, salt, kind)?;
        let cpu = to_f64(&op(&xs)?)?;
        let expected = crate::softmax::reference(&to_f64(&xs)?, &shape, &dims, log);
        let tol = 4.0 * tolerance(dtype);
        close(&cpu, &expected, tol, "softmax CPU vs f64")?;
        for dev in gpus(dtype) {
            let xs = view(&shape, dtype, &dev, salt, kind)?;
            close(&to_f64(&op(&xs)?)?, &cpu, tol, "softmax CUDA vs CPU")?;
        }
        Ok(())
    });
}

#[test]
fn sparse_linear_agrees() {
    let strategy = (
        0usize..=9,
        0usize..=5,
        1usize..=13,
        1usize..=19,
        0..DTYPES.len(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    );
    run(
        strategy,
        |(batch, active, num_inputs, out, dt, with_values, narrow_weight, salt)| {
            let dtype = DTYPES[dt];
            let mut rng = rng(salt);
            use rand::Rng;
            let indices: Vec<i32> = (0..batch * active)
                .map(|_| rng.random_range(-1..num_inputs as i32))
                .collect();
            let values: Vec<f32> = (0..batch * active)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let run_on = |dev: &Device| -> Result<Tensor> {
                let idx = Tensor::from_vec(indices.clone(), (batch, active), dev)?;
                let vals = Tensor::from_vec(values.clone(), (batch, active), dev)?;
                let weight = if narrow_weight {
                    rand_tensor(&[num_inputs, out + 3], 1.0, dtype, dev, salt ^ 2)?
                        .narrow(1, 2, out)?
                } else {
                    rand_tensor(&[num_inputs, out], 1.0, dtype, dev, salt ^ 2)?
                };
                let bias = rand_tensor(&[out], 1.0, dtype, dev, salt ^ 3)?;
                candle_fastops::sparse_linear(&idx, with_values.then_some(&vals), &weight, &bias)
            };
            let cpu = to_f64(&run_on(&Device::Cpu)?)?;
            let weight = if narrow_weight {
                rand_tensor(&[num_inputs, out + 3], 1.0, dtype, &Device::Cpu, salt ^ 2)?
                    .narrow(1, 2, out)?
            } else {
                rand_tensor(&[num_inputs, out], 1.0, dtype, &Device::Cpu, salt ^ 2)?
            };
            let (w, b) = (
                to_f64(&weight)?,
                to_f64(&rand_tensor(&[out], 1.0, dtype, &Device::Cpu, salt ^ 3)?)?,
            );
            let mut expected = Vec::with_capacity(batch * out);
            for r in 0..batch {
                let mut acc = b.clone();
                for k in 0..active {
                    let i = indices[r * active + k];
                    if i == -1 {
                        break;
                    }
                    let v = if with_values {
                        values[r * active + k] as f64
                    } else {
                        1.0
                    };
                    for (a, wv) in acc
                        .iter_mut()
                        .zip(&w[i as usize * out..(i as usize + 1) * out])
                    {
                        *a += v * wv;
                    }
                }
                expected.extend(acc);
            }
            let tol = 8.0 * tolerance(dtype).max(1e-6);
            close(&cpu, &expected, tol, "sparse_linear CPU vs f64")?;
            for dev in gpus(dtype) {
                close(
                    &to_f64(&run_on(&dev)?)?,
                    &cpu,
                    tol,
                    "sparse_linear CUDA vs CPU",
                )?;
            }
            Ok(())
        },
    );
}

#[test]
fn masked_bmm_and_argmin_agree() {
    let strategy = (
        (1usize..=3, 1usize..=20, 0usize..=20, 1usize..=20),
        0..DTYPES.len(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    );
    run(
        strategy,
        |((batch, m, k, n), dt, transposed_b, batched_mask, salt)| {
            let dtype = DTYPES[dt];
            let mask_shape: Vec<usize> = if batched_mask {
                vec![batch, m, n]
            } else {
                vec![m, n]
            };
            let mut rng = rng(salt);
            use rand::Rng;
            let mask_bits: Vec<u8> = (0..mask_shape.iter().product::<usize>())
                .map(|_| rng.random_range(0..2u8))
                .collect();
            let operands = |dev: &Device| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
                let a = rand_tensor(&[batch, m, k], 1.0, dtype, dev, salt ^ 4)?;
                let b = if transposed_b {
                    rand_tensor(&[batch, n, k], 1.0, dtype, dev, salt ^ 5)?.transpose(1, 2)?
                } else {
                    rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt ^ 5)?
                };
                let mask = Tensor::from_vec(mask_bits.clone(), mask_shape.as_slice(), dev)?;
                let bias = rand_tensor(&[n], 1.0, DType::F32, dev, salt ^ 6)?;
                Ok((a, b, mask, bias))
            };
            let (a, b, mask, bias) = operands(&Device::Cpu)?;
            let full = product(&to_f64(&a)?, &to_f64(&b.contiguous()?)?, batch, m, k, n);
            let keep = to_f64(&mask.broadcast_as((batch, m, n))?)?;
            let expected: Vec<f64> = full
                .iter()
                .zip(&keep)
                .map(|(&p, &kp)| if kp != 0.0 { p } else { -7.0 })
                .collect();
            let tol = (tolerance(dtype) * 4.0).max(2e-6 * (k as f64 + 1.0));
            let cpu = to_f64(&candle_fastops::masked_bmm(&a, &b, &mask, -7.0)?)?;
            close(&cpu, &expected, tol, "masked_bmm CPU vs f64")?;
            let scores = argmin_reference(
                &to_f64(&a)?,
                &to_f64(&b.contiguous()?)?,
                &to_f64(&bias)?,
                -2.0,
                (batch, m, k, n),
            );
            let idx_of = |a: &Tensor, b: &Tensor, bias: &Tensor| -> Result<Vec<u32>> {
                candle_fastops::argmin_matmul(a, b, Some(bias), -2.0)?
                    .flatten_all()?
                    .to_vec1::<u32>()
            };
            let argmin_ok = |got: &[u32], what: &str| -> Result<()> {
                std::panic::catch_unwind(|| check_argmin(got, &scores, 8.0 * tol, what))
                    .map_err(|_| fail(format!("{what}: an index is not the row's best")))
            };
            argmin_ok(&idx_of(&a, &b, &bias)?, "argmin CPU")?;
            for dev in gpus(dtype) {
                let (a, b, mask, bias) = operands(&dev)?;
                let gpu_out = to_f64(&candle_fastops::masked_bmm(&a, &b, &mask, -7.0)?)?;
                close(&gpu_out, &cpu, tol, "masked_bmm CUDA vs CPU")?;
                argmin_ok(&idx_of(&a, &b, &bias)?, "argmin CUDA")?;
            }
            Ok(())
        },
    );
}

#[test]
fn small_fc_lopt_fused_agrees_with_the_reference() {
    use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
    use candle_nn::Optimizer;
    let strategy = (
        proptest::collection::vec(proptest::collection::vec(1usize..=6, 0..=3), 1..=3),
        any::<u64>(),
    );
    run(strategy, |(shapes, salt)| {
        let mlp_path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/small_fc_lopt_mlp.safetensors"
        );
        let step = |dev: &Device, fused: bool| -> Result<Vec<f64>> {
            let vars: Vec<candle_core::Var> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    candle_core::Var::from_tensor(&rand_tensor(
                        s,
                        1.0,
                        DType::F32,
                        dev,
                        salt + i as u64,
                    )?)
                })
                .collect::<Result<_>>()?;
            let mut params = ParamsSmallFcLOpt::new(MlpWeights::from_safetensors(mlp_path, dev)?);
            params.backend.fused = fused;
            let mut opt = SmallFcLOpt::new(vars.clone(), params)?;
            for round in 0..2u64 {
                let mut grads = candle_core::backprop::GradStore::default();
                for (i, v) in vars.iter().enumerate() {
                    let g = rand_tensor(
                        v.dims(),
                        0.5,
                        DType::F32,
                        dev,
                        salt ^ (97 * (round + 1) + i as u64),
                    )?;
                    grads.insert(v.as_tensor(), g);
                }
                opt.step(&grads)?;
            }
            let mut out = Vec::new();
            for v in &vars {
                out.extend(to_f64(v.as_tensor())?);
            }
            Ok(out)
        };
        let reference = step(&Device::Cpu, false)?;
        let cpu = step(&Device::Cpu, true)?;
        close(
            &cpu,
            &reference,
            1e-5,
            "small_fc_lopt fused CPU vs composed",
        )?;
        if let Some(dev) = gpu() {
            close(&step(&dev, true)?, &cpu, 1e-4, "small_fc_lopt CUDA vs CPU")?;
        }
        Ok(())
    });
}
