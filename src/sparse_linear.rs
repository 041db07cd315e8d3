//! The sparse feature transformer, the input layer of NNUE evaluation networks:
//! `y[b, :] = bias + sum_k value[b, k] * weight[indices[b, k], :]` over a row's active features.
//!
//! `indices` is `[batch, max_active]` i32; a row's features end at its first `-1` and the slots
//! after it are ignored, whatever they hold. The CUDA kernels (`src/cuda/sparse_linear.cu`) give
//! one warp a (position, perspective) and a stripe of output columns held in registers; the
//! persistent grid walks the stripes in order so the weight rows in use stay in L2. The backward
//! pass adds into the dense weight gradient with vector atomics (skipping zero output gradients)
//! and sums the bias gradient per block. The CPU path runs positions in parallel forward, and
//! weight-row ranges in parallel backward (each thread owns its rows: no races, deterministic).

use crate::cpu::{output_vec, spare, CpuFloat};
use crate::dispatch::with_float_cpu;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor, WithDType,
};
use candle_nn::init::Init;
use num_traits::{NumCast, Zero};
use rayon::prelude::*;
use std::sync::Arc;

const OP: &str = "sparse_linear";

/// `bias + sum_k values[b, k] * weight[indices[b, k], :]` for each row `b` of `indices`: the NNUE
/// feature transformer as one op.
///
/// * `indices`: `[batch, max_active]` i32. A row's active features end at its first `-1`; slots
///   after it are ignored. An index below -1 or at least `num_inputs` is an error (see below).
///   The same index may appear several times in a row (its weight row is added each time).
/// * `values`: `None` for all ones, or `[batch, max_active]` f32.
/// * `weight`: `[num_inputs, out]`, `bias`: `[out]`, both of one float dtype: f32, f16 or bf16
///   (f64 on the CPU). Sums are accumulated in f32 (f64 for f64) and the result `[batch, out]`
///   has the weight's dtype. `weight` may be a view with a row stride (a column `narrow`); other
///   layouts are copied first.
/// * Autograd: gradients flow to `weight` and `bias` (dense, shaped like them); `indices` and
///   `values` get none.
///
/// Bad indices: on the CPU the call fails with an error naming the index. On CUDA the kernel
/// never reads outside `weight`: a bad index contributes nothing and raises a device-written flag
/// that the *next* `sparse_linear` call on that device (or [`check_sparse_indices`]) reports, so
/// valid inputs never cost a host synchronisation. Call [`check_sparse_indices`] on a batch to
/// validate it eagerly.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let weight = Tensor::new(&[[1f32, 2.], [10., 20.], [100., 200.]], &dev)?; // 3 inputs -> 2 outputs
/// let bias = Tensor::new(&[0.5f32, 0.25], &dev)?;
/// // Row 0: features 0 and 2. Row 1: feature 1 twice, then padding (the 7 after -1 is ignored).
/// let indices = Tensor::new(&[[0i32, 2, -1], [1, 1, -1]], &dev)?;
/// let ys = candle_fastops::sparse_linear(&indices, None, &weight, &bias)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[101.5, 202.25], [20.5, 40.25]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sparse_linear(
    indices: &Tensor,
    values: Option<&Tensor>,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<Tensor> {
    let batch = Features::new(&[(indices, values)], None, weight, bias)?;
    apply(batch, weight, bias)
}

/// Both perspectives of an NNUE position in one launch: `[batch, 2 * out]` whose row `b` is
/// `[transform(white[b]), transform(black[b])]` when `stm[b]` is nonzero (white to move) and
/// `[transform(black[b]), transform(white[b])]` otherwise, sharing `weight` and `bias`. This is
/// what NNUE trainers feed the next layer, without a concat or a select copy.
///
/// `white` / `black` (and their optional values) follow [`sparse_linear`]'s rules and share a
/// shape; `stm` is `[batch]` (or `[batch, 1]`) of any dtype, nonzero meaning white to move.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let weight = Tensor::new(&[[1f32], [10.], [100.]], &dev)?;
/// let bias = Tensor::new(&[0f32], &dev)?;
/// let white = Tensor::new(&[[0i32, 1], [2, -1]], &dev)?;
/// let black = Tensor::new(&[[2i32, -1], [0, -1]], &dev)?;
/// let stm = Tensor::new(&[1u8, 0], &dev)?; // white to move, then black to move
/// let ys = candle_fastops::sparse_linear_pair(&white, &black, &stm, None, None, &weight, &bias)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[11., 100.], [1., 100.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sparse_linear_pair(
    white: &Tensor,
    black: &Tensor,
    stm: &Tensor,
    white_values: Option<&Tensor>,
    black_values: Option<&Tensor>,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<Tensor> {
    let batch = Features::new(
        &[(white, white_values), (black, black_values)],
        Some(stm),
        weight,
        bias,
    )?;
    apply(batch, weight, bias)
}

/// Checks that every active index of `indices` (those before each row's first -1) lies in
/// `0..num_inputs`, with an error naming the first bad one. On CUDA it also reports a bad index
/// that an earlier [`sparse_linear`] call skipped. It reads the indices on the host: one
/// synchronisation, meant for data-loading checks and tests rather than every step.
pub fn check_sparse_indices(indices: &Tensor, num_inputs: usize) -> Result<()> {
    check_indices_tensor(indices, "indices")?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = indices.device() {
        cuda::take_pending_error(dev)?;
    }
    let (batch, max_active) = indices.dims2()?;
    let host = indices.to_device(&Device::Cpu)?.contiguous()?;
    let flat = host.flatten_all()?.to_vec1::<i32>()?;
    validate_rows(&flat, batch, max_active, num_inputs)
}

/// The gradients [`sparse_linear`]'s autograd produces for an output gradient `grad_out`
/// (`[batch, out]`): `(grad_weight [num_inputs, out], grad_bias [out])` in the accumulator dtype
/// (f32; f64 for f64), for the bench and for training loops without autograd.
#[doc(hidden)]
pub fn sparse_linear_backward(
    indices: &Tensor,
    values: Option<&Tensor>,
    grad_out: &Tensor,
    num_inputs: usize,
) -> Result<(Tensor, Tensor)> {
    let out = grad_out.dim(1)?;
    let shape_only = Tensor::zeros((num_inputs, 1), grad_out.dtype(), grad_out.device())?
        .broadcast_as((num_inputs, out))?;
    let bias_like = Tensor::zeros(1, grad_out.dtype(), grad_out.device())?.broadcast_as(out)?;
    let batch = Features::new(&[(indices, values)], None, &shape_only, &bias_like)?;
    let grads = grad_out.contiguous()?.apply_op1_no_bwd(&SparseLinearGrad {
        batch: Arc::new(batch),
    })?;
    Ok((grads.narrow(0, 0, num_inputs)?, grads.get(num_inputs)?))
}

/// An NNUE feature transformer layer: owns `weight` `[num_inputs, out]` and `bias` `[out]`,
/// initialised like PyTorch's `nn.Linear` (uniform in `±sqrt(1 / num_inputs)`), created through a
/// [`candle_nn::VarBuilder`] so any candle optimizer trains them.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let ft = candle_fastops::FeatureTransformer::new(40960, 256, vb.pp("ft"))?;
/// let white = Tensor::new(&[[5i32, 700, 40000, -1]], &Device::Cpu)?;
/// let black = Tensor::new(&[[9i32, 12, -1, -1]], &Device::Cpu)?;
/// let stm = Tensor::new(&[1f32], &Device::Cpu)?;
/// let hidden = ft.forward_pair(&white, &black, &stm, None, None)?; // [1, 512]
/// assert_eq!(hidden.dims(), [1, 512]);
/// assert_eq!(varmap.all_vars().len(), 2); // ft.weight and ft.bias, ready for an optimizer
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct FeatureTransformer {
    weight: Tensor,
    bias: Tensor,
}

impl FeatureTransformer {
    /// Creates (or loads) `weight` and `bias` under `vb`, in `vb`'s dtype and device.
    pub fn new(num_inputs: usize, out: usize, vb: candle_nn::VarBuilder) -> Result<Self> {
        let bound = (1.0 / num_inputs.max(1) as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let weight = vb.get_with_hints((num_inputs, out), "weight", init)?;
        let bias = vb.get_with_hints(out, "bias", init)?;
        Ok(Self { weight, bias })
    }

    /// A layer over existing tensors (checked on first use).
    pub fn from_tensors(weight: Tensor, bias: Tensor) -> Self {
        Self { weight, bias }
    }

    /// `[num_inputs, out]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `[out]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// [`sparse_linear`] with this layer's parameters.
    pub fn forward(&self, indices: &Tensor, values: Option<&Tensor>) -> Result<Tensor> {
        sparse_linear(indices, values, &self.weight, &self.bias)
    }

    /// [`sparse_linear_pair`] with this layer's parameters: `[batch, 2 * out]`, the side to
    /// move's half first.
    pub fn forward_pair(
        &self,
        white: &Tensor,
        black: &Tensor,
        stm: &Tensor,
        white_values: Option<&Tensor>,
        black_values: Option<&Tensor>,
    ) -> Result<Tensor> {
        sparse_linear_pair(
            white,
            black,
            stm,
            white_values,
            black_values,
            &self.weight,
            &self.bias,
        )
    }
}

fn apply(batch: Features, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    // A row-strided weight (a column narrow) is read in place; other layouts are copied.
    let weight = if weight_row_stride(weight.layout()).is_some() {
        weight.clone()
    } else {
        weight.contiguous()?
    };
    weight.apply_op2(
        &bias.contiguous()?,
        SparseLinear {
            batch: Arc::new(batch),
        },
    )
}

/// The feature tensors of a call (one perspective, or two sharing the weights), contiguous and
/// checked.
#[derive(Debug)]
struct Features {
    sides: Vec<Side>,
    /// `[batch]` u8, nonzero: perspective 0 fills the first half of the row.
    side_first: Option<Tensor>,
    batch: usize,
    max_active: usize,
    num_inputs: usize,
    out: usize,
}

#[derive(Debug)]
struct Side {
    indices: Tensor,
    values: Option<Tensor>,
}

fn check_indices_tensor(indices: &Tensor, what: &str) -> Result<()> {
    if indices.dtype() != DType::I32 {
        bail!(
            "{OP}: {what} must be i32, got {:?} (convert with .to_dtype(DType::I32))",
            indices.dtype()
        );
    }
    if indices.rank() != 2 {
        bail!(
            "{OP}: {what} must be [batch, max_active], got shape {:?}",
            indices.dims()
        );
    }
    Ok(())
}

fn same_device(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if !a.device().same_device(b.device()) {
        bail!(
            "{OP}: device mismatch, weight is on {:?} but {what} is on {:?}",
            a.device().location(),
            b.device().location()
        );
    }
    Ok(())
}

impl Features {
    fn new(
        sides: &[(&Tensor, Option<&Tensor>)],
        stm: Option<&Tensor>,
        weight: &Tensor,
        bias: &Tensor,
    ) -> Result<Self> {
        let (num_inputs, out) = match weight.dims() {
            &[n, o] => (n, o),
            dims => bail!("{OP}: weight must be [num_inputs, out], got shape {dims:?}"),
        };
        if bias.dims() != [out] {
            bail!(
                "{OP}: bias must be [{out}] to match weight {:?}, got shape {:?}",
                weight.dims(),
                bias.dims()
            );
        }
        if !matches!(
            weight.dtype(),
            DType::F32 | DType::F16 | DType::BF16 | DType::F64
        ) {
            bail!(
                "{OP}: weight must be f32, f16 or bf16 (f64 on the CPU), got {:?}",
                weight.dtype()
            );
        }
        if weight.device().is_cuda() && weight.dtype() == DType::F64 {
            bail!("{OP}: f64 weights are supported on the CPU only");
        }
        if bias.dtype() != weight.dtype() {
            bail!(
                "{OP}: dtype mismatch, weight is {:?} but bias is {:?}",
                weight.dtype(),
                bias.dtype()
            );
        }
        same_device(weight, bias, "bias")?;
        let names = [("white", "white_values"), ("black", "black_values")];
        let names = if sides.len() == 1 {
            &[("indices", "values")][..]
        } else {
            &names[..]
        };
        let (batch, max_active) = sides[0].0.dims2().unwrap_or((0, 0));
        let mut checked = Vec::with_capacity(sides.len());
        for (&(indices, values), &(name, value_name)) in sides.iter().zip(names) {
            check_indices_tensor(indices, name)?;
            if indices.dims() != [batch, max_active] {
                bail!(
                    "{OP}: {name} has shape {:?} but {} has {:?}",
                    indices.dims(),
                    names[0].0,
                    [batch, max_active]
                );
            }
            same_device(weight, indices, name)?;
            let values = match values {
                None => None,
                Some(values) => {
                    if values.dtype() != DType::F32 {
                        bail!("{OP}: {value_name} must be f32, got {:?}", values.dtype());
                    }
                    if values.dims() != indices.dims() {
                        bail!(
                            "{OP}: {value_name} must have the shape of {name} {:?}, got {:?}",
                            indices.dims(),
                            values.dims()
                        );
                    }
                    same_device(weight, values, value_name)?;
                    Some(values.contiguous()?)
                }
            };
            checked.push(Side {
                indices: indices.contiguous()?,
                values,
            });
        }
        let side_first = match stm {
            None => None,
            Some(stm) => {
                if stm.elem_count() != batch || !matches!(stm.rank(), 1 | 2) {
                    bail!(
                        "{OP}: stm must be [batch] or [batch, 1] with batch {batch}, got shape {:?}",
                        stm.dims()
                    );
                }
                same_device(weight, stm, "stm")?;
                let stm = stm.flatten_all()?;
                Some(stm.ne(&stm.zeros_like()?)?.contiguous()?)
            }
        };
        Ok(Self {
            sides: checked,
            side_first,
            batch,
            max_active,
            num_inputs,
            out,
        })
    }

    fn perspectives(&self) -> usize {
        self.sides.len()
    }
}

/// Checks the active indices of `batch` rows of `max_active` (each row up to its first -1).
fn validate_rows(
    indices: &[i32],
    batch: usize,
    max_active: usize,
    num_inputs: usize,
) -> Result<()> {
    if max_active == 0 {
        return Ok(());
    }
    let bad = indices
        .par_chunks(max_active)
        .take(batch)
        .enumerate()
        .find_map_first(|(row, slots)| {
            slots
                .iter()
                .take_while(|&&i| i != -1)
                .position(|&i| i < -1 || i as i64 >= num_inputs as i64)
                .map(|k| (row, k, slots[k]))
        });
    match bad {
        None => Ok(()),
        Some((row, k, index)) => bail!(
            "{OP}: index {index} at [{row}, {k}] is out of range (expected -1 or 0..{num_inputs})"
        ),
    }
}

/// The row stride of a weight whose rows are contiguous (a contiguous tensor, or a column
/// `narrow` of one), `None` for other layouts.
fn weight_row_stride(layout: &Layout) -> Option<usize> {
    match (layout.dims(), layout.stride()) {
        (&[_, cols], &[row_stride, col_stride]) if col_stride == 1 || cols <= 1 => {
            Some(row_stride.max(cols))
        }
        _ => None,
    }
}

struct SparseLinear {
    batch: Arc<Features>,
}

impl CustomOp2 for SparseLinear {
    fn name(&self) -> &'static str {
        "fastops-sparse-linear"
    }

    fn cpu_fwd(
        &self,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let f = &self.batch;
        let locks = cpu::lock(f)?;
        let sides = locks.sides()?;
        for side in &sides.indices {
            validate_rows(side, f.batch, f.max_active, f.num_inputs)?;
        }
        let stride = weight_row_stride(weight_layout).ok_or_else(|| {
            candle_core::Error::Msg(format!("{OP}: internal error, weight layout"))
        })?;
        let bias_start = bias_layout.start_offset();
        let out = with_float_cpu!(OP, weight, |weight| {
            let weight = &weight[weight_layout.start_offset()..];
            let bias = &bias.as_slice()?[bias_start..bias_start + f.out];
            WithDType::to_cpu_storage_owned(cpu::forward(f, &sides, weight, stride, bias))
        });
        Ok((out, Shape::from((f.batch, f.perspectives() * f.out))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        weight: &candle_core::CudaStorage,
        weight_layout: &Layout,
        bias: &candle_core::CudaStorage,
        bias_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let f = &self.batch;
        let dev = &weight.device;
        cuda::take_pending_error(dev)?;
        let stride = weight_row_stride(weight_layout).ok_or_else(|| {
            candle_core::Error::Msg(format!("{OP}: internal error, weight layout"))
        })?;
        let len = f.batch * f.perspectives() * f.out;
        let out = crate::dispatch::with_float_cuda!(OP, &weight.slice, |w| {
            let out = crate::cuda::alloc_output(dev, len)?;
            let w_view = w.slice(weight_layout.start_offset()..);
            let b = bias.as_cuda_slice()?;
            let b_view = b.slice(bias_layout.start_offset()..bias_layout.start_offset() + f.out);
            cuda::forward(
                dev,
                f,
                &w_view,
                weight_layout.start_offset(),
                stride,
                &b_view,
                bias_layout.start_offset(),
                &out,
            )?;
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, Shape::from((f.batch, f.perspectives() * f.out))))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let f = &self.batch;
        // One buffer for both gradients: rows 0..num_inputs the weight's, the last row the bias's.
        let grads = grad_res.contiguous()?.apply_op1_no_bwd(&SparseLinearGrad {
            batch: self.batch.clone(),
        })?;
        let grad_weight = grads.narrow(0, 0, f.num_inputs)?.to_dtype(weight.dtype())?;
        let grad_bias = grads.get(f.num_inputs)?.to_dtype(weight.dtype())?;
        Ok((Some(grad_weight), Some(grad_bias)))
    }
}

/// The backward pass of [`SparseLinear`] from the gradient of its output: a
/// `[num_inputs + 1, out]` tensor (f32; f64 for f64) holding the weight gradient and, in its last
/// row, the bias gradient.
struct SparseLinearGrad {
    batch: Arc<Features>,
}

impl CustomOp1 for SparseLinearGrad {
    fn name(&self) -> &'static str {
        "fastops-sparse-linear-grad"
    }

    fn cpu_fwd(&self, grad: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let f = &self.batch;
        let locks = cpu::lock(f)?;
        let sides = locks.sides()?;
        let start = layout.start_offset();
        let len = layout.shape().elem_count();
        let out = with_float_cpu!(OP, grad, |grad| {
            let grad = &grad[start..start + len];
            accumulator_storage(cpu::backward(f, &sides, grad))
        });
        Ok((out, Shape::from((f.num_inputs + 1, f.out))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        grad: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let f = &self.batch;
        let dev = &grad.device;
        let start = layout.start_offset();
        let len = layout.shape().elem_count();
        let out = dev.alloc_zeros::<f32>((f.num_inputs + 1) * f.out)?;
        let deterministic = crate::deterministic();
        crate::dispatch::with_float_cuda!(OP, &grad.slice, |g| {
            let g = g.slice(start..start + len);
            if deterministic {
                cuda::backward_sorted(dev, f, &g, start, &out)?
            } else {
                cuda::backward(dev, f, &g, start, &out)?
            }
        });
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((f.num_inputs + 1, f.out)),
        ))
    }
}

/// Wraps a gradient accumulated in a float's accumulator type (f32 or f64) as CPU storage.
fn accumulator_storage<A: 'static>(grad: Vec<A>) -> CpuStorage {
    let any: Box<dyn std::any::Any> = Box::new(grad);
    match any.downcast::<Vec<f64>>() {
        Ok(v) => CpuStorage::F64(*v),
        Err(any) => match any.downcast::<Vec<f32>>() {
            Ok(v) => CpuStorage::F32(*v),
            Err(_) => unreachable!("accumulators are f32 or f64"),
        },
    }
}

mod cpu {
    use super::*;
    use candle_core::StorageRef;

    /// Read locks on a call's feature tensors, held while the op borrows their data.
    pub(super) struct Locks<'a> {
        indices: Vec<(StorageRef<'a>, &'a Layout)>,
        values: Vec<Option<(StorageRef<'a>, &'a Layout)>>,
        side_first: Option<(StorageRef<'a>, &'a Layout)>,
    }

    /// The feature data of a call as slices.
    pub(super) struct Sides<'a> {
        pub(super) indices: Vec<&'a [i32]>,
        values: Vec<Option<&'a [f32]>>,
        side_first: Option<&'a [u8]>,
    }

    pub(super) fn lock(f: &Features) -> Result<Locks<'_>> {
        Ok(Locks {
            indices: f
                .sides
                .iter()
                .map(|s| s.indices.storage_and_layout())
                .collect(),
            values: f
                .sides
                .iter()
                .map(|s| s.values.as_ref().map(|v| v.storage_and_layout()))
                .collect(),
            side_first: f.side_first.as_ref().map(|t| t.storage_and_layout()),
        })
    }

    fn slice<'a, T: WithDType>(lock: &'a (StorageRef<'_>, &Layout)) -> Result<&'a [T]> {
        crate::cpu::locked_slice(lock, OP)
    }

    impl Locks<'_> {
        pub(super) fn sides(&self) -> Result<Sides<'_>> {
            Ok(Sides {
                indices: self
                    .indices
                    .iter()
                    .map(slice::<i32>)
                    .collect::<Result<_>>()?,
                values: self
                    .values
                    .iter()
                    .map(|v| v.as_ref().map(slice::<f32>).transpose())
                    .collect::<Result<_>>()?,
                side_first: self.side_first.as_ref().map(slice::<u8>).transpose()?,
            })
        }
    }

    impl Sides<'_> {
        /// The half of the output row that perspective `p` of position `b` fills.
        fn half(&self, b: usize, p: usize) -> usize {
            match self.side_first {
                Some(first) if first[b] == 0 => 1 - p,
                _ => p,
            }
        }

        /// The active (index, value) pairs of perspective `p` of position `b`.
        fn features(
            &self,
            b: usize,
            p: usize,
            max_active: usize,
        ) -> impl Iterator<Item = (usize, f32)> + '_ {
            let row = b * max_active..(b + 1) * max_active;
            let values = self.values[p].map(|v| &v[row.clone()]);
            self.indices[p][row]
                .iter()
                .take_while(|&&i| i != -1)
                .enumerate()
                .map(move |(k, &i)| (i as usize, values.map_or(1.0, |v| v[k])))
        }
    }

    pub(super) fn forward<T: CpuFloat>(
        f: &Features,
        sides: &Sides,
        weight: &[T],
        weight_stride: usize,
        bias: &[T],
    ) -> Vec<T> {
        let (n_out, row_len) = (f.out, f.perspectives() * f.out);
        let len = f.batch * row_len;
        let mut out = output_vec(len);
        if len > 0 {
            spare(&mut out, len)
                .par_chunks_mut(row_len)
                .with_min_len(16)
                .enumerate()
                .for_each_init(
                    || vec![T::Acc::zero(); n_out],
                    |acc, (b, dst)| {
                        for p in 0..f.perspectives() {
                            for (a, &bias) in acc.iter_mut().zip(bias) {
                                *a = bias.to_acc();
                            }
                            for (index, value) in sides.features(b, p, f.max_active) {
                                let value: T::Acc = acc_of(value);
                                let row = &weight[index * weight_stride..][..n_out];
                                for (a, &w) in acc.iter_mut().zip(row) {
                                    *a = *a + value * w.to_acc();
                                }
                            }
                            let half = sides.half(b, p);
                            for (d, &a) in dst[half * n_out..][..n_out].iter_mut().zip(acc.iter()) {
                                d.write(T::from_acc(a));
                            }
                        }
                    },
                );
        }
        // SAFETY: every row of `len` elements was written above (both halves of each row).
        unsafe { out.set_len(len) };
        out
    }

    /// A feature value in the accumulator type (f32 or f64: never fails).
    fn acc_of<A: NumCast + Zero>(v: f32) -> A {
        A::from(v).unwrap_or_else(A::zero)
    }

    /// Weight rows handed to one rayon task in the backward pass.
    const ROWS_PER_TASK_MIN: usize = 64;

    pub(super) fn backward<T: CpuFloat>(f: &Features, sides: &Sides, grad: &[T]) -> Vec<T::Acc> {
        let (n_out, row_len) = (f.out, f.perspectives() * f.out);
        let mut out = vec![T::Acc::zero(); (f.num_inputs + 1) * n_out];
        if n_out == 0 {
            return out;
        }
        let (grad_weight, grad_bias) = out.split_at_mut(f.num_inputs * n_out);
        let rows_per_task = f
            .num_inputs
            .div_ceil(4 * rayon::current_num_threads())
            .max(ROWS_PER_TASK_MIN);
        rayon::join(
            || {
                // Each task owns a range of weight rows and scans every feature for them: no two
                // tasks write one element, and each element's sum runs in batch order.
                grad_weight
                    .par_chunks_mut(rows_per_task * n_out)
                    .enumerate()
                    .for_each(|(task, rows)| {
                        let first = task * rows_per_task;
                        let owned = first..first + rows.len() / n_out;
                        for b in 0..f.batch {
                            for p in 0..f.perspectives() {
                                let g = &grad[b * row_len + sides.half(b, p) * n_out..][..n_out];
                                for (index, value) in sides.features(b, p, f.max_active) {
                                    if owned.contains(&index) {
                                        let value: T::Acc = acc_of(value);
                                        let row = &mut rows[(index - first) * n_out..][..n_out];
                                        for (r, &g) in row.iter_mut().zip(g) {
                                            *r = *r + value * g.to_acc();
                                        }
                                    }
                                }
                            }
                        }
                    })
            },
            || {
                grad_bias
                    .par_chunks_mut(64)
                    .enumerate()
                    .for_each(|(chunk, sums)| {
                        let first = chunk * 64;
                        for row in grad.chunks(n_out) {
                            for (s, &g) in sums.iter_mut().zip(&row[first..]) {
                                *s = *s + g.to_acc();
                            }
                        }
                    })
            },
        );
        out
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Features, OP};
    use crate::cuda::{grid_stride_config, l2_bytes, sm_count, tuning, ErrorFlag, Kernel, Module};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::kernel_name;
    use candle_core::{bail, CudaDevice, Result, Storage, StorageRef, WithDType};

    /// Mirrors `SparseShape` in `src/cuda/sparse_linear.cu`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    struct SparseShape {
        error_flag: u64,
        batch: u64,
        num_inputs: u64,
        out_dim: u64,
        index_stride: u64,
        weight_stride: u64,
        stripe_begin: u64,
        stripe_end: u64,
        max_active: u32,
        perspectives: u32,
    }

    // SAFETY: plain data with the C layout the kernels expect.
    unsafe impl DeviceRepr for SparseShape {}

    const THREADS: u32 = 256;
    const WARPS_PER_BLOCK: u64 = (THREADS / 32) as u64;

    /// Reports (and clears) a bad index that a finished kernel on `dev` skipped.
    pub(super) fn take_pending_error(dev: &CudaDevice) -> Result<()> {
        if let Some(flag) = ErrorFlag::of(dev)? {
            if flag.take() {
                bail!(
                    "{OP}: an earlier call on this device was given an index outside [-1, num_inputs); \
                     it was skipped (nothing outside the weight was read). \
                     Use check_sparse_indices to find it"
                );
            }
        }
        Ok(())
    }

    /// How a kernel is launched: its variant, the width of its column stripes, and how many
    /// stripes one launch covers.
    struct StripePlan {
        variant: &'static str,
        stripes: usize,
        stripes_per_launch: usize,
        blocks_per_sm: u32,
    }

    impl StripePlan {
        /// `elem` is the size of the matrix the stripes cut (weight forward, f32 gradient
        /// backward), `group` its columns per 16-byte (vector) or 4-byte (scalar) access and
        /// `loads` the 16-byte accesses per lane and row (1 or 2; the H200 sweeps in
        /// BENCHMARKS.md favour 1 for f32, 2 for 2-byte weights). A launch covers as many stripes
        /// as fit in the L2 with all their rows (an L2 prefetch of the next stripe, tried,
        /// gained nothing measurable).
        fn new(
            dev: &CudaDevice,
            f: &Features,
            (vec, group, elem): (bool, usize, usize),
            loads: u32,
            blocks_per_sm: u32,
        ) -> Result<Self> {
            let loads = tuning("FASTOPS_SPARSE_LOADS").unwrap_or(loads).clamp(1, 2) as usize;
            let (variant, stripe_cols) = match (vec, loads) {
                (false, _) => ("scalar", 32 * 4),
                (true, 1) => ("vec1", 32 * group),
                (true, _) => ("vec2", 64 * group),
            };
            let stripes = f.out.div_ceil(stripe_cols);
            let budget = match tuning("FASTOPS_SPARSE_L2_BUDGET_MB") {
                Some(0) => usize::MAX,
                Some(mb) => (mb as usize) << 20,
                None => l2_bytes(dev)?,
            };
            let stripe_bytes = f.num_inputs.max(1).saturating_mul(stripe_cols * elem);
            let stripes_per_launch = (budget / stripe_bytes).clamp(1, stripes.max(1));
            Ok(Self {
                variant,
                stripes,
                stripes_per_launch,
                blocks_per_sm: tuning("FASTOPS_SPARSE_BLOCKS_PER_SM").unwrap_or(blocks_per_sm),
            })
        }

        fn config(&self, dev: &CudaDevice, tasks: u64) -> Result<LaunchConfig> {
            let wanted = tasks.div_ceil(WARPS_PER_BLOCK).max(1);
            let cap = sm_count(dev)? as u64 * self.blocks_per_sm.max(1) as u64;
            Ok(LaunchConfig {
                grid_dim: (wanted.min(cap) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }

        /// `[begin, end)` of each launch's stripes.
        fn launches(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
            (0..self.stripes).step_by(self.stripes_per_launch).map(|b| {
                (
                    b as u64,
                    (b + self.stripes_per_launch).min(self.stripes) as u64,
                )
            })
        }
    }

    /// Device views of a call's feature tensors, borrowed for one launch.
    struct FeatureViews<'a> {
        locks: Vec<Option<StorageRef<'a>>>,
        starts: Vec<usize>,
    }

    impl<'a> FeatureViews<'a> {
        fn new(f: &'a Features) -> Self {
            let mut tensors: Vec<Option<&candle_core::Tensor>> = Vec::with_capacity(5);
            for p in 0..2 {
                tensors.push(f.sides.get(p).map(|s| &s.indices));
            }
            for p in 0..2 {
                tensors.push(f.sides.get(p).and_then(|s| s.values.as_ref()));
            }
            tensors.push(f.side_first.as_ref());
            let mut locks = Vec::with_capacity(5);
            let mut starts = Vec::with_capacity(5);
            for t in tensors {
                match t {
                    Some(t) => {
                        let (storage, layout) = t.storage_and_layout();
                        starts.push(layout.start_offset());
                        locks.push(Some(storage));
                    }
                    None => {
                        starts.push(0);
                        locks.push(None);
                    }
                }
            }
            Self { locks, starts }
        }

        fn view<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
            &self,
            slot: usize,
        ) -> Result<Option<CudaView<'_, T>>> {
            match &self.locks[slot] {
                None => Ok(None),
                Some(storage) => match &**storage {
                    Storage::Cuda(s) => {
                        Ok(Some(s.as_cuda_slice::<T>()?.slice(self.starts[slot]..)))
                    }
                    _ => bail!("{OP}: internal error, a feature tensor is not on the GPU"),
                },
            }
        }
    }

    /// The feature tensors as kernel arguments (absent ones as null pointers).
    struct FeatureArgs<'a> {
        indices: [Option<CudaView<'a, i32>>; 2],
        values: [Option<CudaView<'a, f32>>; 2],
        side_first: Option<CudaView<'a, u8>>,
        null: u64,
    }

    impl<'a> FeatureArgs<'a> {
        fn new(views: &'a FeatureViews<'_>) -> Result<Self> {
            Ok(Self {
                indices: [views.view::<i32>(0)?, views.view::<i32>(1)?],
                values: [views.view::<f32>(2)?, views.view::<f32>(3)?],
                side_first: views.view::<u8>(4)?,
                null: 0,
            })
        }

        /// Pushes the arguments shared by both kernels: shape, idx0, idx1, val0, val1, stm.
        fn push<'s>(&'s self, args: &mut LaunchArgs<'s>, shape: &'s SparseShape) {
            args.arg(shape);
            for view in &self.indices {
                match view {
                    Some(v) => args.arg(v),
                    None => args.arg(&self.null),
                };
            }
            for view in &self.values {
                match view {
                    Some(v) => args.arg(v),
                    None => args.arg(&self.null),
                };
            }
            match &self.side_first {
                Some(v) => args.arg(v),
                None => args.arg(&self.null),
            };
        }
    }

    fn shape(
        dev: &CudaDevice,
        f: &Features,
        weight_stride: usize,
        stripe_begin: u64,
        stripe_end: u64,
    ) -> Result<SparseShape> {
        let error_flag = ErrorFlag::of(dev)?.map_or(0, |flag| flag.device_ptr());
        Ok(SparseShape {
            error_flag,
            batch: f.batch as u64,
            num_inputs: f.num_inputs as u64,
            out_dim: f.out as u64,
            index_stride: f.max_active as u64,
            weight_stride: weight_stride as u64,
            stripe_begin,
            stripe_end,
            max_active: u32::try_from(f.max_active)
                .map_err(|_| candle_core::Error::Msg(format!("{OP}: max_active too large")))?,
            perspectives: f.sides.len() as u32,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward<T: WithDType + DeviceRepr>(
        dev: &CudaDevice,
        f: &Features,
        weight: &CudaView<'_, T>,
        weight_start: usize,
        weight_stride: usize,
        bias: &CudaView<'_, T>,
        bias_start: usize,
        out: &CudaSlice<T>,
    ) -> Result<()> {
        let tasks = (f.batch * f.sides.len()) as u64;
        if tasks == 0 || f.out == 0 {
            return Ok(());
        }
        let elem = std::mem::size_of::<T>();
        let width = 16 / elem;
        let vec = [f.out, weight_stride, weight_start, bias_start]
            .iter()
            .all(|&n| n % width == 0);
        // 72-96 registers per thread leave room for 2-3 blocks of 256 per SM; the sweeps
        // measured 3 best for f32 (one load per lane), 2 for 2-byte weights (two loads).
        let (loads, blocks) = if elem == 4 { (1, 3) } else { (2, 2) };
        let plan = StripePlan::new(dev, f, (vec, width, elem), loads, blocks)?;
        let name = kernel_name::<T>(&format!("sparse_linear_fwd_{}", plan.variant));
        let kernel = Kernel::load(dev, Module::SparseLinear, &name)?;
        let cfg = plan.config(dev, tasks)?;
        let views = FeatureViews::new(f);
        let features = FeatureArgs::new(&views)?;
        for (begin, end) in plan.launches() {
            let shape = shape(dev, f, weight_stride, begin, end)?;
            // SAFETY: the arguments match `sparse_linear_fwd_*(shape, idx0, idx1, val0, val1,
            // side_first, weight, bias, out)`. Index rows hold max_active entries for batch
            // rows, weight rows are read only at indices checked against num_inputs, with
            // weight_stride and out columns inside the views, and out holds batch x perspectives
            // x out elements.
            unsafe {
                kernel.launch(cfg, |args| {
                    features.push(args, &shape);
                    args.arg(weight).arg(bias).arg(out);
                })?;
            }
        }
        Ok(())
    }

    pub(super) fn backward<T: WithDType + DeviceRepr>(
        dev: &CudaDevice,
        f: &Features,
        grad_out: &CudaView<'_, T>,
        grad_start: usize,
        grad: &CudaSlice<f32>,
    ) -> Result<()> {
        let tasks = (f.batch * f.sides.len()) as u64;
        if tasks == 0 || f.out == 0 {
            return Ok(());
        }
        let vec = f.out.is_multiple_of(4) && grad_start.is_multiple_of(4);
        let plan = StripePlan::new(dev, f, (vec, 4, 4), 1, 4)?;
        let name = kernel_name::<T>(&format!("sparse_linear_bwd_{}", plan.variant));
        let kernel = Kernel::load(dev, Module::SparseLinear, &name)?;
        let cfg = plan.config(dev, tasks)?;
        let views = FeatureViews::new(f);
        let features = FeatureArgs::new(&views)?;
        for (begin, end) in plan.launches() {
            let shape = shape(dev, f, f.out, begin, end)?;
            // SAFETY: the arguments match `sparse_linear_bwd_*(shape, idx0, idx1, val0, val1,
            // side_first, grad_out, grad)`; grad_out holds batch x perspectives x out elements
            // and grad (num_inputs + 1) x out, written only at rows checked against num_inputs.
            unsafe {
                kernel.launch(cfg, |args| {
                    features.push(args, &shape);
                    args.arg(grad_out).arg(grad);
                })?;
            }
        }
        Ok(())
    }

    /// Entries per piece of a feature's sorted run in the deterministic backward: short enough
    /// to spread a frequent feature over many warps, long enough to amortise a piece.
    const PIECE: usize = 32;
    const NO_SCRATCH: u32 = u32::MAX;

    /// The deterministic backward's work list, built on the host: every active (feature, output
    /// gradient row, value) sorted by feature in batch order, cut into pieces.
    #[derive(Debug, Default)]
    struct SortedEntries {
        rows: Vec<u32>,
        values: Vec<f32>,
        /// `[key, begin, end, scratch row or NO_SCRATCH]` per piece.
        pieces: Vec<u32>,
        /// `[key, first scratch row, scratch rows]` per feature with several pieces.
        groups: Vec<u32>,
        scratch_rows: usize,
    }

    fn sort_entries(dev: &CudaDevice, f: &Features, views: &FeatureViews) -> Result<SortedEntries> {
        let (perspectives, a, n) = (f.sides.len(), f.max_active, f.num_inputs);
        let grad_rows = f.batch * perspectives;
        if grad_rows
            .checked_mul(a + 1)
            .is_none_or(|total| total >= u32::MAX as usize)
        {
            bail!("{OP}: deterministic backward supports fewer than 2^32 feature slots");
        }
        let mut indices = Vec::with_capacity(perspectives);
        let mut values = Vec::with_capacity(perspectives);
        for p in 0..perspectives {
            let idx = views
                .view::<i32>(p)?
                .expect("one index tensor per perspective");
            indices.push(dev.clone_dtoh(&idx)?);
            values.push(match views.view::<f32>(2 + p)? {
                Some(v) => Some(dev.clone_dtoh(&v)?),
                None => None,
            });
        }
        let side_first = match views.view::<u8>(4)? {
            Some(v) => Some(dev.clone_dtoh(&v)?),
            None => None,
        };
        // (position, perspective, row of the output gradient) for each task, in batch order.
        let mut tasks = Vec::with_capacity(grad_rows);
        for b in 0..f.batch {
            let first = side_first.as_ref().is_none_or(|s| s[b] != 0);
            for p in 0..perspectives {
                let half = if perspectives == 2 && !first {
                    1 - p
                } else {
                    p
                };
                tasks.push((b, p, (b * perspectives + half) as u32));
            }
        }
        let active = |b: usize, p: usize| {
            let row = &indices[p][b * a..(b + 1) * a];
            row.iter()
                .take_while(|&&i| i != -1)
                .enumerate()
                .filter(|(_, &i)| i >= 0 && (i as usize) < n)
                .map(move |(k, &i)| (k, i as usize))
        };
        // Counting sort by feature; the bias is feature n, fed by every row with value 1.
        let mut counts = vec![0usize; n + 2];
        for &(b, p, _) in &tasks {
            for (_, key) in active(b, p) {
                counts[key + 1] += 1;
            }
        }
        counts[n + 1] = grad_rows;
        for key in 0..=n {
            counts[key + 1] += counts[key];
        }
        let total = counts[n + 1];
        let mut cursor = counts.clone();
        let mut sorted = SortedEntries {
            rows: vec![0; total],
            values: vec![0.0; total],
            ..Default::default()
        };
        for &(b, p, grad_row) in &tasks {
            for (k, key) in active(b, p) {
                let at = cursor[key];
                cursor[key] += 1;
                sorted.rows[at] = grad_row;
                sorted.values[at] = values[p].as_ref().map_or(1.0, |v| v[b * a + k]);
            }
            let at = cursor[n];
            cursor[n] += 1;
            sorted.rows[at] = grad_row;
            sorted.values[at] = 1.0;
        }
        for key in 0..=n {
            let (begin, end) = (counts[key], counts[key + 1]);
            let pieces = (end - begin).div_ceil(PIECE);
            if pieces == 1 {
                sorted
                    .pieces
                    .extend([key as u32, begin as u32, end as u32, NO_SCRATCH]);
            } else if pieces > 1 {
                let first = sorted.scratch_rows;
                for piece in 0..pieces {
                    let b = begin + piece * PIECE;
                    let e = (b + PIECE).min(end);
                    let slot = (first + piece) as u32;
                    sorted.pieces.extend([key as u32, b as u32, e as u32, slot]);
                }
                sorted.scratch_rows += pieces;
                sorted
                    .groups
                    .extend([key as u32, first as u32, pieces as u32]);
            }
        }
        Ok(sorted)
    }

    /// The deterministic form of [`backward`] (see [`crate::set_deterministic`]).
    pub(super) fn backward_sorted<T: WithDType + DeviceRepr>(
        dev: &CudaDevice,
        f: &Features,
        grad_out: &CudaView<'_, T>,
        grad_start: usize,
        grad: &CudaSlice<f32>,
    ) -> Result<()> {
        if f.batch * f.sides.len() == 0 || f.out == 0 {
            return Ok(());
        }
        let views = FeatureViews::new(f);
        let sorted = sort_entries(dev, f, &views)?;
        let upload_u32 = |v: &[u32]| dev.clone_htod(if v.is_empty() { &[0u32][..] } else { v });
        let rows = upload_u32(&sorted.rows)?;
        let values = dev.clone_htod(if sorted.values.is_empty() {
            &[0f32][..]
        } else {
            &sorted.values
        })?;
        let pieces = upload_u32(&sorted.pieces)?;
        let groups = upload_u32(&sorted.groups)?;
        let scratch = dev.alloc_zeros::<f32>((sorted.scratch_rows * f.out).max(1))?;
        let (num_pieces, num_groups) = (
            (sorted.pieces.len() / 4) as u64,
            (sorted.groups.len() / 3) as u64,
        );
        let out_dim = f.out as u64;
        let vec = f.out.is_multiple_of(4) && grad_start.is_multiple_of(4);
        let variant = if vec { "vec" } else { "scalar" };
        let gather = Kernel::load(
            dev,
            Module::SparseLinear,
            &kernel_name::<T>(&format!("sparse_linear_bwd_sorted_{variant}")),
        )?;
        let cfg = grid_stride_config(dev, num_pieces * 32, THREADS, 8, 0)?;
        // SAFETY: the arguments match `sparse_linear_bwd_sorted_*(pieces, num_pieces, rows,
        // values, grad_out, out_dim, grad, scratch)`; every piece's [begin, end) lies in rows and
        // values, rows index grad_out's batch x perspectives rows, keys are at most num_inputs
        // (grad has num_inputs + 1 rows) and scratch rows are below scratch_rows.
        unsafe {
            gather.launch(cfg, |args| {
                args.arg(&pieces)
                    .arg(&num_pieces)
                    .arg(&rows)
                    .arg(&values)
                    .arg(grad_out)
                    .arg(&out_dim)
                    .arg(grad)
                    .arg(&scratch);
            })?;
        }
        if num_groups > 0 {
            let combine = Kernel::load(dev, Module::SparseLinear, "sparse_linear_bwd_combine")?;
            let cfg = grid_stride_config(dev, num_groups * out_dim, THREADS, 8, 0)?;
            // SAFETY: the arguments match `sparse_linear_bwd_combine(groups, num_groups,
            // scratch, out_dim, grad)`; each group's scratch rows lie in scratch, its key in grad.
            unsafe {
                combine.launch(cfg, |args| {
                    args.arg(&groups)
                        .arg(&num_groups)
                        .arg(&scratch)
                        .arg(&out_dim)
                        .arg(grad);
                })?;
            }
        }
        Ok(())
    }
}
