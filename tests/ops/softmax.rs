use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_fastops::{log_softmax_dims, softmax_dims};

/// f64 reference, independent of ReducePlan: each element's group is the row-major index of
/// its kept coordinates.
pub(crate) fn reference(x: &[f64], shape: &[usize], dims: &[usize], log: bool) -> Vec<f64> {
    let rank = shape.len();
    let n: usize = shape.iter().product();
    let mut group_of = vec![0usize; n];
    let mut groups = 1;
    for (i, g) in group_of.iter_mut().enumerate() {
        let (mut rest, mut id, mut mult) = (i, 0, 1);
        for d in (0..rank).rev() {
            let idx = rest % shape[d];
            rest /= shape[d];
            if !dims.contains(&d) {
                id += idx * mult;
                mult *= shape[d];
            }
        }
        *g = id;
        groups = mult;
    }
    let mut max = vec![f64::NEG_INFINITY; groups];
    for (i, &v) in x.iter().enumerate() {
        let m = &mut max[group_of[i]];
        if v.is_nan() || v > *m {
            *m = if m.is_nan() { *m } else { v };
        }
    }
    let mut sum = vec![0f64; groups];
    for (i, &v) in x.iter().enumerate() {
        let m = max[group_of[i]];
        if m != f64::NEG_INFINITY {
            sum[group_of[i]] += (v - m).exp();
        }
    }
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let (m, s) = (max[group_of[i]], sum[group_of[i]]);
            match (m == f64::NEG_INFINITY, log) {
                (true, true) => f64::NEG_INFINITY,
                (true, false) => 0.0,
                (false, true) => v - m - s.ln(),
                (false, false) => (v - m).exp() / s,
            }
        })
        .collect()
}

fn check(xs: &Tensor, dims: &[usize], what: &str) -> Result<()> {
    let x = to_f64(xs)?;
    let tol = tolerance(xs.dtype()).max(1e-5) * 4.0;
    for log in [false, true] {
        let ys = if log {
            log_softmax_dims(xs, dims)?
        } else {
            softmax_dims(xs, dims)?
        };
        assert_eq!(ys.dims(), xs.dims());
        assert_eq!(ys.dtype(), xs.dtype());
        let expected = reference(&x, xs.dims(), dims, log);
        assert_close(
            &to_f64(&ys)?,
            &expected,
            tol,
            &format!("{what} dims {dims:?} log={log} {:?}", xs.dtype()),
        );
    }
    Ok(())
}

fn subsets(rank: usize) -> Vec<Vec<usize>> {
    (1u32..(1 << rank))
        .map(|m| (0..rank).filter(|d| m & (1 << d) != 0).collect())
        .collect()
}

#[test]
fn every_subset_of_dims_ranks_1_to_4() {
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[3, 257],
        &[1, 5],
        &[2, 3, 5],
        &[4, 1, 7],
        &[2, 3, 1, 5],
        &[3, 2, 5, 7],
    ];
    for_each_device(|dev| {
        let mut salt = 0;
        for dtype in float_dtypes(dev) {
            for shape in shapes {
                for dims in subsets(shape.len()) {
                    salt += 1;
                    let xs = rand_tensor(shape, 5.0, dtype, dev, salt)?;
                    check(&xs, &dims, &format!("{shape:?}"))?;
                }
            }
        }
        Ok(())
    })
}

#[test]
fn ranks_5_and_6_and_reordered_dims() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            let xs = rand_tensor(&[2, 3, 4, 5, 6], 3.0, dtype, dev, 77)?;
            for dims in [
                vec![1, 3],
                vec![3, 1],
                vec![0, 2, 4],
                vec![4],
                vec![0],
                vec![4, 3, 2, 1, 0],
                vec![0, 1, 3, 4],
            ] {
                check(&xs, &dims, "rank 5")?;
            }
            let xs = rand_tensor(&[2, 1, 3, 2, 5, 3], 3.0, dtype, dev, 78)?;
            for dims in subsets(6).into_iter().step_by(5) {
                check(&xs, &dims, "rank 6")?;
            }
        }
        Ok(())
    })
}

#[test]
fn large_groups_split_across_blocks_and_many_tiny_groups() {
    for_each_device(|dev| {
        for dtype in [DType::F32, DType::BF16] {
            // Row-like groups of 160000 elements, three of them (chunked on the GPU).
            check(
                &rand_tensor(&[4, 3, 40000], 4.0, dtype, dev, 81)?,
                &[0, 2],
                "huge rows",
            )?;
            // Column-like groups of 100000 elements, three lanes.
            check(
                &rand_tensor(&[100000, 3], 4.0, dtype, dev, 82)?,
                &[0],
                "huge columns",
            )?;
            // Whole-tensor softmax.
            check(
                &rand_tensor(&[37, 1031], 4.0, dtype, dev, 83)?,
                &[0, 1],
                "all dims",
            )?;
            // Many tiny groups and groups of one element.
            check(
                &rand_tensor(&[5000, 3], 4.0, dtype, dev, 84)?,
                &[1],
                "tiny rows",
            )?;
            check(
                &rand_tensor(&[3, 5000], 4.0, dtype, dev, 85)?,
                &[0],
                "tiny columns",
            )?;
            check(
                &rand_tensor(&[64, 1, 9], 4.0, dtype, dev, 86)?,
                &[1],
                "one-element groups",
            )?;
        }
        Ok(())
    })
}

#[test]
fn special_values_large_inf_and_nan() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            // Values near 1e4 overflow a naive exp.
            let big = (rand_tensor(&[6, 50], 1.0, DType::F32, dev, 91)? + 1e4)?.to_dtype(dtype)?;
            check(&big, &[1], "large values")?;
            // Row 2 fully masked (-inf), row 4 holds a NaN, row 1 partly masked.
            let mut host = to_f64(&rand_tensor(&[6, 50], 2.0, DType::F32, dev, 92)?)?;
            for v in &mut host[100..150] {
                *v = f64::NEG_INFINITY;
            }
            host[217] = f64::NAN;
            for v in host[50..75].iter_mut() {
                *v = f64::NEG_INFINITY;
            }
            let xs = Tensor::from_vec(host, (6, 50), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(dev)?;
            check(&xs, &[1], "masked and NaN rows")?;
            let ys = to_f64(&softmax_dims(&xs, [1])?)?;
            assert!(
                ys[100..150].iter().all(|&v| v == 0.0),
                "fully masked row gives zeros"
            );
            assert!(ys[200..250].iter().all(|v| v.is_nan()), "NaN row is NaN");
            assert!(ys[..100]
                .iter()
                .chain(&ys[150..200])
                .chain(&ys[250..])
                .all(|v| v.is_finite()));
            // Column-mode groups with the same specials.
            check(&xs.t()?.contiguous()?, &[0], "masked and NaN columns")?;
        }
        Ok(())
    })
}

#[test]
fn vector_path_aligned_and_misaligned() {
    // Runs that are whole 16-byte vectors take the vectorised kernels on the GPU; a storage
    // offset that breaks the alignment falls back to the element-wise ones.
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            check(
                &rand_tensor(&[37, 1024], 4.0, dtype, dev, 131)?,
                &[1],
                "vector rows",
            )?;
            check(
                &rand_tensor(&[6, 64, 40], 4.0, dtype, dev, 132)?,
                &[0, 2],
                "vector runs",
            )?;
            check(
                &rand_tensor(&[3, 8, 5000], 4.0, dtype, dev, 133)?,
                &[0, 2],
                "vector chunks",
            )?;
            let parent = rand_tensor(&[10, 64], 4.0, dtype, dev, 134)?;
            check(&parent.narrow(0, 1, 8)?, &[1], "aligned offset rows")?;
            let flat = rand_tensor(&[1 + 8 * 64], 4.0, dtype, dev, 135)?;
            check(
                &flat.narrow(0, 1, 8 * 64)?.reshape((8, 64))?,
                &[1],
                "misaligned offset rows",
            )?;
        }
        Ok(())
    })
}

#[test]
fn one_read_kernels_loop_over_more_groups_than_resident_blocks() {
    // The GPU's one-read kernels run a grid of resident blocks that walk the groups; these shapes
    // hold several times more group columns than an H200 keeps resident, a last column that is
    // only partly valid, and masked / NaN groups late in the walk.
    for_each_device(|dev| {
        // The CPU has no resident grid; a tenth of the size keeps its (debug-build) run short.
        let n = if dev.is_cuda() { 100_001 } else { 10_001 };
        for dtype in float_dtypes(dev) {
            let mut host = to_f64(&rand_tensor(&[n, 40], 3.0, DType::F32, dev, 151)?)?;
            for v in &mut host[40 * (n - 1001)..40 * (n - 1000)] {
                *v = f64::NEG_INFINITY;
            }
            host[40 * (n - 1236) + 7] = f64::NAN;
            let rows = Tensor::from_vec(host, (n, 40), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(dev)?;
            check(&rows, &[1], "many short rows")?;
            check(
                &rand_tensor(&[n / 50, 4096], 3.0, dtype, dev, 152)?,
                &[1],
                "many 4096 rows",
            )?;
            check(
                &rand_tensor(&[32, 2 * n + 1], 3.0, dtype, dev, 153)?,
                &[0],
                "many columns of 32",
            )?;
        }
        Ok(())
    })
}

#[test]
fn row_block_kernel_edges_and_special_rows() {
    // Contiguous rows of 128 to 2048 16-byte vectors take a block per row on the GPU: rows that
    // leave threads with one or no vector, both ends of the range and one past each, with a
    // masked row, a NaN row and a partly masked row.
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            let per_vector = 16 / dtype.size_in_bytes();
            for (vectors, seed) in [(250, 161), (2048, 162), (2049, 163), (128, 164), (127, 165)] {
                let cols = vectors * per_vector;
                let mut host = to_f64(&rand_tensor(&[5, cols], 3.0, DType::F32, dev, seed)?)?;
                for v in &mut host[cols..2 * cols] {
                    *v = f64::NEG_INFINITY;
                }
                host[3 * cols + cols / 2] = f64::NAN;
                for v in &mut host[4 * cols..4 * cols + cols / 3] {
                    *v = f64::NEG_INFINITY;
                }
                let xs = Tensor::from_vec(host, (5, cols), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(dev)?;
                check(&xs, &[1], &format!("rows of {cols}"))?;
                let ys = to_f64(&softmax_dims(&xs, [1])?)?;
                assert!(ys[cols..2 * cols].iter().all(|&v| v == 0.0), "masked row");
                assert!(ys[3 * cols..4 * cols].iter().all(|v| v.is_nan()), "NaN row");
                let lys = to_f64(&log_softmax_dims(&xs, [1])?)?;
                assert!(lys[cols..2 * cols].iter().all(|&v| v == f64::NEG_INFINITY));
            }
        }
        Ok(())
    })
}

#[test]
fn lane_path_columns_of_four() {
    // Column-like groups of more than 128 elements whose lane count is a multiple of 4 take the
    // 4-groups-per-access kernels on the GPU (streamed and chunked), with masked and NaN
    // columns; smaller ones the scalar kernels.
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            check(
                &rand_tensor(&[5, 8, 12], 4.0, dtype, dev, 141)?,
                &[0],
                "small columns (scalar)",
            )?;
            check(
                &rand_tensor(&[700, 96], 4.0, dtype, dev, 142)?,
                &[0],
                "lanes streamed",
            )?;
            check(
                &rand_tensor(&[100000, 4], 4.0, dtype, dev, 143)?,
                &[0],
                "lanes chunked",
            )?;
            check(
                &rand_tensor(&[2, 16, 3, 32, 8], 4.0, dtype, dev, 144)?,
                &[1, 3],
                "lanes two blocks",
            )?;
            let mut host = to_f64(&rand_tensor(&[150, 8], 2.0, DType::F32, dev, 145)?)?;
            for r in 0..150 {
                host[r * 8 + 2] = f64::NEG_INFINITY;
            }
            host[17 * 8 + 5] = f64::NAN;
            host[3 * 8 + 6] = f64::NEG_INFINITY;
            let xs = Tensor::from_vec(host, (150, 8), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(dev)?;
            check(&xs, &[0], "lanes masked and NaN columns")?;
        }
        Ok(())
    })
}

#[test]
fn non_contiguous_inputs() {
    for_each_device(|dev| {
        for dtype in float_dtypes(dev) {
            let base = rand_tensor(&[6, 7, 11], 3.0, dtype, dev, 101)?;
            for (name, xs) in [
                ("permuted", base.permute((2, 0, 1))?),
                ("narrowed", base.narrow(2, 2, 7)?),
                ("offset", base.narrow(0, 1, 4)?),
            ] {
                for dims in subsets(3) {
                    check(&xs, &dims, name)?;
                }
            }
        }
        Ok(())
    })
}

#[test]
fn matches_candle_composite_and_its_gradients() {
    for_each_device(|dev| {
        for dtype in [DType::F32, DType::BF16] {
            let x0 = rand_tensor(&[3, 4, 5, 6], 2.0, dtype, dev, 111)?;
            for dims in [vec![1usize, 3], vec![3], vec![0, 2]] {
                for log in [false, true] {
                    let xs = Var::from_tensor(&x0)?;
                    let w = rand_tensor(&[3, 4, 5, 6], 1.0, dtype, dev, 112)?;
                    let ours = if log {
                        log_softmax_dims(&xs, &dims)?
                    } else {
                        softmax_dims(&xs, &dims)?
                    };
                    let mut max = xs.as_tensor().clone();
                    for &d in &dims {
                        max = max.max_keepdim(d)?;
                    }
                    let shifted = xs.broadcast_sub(&max.detach())?;
                    let mut sum = shifted.exp()?;
                    for &d in &dims {
                        sum = sum.sum_keepdim(d)?;
                    }
                    let theirs = if log {
                        shifted.broadcast_sub(&sum.log()?)?
                    } else {
                        shifted.exp()?.broadcast_div(&sum)?
                    };
                    let tol = tolerance(dtype).max(1e-5) * 8.0;
                    let what = format!("{dtype:?} dims {dims:?} log={log}");
                    assert_close(
                        &to_f64(&ours)?,
                        &to_f64(&theirs)?,
                        tol,
                        &format!("forward {what}"),
                    );
                    let g_ours = (ours * &w)?.sum_all()?.backward()?;
                    let g_theirs = (theirs * &w)?.sum_all()?.backward()?;
                    let (a, b) = (
                        g_ours.get(&xs).expect("grad"),
                        g_theirs.get(&xs).expect("grad"),
                    );
                    assert_close(&to_f64(a)?, &to_f64(b)?, tol * 4.0, &format!("grad {what}"));
                }
            }
        }
        // The last-dim case against candle_nn's own softmax.
        let xs = rand_tensor(&[5, 33], 3.0, DType::F32, dev, 113)?;
        let theirs = candle_nn::ops::softmax_last_dim(&xs)?;
        assert_close(
            &to_f64(&softmax_dims(&xs, [1])?)?,
            &to_f64(&theirs)?,
            1e-6,
            "vs softmax_last_dim",
        );
        let theirs = candle_nn::ops::log_softmax(&xs, D::Minus1)?;
        assert_close(
            &to_f64(&log_softmax_dims(&xs, [1])?)?,
            &to_f64(&theirs)?,
            1e-5,
            "vs log_softmax",
        );
        Ok(())
    })
}

#[test]
fn bad_input_is_a_clear_error() {
    for_each_device(|dev| {
        let xs = rand_tensor(&[2, 3], 1.0, DType::F32, dev, 121)?;
        for (dims, needle) in [
            (vec![], "empty"),
            (vec![1, 1], "twice"),
            (vec![2], "out of range"),
            (vec![0, 5], "out of range"),
        ] {
            let err = softmax_dims(&xs, &dims).expect_err("bad dims");
            assert!(err.to_string().contains(needle), "{err}");
        }
        let scalar = Tensor::new(1f32, dev)?;
        assert!(softmax_dims(&scalar, [0])
            .unwrap_err()
            .to_string()
            .contains("rank-0"));
        let ints = Tensor::zeros((2, 3), DType::U32, dev)?;
        assert!(log_softmax_dims(&ints, [1])
            .unwrap_err()
            .to_string()
            .contains("unsupported dtype"));
        // Empty tensors are fine.
        let empty = Tensor::zeros((0, 4), DType::F32, dev)?;
        assert_eq!(softmax_dims(&empty, [1])?.dims(), [0, 4]);
        Ok(())
    })
}

/// `dims` as candle's `D`, a single `usize`, arrays, vectors and slices all name the same dims.
#[test]
fn dims_in_every_form_agree() -> Result<()> {
    use candle_fastops::ReduceDims;
    for_each_device(|dev| {
        let xs = rand_tensor(&[3, 5, 7], 2.0, DType::F32, dev, 9100)?;
        let want = to_f64(&softmax_dims(&xs, &[0, 2][..])?)?;
        let forms: Vec<Box<dyn ReduceDims>> = vec![
            Box::new([0usize, 2]),
            Box::new(vec![2usize, 0]),
            Box::new([D::Minus(3), D::Minus1]),
        ];
        for (i, dims) in forms.iter().enumerate() {
            let got = to_f64(&softmax_dims(&xs, &**dims)?)?;
            assert_close(&got, &want, 0.0, &format!("form {i}"));
        }
        let plan = candle_fastops::ReducePlan::new(xs.dims(), &[2, 0])?;
        let planned = to_f64(&softmax_dims(&xs, &plan)?)?;
        assert_close(&planned, &want, 0.0, "a ReducePlan");
        let other = candle_fastops::ReducePlan::new(&[3, 5, 8], &[2, 0])?;
        let e = softmax_dims(&xs, &other).expect_err("plan of another shape");
        assert!(
            e.to_string().contains("the plan was built for shape"),
            "{e}"
        );
        let last = to_f64(&log_softmax_dims(&xs, D::Minus1)?)?;
        assert_close(
            &last,
            &to_f64(&log_softmax_dims(&xs, 2)?)?,
            0.0,
            "D::Minus1",
        );
        assert!(softmax_dims(&xs, D::Minus(4)).is_err(), "D past the rank");
        let bias = rand_tensor(&[5], 1.0, DType::F32, dev, 9101)?;
        let a = to_f64(&candle_fastops::bias_add(&xs, &bias, D::Minus2)?)?;
        let b = to_f64(&candle_fastops::bias_add(&xs, &bias, 1)?)?;
        assert_close(&a, &b, 0.0, "bias_add D::Minus2");
        assert!(candle_fastops::bias_add(&xs, &bias, D::Minus(4)).is_err());
        Ok(())
    });
    Ok(())
}
