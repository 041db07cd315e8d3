//! The sparse feature transformer, the input layer of NNUE evaluation networks:
//! `y[b, :] = bias + sum_k value[b, k] * weight[indices[b, k], :]` over a row's active features.
//!
//! `indices` is `[batch, max_active]` i32; a row's features end at its first `-1` and the slots
//! after it are ignored, whatever they hold. The CUDA kernels (`src/cuda/sparse_linear.cu`) give
//! one warp a (position, perspective) and a stripe of output columns held in registers; the
//! persistent grid walks the stripes in order so the weight rows in use stay in L2. The backward
//! pass goes by feature: four small kernels list each feature's (output-gradient row, value)
//! pairs on the GPU (count, scan, scatter, cut into pieces of 32), then a warp per piece sums
//! its rows' gradient stripe by stripe and writes the feature's gradient row once (features
//! with several pieces add theirs atomically); the bias is one more feature fed by every row.
//! Behind a fused clipped ReLU the backward instead adds into the weight gradient with vector
//! atomics per slot, skipping zero output gradients (reading the stored output beside each
//! gathered gradient row would cost more than the atomics save). The CPU path runs positions in parallel forward, and
//! weight-row ranges in parallel backward (each thread owns its rows: no races, deterministic).

pub use crate::activation::Activation;
use crate::cpu::CpuFloat;
use crate::dispatch::with_float_cpu;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape,
    Tensor, WithDType,
};
use candle_nn::init::Init;
use num_traits::Zero;
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
/// Bad indices make this call return an error naming the first one, on every device. On CUDA
/// the kernel never reads outside `weight` and raises a flag of this call's own, which the host
/// reads after the kernel: one stream synchronisation per call. Loops over data validated once
/// (with [`check_sparse_indices`]) can skip it with [`IndexCheck::Unchecked`] through
/// [`sparse_linear_with`] or [`FeatureTransformer::with_options`].
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
    indices: &Tensor, values: Option<&Tensor>, weight: &Tensor, bias: &Tensor,
) -> Result<Tensor> {
    let features = SparseFeatures { indices, values };
    sparse_linear_with(features, weight, bias, &SparseLinearOptions::default())
}

/// [`sparse_linear`] with per-call options (index checking, deterministic backward).
pub fn sparse_linear_with(
    features: SparseFeatures<'_>, weight: &Tensor, bias: &Tensor, options: &SparseLinearOptions,
) -> Result<Tensor> {
    let batch = Features::new(&[features], None, weight, bias, options)?;
    apply(batch, weight, bias)
}

/// One perspective's active features: `indices` `[batch, max_active]` i32 (each row ends at its
/// first -1) and optional per-feature `values` (f32, the same shape; `None` for all ones). A
/// plain `&Tensor` converts into features without values, so the values of one perspective
/// cannot be passed with the indices of the other.
#[derive(Debug, Clone, Copy)]
pub struct SparseFeatures<'a> {
    /// `[batch, max_active]` i32.
    pub indices: &'a Tensor,
    /// `[batch, max_active]` f32, or `None` for all ones.
    pub values: Option<&'a Tensor>,
}

impl<'a> SparseFeatures<'a> {
    /// Features whose values are all one.
    pub fn new(indices: &'a Tensor) -> Self {
        Self {
            indices,
            values: None,
        }
    }

    /// The same features with per-feature values.
    pub fn with_values(self, values: &'a Tensor) -> Self {
        Self {
            values: Some(values),
            ..self
        }
    }
}

impl<'a> From<&'a Tensor> for SparseFeatures<'a> {
    fn from(indices: &'a Tensor) -> Self {
        Self::new(indices)
    }
}

/// How a call treats indices outside `-1..num_inputs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IndexCheck {
    /// The call returns an error naming the first bad index, on every device (the default).
    /// On CUDA this costs one stream synchronisation per call (the host reads the kernel's
    /// per-call flag; BENCHMARKS.md gives the measured cost).
    #[default]
    AtCall,
    /// For data validated once (for example with [`check_sparse_indices`] at load time): no
    /// synchronisation. The CUDA kernels still never read outside `weight`, but a bad index
    /// then contributes nothing, silently; the CPU path still checks (it costs no sync).
    Unchecked,
}

/// The activations a [`sparse_linear_with`] call can fuse: [`Activation`] under the name this
/// layer first gave it.
pub type SparseActivation = Activation;

/// Per-call options of [`sparse_linear_with`] / [`sparse_linear_pair_with`] and
/// [`FeatureTransformer::with_options`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SparseLinearOptions {
    /// Index checking on CUDA (default [`IndexCheck::AtCall`]).
    pub index_check: IndexCheck,
    /// Whether the backward pass of this call is bit-reproducible on CUDA (features sorted on
    /// the host, one synchronisation per backward, no atomics). `None` (default) follows
    /// [`crate::set_deterministic`]. The CPU is always deterministic.
    pub deterministic: Option<bool>,
    /// An activation fused into the output (default [`Activation::Identity`]).
    pub activation: Activation,
}

/// Both perspectives of an NNUE position in one launch: `[batch, 2 * out]` whose row `b` is
/// `[transform(white[b]), transform(black[b])]` when `stm[b]` is nonzero (white to move) and
/// `[transform(black[b]), transform(white[b])]` otherwise, sharing `weight` and `bias`. This is
/// what NNUE trainers feed the next layer, without a concat or a select copy.
///
/// `white` / `black` are [`SparseFeatures`] (a plain `&Tensor` of indices, or
/// `SparseFeatures::new(&idx).with_values(&vals)`), follow [`sparse_linear`]'s rules and share a
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
/// let ys = candle_fastops::sparse_linear_pair(&white, &black, &stm, &weight, &bias)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[11., 100.], [1., 100.]]);
/// // Weighted features: the values travel with their own perspective's indices.
/// use candle_fastops::SparseFeatures;
/// let half = Tensor::new(&[[0.5f32, 0.5], [0.5, 0.5]], &dev)?;
/// let white = SparseFeatures::new(&white).with_values(&half);
/// let ys = candle_fastops::sparse_linear_pair(white, &black, &stm, &weight, &bias)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[5.5, 100.], [1., 50.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sparse_linear_pair<'a>(
    white: impl Into<SparseFeatures<'a>>, black: impl Into<SparseFeatures<'a>>, stm: &Tensor,
    weight: &Tensor, bias: &Tensor,
) -> Result<Tensor> {
    let options = SparseLinearOptions::default();
    sparse_linear_pair_with(white, black, stm, weight, bias, &options)
}

/// [`sparse_linear_pair`] with per-call options (index checking, deterministic backward).
pub fn sparse_linear_pair_with<'a>(
    white: impl Into<SparseFeatures<'a>>, black: impl Into<SparseFeatures<'a>>, stm: &Tensor,
    weight: &Tensor, bias: &Tensor, options: &SparseLinearOptions,
) -> Result<Tensor> {
    let sides = [white.into(), black.into()];
    let batch = Features::new(&sides, Some(stm), weight, bias, options)?;
    apply(batch, weight, bias)
}

/// Checks that every active index of `indices` (those before each row's first -1) lies in
/// `0..num_inputs`, with an error naming the first bad one. It reads the indices on the host:
/// one synchronisation, meant for validating data once before [`IndexCheck::Unchecked`] calls.
pub fn check_sparse_indices(indices: &Tensor, num_inputs: usize) -> Result<()> {
    check_indices_tensor(indices, "indices")?;
    let (batch, max_active) = indices.dims2()?;
    let host = indices.to_device(&Device::Cpu)?.contiguous()?;
    let flat = host.flatten_all()?.to_vec1::<i32>()?;
    validate_rows(&flat, batch, max_active, num_inputs)
}

/// The gradients [`sparse_linear`]'s autograd produces for an output gradient `grad_out`
/// (`[batch, out]`): `(grad_weight [num_inputs, out], grad_bias [out])` in the accumulator dtype
/// (f32; f64 for f64), for the bench and for training loops without autograd. Indices are not
/// checked on CUDA (bad ones contribute nothing).
#[doc(hidden)]
pub fn sparse_linear_backward(
    indices: &Tensor, values: Option<&Tensor>, grad_out: &Tensor, num_inputs: usize,
) -> Result<(Tensor, Tensor)> {
    let out = grad_out.dim(1)?;
    let shape_only = Tensor::zeros((num_inputs, 1), grad_out.dtype(), grad_out.device())?
        .broadcast_as((num_inputs, out))?;
    let bias_like = Tensor::zeros(1, grad_out.dtype(), grad_out.device())?.broadcast_as(out)?;
    let options = SparseLinearOptions {
        index_check: IndexCheck::Unchecked,
        ..Default::default()
    };
    let features = SparseFeatures { indices, values };
    let batch = Features::new(&[features], None, &shape_only, &bias_like, &options)?;
    let grads = grad_out.contiguous()?.apply_op1_no_bwd(&SparseLinearGrad {
        batch: Arc::new(batch),
        activation_output: None,
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
/// let hidden = ft.forward_pair(&white, &black, &stm)?; // [1, 512]
/// assert_eq!(hidden.dims(), [1, 512]);
/// assert_eq!(varmap.all_vars().len(), 2); // ft.weight and ft.bias, ready for an optimizer
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct FeatureTransformer {
    weight: Tensor,
    bias: Tensor,
    options: SparseLinearOptions,
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
        Ok(Self::from_tensors(weight, bias))
    }

    /// A layer over existing tensors (checked on first use).
    pub fn from_tensors(weight: Tensor, bias: Tensor) -> Self {
        Self {
            weight,
            bias,
            options: SparseLinearOptions::default(),
        }
    }

    /// The same layer calling the op with `options`, e.g. [`IndexCheck::Unchecked`] in a
    /// training loop over data validated once.
    pub fn with_options(self, options: SparseLinearOptions) -> Self {
        Self { options, ..self }
    }

    /// `[num_inputs, out]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `[out]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// [`sparse_linear`] with this layer's parameters and options.
    pub fn forward<'a>(&self, features: impl Into<SparseFeatures<'a>>) -> Result<Tensor> {
        sparse_linear_with(features.into(), &self.weight, &self.bias, &self.options)
    }

    /// [`sparse_linear_pair`] with this layer's parameters: `[batch, 2 * out]`, the side to
    /// move's half first.
    pub fn forward_pair<'a>(
        &self, white: impl Into<SparseFeatures<'a>>, black: impl Into<SparseFeatures<'a>>,
        stm: &Tensor,
    ) -> Result<Tensor> {
        let (weight, bias) = (&self.weight, &self.bias);
        sparse_linear_pair_with(white, black, stm, weight, bias, &self.options)
    }

    /// [`forward_pair`](Self::forward_pair) fed straight into a bias-free linear layer:
    /// `forward_pair(..)?.matmul(&next_weight.t()?)`, `[batch, n]` for a `next_weight` of
    /// `[n, 2 * out]` (candle_nn's `Linear` layout, e.g. `linear.weight()`), in this layer's
    /// dtype and device.
    ///
    /// The result and every gradient (this layer's weight and bias, and `next_weight`) are those
    /// of the composition, but the `[batch, 2 * out]` activations stay inside the op instead of
    /// becoming a node of candle's autograd graph: the backward computes their gradient, passes
    /// it through this layer and drops it, where candle's `backward` adds the gradient of every
    /// node into a fresh zero tensor (a fill and an add over the activations: 128 MiB each in
    /// f32 at NNUE's 16384 x 2048, about 0.2 ms a step on an H100; BENCHMARKS.md). The next
    /// layer's bias and activation follow as usual, e.g. with [`crate::bias_add_with`].
    /// `next_weight` must share this layer's dtype and device; an empty batch (or an `n` or
    /// `out` of 0) gives zeros of `[batch, n]`, which pass no gradient.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor, Var};
    /// use candle_nn::{VarBuilder, VarMap};
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let ft = candle_fastops::FeatureTransformer::new(768, 16, vb.pp("ft"))?;
    /// let l1 = candle_nn::linear(32, 8, vb.pp("l1"))?;
    /// let white = Tensor::new(&[[5i32, 70, -1]], &Device::Cpu)?;
    /// let black = Tensor::new(&[[9i32, 12, 400]], &Device::Cpu)?;
    /// let stm = Tensor::new(&[0u8], &Device::Cpu)?;
    /// let fused = ft.forward_pair_linear(&white, &black, &stm, l1.weight())?;
    /// let composed = ft.forward_pair(&white, &black, &stm)?.matmul(&l1.weight().t()?)?;
    /// let diff = (fused - composed)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-6);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_pair_linear<'a>(
        &self, white: impl Into<SparseFeatures<'a>>, black: impl Into<SparseFeatures<'a>>,
        stm: &Tensor, next_weight: &Tensor,
    ) -> Result<Tensor> {
        let sides = [white.into(), black.into()];
        let batch = Features::new(&sides, Some(stm), &self.weight, &self.bias, &self.options)?;
        self.then_linear(batch, next_weight)
    }

    /// [`forward`](Self::forward) fed straight into a bias-free linear layer, as
    /// [`forward_pair_linear`](Self::forward_pair_linear) does for both perspectives:
    /// `forward(features)?.matmul(&next_weight.t()?)` for a `next_weight` of `[n, out]`, the
    /// `[batch, out]` activations kept out of the autograd graph.
    pub fn forward_linear<'a>(
        &self, features: impl Into<SparseFeatures<'a>>, next_weight: &Tensor,
    ) -> Result<Tensor> {
        let sides = [features.into()];
        let batch = Features::new(&sides, None, &self.weight, &self.bias, &self.options)?;
        self.then_linear(batch, next_weight)
    }

    /// The layer's output for `batch` times `next_weight^T`, `next_weight` checked here.
    fn then_linear(&self, batch: Features, next_weight: &Tensor) -> Result<Tensor> {
        let (weight, bias) = (&self.weight, &self.bias);
        let width = batch.perspectives() * batch.out;
        match next_weight.dims() {
            &[_, k] if k == width => {}
            dims => bail!(
                "{OP}: next_weight must be [n, {width}] (one column per output of the layer, as \
                 candle_nn's Linear weight), got shape {dims:?}"
            ),
        }
        crate::dispatch::check_float_operands(
            OP,
            ("weight", weight),
            &[("next_weight", next_weight)],
            &[],
        )?;
        let n = next_weight.dim(0)?;
        if batch.batch == 0 || width == 0 || n == 0 {
            // An empty product, or one over no columns: zeros, with no gradient to pass.
            return Tensor::zeros((batch.batch, n), weight.dtype(), weight.device());
        }
        apply_then_linear(batch, weight, bias, next_weight)
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

/// `apply(..)?.matmul(&next.t()?)` with the activations held by the op, not by the graph.
fn apply_then_linear(
    batch: Features, weight: &Tensor, bias: &Tensor, next: &Tensor,
) -> Result<Tensor> {
    let weight = if weight_row_stride(weight.layout()).is_some() {
        weight.clone()
    } else {
        weight.contiguous()?
    };
    let bias = bias.contiguous()?;
    let batch = Arc::new(batch);
    let hidden = weight.apply_op2_no_bwd(
        &bias,
        &SparseLinear {
            batch: batch.clone(),
        },
    )?;
    weight.apply_op3(
        &bias,
        &next.contiguous()?,
        SparseLinearThenLinear { batch, hidden },
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
    /// CUDA: read the per-call bad-index flag after the forward kernel.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    check_indices: bool,
    /// CUDA: the backward sums in a fixed order (resolved from the options at the call).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    deterministic: bool,
    /// The fused clipped ReLU's ceiling (`None`: no activation).
    clip_ceiling: Option<f32>,
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
        sides: &[SparseFeatures<'_>], stm: Option<&Tensor>, weight: &Tensor, bias: &Tensor,
        options: &SparseLinearOptions,
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
        crate::dispatch::check_float_operands(OP, ("weight", weight), &[("bias", bias)], &[])?;
        let clip_ceiling = options.activation.clip_ceiling(OP)?;
        let names = [("white", "white_values"), ("black", "black_values")];
        let names = if sides.len() == 1 {
            &[("indices", "values")][..]
        } else {
            &names[..]
        };
        let (batch, max_active) = sides[0].indices.dims2().unwrap_or((0, 0));
        let mut checked = Vec::with_capacity(sides.len());
        for (side, &(name, value_name)) in sides.iter().zip(names) {
            let (indices, values) = (side.indices, side.values);
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
                if batch == 0 {
                    // candle's CUDA comparison cannot launch on an empty tensor.
                    Some(Tensor::zeros(0, DType::U8, stm.device())?)
                } else {
                    Some(stm.ne(&stm.zeros_like()?)?.contiguous()?)
                }
            }
        };
        Ok(Self {
            sides: checked,
            side_first,
            batch,
            max_active,
            num_inputs,
            out,
            check_indices: options.index_check == IndexCheck::AtCall,
            deterministic: options.deterministic.unwrap_or_else(crate::deterministic),
            clip_ceiling,
        })
    }

    fn perspectives(&self) -> usize {
        self.sides.len()
    }
}

/// Checks the active indices of `batch` rows of `max_active` (each row up to its first -1).
fn validate_rows(
    indices: &[i32], batch: usize, max_active: usize, num_inputs: usize,
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
        &self, weight: &CpuStorage, weight_layout: &Layout, bias: &CpuStorage, bias_layout: &Layout,
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
        &self, weight: &candle_core::CudaStorage, weight_layout: &Layout,
        bias: &candle_core::CudaStorage, bias_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let f = &self.batch;
        let dev = &weight.device;
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
        &self, weight: &Tensor, _bias: &Tensor, res: &Tensor, grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad_weight, grad_bias) = layer_grads(&self.batch, weight.dtype(), res, grad_res)?;
        Ok((Some(grad_weight), Some(grad_bias)))
    }
}

/// The layer's `(weight, bias)` gradients in `dtype` from its output and the output's gradient.
fn layer_grads(
    batch: &Arc<Features>, dtype: DType, output: &Tensor, grad_output: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let f = &**batch;
    // One buffer for both gradients: rows 0..num_inputs the weight's, the last row the bias's.
    let grads = grad_output
        .contiguous()?
        .apply_op1_no_bwd(&SparseLinearGrad {
            batch: batch.clone(),
            activation_output: f.clip_ceiling.map(|_| output.contiguous()).transpose()?,
        })?;
    let grad_weight = grads.narrow(0, 0, f.num_inputs)?.to_dtype(dtype)?;
    let grad_bias = grads.get(f.num_inputs)?.to_dtype(dtype)?;
    Ok((grad_weight, grad_bias))
}

/// The layer's output times `next^T` (`FeatureTransformer::forward_pair_linear`), from the
/// layer's `weight`, `bias` and `next` `[n, width]` (contiguous). `hidden` is the layer's
/// output `[batch, width]`, computed outside the graph; the forward multiplies it, the backward
/// takes the three gradients through it.
struct SparseLinearThenLinear {
    batch: Arc<Features>,
    hidden: Tensor,
}

impl SparseLinearThenLinear {
    /// `(b, m, n, k)` of the product and the layout of `next^T`.
    fn product(&self, next_layout: &Layout) -> Result<((usize, usize, usize, usize), Layout)> {
        let (m, k) = self.hidden.dims2()?;
        let n = next_layout.dims()[0];
        Ok(((1, m, n, k), next_layout.transpose(0, 1)?))
    }
}

impl CustomOp3 for SparseLinearThenLinear {
    fn name(&self) -> &'static str {
        "fastops-sparse-linear-then-linear"
    }

    fn cpu_fwd(
        &self, _weight: &CpuStorage, _weight_layout: &Layout, _bias: &CpuStorage,
        _bias_layout: &Layout, next: &CpuStorage, next_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (bmnk, next_t) = self.product(next_layout)?;
        let (hidden, hidden_layout) = self.hidden.storage_and_layout();
        let candle_core::Storage::Cpu(hidden) = &*hidden else {
            bail!("{OP}: internal error, the activations are not on the CPU");
        };
        let out = hidden.matmul(next, bmnk, hidden_layout, &next_t)?;
        Ok((out, Shape::from((bmnk.1, bmnk.2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, _weight: &candle_core::CudaStorage, _weight_layout: &Layout,
        _bias: &candle_core::CudaStorage, _bias_layout: &Layout, next: &candle_core::CudaStorage,
        next_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (bmnk, next_t) = self.product(next_layout)?;
        let (hidden, hidden_layout) = self.hidden.storage_and_layout();
        let candle_core::Storage::Cuda(hidden) = &*hidden else {
            bail!("{OP}: internal error, the activations are not on the GPU");
        };
        let out = hidden.matmul(next, bmnk, hidden_layout, &next_t)?;
        Ok((out, Shape::from((bmnk.1, bmnk.2))))
    }

    fn bwd(
        &self, weight: &Tensor, _bias: &Tensor, next: &Tensor, _res: &Tensor, grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad_hidden = grad_res.matmul(next)?;
        let (grad_weight, grad_bias) =
            layer_grads(&self.batch, weight.dtype(), &self.hidden, &grad_hidden)?;
        let grad_next = grad_res.t()?.matmul(&self.hidden)?;
        Ok((Some(grad_weight), Some(grad_bias), Some(grad_next)))
    }
}

/// The backward pass of [`SparseLinear`] from the gradient of its output: a
/// `[num_inputs + 1, out]` tensor (f32; f64 for f64) holding the weight gradient and, in its last
/// row, the bias gradient.
struct SparseLinearGrad {
    batch: Arc<Features>,
    /// The forward's output (contiguous, the gradient's shape) when a clipped ReLU is fused.
    activation_output: Option<Tensor>,
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
        let act_lock = self
            .activation_output
            .as_ref()
            .map(|t| t.storage_and_layout());
        let out = with_float_cpu!(OP, grad, |grad| {
            let grad = &grad[start..start + len];
            let grad = match (&act_lock, f.clip_ceiling) {
                (Some(lock), Some(ceiling)) => {
                    let output = crate::cpu::locked_slice(lock, OP)?;
                    std::borrow::Cow::Owned(crate::activation::through_clipped_relu(
                        grad, output, ceiling,
                    ))
                }
                _ => std::borrow::Cow::Borrowed(grad),
            };
            WithDType::to_cpu_storage_owned(cpu::backward(f, &sides, &grad))
        });
        Ok((out, Shape::from((f.num_inputs + 1, f.out))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self, grad: &candle_core::CudaStorage, layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let f = &self.batch;
        let dev = &grad.device;
        let start = layout.start_offset();
        let len = layout.shape().elem_count();
        let out = dev.alloc_zeros::<f32>((f.num_inputs + 1) * f.out)?;
        let act_lock = self
            .activation_output
            .as_ref()
            .map(|t| t.storage_and_layout());
        crate::dispatch::with_float_cuda!(OP, &grad.slice, |g| {
            let g = g.slice(start..start + len);
            let act_out = match &act_lock {
                None => None,
                Some((storage, layout)) => match &**storage {
                    candle_core::Storage::Cuda(s) => {
                        let at = layout.start_offset();
                        Some((s.as_cuda_slice()?.slice(at..at + len), at))
                    }
                    _ => bail!("{OP}: internal error, the activation output is not on the GPU"),
                },
            };
            if f.deterministic {
                cuda::backward_sorted(dev, f, &g, start, &act_out, &out)?
            } else {
                cuda::backward(dev, f, &g, start, &act_out, &out)?
            }
        });
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((f.num_inputs + 1, f.out)),
        ))
    }
}

mod cpu;

#[cfg(feature = "cuda")]
mod cuda;
