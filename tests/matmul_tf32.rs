//! The opt-in TF32 tensor-core mode of masked_bmm / argmin_matmul (`set_matmul_tf32`). Its own
//! test binary: the switch is process-wide, and the f32 tests in `matmul.rs` expect full f32.
mod common;

use candle_core::{DType, Device, Result, Tensor};
use candle_fastops::{argmin_matmul, masked_bmm, matmul_tf32, set_matmul_tf32};
use common::*;

/// A TF32 product of terms of size ~1: each operand rounded to an 11-bit significand.
fn tf32_tolerance(k: usize) -> f64 {
    2e-3 * (k as f64).sqrt() + 1e-5
}

#[test]
fn tf32_mode_rounds_on_the_gpu_and_stays_close() -> Result<()> {
    // 1 + 2^-15 is an f32 but not a TF32 value: the GPU's TF32 product rounds it to 1, the CPU
    // (always full f32) and the GPU with the switch off keep it. Proves which path ran.
    let exact = 1.0 + 2f32.powi(-15);
    for dev in devices() {
        for tf32 in [false, true] {
            set_matmul_tf32(tf32);
            assert_eq!(matmul_tf32(), tf32);
            let a = Tensor::new(&[[[exact]]], &dev)?;
            let b = Tensor::new(&[[[1f32]]], &dev)?;
            let mask = Tensor::new(&[[1u8]], &dev)?;
            let got = masked_bmm(&a, &b, &mask, 0.0)?
                .flatten_all()?
                .to_vec1::<f32>()?[0];
            let rounded = tf32 && dev.is_cuda();
            assert_eq!(
                got,
                if rounded { 1.0 } else { exact },
                "{dev:?} tf32={tf32}"
            );
        }
    }
    set_matmul_tf32(true);
    for dev in devices() {
        for (s, &(batch, m, k, n)) in [(2, 131, 67, 140), (1, 300, 128, 257), (3, 5, 1, 9)]
            .iter()
            .enumerate()
        {
            let salt = 700 + 10 * s as u64;
            let a = rand_tensor(&[batch, m, k], 1.0, DType::F32, &dev, salt)?;
            // Transposed b, as attention's k^T and k-means' centroids.t() arrive.
            let b =
                rand_tensor(&[batch, n, k], 1.0, DType::F32, &dev, salt + 1)?.transpose(1, 2)?;
            let mask = Tensor::rand(0f32, 1f32, (m, n), &Device::Cpu)?
                .ge(0.5)?
                .to_device(&dev)?;
            let out = masked_bmm(&a, &b, &mask, f64::NEG_INFINITY)?;
            let full = product(&to_f64(&a)?, &to_f64(&b)?, batch, m, k, n);
            let keep = to_f64(&mask.broadcast_as((batch, m, n))?)?;
            let expected: Vec<f64> = full
                .iter()
                .zip(&keep)
                .map(|(&p, &kp)| if kp != 0.0 { p } else { f64::NEG_INFINITY })
                .collect();
            assert_close(
                &to_f64(&out)?,
                &expected,
                tf32_tolerance(k),
                &format!("{dev:?} masked_bmm tf32 case {s}"),
            );
            let bias = rand_tensor(&[n], 2.0, DType::F32, &dev, salt + 2)?;
            let got = argmin_matmul(&a, &b, Some(&bias), -2.0)?
                .flatten_all()?
                .to_vec1::<u32>()?;
            let scores = argmin_reference(
                &to_f64(&a)?,
                &to_f64(&b)?,
                &to_f64(&bias)?,
                -2.0,
                (batch, m, k, n),
            );
            check_argmin(
                &got,
                &scores,
                2.0 * tf32_tolerance(k),
                &format!("{dev:?} argmin tf32 case {s}"),
            );
        }
    }
    set_matmul_tf32(false);
    Ok(())
}
