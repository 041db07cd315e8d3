//! masked_bmm and argmin_matmul (one tiled matmul core) against f64 references and candle's
//! composed ops, on every device and dtype.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_fastops::{
    argmin_matmul, kmeans_assign, kmeans_assign_with_distances, masked_bmm, masked_bmm_with,
    masked_bmm_with_plan, F32Matmul, MaskPlan, MatmulOptions,
};
use rand::Rng;

#[derive(Debug, Clone, Copy)]
enum MaskKind {
    Causal,
    Random,
    AllKept,
    AllMasked,
}

/// A u8 mask whose kept entries hold arbitrary nonzero values (not just 1).
fn make_mask(kind: MaskKind, shape: &[usize], dev: &Device, salt: u64) -> Result<Tensor> {
    let mut rng = rng(salt);
    let (m, n) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let len: usize = shape.iter().product();
    let data: Vec<u8> = (0..len)
        .map(|e| {
            let (i, j) = ((e / n) % m.max(1), e % n);
            let keep = match kind {
                MaskKind::Causal => j <= i,
                MaskKind::Random => rng.random_bool(0.5),
                MaskKind::AllKept => true,
                MaskKind::AllMasked => false,
            };
            if keep {
                rng.random_range(1..=255)
            } else {
                0
            }
        })
        .collect();
    Tensor::from_vec(data, shape, dev)
}

/// f32 accumulation over k terms of size ~1, then one rounding to the dtype.
fn product_tolerance(dtype: DType, k: usize) -> f64 {
    tolerance(dtype) * 4.0 + 4e-7 * (k as f64).sqrt()
}

/// masked_bmm against the f64 product, masked by hand.
fn check_masked(a: &Tensor, b: &Tensor, mask: &Tensor, fill: f64, what: &str) -> Result<()> {
    let (batch, m, k) = a.dims3()?;
    let n = b.dim(2)?;
    let out = masked_bmm(a, b, mask, fill)?;
    assert_eq!(out.dims(), [batch, m, n], "{what}");
    assert_eq!(out.dtype(), a.dtype(), "{what}");
    let full = product(&to_f64(a)?, &to_f64(b)?, batch, m, k, n);
    let mask_v = to_f64(&mask.broadcast_as((batch, m, n))?)?;
    let expected: Vec<f64> = full
        .iter()
        .zip(&mask_v)
        .map(|(&p, &keep)| if keep != 0.0 { p } else { fill })
        .collect();
    assert_close(
        &to_f64(&out)?,
        &expected,
        product_tolerance(a.dtype(), k),
        what,
    );
    Ok(())
}

#[test]
fn masked_bmm_matches_reference_for_every_mask_and_size() -> Result<()> {
    for_each_device(|dev| {
        let shapes = [
            (1, 1, 1, 1),
            (2, 7, 5, 1),
            (3, 127, 33, 129),
            (1, 129, 64, 127),
            (2, 300, 17, 257),
        ];
        for (s, &(batch, m, k, n)) in shapes.iter().enumerate() {
            let a = rand_tensor(&[batch, m, k], 1.0, DType::F32, dev, 10 + s as u64)?;
            let b = rand_tensor(&[batch, k, n], 1.0, DType::F32, dev, 20 + s as u64)?;
            for kind in [
                MaskKind::Causal,
                MaskKind::Random,
                MaskKind::AllKept,
                MaskKind::AllMasked,
            ] {
                for shared in [true, false] {
                    let shape: Vec<usize> = if shared {
                        vec![m, n]
                    } else {
                        vec![batch, m, n]
                    };
                    let mask = make_mask(kind, &shape, dev, 30 + s as u64)?;
                    for fill in [0.0, f64::NEG_INFINITY] {
                        let what = format!(
                            "[{batch},{m},{k}]x[{batch},{k},{n}] {kind:?} shared={shared} fill={fill}"
                        );
                        check_masked(&a, &b, &mask, fill, &what)?;
                    }
                }
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn masked_bmm_every_dtype_and_layout() -> Result<()> {
    for_each_device(|dev| {
        let (batch, m, k, n) = (3, 131, 36, 140);
        for dtype in float_dtypes(dev) {
            let a = rand_tensor(&[batch, m, k], 1.0, dtype, dev, 40)?;
            let b = rand_tensor(&[batch, k, n], 1.0, dtype, dev, 41)?;
            let mask = make_mask(MaskKind::Random, &[m, n], dev, 42)?;
            check_masked(&a, &b, &mask, -1.5, &format!("{dtype:?} contiguous"))?;
            // Transposed operands (attention's q . k^T), read in place.
            let at = rand_tensor(&[batch, k, m], 1.0, dtype, dev, 43)?.transpose(1, 2)?;
            let bt = rand_tensor(&[batch, n, k], 1.0, dtype, dev, 44)?.transpose(1, 2)?;
            check_masked(&at, &bt, &mask, 0.0, &format!("{dtype:?} transposed"))?;
            // Offset, strided views (narrowed from larger tensors), odd alignment.
            let ao = rand_tensor(&[batch, m + 2, k + 3], 1.0, dtype, dev, 45)?
                .narrow(1, 1, m)?
                .narrow(2, 3, k)?;
            let bo = rand_tensor(&[batch + 1, k, n + 1], 1.0, dtype, dev, 46)?
                .narrow(0, 1, batch)?
                .narrow(2, 1, n)?;
            let maskb =
                make_mask(MaskKind::Causal, &[batch, m, n + 5], dev, 47)?.narrow(2, 2, n)?;
            check_masked(&ao, &bo, &maskb, 0.0, &format!("{dtype:?} offset views"))?;
        }
        Ok(())
    });
    Ok(())
}

/// Operands whose rows are 16-byte aligned take the async core on CUDA (cp.async; f16 / bf16 as
/// ldmatrix + m16n8k16, f32 as three TF32 passes, the default f32 mode): contiguous and
/// transposed operands (both copy layouts, ldmatrix and scalar fragment loads), tiles cut by m, n
/// and k (k = 72: a partial last stage), narrowed views whose last 16-byte chunk is partly
/// outside the view, and argmin over `centroids.t()`.
#[test]
fn async_core_every_layout() -> Result<()> {
    for_each_device(|dev| {
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            let (batch, m, k, n) = (2, 136, 72, 136);
            let a = rand_tensor(&[batch, m, k], 1.0, dtype, dev, 60)?;
            let b = rand_tensor(&[batch, k, n], 1.0, dtype, dev, 61)?;
            let mask = make_mask(MaskKind::Random, &[m, n], dev, 62)?;
            check_masked(&a, &b, &mask, -1.5, &format!("{dtype:?} async contiguous"))?;
            let at = rand_tensor(&[batch, k, m], 1.0, dtype, dev, 63)?.transpose(1, 2)?;
            let bt = rand_tensor(&[batch, n, k], 1.0, dtype, dev, 64)?.transpose(1, 2)?;
            check_masked(&at, &bt, &mask, 0.0, &format!("{dtype:?} async transposed"))?;
            // k = 50 and n = 130 inside rows of 80 and 144: the last chunk of a row along the
            // contiguous dim holds 2 valid elements (f32: 2 of 4).
            let (k2, n2, m2) = (50, 130, 129);
            let ao = rand_tensor(&[batch, m2, 80], 1.0, dtype, dev, 65)?.narrow(2, 8, k2)?;
            let bo = rand_tensor(&[batch, k2, 144], 1.0, dtype, dev, 66)?.narrow(2, 8, n2)?;
            let mask2 = make_mask(MaskKind::Causal, &[batch, m2, n2], dev, 67)?;
            check_masked(
                &ao,
                &bo,
                &mask2,
                0.0,
                &format!("{dtype:?} async partial chunks"),
            )?;

            let x = rand_tensor(&[300, 72], 1.0, dtype, dev, 68)?;
            let centroids = rand_tensor(&[1000, 72], 1.0, dtype, dev, 69)?;
            let bias = rand_tensor(&[1000], 2.0, DType::F32, dev, 70)?;
            let got = argmin_matmul(&x, &centroids.t()?, Some(&bias), -2.0)?;
            let scores = argmin_reference(
                &to_f64(&x)?,
                &to_f64(&centroids.t()?.contiguous()?)?,
                &to_f64(&bias)?,
                -2.0,
                (1, 300, 72, 1000),
            );
            check_argmin(
                &got.to_vec1::<u32>()?,
                &scores,
                1e-5 + 2e-6 * 72.0,
                &format!("{dtype:?} async argmin"),
            );
        }
        Ok(())
    });
    Ok(())
}

/// The async core's argmin (pairwise epilogue): planted ties between small-integer scores (exact
/// in bf16, and split into TF32 parts without remainder) go to the lowest column, and a NaN
/// column never wins over numbers (it sits next to a real column in its pair, on both sides).
#[test]
fn async_argmin_ties_and_nan_columns() -> Result<()> {
    for_each_device(|dev| {
        let (m, k, n) = (200, 8, 300);
        let (a, cols) = planted_ties(m, k, n, 5, 210);
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let b = Tensor::from_vec(cols.concat(), (n, k), dev)?
                .to_dtype(dtype)?
                .t()?;
            let at = Tensor::from_vec(a.clone(), (m, k), dev)?.to_dtype(dtype)?;
            let got = argmin_matmul(&at, &b, None, 1.0)?.to_vec1::<u32>()?;
            let scores = argmin_reference(
                &to_f64(&at)?,
                &to_f64(&b)?,
                &vec![0.0; n],
                1.0,
                (1, m, k, n),
            );
            assert_lowest_best(&got, &scores, &[], &format!("{dtype:?} planted ties"));
            // Every column the same: every score of a row ties, so every row takes column 0
            // (whichever thread or tile holds it).
            let same = Tensor::from_vec(cols[0].repeat(n), (n, k), dev)?
                .to_dtype(dtype)?
                .t()?;
            let got = argmin_matmul(&at, &same, None, 1.0)?.to_vec1::<u32>()?;
            assert!(
                got.iter().all(|&j| j == 0),
                "{dtype:?} all columns tied: {:?}",
                &got[..8]
            );
            // NaN in columns 10 (left of its pair) and 13 (right of its pair).
            let mut nan_cols = cols.clone();
            nan_cols[10][0] = f32::NAN;
            nan_cols[13][3] = f32::NAN;
            let b = Tensor::from_vec(nan_cols.concat(), (n, k), dev)?
                .to_dtype(dtype)?
                .t()?;
            let got = argmin_matmul(&at, &b, None, 1.0)?.to_vec1::<u32>()?;
            assert_lowest_best(&got, &scores, &[10, 13], &format!("{dtype:?} NaN columns"));
        }
        Ok(())
    });
    Ok(())
}

/// argmin with k-contiguous, 16-byte aligned rows of `a` and rows of at most 512 bytes: on
/// compute capability 9.0 the wgmma kernels (`src/cuda/sm90/argmin.cu`: f32 in the compensated
/// and TF32 modes, f16, bf16), elsewhere the async core. Row tiles and column tiles cut by m and
/// n (4099 columns: the last column tile holds 3), k off the stage (67 inside rows of 72, 1
/// inside rows of 8, 13, 200) and at the limits (128 for f32, 256 for 16 bits) and past them
/// (132 and 264, the portable core), batched and shared `b` in both layouts, few rows (blocks
/// split the column tiles), `centroids.t()` as k-means passes it.
#[test]
fn argmin_tiles_views_and_dtypes() -> Result<()> {
    use candle_fastops::{argmin_matmul_with, F32Matmul, MatmulOptions};
    for_each_device(|dev| {
        let cases: [(usize, usize, usize, usize, usize, bool); 10] = [
            // (batch, m, k, row length of a, n, b shared)
            (1, 257, 67, 72, 4099, true),
            (1, 300, 128, 128, 389, true),
            (1, 130, 1, 8, 250, true),
            (2, 131, 13, 16, 260, false),
            (3, 64, 64, 64, 131, true),
            (1, 5, 40, 40, 1000, true),
            (2, 200, 132, 136, 140, false),
            (1, 129, 32, 40, 128, false),
            (1, 150, 256, 256, 300, true),
            (2, 70, 200, 208, 264, false),
        ];
        for (s, &(batch, m, k, row, n, shared)) in cases.iter().enumerate() {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let salt = 1300 + 10 * s as u64;
                let a = rand_tensor(&[batch, m, row], 1.0, dtype, dev, salt)?.narrow(2, 0, k)?;
                // b as centroids.t() ([n, k] rows) when shared, row-major [k, n] otherwise.
                let b = if shared {
                    rand_tensor(&[n, k], 1.0, dtype, dev, salt + 1)?.t()?
                } else {
                    rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt + 1)?
                };
                let bias = rand_tensor(&[n], 2.0, DType::F32, dev, salt + 2)?;
                let b_full = if shared {
                    b.unsqueeze(0)?.broadcast_as((batch, k, n))?.contiguous()?
                } else {
                    b.clone()
                };
                let scores = argmin_reference(
                    &to_f64(&a)?,
                    &to_f64(&b_full)?,
                    &to_f64(&bias)?,
                    -2.0,
                    (batch, m, k, n),
                );
                // 16-bit products are exact: the same bound as the f32-accurate mode.
                let modes: &[(F32Matmul, f64)] = if dtype == DType::F32 {
                    &[
                        (F32Matmul::Compensated, 1e-5 + 2e-6 * k as f64),
                        (F32Matmul::Tf32, 4e-3 * (k as f64).sqrt() + 2e-5),
                    ]
                } else {
                    &[(F32Matmul::Compensated, 1e-5 + 2e-6 * k as f64)]
                };
                for &(mode, tol) in modes {
                    let options = MatmulOptions::with_f32(mode);
                    let got = argmin_matmul_with(&a, &b, Some(&bias), -2.0, &options)?
                        .flatten_all()?
                        .to_vec1::<u32>()?;
                    check_argmin(&got, &scores, tol, &format!("case {s} {dtype:?} {mode:?}"));
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// Enough row tiles that the argmin kernel gives each block several column tiles, one after the
/// other through the async core's pipeline. GPU only: the check is a plain f64 scan of
/// 8000 x 2000 scores.
#[test]
fn async_argmin_streams_column_tiles() -> Result<()> {
    let Some(dev) = gpu() else {
        return Ok(());
    };
    let (batch, m, k, n) = (40, 200, 40, 2000);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let a = rand_tensor(&[batch, m, k], 1.0, dtype, &dev, 80)?;
        let b = rand_tensor(&[n, k], 1.0, dtype, &dev, 81)?.t()?;
        let bias = rand_tensor(&[n], 2.0, DType::F32, &dev, 82)?;
        let got = argmin_matmul(&a, &b, Some(&bias), -2.0)?
            .flatten_all()?
            .to_vec1::<u32>()?;
        let (av, bv, biasv) = (to_f64(&a)?, to_f64(&b.contiguous()?)?, to_f64(&bias)?);
        for (r, &j) in got.iter().enumerate() {
            let score = |j: usize| {
                let dot: f64 = (0..k).map(|q| av[r * k + q] * bv[q * n + j]).sum();
                -2.0 * dot + biasv[j]
            };
            let best = (0..n).map(score).fold(f64::INFINITY, f64::min);
            assert!(
                (j as usize) < n && score(j as usize) <= best + 1e-5 + 2e-6 * k as f64,
                "{dtype:?} row {r}: index {j} scores {} against the best {best}",
                score(j as usize)
            );
        }
    }
    Ok(())
}

#[test]
fn masked_bmm_empty_dims_and_plans() -> Result<()> {
    for_each_device(|dev| {
        for &(batch, m, k, n) in &[(0, 4, 3, 5), (2, 0, 3, 5), (2, 4, 3, 0), (2, 4, 0, 5)] {
            let a = rand_tensor(&[batch, m, k], 1.0, DType::F32, dev, 50)?;
            let b = rand_tensor(&[batch, k, n], 1.0, DType::F32, dev, 51)?;
            let mask = make_mask(MaskKind::Random, &[m, n], dev, 52)?;
            check_masked(&a, &b, &mask, 7.0, &format!("empty [{batch},{m},{k},{n}]"))?;
        }
        // A plan built once serves repeated calls and counts tiles as expected.
        let causal = make_mask(MaskKind::Causal, &[300, 300], dev, 53)?;
        let plan = MaskPlan::new(&causal)?;
        assert_eq!(plan.tile_counts()?, [3, 3, 3]);
        let random = make_mask(MaskKind::Random, &[2, 300, 300], dev, 54)?;
        assert_eq!(MaskPlan::new(&random)?.tile_counts()?, [0, 18, 0]);
        let a = rand_tensor(&[2, 300, 8], 1.0, DType::F32, dev, 55)?;
        let b = rand_tensor(&[2, 8, 300], 1.0, DType::F32, dev, 56)?;
        let first = masked_bmm_with_plan(&a, &b, &causal, &plan, f64::NEG_INFINITY)?;
        let again = masked_bmm_with_plan(&a, &b, &causal, &plan, f64::NEG_INFINITY)?;
        assert_eq!(to_f64(&first)?, to_f64(&again)?);
        check_masked(&a, &b, &causal, f64::NEG_INFINITY, "plan reuse")?;
        Ok(())
    });
    Ok(())
}

#[test]
fn masked_bmm_autograd_matches_composed() -> Result<()> {
    for_each_device(|dev| {
        let (batch, m, k, n) = (2, 37, 9, 41);
        let a = Var::from_tensor(&rand_tensor(&[batch, m, k], 1.0, DType::F32, dev, 60)?)?;
        let b = Var::from_tensor(&rand_tensor(&[batch, k, n], 1.0, DType::F32, dev, 61)?)?;
        let w = rand_tensor(&[batch, m, n], 1.0, DType::F32, dev, 62)?;
        let mask = make_mask(MaskKind::Random, &[m, n], dev, 63)?;
        let out = masked_bmm(a.as_tensor(), b.as_tensor(), &mask, 0.0)?;
        let grads = (out * &w)?.sum_all()?.backward()?;
        let keep = mask.to_dtype(DType::F32)?.ne(0f64)?.to_dtype(DType::F32)?;
        let composed = a.as_tensor().matmul(b.as_tensor())?.broadcast_mul(&keep)?;
        let ref_grads = (composed * &w)?.sum_all()?.backward()?;
        for (v, name) in [(&a, "a"), (&b, "b")] {
            let got = to_f64(grads.get(v.as_tensor()).expect("gradient"))?;
            let want = to_f64(ref_grads.get(v.as_tensor()).expect("reference gradient"))?;
            assert_close(&got, &want, 1e-5, &format!("grad {name}"));
        }
        Ok(())
    });
    Ok(())
}

/// masked_bmm's gradients for `loss = sum(w * masked_bmm(a, b, mask, 0))` against the composed
/// product (matmul, multiply by the mask) in f64 on the CPU through candle's autograd.
fn check_masked_backward(
    (a, b, w): (&Var, &Var, &Tensor), mask: &Tensor, what: &str,
) -> Result<()> {
    check_masked_backward_with((a, b, w), mask, &MatmulOptions::default(), what)
}

/// [`check_masked_backward`] with the call's options (e.g. an f32 mode).
fn check_masked_backward_with(
    (a, b, w): (&Var, &Var, &Tensor), mask: &Tensor, options: &MatmulOptions, what: &str,
) -> Result<()> {
    let dtype = a.dtype();
    let out = masked_bmm_with(a.as_tensor(), b.as_tensor(), mask, 0.0, None, options)?;
    let grads = (out * w)?.sum_all()?.backward()?;
    let cpu64 = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
    let (a64, b64) = (
        Var::from_tensor(&cpu64(a.as_tensor())?)?,
        Var::from_tensor(&cpu64(b.as_tensor())?)?,
    );
    let keep = cpu64(&mask.ne(0u8)?)?;
    let composed = a64
        .as_tensor()
        .matmul(b64.as_tensor())?
        .broadcast_mul(&keep)?;
    let ref_grads = (composed * cpu64(w)?)?.sum_all()?.backward()?;
    let t = match dtype {
        DType::F32 | DType::F64 => 1e-5,
        other => tolerance(other) * 4.0,
    };
    for (v, v64, name) in [(a, &a64, "a"), (b, &b64, "b")] {
        let got = to_f64(grads.get(v.as_tensor()).expect("gradient"))?;
        let want = to_f64(ref_grads.get(v64.as_tensor()).expect("reference gradient"))?;
        assert_close(&got, &want, t, &format!("grad {name} {what}"));
    }
    Ok(())
}

/// The masked gradient at widths whose rows take the 16-byte path on CUDA (n a multiple of 8)
/// and one that does not, per-batch and shared masks, every dtype: gradients against the
/// composed product (matmul, multiply by the mask) in f64 on the CPU through candle's autograd.
#[test]
fn masked_bmm_backward_at_vector_widths() -> Result<()> {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            for (c, (n, per_batch)) in [(264usize, false), (264, true), (136, true), (131, false)]
                .into_iter()
                .enumerate()
            {
                let (batch, m, k) = (3, 200, 16);
                let salt = 700 + 10 * c as u64;
                let a = Var::from_tensor(&rand_tensor(&[batch, m, k], 1.0, dtype, dev, salt)?)?;
                let b = Var::from_tensor(&rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt + 1)?)?;
                let w = rand_tensor(&[batch, m, n], 1.0, dtype, dev, salt + 2)?;
                let mask = if per_batch {
                    make_mask(MaskKind::Random, &[batch, m, n], dev, salt + 3)?
                } else {
                    make_mask(MaskKind::Causal, &[m, n], dev, salt + 3)?
                };
                check_masked_backward(
                    (&a, &b, &w),
                    &mask,
                    &format!("{dtype:?} n {n} per-batch mask {per_batch}"),
                )?;
            }
        }
        Ok(())
    });
    Ok(())
}

/// The backward with masks that are views: a per-batch mask narrowed out of a larger one (an
/// offset start and a batch stride of its own) and a shared one broadcast over the batch, at
/// k = 64 (the products 64 wide: CUDA's narrow tiles, the mask applied as the gradient is read)
/// and k = 80, every dtype, and f32 in the FMA mode.
#[test]
fn masked_bmm_backward_with_mask_views() -> Result<()> {
    for_each_device(|dev| {
        let (batch, m, n) = (2, 261, 200);
        let larger = make_mask(MaskKind::Random, &[3, m, n], dev, 760)?;
        let narrowed = larger.narrow(0, 1, 2)?;
        let shared =
            make_mask(MaskKind::Causal, &[1, m, n], dev, 761)?.broadcast_as((batch, m, n))?;
        for dtype in float_dtypes(dev) {
            for (c, k) in [64usize, 80].into_iter().enumerate() {
                for (mask, name) in [(&narrowed, "narrowed"), (&shared, "broadcast")] {
                    let salt = 770 + 10 * c as u64;
                    let a = Var::from_tensor(&rand_tensor(&[batch, m, k], 1.0, dtype, dev, salt)?)?;
                    let b =
                        Var::from_tensor(&rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt + 1)?)?;
                    let w = rand_tensor(&[batch, m, n], 1.0, dtype, dev, salt + 2)?;
                    check_masked_backward(
                        (&a, &b, &w),
                        mask,
                        &format!("{dtype:?} k {k} {name} mask"),
                    )?;
                    if dtype == DType::F32 {
                        // The FMA core stages through registers: on CUDA its products get a
                        // masked copy of the gradient instead.
                        let fma = MatmulOptions::with_f32(F32Matmul::Fma);
                        let what = format!("fma k {k} {name} mask");
                        check_masked_backward_with((&a, &b, &w), mask, &fma, &what)?;
                    }
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// The backward's span products against f64: grad_a = (w masked) . b^T and grad_b = a^T . (w
/// masked) for `loss = sum(w * out)`. Causal (spans that end on the diagonal), a mask whose
/// spans hold empty tiles inside them, per-batch masks with one batch entry all masked (empty
/// spans: zero gradients), transposed operands, k = 1, and every dtype. n = 332 and k a multiple
/// of 4 up to 64 with row-major operands (the per-batch and the corners cases at k = 40 and 12,
/// the narrowed masks' at 64 and 20): on an H200, f32 takes the Hopper span kernels for both
/// gradients, with the mask read from global memory (rows of 332 bytes) and copied with the
/// stages (the narrowed masks).
#[test]
fn masked_bmm_backward_skips_empty_tiles() -> Result<()> {
    for_each_device(|dev| {
        // Tiles (0, 2) and (2, 0) of a 3 x 3 grid kept: row tile 0 spans column tiles 0..3 with
        // tile 1 empty inside, and row tile 1 is empty.
        let corners = {
            let (m, n) = (300, 332);
            let data: Vec<u8> = (0..m * n)
                .map(|e| {
                    let (ti, tj) = (e / n / 128, e % n / 128);
                    u8::from((ti, tj) == (0, 2) || (ti, tj) == (2, 0) || (ti, tj) == (2, 2))
                })
                .collect();
            Tensor::from_vec(data, (m, n), dev)?
        };
        let per_batch = {
            let random = make_mask(MaskKind::Random, &[1, 300, 332], dev, 410)?;
            let none = make_mask(MaskKind::AllMasked, &[1, 300, 332], dev, 411)?;
            Tensor::cat(&[&random, &none], 0)?
        };
        let causal = make_mask(MaskKind::Causal, &[300, 332], dev, 412)?;
        // Masks narrowed out of rows of 352 bytes (strides multiples of 16, the last 16 bytes of
        // a row cut to 12): the Hopper kernels copy their partial tiles' bytes with the stages.
        let causal_narrowed =
            make_mask(MaskKind::Causal, &[300, 352], dev, 413)?.narrow(1, 0, 332)?;
        let per_batch_narrowed = {
            let random = make_mask(MaskKind::Random, &[1, 300, 352], dev, 414)?;
            let none = make_mask(MaskKind::AllMasked, &[1, 300, 352], dev, 415)?;
            Tensor::cat(&[&random, &none], 0)?.narrow(2, 0, 332)?
        };
        for dtype in float_dtypes(dev) {
            // (mask, k, transposed, the row length a is narrowed out of: its row stride)
            for (c, (mask, k, transposed, a_row)) in [
                (&causal, 72, false, 72),
                (&corners, 9, true, 9),
                (&per_batch, 40, false, 40),
                (&corners, 12, false, 12),
                (&causal, 1, true, 1),
                (&causal_narrowed, 64, false, 64),
                (&per_batch_narrowed, 20, false, 20),
                // a's rows of 13 and 30 elements (not whole 16-byte chunks in f32) at strides of
                // 16 and 32: in f32 on compute capability 9.0 the Hopper grad_b takes them
                // (outer-contiguous, 16-byte aligned rows) and copies each row's last chunk in part.
                (&causal, 13, false, 16),
                (&per_batch_narrowed, 30, false, 32),
            ]
            .into_iter()
            .enumerate()
            {
                let (batch, m, n) = (2, 300, 332);
                let salt = 420 + 10 * c as u64;
                // Transposed operands are views of [batch, k, m] and [batch, n, k] tensors; a
                // narrowed a is the first k columns of [batch, m, a_row].
                let a_store = if transposed {
                    rand_tensor(&[batch, k, m], 1.0, dtype, dev, salt)?
                } else {
                    rand_tensor(&[batch, m, a_row], 1.0, dtype, dev, salt)?
                };
                let b_store = if transposed {
                    rand_tensor(&[batch, n, k], 1.0, dtype, dev, salt + 1)?
                } else {
                    rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt + 1)?
                };
                let (a, b) = (Var::from_tensor(&a_store)?, Var::from_tensor(&b_store)?);
                let view = |v: &Var| -> Result<Tensor> {
                    if transposed {
                        v.as_tensor().transpose(1, 2)
                    } else {
                        Ok(v.as_tensor().clone())
                    }
                };
                let (av, bv) = (view(&a)?.narrow(2, 0, k)?, view(&b)?);
                let w = rand_tensor(&[batch, m, n], 1.0, dtype, dev, salt + 2)?;
                let out = masked_bmm(&av, &bv, mask, -3.0)?;
                let grads = (out.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
                    .sum_all()?
                    .backward()?;
                let keep = to_f64(&mask.broadcast_as((batch, m, n))?)?;
                let gm: Vec<f64> = to_f64(&w)?
                    .iter()
                    .zip(&keep)
                    .map(|(w, kp)| if *kp != 0.0 { *w } else { 0.0 })
                    .collect();
                let at = to_f64(&av.transpose(1, 2)?)?;
                let bt = to_f64(&bv.transpose(1, 2)?)?;
                let want_a = product(&gm, &bt, batch, m, n, k);
                let want_b = product(&at, &gm, batch, k, m, n);
                let grad_of = |v: &Var| -> Result<Tensor> {
                    let g = grads.get(v.as_tensor()).expect("gradient");
                    if transposed {
                        g.transpose(1, 2)
                    } else {
                        Ok(g.clone())
                    }
                };
                let what = format!("{dtype:?} case {c}");
                let grad_a = grad_of(&a)?;
                if a_row > k {
                    // The columns of the store outside the view get no gradient.
                    let outside = to_f64(&grad_a.narrow(2, k, a_row - k)?)?;
                    assert!(
                        outside.iter().all(|x| *x == 0.0),
                        "{what}: gradient outside the narrowed a"
                    );
                }
                assert_close(
                    &to_f64(&grad_a.narrow(2, 0, k)?)?,
                    &want_a,
                    product_tolerance(dtype, n),
                    &format!("{what} grad a"),
                );
                assert_close(
                    &to_f64(&grad_of(&b)?)?,
                    &want_b,
                    product_tolerance(dtype, m),
                    &format!("{what} grad b"),
                );
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn masked_bmm_bad_inputs_are_errors() -> Result<()> {
    for_each_device(|dev| {
        let a = rand_tensor(&[2, 4, 3], 1.0, DType::F32, dev, 70)?;
        let b = rand_tensor(&[2, 3, 5], 1.0, DType::F32, dev, 71)?;
        let mask = make_mask(MaskKind::Causal, &[4, 5], dev, 72)?;
        let expect_err = |r: Result<Tensor>, needle: &str| {
            let e = r.expect_err(needle).to_string();
            assert!(e.contains(needle), "error {e:?} should mention {needle:?}");
        };
        expect_err(
            masked_bmm(&a.flatten(0, 1)?, &b, &mask, 0.0),
            "[batch, m, k]",
        );
        expect_err(
            masked_bmm(&a, &b.narrow(1, 0, 2)?, &mask, 0.0),
            "shape mismatch",
        );
        expect_err(
            masked_bmm(&a, &b, &mask.narrow(1, 0, 4)?, 0.0),
            "mask must be",
        );
        expect_err(
            masked_bmm(&a, &b, &mask.to_dtype(DType::F32)?, 0.0),
            "must be u8",
        );
        expect_err(
            masked_bmm(&a, &b.to_dtype(DType::F16)?, &mask, 0.0),
            "dtype mismatch",
        );
        expect_err(
            masked_bmm(
                &a.to_dtype(DType::U32)?,
                &b.to_dtype(DType::U32)?,
                &mask,
                0.0,
            ),
            "unsupported dtype",
        );
        let other = MaskPlan::new(&make_mask(MaskKind::Causal, &[2, 4, 5], dev, 73)?)?;
        expect_err(
            masked_bmm_with_plan(&a, &b, &mask, &other, 0.0),
            "plan was built",
        );
        if dev.is_cuda() {
            expect_err(
                masked_bmm(&a, &b.to_device(&Device::Cpu)?, &mask, 0.0),
                "device mismatch",
            );
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn argmin_matmul_matches_reference() -> Result<()> {
    for_each_device(|dev| {
        let cases = [
            (1, 1, 1, 1),
            (1, 7, 1, 129),
            (2, 127, 33, 7),
            (1, 129, 64, 1000),
            (3, 300, 5, 257),
        ];
        for (s, &(batch, m, k, n)) in cases.iter().enumerate() {
            for dtype in float_dtypes(dev) {
                let salt = 100 + 10 * s as u64;
                let a = rand_tensor(&[batch, m, k], 1.0, dtype, dev, salt)?;
                let b = rand_tensor(&[batch, k, n], 1.0, dtype, dev, salt + 1)?;
                let bias = rand_tensor(&[n], 2.0, DType::F32, dev, salt + 2)?;
                for (scale, bias) in [(1.0, None), (-2.0, Some(&bias))] {
                    let got = argmin_matmul(&a, &b, bias, scale)?;
                    assert_eq!(got.dims(), [batch, m]);
                    assert_eq!(got.dtype(), DType::U32);
                    let bias_v = match bias {
                        Some(t) => to_f64(t)?,
                        None => vec![0.0; n],
                    };
                    let scores = argmin_reference(
                        &to_f64(&a)?,
                        &to_f64(&b)?,
                        &bias_v,
                        scale,
                        (batch, m, k, n),
                    );
                    let got = got.flatten_all()?.to_vec1::<u32>()?;
                    let tol = 1e-5 + 2e-6 * k as f64;
                    check_argmin(
                        &got,
                        &scores,
                        tol,
                        &format!("{dtype:?} case {s} scale {scale}"),
                    );
                }
            }
        }
        Ok(())
    });
    Ok(())
}

/// Small-integer rows `a` `[m, k]` and columns `[n][k]` (every `every`-th column a copy of a
/// random one): every score is exact in any float dtype and ties are planted.
fn planted_ties(
    m: usize, k: usize, n: usize, every: usize, salt: u64,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut rng = rng(salt);
    let a: Vec<f32> = (0..m * k)
        .map(|_| rng.random_range(-3..=3) as f32)
        .collect();
    let mut cols: Vec<Vec<f32>> = (0..n)
        .map(|_| (0..k).map(|_| rng.random_range(-3..=3) as f32).collect())
        .collect();
    for j in (0..n).step_by(every) {
        let src = rng.random_range(0..n);
        cols[j] = cols[src].clone();
    }
    (a, cols)
}

/// Each row's index is exactly the lowest column holding the row's best score, the columns in
/// `skip` left out (they must never be chosen).
fn assert_lowest_best(got: &[u32], scores: &[Vec<f64>], skip: &[usize], what: &str) {
    for (r, row) in scores.iter().enumerate() {
        let kept = || (0..row.len()).filter(|j| !skip.contains(j));
        let best = kept().map(|j| row[j]).fold(f64::INFINITY, f64::min);
        let first = kept().find(|&j| row[j] == best).unwrap() as u32;
        assert_eq!(got[r], first, "{what}, row {r}: the lowest best column");
    }
}

#[test]
fn argmin_matmul_ties_layouts_and_batches() -> Result<()> {
    for_each_device(|dev| {
        // Small integers: every score is exact, so the index must be exactly the lowest tied
        // column on every device. Columns are duplicated to plant ties.
        let (m, k, n) = (200, 6, 300);
        let (a, cols) = planted_ties(m, k, n, 7, 200);
        // b stored as [n, k] (a centroid table) and used transposed: read in place.
        let bt = Tensor::from_vec(cols.concat(), (n, k), dev)?;
        let b = bt.t()?;
        let at = Tensor::from_vec(a, (m, k), dev)?;
        let got = argmin_matmul(&at, &b, None, 1.0)?.to_vec1::<u32>()?;
        let scores = argmin_reference(
            &to_f64(&at)?,
            &to_f64(&b)?,
            &vec![0.0; n],
            1.0,
            (1, m, k, n),
        );
        assert_lowest_best(&got, &scores, &[], "f32 planted ties");
        // Leading batch dims with a shared 2-D b, and with a batched b.
        let a4 = rand_tensor(&[2, 3, 17, 8], 1.0, DType::F32, dev, 201)?;
        let shared = rand_tensor(&[40, 8], 1.0, DType::F32, dev, 202)?.t()?;
        let got = argmin_matmul(&a4, &shared, None, 1.0)?;
        assert_eq!(got.dims(), [2, 3, 17]);
        let per_batch = argmin_matmul(&a4.flatten(0, 2)?, &shared, None, 1.0)?;
        assert_eq!(
            got.flatten_all()?.to_vec1::<u32>()?,
            per_batch.to_vec1::<u32>()?
        );
        let b4 = rand_tensor(&[2, 3, 8, 40], 1.0, DType::F32, dev, 203)?;
        let got = argmin_matmul(&a4, &b4, None, -1.0)?
            .flatten_all()?
            .to_vec1::<u32>()?;
        let scores = argmin_reference(
            &to_f64(&a4)?,
            &to_f64(&b4)?,
            &[0.0; 40],
            -1.0,
            (6, 17, 8, 40),
        );
        check_argmin(&got, &scores, 1e-5, "batched b");
        // A non-collapsible a (a permuted batch) is copied, with the same answer.
        let ap = a4.transpose(0, 1)?;
        let got = argmin_matmul(&ap, &shared, None, 1.0)?;
        let want = argmin_matmul(&ap.contiguous()?, &shared, None, 1.0)?;
        assert_eq!(to_f64(&got)?, to_f64(&want)?);
        // k = 0: the product is zero, the bias decides.
        let bias = Tensor::new(&[3f32, -1.0, 5.0, -1.0], dev)?;
        let got = argmin_matmul(
            &Tensor::zeros((5, 0), DType::F32, dev)?,
            &Tensor::zeros((0, 4), DType::F32, dev)?,
            Some(&bias),
            1.0,
        )?;
        assert_eq!(got.to_vec1::<u32>()?, [1; 5]);
        // m = 0: empty result.
        let got = argmin_matmul(
            &Tensor::zeros((0, 3), DType::F32, dev)?,
            &Tensor::zeros((3, 4), DType::F32, dev)?,
            None,
            1.0,
        )?;
        assert_eq!(got.dims(), [0]);
        // A row of NaN scores gets index 0; other rows are unaffected.
        let a = Tensor::new(&[[f32::NAN, 1.0], [1.0, 2.0]], dev)?;
        let b = Tensor::new(&[[1f32, 2.0, 3.0], [1.0, -4.0, 0.0]], dev)?;
        assert_eq!(argmin_matmul(&a, &b, None, 1.0)?.to_vec1::<u32>()?, [0, 1]);
        Ok(())
    });
    Ok(())
}

#[test]
fn argmin_matmul_bad_inputs_are_errors() -> Result<()> {
    for_each_device(|dev| {
        let a = rand_tensor(&[4, 3], 1.0, DType::F32, dev, 300)?;
        let b = rand_tensor(&[3, 5], 1.0, DType::F32, dev, 301)?;
        let expect_err = |r: Result<Tensor>, needle: &str| {
            let e = r.expect_err(needle).to_string();
            assert!(e.contains(needle), "error {e:?} should mention {needle:?}");
        };
        expect_err(
            argmin_matmul(&a.flatten_all()?, &b, None, 1.0),
            "[.., m, k]",
        );
        expect_err(argmin_matmul(&a, &b.t()?, None, 1.0), "inner dims");
        expect_err(
            argmin_matmul(
                &a.unsqueeze(0)?,
                &b.unsqueeze(0)?.repeat((2, 1, 1))?,
                None,
                1.0,
            ),
            "batch dims",
        );
        expect_err(
            argmin_matmul(&a, &b.narrow(1, 0, 0)?, None, 1.0),
            "no columns",
        );
        expect_err(
            argmin_matmul(&a, &b.to_dtype(DType::F16)?, None, 1.0),
            "dtype mismatch",
        );
        let short = Tensor::zeros(4, DType::F32, dev)?;
        expect_err(argmin_matmul(&a, &b, Some(&short), 1.0), "col_bias must be");
        expect_err(
            kmeans_assign(&a, &rand_tensor(&[5, 4], 1.0, DType::F32, dev, 302)?),
            "features per row",
        );
        if dev.is_cuda() {
            expect_err(
                argmin_matmul(&a, &b.to_device(&Device::Cpu)?, None, 1.0),
                "device mismatch",
            );
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn kmeans_assign_finds_the_nearest_centroid() -> Result<()> {
    for_each_device(|dev| {
        let (n, c, d) = (1000, 37, 13);
        for dtype in float_dtypes(dev) {
            let x = rand_tensor(&[n, d], 3.0, dtype, dev, 400)?;
            let centroids = rand_tensor(&[c, d], 3.0, dtype, dev, 401)?;
            let (assign, dist) = kmeans_assign_with_distances(&x, &centroids)?;
            assert_eq!(
                assign.to_vec1::<u32>()?,
                kmeans_assign(&x, &centroids)?.to_vec1::<u32>()?
            );
            let (xv, cv) = (to_f64(&x)?, to_f64(&centroids)?);
            let assign = assign.to_vec1::<u32>()?;
            let dist = to_f64(&dist)?;
            for i in 0..n {
                let d2 = |j: usize| -> f64 {
                    (0..d)
                        .map(|p| (xv[i * d + p] - cv[j * d + p]).powi(2))
                        .sum()
                };
                let best = (0..c).map(d2).fold(f64::INFINITY, f64::min);
                let picked = d2(assign[i] as usize);
                assert!(
                    picked - best <= 1e-4 * best.max(1.0),
                    "{dtype:?} row {i}: picked distance {picked}, best {best}"
                );
                assert!((dist[i] - picked).abs() <= 1e-4 * picked.max(1.0));
            }
        }
        Ok(())
    });
    Ok(())
}

#[test]
fn cpu_and_gpu_agree() -> Result<()> {
    let Some(gpu) = gpu() else {
        return Ok(());
    };
    let (batch, m, k, n) = (4, 257, 64, 263);
    let a = rand_tensor(&[batch, m, k], 1.0, DType::F32, &Device::Cpu, 500)?;
    let b = rand_tensor(&[batch, k, n], 1.0, DType::F32, &Device::Cpu, 501)?;
    let mask = make_mask(MaskKind::Causal, &[m, n], &Device::Cpu, 502)?;
    let cpu = masked_bmm(&a, &b, &mask, f64::NEG_INFINITY)?;
    let gpu_out = masked_bmm(
        &a.to_device(&gpu)?,
        &b.to_device(&gpu)?,
        &mask.to_device(&gpu)?,
        f64::NEG_INFINITY,
    )?;
    assert_close(
        &to_f64(&gpu_out)?,
        &to_f64(&cpu)?,
        1e-5,
        "masked_bmm CPU vs GPU",
    );
    Ok(())
}

/// A mask whose 128 x 128 tiles are each made empty, partial (one element flipped) or full at
/// random, of odd size (edge tiles are partial-sized), read through a transposed view and a
/// broadcast batch: the plan counts each kind exactly.
#[test]
fn mask_plan_counts_tiles_of_any_layout() -> Result<()> {
    use rand::Rng;
    for_each_device(|dev| {
        let (m, n): (usize, usize) = (3 * 128 + 17, 2 * 128 + 1);
        let (row_tiles, col_tiles) = (m.div_ceil(128), n.div_ceil(128));
        let mut r = rng(91);
        let mut expected = [0usize; 3];
        let mut data = vec![0u8; m * n];
        for ti in 0..row_tiles {
            for tj in 0..col_tiles {
                let kind = r.random_range(0..3usize);
                expected[kind] += 1;
                let (rows, cols) = (
                    ti * 128..((ti + 1) * 128).min(m),
                    tj * 128..((tj + 1) * 128).min(n),
                );
                let flip = (r.random_range(rows.clone()), r.random_range(cols.clone()));
                for i in rows.clone() {
                    for j in cols.clone() {
                        let keep = match kind {
                            0 => false,
                            1 => (i, j) == flip,
                            _ => true,
                        };
                        // Kept elements hold any nonzero byte.
                        data[i * n + j] = if keep { 1 + (i * 7 + j) as u8 % 255 } else { 0 };
                    }
                }
            }
        }
        let mask = Tensor::from_vec(data, (m, n), dev)?;
        assert_eq!(
            MaskPlan::new(&mask)?.tile_counts()?,
            expected,
            "contiguous on {dev:?}"
        );
        // The same mask stored transposed and read through a transposed view.
        let transposed = mask.t()?.contiguous()?.t()?;
        assert!(!transposed.is_contiguous());
        assert_eq!(
            MaskPlan::new(&transposed)?.tile_counts()?,
            expected,
            "transposed on {dev:?}"
        );
        // A batch of three broadcast from one matrix (batch stride 0).
        let batched = mask.unsqueeze(0)?.broadcast_as((3, m, n))?;
        let tripled = expected.map(|c| 3 * c);
        assert_eq!(
            MaskPlan::new(&batched)?.tile_counts()?,
            tripled,
            "broadcast on {dev:?}"
        );
        Ok(())
    });
    Ok(())
}
