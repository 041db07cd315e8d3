//! The f32 modes of masked_bmm / argmin_matmul on CUDA, chosen per call with `MatmulOptions`:
//! compensated (three TF32 passes, the default), plain FMA and TF32. (That a call without a mode
//! follows the process-wide default is checked in `tests/global_defaults.rs`, its own process:
//! flipping the global here would change what the other tests of this binary compute.)

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_fastops::{argmin_matmul_with, masked_bmm_with, F32Matmul, MatmulOptions};

/// `masked_bmm` with the given f32 mode for this call only.
fn masked_in(a: &Tensor, b: &Tensor, mask: &Tensor, fill: f64, mode: F32Matmul) -> Result<Tensor> {
    masked_bmm_with(a, b, mask, fill, None, &MatmulOptions::with_f32(mode))
}

/// Worst |got - exact| / max(|exact|, 1) over the masked product of `a` and `b` (mask all kept).
fn worst_error(a: &Tensor, b: &Tensor, exact: &[f64], mode: F32Matmul) -> Result<f64> {
    let (_, m, _) = a.dims3()?;
    let n = b.dim(2)?;
    let keep = Tensor::ones((m, n), DType::U8, a.device())?;
    let got = to_f64(&masked_in(a, b, &keep, 0.0, mode)?)?;
    Ok(got
        .iter()
        .zip(exact)
        .map(|(g, e)| (g - e).abs() / e.abs().max(1.0))
        .fold(0.0, f64::max))
}

/// `argmin_matmul(a, b, bias, -2)` (the k-means form) against the f64 reference, within `tol`.
fn check_kmeans_like_argmin(
    a: &Tensor, b: &Tensor, bias: &Tensor, tol: f64, what: &str, mode: F32Matmul,
) -> Result<()> {
    let (batch, m, k) = a.dims3()?;
    let n = b.dim(2)?;
    let options = MatmulOptions::with_f32(mode);
    let got = argmin_matmul_with(a, b, Some(bias), -2.0, &options)?
        .flatten_all()?
        .to_vec1::<u32>()?;
    let scores = argmin_reference(
        &to_f64(a)?,
        &to_f64(b)?,
        &to_f64(bias)?,
        -2.0,
        (batch, m, k, n),
    );
    check_argmin(&got, &scores, tol, what);
    Ok(())
}

/// Which f32 core ran shows in one product: with x = 1 + 2^-11 + 2^-22, TF32 rounds x to
/// 1 + 2^-10 and the compensated split drops small^2 = (2^-11 - 2^-22)^2 per product, about 4 ulp
/// of the FMA result. On aligned 8 x 8 x 8 operands (the async core on CUDA).
#[test]
fn f32_modes_take_their_paths() -> Result<()> {
    let Some(dev) = gpu() else {
        return Ok(());
    };
    let x = 1.0 + 2f32.powi(-11) + 2f32.powi(-22);
    let a = Tensor::full(x, (1, 8, 8), &dev)?;
    let keep = Tensor::ones((8, 8), DType::U8, &dev)?;
    let mut got = Vec::new();
    for mode in [F32Matmul::Compensated, F32Matmul::Fma, F32Matmul::Tf32] {
        got.push(
            masked_in(&a, &a, &keep, 0.0, mode)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    let exact = 8.0 * (x as f64) * (x as f64);
    let tf32 = 1.0 + 2f64.powi(-10);
    for v in &got[2] {
        assert_eq!(*v as f64, 8.0 * tf32 * tf32, "TF32 mode");
    }
    for (c, f) in got[0].iter().zip(&got[1]) {
        assert!(
            ((*f as f64) - exact).abs() < 1e-6 * exact,
            "FMA {f} vs {exact}"
        );
        assert!(
            ((*c as f64) - exact).abs() < 1e-6 * exact,
            "compensated {c} vs {exact}"
        );
        assert_ne!(
            c, f,
            "the compensated product should drop small^2 (did the FMA core run?)"
        );
    }
    Ok(())
}

/// The default compensated mode is as accurate as f32 FMAs: on random operands (k-contiguous and
/// transposed, k up to 512, sizes off the tile), its worst error against f64 stays within 4x
/// the FMA kernel's on the same inputs, and argmin picks the same rows' best columns up to
/// near-ties.
#[test]
fn compensated_f32_matches_fma_accuracy() -> Result<()> {
    let Some(dev) = gpu() else {
        return Ok(());
    };
    for (s, &(batch, m, k, n)) in [(2, 200, 64, 136), (1, 129, 512, 260), (3, 64, 132, 72)]
        .iter()
        .enumerate()
    {
        let salt = 900 + 10 * s as u64;
        let a = rand_tensor(&[batch, m, k], 1.0, DType::F32, &dev, salt)?;
        let b = rand_tensor(&[batch, n, k], 1.0, DType::F32, &dev, salt + 1)?.transpose(1, 2)?;
        let b_rows = rand_tensor(&[batch, k, n], 1.0, DType::F32, &dev, salt + 2)?;
        for (what, b) in [("transposed b", &b), ("row-major b", &b_rows)] {
            let exact = product(&to_f64(&a)?, &to_f64(b)?, batch, m, k, n);
            let fma = worst_error(&a, b, &exact, F32Matmul::Fma)?;
            let compensated = worst_error(&a, b, &exact, F32Matmul::Compensated)?;
            println!(
                "case {s} {what} k={k}: worst error FMA {fma:.3e}, compensated {compensated:.3e}"
            );
            assert!(
                compensated <= 4.0 * fma + 1e-7,
                "case {s} {what}: compensated error {compensated:.3e} against FMA {fma:.3e}"
            );
            let bias = rand_tensor(&[n], 2.0, DType::F32, &dev, salt + 3)?;
            check_kmeans_like_argmin(
                &a,
                b,
                &bias,
                1e-5 + 2e-6 * k as f64,
                &format!("case {s} {what} argmin"),
                F32Matmul::Compensated,
            )?;
        }
    }
    Ok(())
}

/// A TF32 product of terms of size ~1: each operand rounded to an 11-bit significand.
fn tf32_tolerance(k: usize) -> f64 {
    2e-3 * (k as f64).sqrt() + 1e-5
}

#[test]
fn tf32_mode_rounds_on_the_gpu_and_stays_close() -> Result<()> {
    // 1 + 2^-15 is an f32 but not a TF32 value: the GPU's TF32 product rounds it to 1, the CPU
    // (always full f32) and the GPU in the default mode keep it. Proves which path ran.
    let exact = 1.0 + 2f32.powi(-15);
    for dev in devices() {
        for tf32 in [false, true] {
            let mode = if tf32 {
                F32Matmul::Tf32
            } else {
                F32Matmul::Compensated
            };
            let a = Tensor::new(&[[[exact]]], &dev)?;
            let b = Tensor::new(&[[[1f32]]], &dev)?;
            let mask = Tensor::new(&[[1u8]], &dev)?;
            let got = masked_in(&a, &b, &mask, 0.0, mode)?
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
    for dev in devices() {
        // k = 128 with n = 260: both operands 16-byte aligned (the async core); the others are
        // not (the register-staged TF32 core).
        for (s, &(batch, m, k, n)) in [(2, 131, 67, 140), (1, 300, 128, 260), (3, 5, 1, 9)]
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
            let out = masked_in(&a, &b, &mask, f64::NEG_INFINITY, F32Matmul::Tf32)?;
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
            check_kmeans_like_argmin(
                &a,
                &b,
                &bias,
                2.0 * tf32_tolerance(k),
                &format!("{dev:?} argmin tf32 case {s}"),
                F32Matmul::Tf32,
            )?;
        }
    }
    Ok(())
}
