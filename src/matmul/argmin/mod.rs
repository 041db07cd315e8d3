//! Argmin over the columns of a matrix product, `argmin_j scale * (a . b)[i, j] + bias[j]`,
//! without materialising the product: the k-means assignment step.
//!
//! On CUDA each block computes product tiles with the core in `src/cuda/matmul.cu` and keeps, per
//! row, the running minimum and its column packed into one 64-bit key (order-preserving float
//! bits, then the column), merged across blocks with one 64-bit `atomicMin` per row: the value
//! and the index can never disagree, and ties resolve to the lowest column whatever order blocks
//! run in. Extra device memory is 8 bytes per row. On compute capability 9.0 the products run on
//! `wgmma` instead (`src/cuda/sm90/argmin.cu`) when `a`'s rows are k-contiguous, 16-byte aligned
//! and at most 512 bytes long (k <= 128 in f32, 256 in f16 / bf16; f32 in the compensated or TF32
//! mode): `b` is first copied (f32: split into TF32 parts) into a padded buffer laid out for bulk
//! copies (twice `b`'s size in the compensated mode, once otherwise), then a block keeps 128 rows
//! of `a` in shared memory and streams every column tile of that copy. On the CPU each task
//! multiplies a block of rows by a block of columns into a small buffer and scans it.

use crate::dispatch::check_float_operands;
use crate::matmul::core::{cpu_block_product, CpuGemm, F32Matmul, MatView, MatmulOptions};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

const OP: &str = "argmin_matmul";

/// For each row `i` of `a . b`, the column `j` minimising `scale * (a . b)[i, j] + col_bias[j]`.
///
/// * `a` `[.., m, k]`, `b` `[.., k, n]` with the same leading (batch) dims, or `b` 2-D and shared
///   by every batch entry. Returns u32 `[.., m]`.
/// * `col_bias`: optional `[n]` (any float dtype; used in f32). `scale` is applied in f32.
/// * Ties go to the lowest `j`, deterministically on every device. `-0.0` equals `0.0`; a NaN
///   score counts as larger than every number (a row of NaN scores gets index 0).
/// * `b` may be a transposed view (`centroids.t()`): read in place (the Hopper kernels copy it
///   once per call into their layout, see the module docs), never made contiguous. Leading dims
///   of `a` that do not collapse into one stride are copied.
/// * dtypes: f32 on CUDA as [`crate::set_f32_matmul`] says: by default f32-accurate
///   error-compensated tensor-core products ([`crate::F32Matmul::Compensated`], three TF32 passes,
///   when rows start on 4-element boundaries; f32 FMAs otherwise), or plain f32 FMAs, or TF32.
///   f16 and bf16 run on tensor cores, exact products, f32 accumulation: native 16-bit
///   `mma.m16n8k16` when both operands' rows start on 8-element boundaries, as for
///   `centroids.t()` with `d` a multiple of 8; TF32 kernels otherwise. On compute capability 9.0
///   the Hopper kernels (`wgmma`) take every dtype when `a`'s rows allow (see the module docs).
///   f64 on the CPU. `n` must be at least 1; `m = 0` gives an empty result, `k = 0` a zero product.
/// * Extra memory: O(m) on CUDA (one 8-byte key per row), never `m x n`; on compute capability
///   9.0, also a copy of `b` padded to tiles of 128 columns x 64 bytes of k (two copies, the TF32
///   parts, for f32 in the compensated mode).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let a = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &dev)?;
/// let b = Tensor::new(&[[3f32, -1., 0.], [0., 2., -5.]], &dev)?;
/// // a . b = [[3, -1, 0], [0, 2, -5], [3, 1, -5]]
/// let idx = candle_fastops::argmin_matmul(&a, &b, None, 1.0)?;
/// assert_eq!(idx.to_vec1::<u32>()?, [1, 2, 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn argmin_matmul(
    a: &Tensor, b: &Tensor, col_bias: Option<&Tensor>, scale: f64,
) -> Result<Tensor> {
    argmin_matmul_with(a, b, col_bias, scale, &MatmulOptions::default())
}

/// [`argmin_matmul`] with per-call options (the f32 mode on CUDA).
pub fn argmin_matmul_with(
    a: &Tensor, b: &Tensor, col_bias: Option<&Tensor>, scale: f64, options: &MatmulOptions,
) -> Result<Tensor> {
    check_args(a, b, col_bias)?;
    let n = b.dim(D::Minus1)?;
    let bias = match col_bias {
        Some(bias) => bias.to_dtype(DType::F32)?.contiguous()?,
        None => Tensor::zeros(n, DType::F32, a.device())?,
    };
    let a = if MatView::from_layout(a.layout()).is_some() {
        a.clone()
    } else {
        a.contiguous()?
    };
    let b = if MatView::from_layout(b.layout()).is_some() {
        b.clone()
    } else {
        b.contiguous()?
    };
    let op = ArgminMatmul {
        scale: scale as f32,
        mode: options.resolved_f32(),
    };
    if a.device().is_cpu() && matches!(a.dtype(), DType::F16 | DType::BF16) {
        return a
            .to_dtype(DType::F32)?
            .apply_op3_no_bwd(&b.to_dtype(DType::F32)?, &bias, &op);
    }
    a.apply_op3_no_bwd(&b, &bias, &op)
}

/// Index of the nearest centroid (squared L2) for each row of `x`: `x` `[n, d]`, `centroids`
/// `[c, d]`, returns u32 `[n]`. Computed as [`argmin_matmul`] of `x . centroids^T` with
/// `scale = -2` and `|centroid|^2` as the column bias (the `|x|^2` term is the same for every
/// centroid), reading `centroids` in place.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let x = Tensor::new(&[[0f32, 0.], [9., 9.], [4., 6.]], &dev)?;
/// let centroids = Tensor::new(&[[10f32, 10.], [0., 1.]], &dev)?;
/// let assign = candle_fastops::kmeans_assign(&x, &centroids)?;
/// assert_eq!(assign.to_vec1::<u32>()?, [1, 0, 1]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn kmeans_assign(x: &Tensor, centroids: &Tensor) -> Result<Tensor> {
    check_kmeans(x, centroids)?;
    let norms = centroids
        .to_dtype(DType::F32)?
        .sqr()?
        .sum(D::Minus1)?
        .contiguous()?;
    argmin_matmul(x, &centroids.t()?, Some(&norms), -2.0)
}

/// [`kmeans_assign`] and the squared distance of each row to its centroid (f32 `[n]`, computed
/// exactly from the assigned centroid, so it is never negative).
pub fn kmeans_assign_with_distances(x: &Tensor, centroids: &Tensor) -> Result<(Tensor, Tensor)> {
    let assign = kmeans_assign(x, centroids)?;
    let nearest = centroids.to_dtype(DType::F32)?.index_select(&assign, 0)?;
    let dist = (x.to_dtype(DType::F32)? - nearest)?.sqr()?.sum(D::Minus1)?;
    Ok((assign, dist))
}

fn check_kmeans(x: &Tensor, centroids: &Tensor) -> Result<()> {
    if x.rank() != 2 || centroids.rank() != 2 {
        bail!(
            "kmeans_assign: x must be [n, d] and centroids [c, d], got shapes {:?} and {:?}",
            x.dims(),
            centroids.dims()
        );
    }
    if x.dim(1)? != centroids.dim(1)? {
        bail!(
            "kmeans_assign: x has {} features per row but centroids have {}",
            x.dim(1)?,
            centroids.dim(1)?
        );
    }
    Ok(())
}

fn check_args(a: &Tensor, b: &Tensor, col_bias: Option<&Tensor>) -> Result<()> {
    if a.rank() < 2 || b.rank() < 2 {
        bail!(
            "{OP}: a must be [.., m, k] and b [.., k, n], got shapes {:?} and {:?}",
            a.dims(),
            b.dims()
        );
    }
    let (k, k_b, n) = (a.dim(D::Minus1)?, b.dim(D::Minus2)?, b.dim(D::Minus1)?);
    if k != k_b {
        bail!(
            "{OP}: inner dims differ, a is {:?} and b is {:?}",
            a.dims(),
            b.dims()
        );
    }
    let (a_lead, b_lead) = (&a.dims()[..a.rank() - 2], &b.dims()[..b.rank() - 2]);
    if !b_lead.is_empty() && a_lead != b_lead {
        bail!(
            "{OP}: batch dims differ, a is {:?} and b is {:?} (b may also be 2-D, shared)",
            a.dims(),
            b.dims()
        );
    }
    if n == 0 {
        bail!("{OP}: b has no columns (n = 0): there is no argmin");
    }
    if n > u32::MAX as usize {
        bail!("{OP}: {n} columns do not fit u32 indices");
    }
    check_float_operands(OP, ("a", a), &[("b", b)], &[])?;
    if let Some(bias) = col_bias {
        if bias.dims() != [n] {
            bail!(
                "{OP}: col_bias must be [{n}] (one per column of b), got {:?}",
                bias.dims()
            );
        }
        if !bias.dtype().is_float() {
            bail!(
                "{OP}: col_bias must be a float tensor, got {:?}",
                bias.dtype()
            );
        }
        if !a.device().same_device(bias.device()) {
            bail!("{OP}: col_bias is on a different device than a");
        }
    }
    Ok(())
}

/// Rows and columns one CPU task multiplies at a time: the block (64 x 512 f32 = 128 KiB) stays
/// in L2 while it is scanned.
const CPU_ROWS: usize = 64;
const CPU_COLS: usize = 512;

struct ArgminMatmul {
    scale: f32,
    /// The f32 mode on CUDA, resolved at the call.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    mode: F32Matmul,
}

/// `a . b` views and the output shape of one call.
fn views(a: &Layout, b: &Layout) -> Result<(MatView, MatView, Shape)> {
    let (Some(av), Some(bv)) = (MatView::from_layout(a), MatView::from_layout(b)) else {
        bail!("{OP}: internal error, operands reached the kernel uncollapsed");
    };
    let out = Shape::from(&a.dims()[..a.dims().len() - 1]);
    Ok((av, bv, out))
}

/// The order the kernels use: numeric, with NaN above every number (so `-0.0 == 0.0`).
fn less<A: CpuGemm>(x: A, y: A) -> bool {
    x < y || (y.is_nan() && !x.is_nan())
}

fn cpu_argmin<A: CpuGemm + candle_core::WithDType>(
    a: &[A], b: &[A], bias: &[f32], av: &MatView, bv: &MatView, scale: f32,
) -> Result<Vec<u32>> {
    av.check_within(a.len(), OP)?;
    bv.check_within(b.len(), OP)?;
    let (batch, m, n) = (av.batch, av.rows, bv.cols);
    let scale = A::from_f64(scale as f64);
    let bias: Vec<A> = bias.iter().map(|&x| A::from_f64(x as f64)).collect();
    let mut out = vec![0u32; batch * m];
    if m == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(CPU_ROWS)
        .enumerate()
        .for_each(|(chunk, out)| {
            // A chunk of output rows may straddle batch entries: it is walked in runs that
            // do not. NaN is the "nothing yet" score: any number beats it, and a row of NaN
            // scores keeps index 0.
            let first = chunk * CPU_ROWS;
            let mut block = vec![A::zero(); CPU_ROWS * CPU_COLS];
            let mut best: Vec<(A, u32)> = vec![(A::nan(), 0); out.len()];
            let mut done = 0;
            while done < out.len() {
                let (bi, row0) = ((first + done) / m, (first + done) % m);
                let rows = (m - row0).min(out.len() - done);
                for col0 in (0..n).step_by(CPU_COLS) {
                    let cols = (n - col0).min(CPU_COLS);
                    // SAFETY: views checked above; `block` holds rows x cols at stride cols.
                    unsafe {
                        cpu_block_product(
                            (a, av),
                            (b, bv),
                            bi,
                            row0..row0 + rows,
                            col0..col0 + cols,
                            block.as_mut_ptr(),
                            cols,
                        )
                    };
                    for r in 0..rows {
                        let best = &mut best[done + r];
                        for (c, &p) in block[r * cols..(r + 1) * cols].iter().enumerate() {
                            let v = scale * p + bias[col0 + c];
                            // Strictly less: a tie keeps the lower column seen first.
                            if less(v, best.0) {
                                *best = (v, (col0 + c) as u32);
                            }
                        }
                    }
                }
                done += rows;
            }
            for (o, (_, j)) in out.iter_mut().zip(best) {
                *o = j;
            }
        });
    Ok(out)
}

impl CustomOp3 for ArgminMatmul {
    fn name(&self) -> &'static str {
        "fastops-argmin-matmul"
    }

    fn cpu_fwd(
        &self, a: &CpuStorage, a_layout: &Layout, b: &CpuStorage, b_layout: &Layout,
        bias: &CpuStorage, bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (av, bv, shape) = views(a_layout, b_layout)?;
        let Some((start, end)) = bias_layout.contiguous_offsets() else {
            bail!("{OP}: internal error, bias is not contiguous");
        };
        let bias = &bias.as_slice::<f32>()?[start..end];
        let out = crate::dispatch::with_cpu_gemm_pair!(OP, a, b, |a, b| {
            cpu_argmin(a, b, bias, &av, &bv, self.scale)?
        });
        Ok((CpuStorage::U32(out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, a: &candle_core::CudaStorage, a_layout: &Layout, b: &candle_core::CudaStorage,
        b_layout: &Layout, bias: &candle_core::CudaStorage, bias_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (av, bv, shape) = views(a_layout, b_layout)?;
        let dev = &a.device;
        let bias = bias
            .as_cuda_slice::<f32>()?
            .slice(bias_layout.start_offset()..);
        let out = crate::dispatch::with_float_cuda_pair!(OP, &a.slice, &b.slice, |a, b| {
            cuda::launch(dev, a, b, &bias, &av, &bv, self.mode, self.scale)?
        });
        Ok((out, shape))
    }
}

#[cfg(feature = "cuda")]
mod cuda;
