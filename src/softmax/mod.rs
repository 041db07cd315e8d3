//! Softmax and log-softmax over any set of dims of a tensor of any rank, in one or two passes
//! over memory, driven by a [`ReducePlan`].

use crate::dispatch::{check_float_operands, with_float_cpu};
pub(crate) mod plan;

use candle_core::shape::Dim;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType, D};
use plan::ReducePlan;
use rayon::prelude::*;
use std::sync::Arc;

/// Softmax over the sub-tensors spanned by `dims`: every group of elements that share their
/// indices along the other dims is normalised to sum to 1. `dims` may come in any order;
/// all dims of the tensor means softmax over the whole tensor.
///
/// * Max-subtracted; f16/bf16 accumulate in f32, f32 in f32, f64 (CPU only) in f64.
/// * A group whose entries are all `-inf` gives zeros, not NaN (fully masked attention rows).
///   A NaN in a group makes that group NaN and no other.
/// * Any layout (a non-contiguous input is copied first). Autograd:
///   `grad_x = y * (g - sum_over_dims(g * y))`.
/// * Errors: rank 0, empty `dims`, duplicate or out-of-range dims, unsupported dtype; on CUDA
///   also groups of 2^31 or more elements or 2^31 or more groups (offsets themselves are 64-bit).
/// * The backward pass is composed from candle ops (a multiply, a sum over `dims`, a broadcast);
///   only the forward pass has its own kernels.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 3, 4))?;
/// // Normalise each of the three [2, 4] slices.
/// let ys = candle_fastops::softmax_dims(&xs, &[0, 2])?;
/// let sums = ys.sum_keepdim(0)?.sum_keepdim(2)?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-6));
/// // `dims` may be one dim, candle's `D`, or a list of either.
/// use candle_core::D;
/// let last = candle_fastops::softmax_dims(&xs, D::Minus1)?;
/// let same = candle_fastops::softmax_dims(&xs, 2)?;
/// assert_eq!(last.to_vec3::<f32>()?, same.to_vec3::<f32>()?);
/// let pair = candle_fastops::softmax_dims(&xs, [D::Minus1, D::Minus(3)])?;
/// assert_eq!(pair.to_vec3::<f32>()?, ys.to_vec3::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn softmax_dims(xs: &Tensor, dims: impl ReduceDims) -> Result<Tensor> {
    apply(xs, &dims.dims_of(xs.shape(), "softmax_dims")?, false)
}

/// Log-softmax over `dims`: `x - max - log(sum(exp(x - max)))` per group, with the semantics of
/// [`softmax_dims`]; a group whose entries are all `-inf` gives `-inf`. Autograd:
/// `grad_x = g - exp(y) * sum_over_dims(g)`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let ys = candle_fastops::log_softmax_dims(&xs, &[0])?;
/// let expected = (xs.clone() - xs.exp()?.sum_keepdim(0)?.log()?.broadcast_as((2, 2))?)?;
/// let diff = (ys - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn log_softmax_dims(xs: &Tensor, dims: impl ReduceDims) -> Result<Tensor> {
    apply(xs, &dims.dims_of(xs.shape(), "log_softmax_dims")?, true)
}

/// The dims [`softmax_dims`] / [`log_softmax_dims`] normalise over: one dim (`usize` or
/// candle's [`D`]), a list of them (`&[usize]`, `[usize; N]`, `Vec<usize>`, `[D; N]`, `&[D]`,
/// and references to these), or a [`ReducePlan`] built for the tensor's shape. The list itself (no duplicates, each in range) is checked by the
/// op, with an error naming it.
pub trait ReduceDims {
    /// The dims as indexes into `shape` (`D` forms resolved against its rank).
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>>;
}

impl ReduceDims for usize {
    fn dims_of(&self, _: &Shape, _: &'static str) -> Result<Vec<usize>> {
        Ok(vec![*self])
    }
}

impl ReduceDims for D {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        Ok(vec![self.to_index(shape, op)?])
    }
}

impl ReduceDims for [usize] {
    fn dims_of(&self, _: &Shape, _: &'static str) -> Result<Vec<usize>> {
        Ok(self.to_vec())
    }
}

impl<const N: usize> ReduceDims for [usize; N] {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        self[..].dims_of(shape, op)
    }
}

impl ReduceDims for Vec<usize> {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        self[..].dims_of(shape, op)
    }
}

impl ReduceDims for [D] {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        self.iter().map(|d| d.to_index(shape, op)).collect()
    }
}

impl<const N: usize> ReduceDims for [D; N] {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        self[..].dims_of(shape, op)
    }
}

/// A [`ReducePlan`] names its dims too; it must have been built for the tensor's shape.
impl ReduceDims for ReducePlan {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        if self.shape() != shape.dims() {
            bail!(
                "{op}: the plan was built for shape {:?}, the tensor is {:?}",
                self.shape(),
                shape.dims()
            );
        }
        Ok(self.dims().to_vec())
    }
}

impl<T: ReduceDims + ?Sized> ReduceDims for &T {
    fn dims_of(&self, shape: &Shape, op: &'static str) -> Result<Vec<usize>> {
        (**self).dims_of(shape, op)
    }
}

fn apply(xs: &Tensor, dims: &[usize], log: bool) -> Result<Tensor> {
    let op = if log {
        "log_softmax_dims"
    } else {
        "softmax_dims"
    };
    if xs.rank() == 0 {
        bail!("{op}: rank-0 tensors have no dims to normalise over");
    }
    check_float_operands(op, ("xs", xs), &[], &[])?;
    let plan = ReducePlan::cached(xs.dims(), dims).map_err(|e| e.context(op))?;
    xs.contiguous()?.apply_op1(SoftmaxDims { plan, log })
}

struct SoftmaxDims {
    plan: Arc<ReducePlan>,
    log: bool,
}

impl SoftmaxDims {
    fn op_name(&self) -> &'static str {
        if self.log {
            "log_softmax_dims"
        } else {
            "softmax_dims"
        }
    }

    /// Where the input starts in its storage (0 for an empty input, whose view may start past
    /// the end of its storage).
    fn contiguous_start(&self, layout: &Layout) -> Result<usize> {
        match layout.contiguous_offsets() {
            Some(_) if layout.dims() == self.plan.shape() && layout.shape().elem_count() == 0 => {
                Ok(0)
            }
            Some((start, _)) if layout.dims() == self.plan.shape() => Ok(start),
            _ => bail!(
                "{}: internal error, input reached the kernel non-contiguous",
                self.op_name()
            ),
        }
    }
}

impl CustomOp1 for SoftmaxDims {
    fn name(&self) -> &'static str {
        if self.log {
            "fastops-log-softmax-dims"
        } else {
            "fastops-softmax-dims"
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let start = self.contiguous_start(layout)?;
        let n = layout.shape().elem_count();
        let out = with_float_cpu!(self.op_name(), storage, |xs| {
            let xs = &xs[start..start + n];
            WithDType::to_cpu_storage_owned(cpu::softmax(xs, &self.plan, self.log))
        });
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, storage: &candle_core::CudaStorage, layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let start = self.contiguous_start(layout)?;
        let n = layout.shape().elem_count();
        let dev = &storage.device;
        let out = crate::dispatch::with_float_cuda!(self.op_name(), &storage.slice, |xs| {
            let xs = xs.slice(start..start + n);
            let ys = crate::cuda::alloc_output(dev, n)?;
            cuda::launch_softmax(dev, &self.plan, self.log, &xs, start, &ys)?;
            candle_core::CudaStorage::wrap_cuda_slice(ys, dev.clone())
        });
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _xs: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dims = self.plan.dims().to_vec();
        let grad = if self.log {
            let total = grad_res.sum_keepdim(dims)?;
            (grad_res - res.exp()?.broadcast_mul(&total)?)?
        } else {
            let dot = (grad_res * res)?.sum_keepdim(dims)?;
            (res * grad_res.broadcast_sub(&dot)?)?
        };
        Ok(Some(grad))
    }
}

mod cpu;

#[cfg(feature = "cuda")]
mod cuda;
