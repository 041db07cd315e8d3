//! Bias-add with TensorFlow `BiasAdd` semantics: a 1-D `bias` added along one dimension of `xs`.
//!
//! `dim = rank - 1` is TensorFlow's NHWC form (`x + b` for a `[.., C]` tensor), `dim = 1` its NCHW
//! form. The op reads `xs` once and writes the result once, so its speed is bounded by memory
//! bandwidth; the CUDA kernel (`src/cuda/bias_add.cu`) moves 16 bytes per access and keeps the
//! bias in shared memory, the CPU path adds contiguous runs in parallel with rayon.
//!
//! [`bias_add_with`] fuses an [`Activation`] into the same pass (a dense layer's bias and its
//! clipped ReLU in one kernel), and its backward passes the gradient through the activation in
//! one more.

use crate::activation::{acc_of, clipped_relu, through_clipped_relu, Activation};
use crate::cpu::CpuFloat;
use crate::dispatch::{check_float_operands, with_float_cpu};
use candle_core::shape::Dim;
use candle_core::{
    bail, CpuStorage, CustomOp2, InplaceOp2, Layout, Result, Shape, Tensor, WithDType,
};
use rayon::prelude::*;
use std::ops::Range;

const OP: &str = "bias_add";

/// Elements per rayon task on the CPU: large enough to amortise scheduling, small enough to
/// balance two or a hundred cores.
const CPU_CHUNK: usize = 1 << 16;

/// Adds the 1-D `bias` to `xs` along dimension `dim`: `out[.., i, ..] = xs[.., i, ..] + bias[i]`
/// with `i` the index along `dim`.
///
/// * dtypes: f32, f16, bf16 on every device, f64 on the CPU; `xs` and `bias` share the dtype.
///   Half types are added in f32 and rounded once.
/// * `xs` may have any rank >= 1 and any layout (a non-contiguous `xs` is copied first).
/// * `dim` is a `usize` or candle's `D` (`D::Minus1` for a last-dim bias).
/// * Autograd: the gradient of `xs` is the incoming gradient, the gradient of `bias` its sum over
///   every dimension but `dim`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
/// let bias = Tensor::new(&[10f32, 20., 30.], &Device::Cpu)?;
/// let ys = candle_fastops::bias_add(&xs, &bias, 1)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[10., 21., 32.], [13., 24., 35.]]);
/// let last = candle_fastops::bias_add(&xs, &bias, candle_core::D::Minus1)?;
/// assert_eq!(last.to_vec2::<f32>()?, ys.to_vec2::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn bias_add(xs: &Tensor, bias: &Tensor, dim: impl Dim) -> Result<Tensor> {
    bias_add_with_hint(xs, bias, dim_index(xs, dim)?, CacheHint::default())
}

/// Per-call options of [`bias_add_with`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BiasAddOptions {
    /// An activation applied to the sum before it is stored (default [`Activation::Identity`]).
    pub activation: Activation,
}

/// [`bias_add`] with options: `activation(xs + bias)` along `dim` in one pass.
///
/// A dense layer followed by NNUE's clipped ReLU, `xs.matmul(&w.t())?` then this with
/// [`Activation::ClippedRelu`], costs one pass over the activations forward and one backward,
/// where candle's `broadcast_add(..)?.clamp(0, 1)` takes three forward and about thirty small
/// kernels backward. The half types clamp in f32 and round once, so a sum just below the ceiling
/// may be stored as the ceiling itself.
///
/// * Everything [`bias_add`] accepts, and the same errors; a clipped ReLU's ceiling must be
///   finite and positive.
/// * Autograd: the output gradient is passed where the stored output lies strictly between 0
///   and the ceiling (zero elsewhere, NaN outputs included); that is the gradient of `xs`, and
///   its sum over every dimension but `dim` the gradient of `bias`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fastops::{bias_add_with, Activation, BiasAddOptions};
/// let xs = Tensor::new(&[[-1f32, 0.25, 0.75], [2., 0.5, 0.]], &Device::Cpu)?;
/// let bias = Tensor::new(&[0.5f32, 0.25, 0.5], &Device::Cpu)?;
/// let clipped = BiasAddOptions { activation: Activation::ClippedRelu { ceiling: 1.0 } };
/// let ys = bias_add_with(&xs, &bias, 1, &clipped)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[0., 0.5, 1.], [1., 0.75, 0.5]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn bias_add_with(
    xs: &Tensor, bias: &Tensor, dim: impl Dim, options: &BiasAddOptions,
) -> Result<Tensor> {
    let dim = dim_index(xs, dim)?;
    check_args(xs, bias, dim)?;
    let clip_ceiling = options.activation.clip_ceiling(OP)?;
    apply_bias_add(
        xs,
        bias,
        BiasAdd {
            dim,
            hint: CacheHint::default(),
            clip_ceiling,
        },
    )
}

/// `op` on contiguous copies of `xs` and `bias` (checked by the caller).
fn apply_bias_add(xs: &Tensor, bias: &Tensor, op: BiasAdd) -> Result<Tensor> {
    xs.contiguous()?.apply_op2(&bias.contiguous()?, op)
}

/// `dim` (a `usize` or candle's [`D`](candle_core::D)) as an index into `xs`'s dims.
fn dim_index(xs: &Tensor, dim: impl Dim) -> Result<usize> {
    if xs.rank() == 0 {
        bail!("{OP}: xs must have rank >= 1, got a rank-0 tensor");
    }
    dim.to_index(xs.shape(), OP).map_err(|_| {
        candle_core::Error::Msg(format!(
            "{OP}: the bias dim is out of range for xs of shape {:?}",
            xs.dims()
        ))
    })
}

/// [`bias_add`] with the CUDA kernel's cache hint chosen explicitly; the bench uses it to compare
/// them. The hint is ignored on the CPU and for dtypes other than f32.
#[doc(hidden)]
pub fn bias_add_with_hint(
    xs: &Tensor, bias: &Tensor, dim: usize, hint: CacheHint,
) -> Result<Tensor> {
    check_args(xs, bias, dim)?;
    apply_bias_add(
        xs,
        bias,
        BiasAdd {
            dim,
            hint,
            clip_ceiling: None,
        },
    )
}

/// In-place [`bias_add`]: `xs += bias` along `dim`, allocating nothing.
///
/// For tensors the caller owns: the update is not recorded for autograd, and every tensor that
/// shares `xs`'s storage sees it. `xs` must be dense (contiguous, or a permutation of a
/// contiguous tensor, at any storage offset), since a strided view with gaps or repeats cannot be
/// updated in place element by element.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let xs = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let bias = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// candle_fastops::bias_add_(&xs, &bias, 1)?;
/// assert_eq!(xs.to_vec2::<f32>()?, [[1., 2., 3.], [1., 2., 3.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn bias_add_(xs: &Tensor, bias: &Tensor, dim: impl Dim) -> Result<()> {
    let dim = dim_index(xs, dim)?;
    check_args(xs, bias, dim)?;
    if ChannelMap::dense(xs.layout(), dim).is_none() {
        bail!(
            "{OP}: in-place form needs a dense xs (contiguous or permuted), got shape {:?} with strides {:?}",
            xs.dims(),
            xs.stride()
        );
    }
    let bias = bias.contiguous()?;
    xs.inplace_op2(&bias, &BiasAddInPlace { dim })
}

/// Cache hint of the CUDA kernel's streaming loads and stores (bench-only knob).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheHint {
    /// `ld.global.cs` / `st.global.cs` (evict-first): the default.
    #[default]
    Streaming,
    /// `ld.global.cv` / `st.global.wt`, as in the TensorFlow study.
    Volatile,
    /// Plain loads and stores.
    Plain,
}

fn check_args(xs: &Tensor, bias: &Tensor, dim: usize) -> Result<()> {
    if xs.rank() == 0 {
        bail!("{OP}: xs must have rank >= 1, got a rank-0 tensor");
    }
    if dim >= xs.rank() {
        bail!(
            "{OP}: dim {dim} is out of range for xs of shape {:?}",
            xs.dims()
        );
    }
    if bias.rank() != 1 {
        bail!("{OP}: bias must be 1-D, got shape {:?}", bias.dims());
    }
    if bias.dim(0)? != xs.dim(dim)? {
        bail!(
            "{OP}: bias has {} elements but xs has {} along dim {dim} (xs shape {:?})",
            bias.dim(0)?,
            xs.dim(dim)?,
            xs.dims()
        );
    }
    check_float_operands(OP, ("xs", xs), &[("bias", bias)], &[])
}

/// Where the elements of a dense tensor sit and which channel each has: the element at storage
/// slot `start + p` (for `p < len`) belongs to channel `(p / inner) % channels`.
#[derive(Debug, Clone, Copy)]
struct ChannelMap {
    start: usize,
    len: usize,
    inner: usize,
    channels: usize,
}

impl ChannelMap {
    /// For a layout whose elements fill `len` consecutive storage slots in some dimension order
    /// (contiguous, or a permutation of contiguous): then the index along `dim` of the element at
    /// slot `start + p` is `(p / stride[dim]) % dims[dim]`.
    fn dense(layout: &Layout, dim: usize) -> Option<Self> {
        let dims = layout.dims();
        let strides = layout.stride();
        let len = layout.shape().elem_count();
        if len > 0 {
            let mut by_stride: Vec<(usize, usize)> = dims
                .iter()
                .zip(strides)
                .filter(|(&d, _)| d > 1)
                .map(|(&d, &s)| (s, d))
                .collect();
            by_stride.sort_unstable();
            let mut expected = 1;
            for (stride, size) in by_stride {
                if stride != expected {
                    return None;
                }
                expected *= size;
            }
        }
        let channels = dims[dim];
        let inner = if channels > 1 { strides[dim] } else { 1 };
        Some(Self {
            // An empty view may start past the end of its (empty) storage: it reads nothing.
            start: if len == 0 { 0 } else { layout.start_offset() },
            len,
            inner,
            channels,
        })
    }

    /// The map of a contiguous (row-major) layout, the only one an out-of-place result can mirror.
    fn contiguous(layout: &Layout, dim: usize) -> Result<Self> {
        if !layout.is_contiguous() {
            bail!("{OP}: internal error, xs reached the kernel non-contiguous");
        }
        Self::dense(layout, dim).ok_or_else(|| candle_core::Error::Msg(format!("{OP}: bad layout")))
    }
}

/// The storage range of a contiguous operand (empty for an empty one).
fn contiguous_range(layout: &Layout) -> Result<Range<usize>> {
    match layout.contiguous_offsets() {
        Some(_) if layout.shape().elem_count() == 0 => Ok(0..0),
        Some((start, end)) => Ok(start..end),
        None => bail!("{OP}: internal error, an operand reached the kernel non-contiguous"),
    }
}

/// The bias seen by a run of consecutive elements.
enum BiasRun<'a, T> {
    /// Every element of the run is in one channel.
    Same(T),
    /// The run covers consecutive channels (last-dim bias): element `i` gets `bias[i]`.
    Consecutive(&'a [T]),
}

/// Splits the elements `first..first + len` of a buffer mapped by `map` into runs with one bias
/// pattern each, calling `f` with each run's range relative to `first`.
fn for_each_run<'a, T: Copy>(
    first: usize, len: usize, map: &ChannelMap, bias: &'a [T],
    mut f: impl FnMut(Range<usize>, BiasRun<'a, T>),
) {
    let (inner, channels) = (map.inner, map.channels);
    let mut channel = (first / inner) % channels;
    let mut offset = first % inner;
    let mut done = 0;
    while done < len {
        if inner == 1 {
            let run = (channels - channel).min(len - done);
            f(
                done..done + run,
                BiasRun::Consecutive(&bias[channel..channel + run]),
            );
            done += run;
            channel = 0;
        } else {
            let run = (inner - offset).min(len - done);
            f(done..done + run, BiasRun::Same(bias[channel]));
            done += run;
            offset = 0;
            channel = if channel + 1 == channels {
                0
            } else {
                channel + 1
            };
        }
    }
}

fn cpu_bias_add<T: WithDType>(src: &[T], bias: &[T], map: &ChannelMap) -> Vec<T> {
    cpu_bias_add_then(src, bias, map, |sum| sum)
}

/// `cpu_bias_add` with a clipped ReLU on each sum (the sum rounded to `T`, then clamped in the
/// accumulator type against the unrounded ceiling and rounded again: the same values as the
/// CUDA kernel's clamp in f32 before one rounding, see `cpu_bias_add_then`).
fn cpu_bias_add_clipped<T: CpuFloat>(
    src: &[T], bias: &[T], map: &ChannelMap, ceiling: f32,
) -> Vec<T> {
    let ceiling: T::Acc = acc_of(ceiling);
    cpu_bias_add_then(src, bias, map, |sum| {
        T::from_acc(clipped_relu(sum.to_acc(), ceiling))
    })
}

/// `activation(src + bias)` element by element, in parallel, `activation` applied to the sum
/// rounded to `T` (exact for the identity and for f32 / f64; for the half types the clamp of
/// the rounded sum equals the rounded clamp, since rounding is monotone and 0 and the rounded
/// ceiling are representable).
fn cpu_bias_add_then<T: WithDType>(
    src: &[T], bias: &[T], map: &ChannelMap, activation: impl Fn(T) -> T + Sync,
) -> Vec<T> {
    let write_all = |dst: &mut [std::mem::MaybeUninit<_>]| {
        dst.par_chunks_mut(CPU_CHUNK)
            .zip(src.par_chunks(CPU_CHUNK))
            .enumerate()
            .for_each(|(chunk, (dst, src))| {
                for_each_run(chunk * CPU_CHUNK, dst.len(), map, bias, |range, run| {
                    let (dst, src) = (&mut dst[range.clone()], &src[range]);
                    match run {
                        BiasRun::Same(b) => {
                            for (d, &s) in dst.iter_mut().zip(src) {
                                d.write(activation(s + b));
                            }
                        }
                        BiasRun::Consecutive(bias) => {
                            for ((d, &s), &b) in dst.iter_mut().zip(src).zip(bias) {
                                d.write(activation(s + b));
                            }
                        }
                    }
                })
            })
    };
    // Written in parallel straight into the spare capacity: no zero-fill pass.
    // SAFETY: the chunks cover `0..src.len()` and write every element.
    unsafe { crate::cpu::written_output(src.len(), write_all) }
}

fn cpu_bias_add_in_place<T: WithDType>(xs: &mut [T], bias: &[T], map: &ChannelMap) {
    xs.par_chunks_mut(CPU_CHUNK)
        .enumerate()
        .for_each(|(chunk, xs)| {
            for_each_run(
                chunk * CPU_CHUNK,
                xs.len(),
                map,
                bias,
                |range, run| match run {
                    BiasRun::Same(b) => xs[range].iter_mut().for_each(|x| *x += b),
                    BiasRun::Consecutive(bias) => {
                        xs[range].iter_mut().zip(bias).for_each(|(x, &b)| *x += b)
                    }
                },
            )
        });
}

struct BiasAdd {
    dim: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    hint: CacheHint,
    /// A fused clipped ReLU's ceiling (`None`: no activation).
    clip_ceiling: Option<f32>,
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "fastops-bias-add"
    }

    fn cpu_fwd(
        &self, xs: &CpuStorage, xs_layout: &Layout, bias: &CpuStorage, bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let map = ChannelMap::contiguous(xs_layout, self.dim)?;
        let bias_range = contiguous_range(bias_layout)?;
        let out = with_float_cpu!(OP, xs, |xs| {
            let src = &xs[map.start..map.start + map.len];
            let bias = &bias.as_slice()?[bias_range];
            let out = match self.clip_ceiling {
                None => cpu_bias_add(src, bias, &map),
                Some(ceiling) => cpu_bias_add_clipped(src, bias, &map, ceiling),
            };
            WithDType::to_cpu_storage_owned(out)
        });
        Ok((out, xs_layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, xs: &candle_core::CudaStorage, xs_layout: &Layout, bias: &candle_core::CudaStorage,
        bias_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let map = ChannelMap::contiguous(xs_layout, self.dim)?;
        let bias_range = contiguous_range(bias_layout)?;
        let dev = &xs.device;
        let out = crate::dispatch::with_float_cuda!(OP, &xs.slice, |src| {
            let out = crate::cuda::alloc_output(dev, map.len)?;
            let src = src.slice(map.start..map.start + map.len);
            let bias = bias.as_cuda_slice()?.slice(bias_range);
            cuda::launch_bias_add(
                dev,
                self.hint,
                &map,
                &bias,
                self.clip_ceiling,
                cuda::SrcDst::Separate(&src, &out),
            )?;
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, xs_layout.shape().clone()))
    }

    fn bwd(
        &self, xs: &Tensor, _bias: &Tensor, res: &Tensor, grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_sum = match self.clip_ceiling {
            None => grad_res.clone(),
            Some(ceiling) => res
                .contiguous()?
                .apply_op2_no_bwd(&grad_res.contiguous()?, &ClippedReluGrad { ceiling })?,
        };
        let other_dims: Vec<usize> = (0..xs.rank()).filter(|&d| d != self.dim).collect();
        let grad_bias = if other_dims.is_empty() {
            grad_sum.clone()
        } else {
            grad_sum.sum(other_dims)?
        };
        Ok((Some(grad_sum), Some(grad_bias)))
    }
}

/// The gradient behind a clipped ReLU, from its output `y` and the output gradient (both
/// contiguous, of one shape and dtype): the gradient where `0 < y < ceiling` (the ceiling
/// rounded to the dtype), zero elsewhere.
struct ClippedReluGrad {
    ceiling: f32,
}

impl CustomOp2 for ClippedReluGrad {
    fn name(&self) -> &'static str {
        "fastops-clipped-relu-grad"
    }

    fn cpu_fwd(
        &self, ys: &CpuStorage, ys_layout: &Layout, grad: &CpuStorage, grad_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ys_range = contiguous_range(ys_layout)?;
        let grad_range = contiguous_range(grad_layout)?;
        let out = with_float_cpu!(OP, ys, |ys| {
            let grad = &grad.as_slice()?[grad_range];
            WithDType::to_cpu_storage_owned(through_clipped_relu(grad, &ys[ys_range], self.ceiling))
        });
        Ok((out, ys_layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, ys: &candle_core::CudaStorage, ys_layout: &Layout, grad: &candle_core::CudaStorage,
        grad_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let ys_range = contiguous_range(ys_layout)?;
        let grad_range = contiguous_range(grad_layout)?;
        let dev = &ys.device;
        let out = crate::dispatch::with_float_cuda!(OP, &ys.slice, |ys| {
            let out = crate::cuda::alloc_output(dev, ys_range.len())?;
            let grad = grad.as_cuda_slice()?.slice(grad_range);
            cuda::launch_clipped_relu_grad(dev, &ys.slice(ys_range), &grad, &out, self.ceiling)?;
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, ys_layout.shape().clone()))
    }
}

struct BiasAddInPlace {
    dim: usize,
}

impl InplaceOp2 for BiasAddInPlace {
    fn name(&self) -> &'static str {
        "fastops-bias-add-in-place"
    }

    fn cpu_fwd(
        &self, xs: &mut CpuStorage, xs_layout: &Layout, bias: &CpuStorage, bias_layout: &Layout,
    ) -> Result<()> {
        let Some(map) = ChannelMap::dense(xs_layout, self.dim) else {
            bail!("{OP}: in-place form needs a dense xs");
        };
        let bias_range = contiguous_range(bias_layout)?;
        with_float_cpu!(OP, xs, |xs| {
            let bias = &bias.as_slice()?[bias_range];
            cpu_bias_add_in_place(&mut xs[map.start..map.start + map.len], bias, &map)
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, xs: &mut candle_core::CudaStorage, xs_layout: &Layout,
        bias: &candle_core::CudaStorage, bias_layout: &Layout,
    ) -> Result<()> {
        let Some(map) = ChannelMap::dense(xs_layout, self.dim) else {
            bail!("{OP}: in-place form needs a dense xs");
        };
        let bias_range = contiguous_range(bias_layout)?;
        let dev = &xs.device;
        crate::dispatch::with_float_cuda!(OP, &mut xs.slice, |dst| {
            let mut dst = dst.slice_mut(map.start..map.start + map.len);
            let bias = bias.as_cuda_slice()?.slice(bias_range);
            cuda::launch_bias_add(
                dev,
                CacheHint::default(),
                &map,
                &bias,
                None,
                cuda::SrcDst::InPlace(&mut dst),
            )?
        });
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda;
