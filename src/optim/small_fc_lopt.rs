//! small_fc_lopt: an MLP learned optimizer (`AdafacMLPLOpt`). Per element it builds 39 features
//! from the gradient, the parameter, three momenta, an rms accumulator and Adafactor row/column
//! factors, normalises them per tensor, runs a 39-32-32-2 MLP and steps by
//! `direction * exp(exp_mult * magnitude) * step_mult`. The algorithm follows
//! `../shared/specs/small_fc_lopt.md` (PyLO's naive version); tests replay its golden vectors.
//!
//! CPU, per tensor: for matrices the small per-row / per-column Adafactor tensors with candle
//! ops, then two fused per-element passes (`fused.rs`, rayon) — the first updates the momenta /
//! rms (/ vector Adafactor) accumulators and sums the squared features, the second rebuilds the
//! features, runs the MLP and writes the parameter — so the `[39, n]` features never exist in
//! memory. CUDA: the same passes, plus the Adafactor reductions, as four or five kernels over
//! all tensors at once, on state kept in flat device buffers and updated in place
//! (`multi_tensor.rs`). `ParamsSmallFcLOpt::fused = false` selects the reference built from
//! candle ops only (it materialises `[28, n]` features and `[32, n]` activations).

use super::fused::{self, FusedFactors, FusedTensor};
#[cfg(feature = "cuda")]
use super::multi_tensor;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::Path;

const OPT: &str = "small_fc_lopt";
/// Features per element; the first `NORMALISED` are normalised per tensor, the rest are time
/// features.
const NUM_FEATURES: usize = 39;
const NORMALISED: usize = 28;
const HIDDEN: usize = 32;
const TIME_SCALES: [f64; 11] = [
    1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0, 100000.0,
];
const MOMENTUM_BASE: [f64; 3] = [0.9, 0.99, 0.999];
const RMS_BASE: f64 = 0.999;
const ADAFACTOR_BASE: [f64; 3] = [0.9, 0.99, 0.999];

/// The six tensors of the optimizer's MLP, named as PyLO and μLO publish them.
const WEIGHT_NAMES: [(&str, &[usize]); 6] = [
    ("network.input.weight", &[HIDDEN, NUM_FEATURES]),
    ("network.input.bias", &[HIDDEN]),
    ("network.linear_0.weight", &[HIDDEN, HIDDEN]),
    ("network.linear_0.bias", &[HIDDEN]),
    ("network.output.weight", &[2, HIDDEN]),
    ("network.output.bias", &[2]),
];

/// The learned optimizer's MLP: `39 -> 32 (relu) -> 32 (relu) -> 2`, weights in torch
/// `nn.Linear` layout `(out, in)`, f32.
#[derive(Debug, Clone)]
pub struct MlpWeights {
    /// `[32, 39]`, then `[32]`, `[32, 32]`, `[32]`, `[2, 32]`, `[2]`, in `WEIGHT_NAMES` order.
    tensors: [Tensor; 6],
}

impl MlpWeights {
    /// Reads the six tensors from a safetensors file (the published μLO / PyLO weights load
    /// unchanged) onto `device`. A missing tensor, a wrong shape or a dtype other than f32 is an
    /// error naming the tensor.
    pub fn from_safetensors(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let path = path.as_ref();
        let tensors = candle_core::safetensors::load(path, device).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{OPT}: cannot read MLP weights from {}: {e}",
                path.display()
            ))
        })?;
        Self::from_tensors(&tensors)
    }

    /// From in-memory tensors keyed by the published names (`network.input.weight`, ...).
    pub fn from_tensors(tensors: &HashMap<String, Tensor>) -> Result<Self> {
        let mut found = Vec::with_capacity(6);
        for (name, shape) in WEIGHT_NAMES {
            let Some(t) = tensors.get(name) else {
                bail!("{OPT}: MLP weights are missing tensor `{name}` (shape {shape:?})");
            };
            if t.dims() != shape {
                bail!(
                    "{OPT}: MLP tensor `{name}` has shape {:?}, expected {shape:?}",
                    t.dims()
                );
            }
            if t.dtype() != DType::F32 {
                bail!(
                    "{OPT}: MLP tensor `{name}` is {:?}, expected f32",
                    t.dtype()
                );
            }
            found.push(t.clone());
        }
        let tensors: [Tensor; 6] = found.try_into().expect("six names");
        Ok(Self { tensors })
    }

    /// From a [`VarBuilder`] (for example over a safetensors file or a `VarMap`), under the
    /// published names relative to `vb`'s prefix; converted to f32.
    pub fn from_varbuilder(vb: &VarBuilder) -> Result<Self> {
        let mut map = HashMap::new();
        for (name, shape) in WEIGHT_NAMES {
            let t = vb
                .get(shape, name)
                .map_err(|e| candle_core::Error::Msg(format!("{OPT}: MLP tensor `{name}`: {e}")))?;
            map.insert(name.to_string(), t.to_dtype(DType::F32)?);
        }
        Self::from_tensors(&map)
    }

    /// The weights on another device.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let moved: Vec<Tensor> = self
            .tensors
            .iter()
            .map(|t| t.to_device(device))
            .collect::<Result<_>>()?;
        Ok(Self {
            tensors: moved.try_into().expect("six tensors"),
        })
    }

    fn device(&self) -> &Device {
        self.tensors[0].device()
    }
}

/// What `SmallFcLOpt::step` ([`candle_nn::Optimizer::step`]) does with NaN or infinite gradient entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFiniteGrads {
    /// Use them as they are, as the reference implementation does: the tensor's per-tensor
    /// feature norms become NaN, and so does every parameter of that tensor.
    #[default]
    Propagate,
    /// Replace each non-finite entry by zero before the update.
    Zero,
    /// Leave a tensor with any non-finite gradient entry untouched this step (its state too).
    /// Costs one device-to-host read per tensor.
    SkipTensor,
}

/// Hyper-parameters of [`SmallFcLOpt`], with the published defaults from
/// [`ParamsSmallFcLOpt::new`].
#[derive(Debug, Clone)]
pub struct ParamsSmallFcLOpt {
    /// Scales every step (1.0).
    pub lr: f64,
    /// The step is `direction * exp(exp_mult * magnitude) * step_mult` (0.01).
    pub step_mult: f64,
    /// See `step_mult` (0.001).
    pub exp_mult: f64,
    /// Decoupled weight decay applied after the step: `p -= lr * weight_decay * p` (0.0).
    pub weight_decay: f64,
    /// Meta-learned offsets theta of the three momentum decays over base decays 0.9, 0.99,
    /// 0.999: `beta = 1 - (1 - base) * exp(10 * theta)`, clipped to [0, 1].
    pub momentum_offsets: [f64; 3],
    /// Offset of the rms decay over base 0.999.
    pub rms_offset: f64,
    /// Offsets of the three Adafactor decays over 0.9, 0.99, 0.999.
    pub adafactor_offsets: [f64; 3],
    /// Handling of NaN / infinite gradients.
    pub non_finite: NonFiniteGrads,
    /// `true` (default): the fused per-element passes (CPU threads or CUDA kernels), which never
    /// materialise the features. `false`: the reference built from candle ops, which stacks the
    /// `[28, n]` features and `[32, n]` activations of each tensor (for testing).
    pub fused: bool,
    /// CUDA, fused path: evaluate the MLP's two 32-wide layers on f16 tensor cores (default)
    /// instead of f32 FMAs. Every operand is split into two f16 halves and the three significant
    /// products are accumulated in f32, so the result matches f32 arithmetic closely (the
    /// golden vectors to 1e-4, see BENCHMARKS.md) at a fraction of the FMA path's time. A
    /// single f16 rounding per operand was measured at 1.2-2.5e-4 against the golden vectors,
    /// too coarse, so there is no cheaper mode. Ignored on the CPU, which always uses f32.
    pub tensor_cores: bool,
    /// The MLP.
    pub mlp: MlpWeights,
}

impl ParamsSmallFcLOpt {
    /// The published defaults with the given MLP.
    pub fn new(mlp: MlpWeights) -> Self {
        Self {
            lr: 1.0,
            step_mult: 0.01,
            exp_mult: 0.001,
            weight_decay: 0.0,
            momentum_offsets: [0.15216392, 0.14245212, 0.06812963],
            rms_offset: 0.01079706,
            adafactor_offsets: [0.18621896, -0.10864615, -0.06185547],
            non_finite: NonFiniteGrads::Propagate,
            fused: true,
            tensor_cores: true,
            mlp,
        }
    }
}

fn decay(base: f64, offset: f64) -> f64 {
    (1.0 - (1.0 - base) * (10.0 * offset).exp()).clamp(0.0, 1.0)
}

/// The Adafactor accumulators of one tensor.
#[derive(Debug, Clone)]
enum Factors {
    /// Rank >= 2: `row.get(k)` is the k-th accumulator of means over axis `d0` (the largest,
    /// kept with size 1), `col.get(k)` of means over `d1` (the second largest). The three are
    /// stacked along a leading axis so one op updates all of them.
    Matrix {
        d0: usize,
        d1: usize,
        row: Tensor,
        col: Tensor,
    },
    /// Rank 0 and 1: one accumulator per element.
    Vector { full: [Tensor; 3] },
}

#[derive(Debug, Clone)]
struct TensorState {
    var: Var,
    /// The shape the optimizer works in: the variable's, with rank 0 as `[1]`.
    shape: Vec<usize>,
    momentum: [Tensor; 3],
    rms: Tensor,
    factors: Factors,
}

/// The axes of the largest and second-largest dims (ties: the later axis counts as larger).
fn factored_axes(shape: &[usize]) -> (usize, usize) {
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&a| (shape[a], a));
    (order[shape.len() - 1], order[shape.len() - 2])
}

impl TensorState {
    fn new(var: Var) -> Result<Self> {
        let shape = if var.rank() == 0 {
            vec![1]
        } else {
            var.dims().to_vec()
        };
        let dev = var.device();
        let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev);
        let three = |shape: &[usize]| -> Result<[Tensor; 3]> {
            Ok([zeros(shape)?, zeros(shape)?, zeros(shape)?])
        };
        let factors = if shape.len() >= 2 {
            let (d0, d1) = factored_axes(&shape);
            let mut row_shape = shape.clone();
            row_shape[d0] = 1;
            let mut col_shape = shape.clone();
            col_shape[d1] = 1;
            let stacked = |shape: &[usize]| zeros(&[&[3], shape].concat());
            Factors::Matrix {
                d0,
                d1,
                row: stacked(&row_shape)?,
                col: stacked(&col_shape)?,
            }
        } else {
            Factors::Vector {
                full: three(&shape)?,
            }
        };
        Ok(Self {
            momentum: three(&shape)?,
            rms: zeros(&shape)?,
            factors,
            shape,
            var,
        })
    }
}

#[cfg(feature = "cuda")]
impl TensorState {
    /// The states of `vars` as views into one set of flat device buffers.
    fn new_flat(vars: Vec<Var>, dev: &Device) -> Result<(multi_tensor::DeviceState, Vec<Self>)> {
        let shapes: Vec<_> = vars
            .iter()
            .map(|v| {
                let shape = if v.rank() == 0 {
                    vec![1]
                } else {
                    v.dims().to_vec()
                };
                let axes = (shape.len() >= 2).then(|| factored_axes(&shape));
                (shape, axes)
            })
            .collect();
        let flat = multi_tensor::DeviceState::new(&shapes, dev)?;
        let mut states = Vec::with_capacity(vars.len());
        for ((var, (shape, axes)), slots) in vars.into_iter().zip(shapes).zip(&flat.slots) {
            let n = slots.n;
            let plane = |buf: &Tensor, at: usize| buf.narrow(0, at, n)?.reshape(shape.as_slice());
            let factors = match (&slots.kind, axes) {
                (
                    multi_tensor::SlotKind::Matrix {
                        row,
                        row_shape,
                        col,
                        col_shape,
                    },
                    Some((d0, d1)),
                ) => {
                    let stacked = |buf: &Tensor, at: usize, shape: &[usize]| {
                        let len: usize = shape.iter().product();
                        buf.narrow(0, at, 3 * len)?.reshape([&[3], shape].concat())
                    };
                    Factors::Matrix {
                        d0,
                        d1,
                        row: stacked(&flat.row, *row, row_shape)?,
                        col: stacked(&flat.col, *col, col_shape)?,
                    }
                }
                (multi_tensor::SlotKind::Vector { full }, None) => Factors::Vector {
                    full: [
                        plane(&flat.full, *full)?,
                        plane(&flat.full, full + n)?,
                        plane(&flat.full, full + 2 * n)?,
                    ],
                },
                _ => bail!("{OPT}: internal error, flat state layout does not match the tensor"),
            };
            let e = slots.elem;
            states.push(Self {
                momentum: [
                    plane(&flat.elem, e)?,
                    plane(&flat.elem, e + n)?,
                    plane(&flat.elem, e + 2 * n)?,
                ],
                rms: plane(&flat.elem, e + 3 * n)?,
                factors,
                shape,
                var,
            });
        }
        Ok((flat, states))
    }

    /// Overwrites this state's values (views into the flat buffers) with `src`'s.
    fn copy_from(&self, src: &TensorState) -> Result<()> {
        let pairs: Vec<(&Tensor, &Tensor)> = match (&self.factors, &src.factors) {
            (Factors::Matrix { row, col, .. }, Factors::Matrix { row: r, col: c, .. }) => {
                vec![(row, r), (col, c)]
            }
            (Factors::Vector { full }, Factors::Vector { full: f }) => full.iter().zip(f).collect(),
            _ => bail!("{OPT}: internal error, state kinds differ"),
        };
        let momenta = self.momentum.iter().zip(&src.momentum);
        for (dst, src) in pairs
            .into_iter()
            .chain(momenta)
            .chain(std::iter::once((&self.rms, &src.rms)))
        {
            dst.flatten_all()?
                .slice_set(&src.flatten_all()?.contiguous()?, 0, 0)?;
        }
        Ok(())
    }
}

/// The decays, resolved from the offsets once per step.
struct Decays {
    momentum: [f64; 3],
    rms: f64,
    adafactor: [f64; 3],
    /// `adafactor` and `1 - adafactor` as `[3]` f32 tensors on the optimizer's device, to update
    /// the three stacked matrix accumulators in one op.
    adafactor_tensors: (Tensor, Tensor),
}

impl Decays {
    /// As the fused passes take them.
    fn fused(&self) -> fused::Decays {
        fused::Decays {
            momentum: self.momentum.map(|d| d as f32),
            rms: self.rms as f32,
            adafactor: self.adafactor.map(|d| d as f32),
            pad: 0.0,
        }
    }
}

/// The three views of a stacked `[3, ...]` tensor.
fn unstack(t: &Tensor) -> Result<[Tensor; 3]> {
    Ok([t.get(0)?, t.get(1)?, t.get(2)?])
}

/// One tensor's accumulators after this step's gradient, and for matrices the per-row and
/// per-column Adafactor scales derived from them.
struct Accumulators {
    momentum: [Tensor; 3],
    rms: Tensor,
    factors: Factors,
    /// `(row_factor[k], col_factor[k])` for matrices (axis d0 resp. d1 kept with size 1).
    scaled: Option<([Tensor; 3], [Tensor; 3])>,
}

type Scales = ([Tensor; 3], [Tensor; 3]);

/// A matrix's new row and column accumulators from `g2 = g^2 + 1e-30`, and its row and column
/// factors (`srsqrt` of the row accumulator over its mean along d1, `srsqrt` of the column one).
fn matrix_factors(
    d0: usize,
    d1: usize,
    row: &Tensor,
    col: &Tensor,
    g2: &Tensor,
    decays: &Decays,
) -> Result<(Factors, Scales)> {
    // Each op works on the three stacked accumulators at once (axis 0), d0 and d1 move to
    // d0 + 1 and d1 + 1.
    let (beta, rest) = &decays.adafactor_tensors;
    let lead: Vec<usize> = std::iter::once(3)
        .chain(std::iter::repeat_n(1, g2.rank()))
        .collect();
    let (beta, rest) = (
        beta.reshape(lead.as_slice())?,
        rest.reshape(lead.as_slice())?,
    );
    let ema3 = |acc: &Tensor, mean: Tensor| -> Result<Tensor> {
        acc.broadcast_mul(&beta)? + mean.unsqueeze(0)?.broadcast_mul(&rest)?
    };
    let r = ema3(row, g2.mean_keepdim(d0)?)?;
    let c = ema3(col, g2.mean_keepdim(d1)?)?;
    let row_factor = srsqrt(&r.broadcast_div(&(r.mean_keepdim(d1 + 1)? + 1e-9)?)?)?;
    let col_factor = srsqrt(&c)?;
    Ok((
        Factors::Matrix {
            d0,
            d1,
            row: r,
            col: c,
        },
        (unstack(&row_factor)?, unstack(&col_factor)?),
    ))
}

impl Accumulators {
    fn update(state: &TensorState, g: &Tensor, decays: &Decays) -> Result<Self> {
        let momentum: [Tensor; 3] = [
            ema(&state.momentum[0], g, decays.momentum[0])?,
            ema(&state.momentum[1], g, decays.momentum[1])?,
            ema(&state.momentum[2], g, decays.momentum[2])?,
        ];
        let g2 = g.sqr()?;
        let rms = ema(&state.rms, &g2, decays.rms)?;
        let g2 = (g2 + 1e-30)?;
        let (factors, scaled) = match &state.factors {
            Factors::Matrix { d0, d1, row, col } => {
                let (factors, scaled) = matrix_factors(*d0, *d1, row, col, &g2, decays)?;
                (factors, Some(scaled))
            }
            Factors::Vector { full } => {
                let full: Vec<Tensor> = (0..3)
                    .map(|k| ema(&full[k], &g2, decays.adafactor[k]))
                    .collect::<Result<_>>()?;
                (
                    Factors::Vector {
                        full: full.try_into().expect("three"),
                    },
                    None,
                )
            }
        };
        Ok(Self {
            momentum,
            rms,
            factors,
            scaled,
        })
    }
}

/// The MLP as one step uses it: the first layer's bias with the 11 time features folded in,
/// and (for the fused passes) every weight packed into one buffer.
struct StepMlp {
    first_bias: Tensor,
    packed: Tensor,
}

impl StepMlp {
    fn new(mlp: &MlpWeights, time: &Tensor) -> Result<Self> {
        let [w_in, b_in, w_1, b_1, w_out, b_out] = &mlp.tensors;
        let first_bias = (w_in
            .narrow(1, NORMALISED, TIME_SCALES.len())?
            .contiguous()? // CUDA matmul takes contiguous operands only
            .matmul(time)?
            .squeeze(1)?
            + b_in)?;
        let packed = Tensor::cat(
            &[
                &w_in.narrow(1, 0, NORMALISED)?.flatten_all()?,
                &first_bias,
                &w_1.flatten_all()?,
                b_1,
                &w_out.flatten_all()?,
                b_out,
            ],
            0,
        )?;
        debug_assert_eq!(packed.elem_count(), fused::MLP_FLOATS);
        Ok(Self { first_bias, packed })
    }
}

/// small_fc_lopt as a [`candle_nn::Optimizer`]: `SmallFcLOpt::new(vars, params)`, then
/// `step(&grads)` or `backward_step(&loss)` like candle's `AdamW`.
///
/// * Variables: any rank (0-D included) and float dtype (the optimizer state is f32), all on one
///   device (CPU or CUDA). Variables without a gradient are skipped, as candle's optimizers do.
/// * State: 3 momenta and an rms accumulator per element, plus Adafactor factors (3 per row and
///   3 per column of a matrix, 3 per element of a vector); [`SmallFcLOpt::save_state`] /
///   [`SmallFcLOpt::load_state`] round-trip it with the step counter, so a run resumes exactly.
/// * Every gradient is checked (device, shape, dtype) before any variable is updated.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
/// use candle_nn::Optimizer;
/// let dev = Device::Cpu;
/// let mlp = MlpWeights::from_safetensors(
///     concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/small_fc_lopt_mlp.safetensors"),
///     &dev,
/// )?;
/// let w = Var::from_tensor(&Tensor::new(&[[1f32, -2.], [3., 0.5]], &dev)?)?;
/// let mut opt = SmallFcLOpt::new(vec![w.clone()], ParamsSmallFcLOpt::new(mlp))?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.backward_step(&loss)?;
/// assert_eq!(opt.steps_taken(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct SmallFcLOpt {
    params: ParamsSmallFcLOpt,
    states: Vec<TensorState>,
    steps: u64,
    /// CUDA with the fused path: every state in flat buffers (`states` are views into them),
    /// stepped by the multi-tensor kernels.
    #[cfg(feature = "cuda")]
    flat: Option<multi_tensor::DeviceState>,
}

impl candle_nn::Optimizer for SmallFcLOpt {
    type Config = ParamsSmallFcLOpt;

    fn new(vars: Vec<Var>, params: ParamsSmallFcLOpt) -> Result<Self> {
        let device = match vars.first() {
            Some(v) => v.device().clone(),
            None => params.mlp.device().clone(),
        };
        for (i, var) in vars.iter().enumerate() {
            if !var.dtype().is_float() {
                bail!(
                    "{OPT}: variable {i} (shape {:?}) is {:?}, not a float dtype",
                    var.dims(),
                    var.dtype()
                );
            }
            if !var.device().same_device(&device) {
                bail!(
                    "{OPT}: variables on mixed devices: variable 0 is on {:?}, variable {i} on {:?}",
                    device.location(),
                    var.device().location()
                );
            }
        }
        let params = ParamsSmallFcLOpt {
            mlp: params.mlp.to_device(&device)?,
            ..params
        };
        #[cfg(feature = "cuda")]
        if device.is_cuda() && params.fused {
            let (flat, states) = TensorState::new_flat(vars, &device)?;
            return Ok(Self {
                params,
                states,
                steps: 0,
                flat: Some(flat),
            });
        }
        let states = vars
            .into_iter()
            .map(TensorState::new)
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            states,
            steps: 0,
            #[cfg(feature = "cuda")]
            flat: None,
        })
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        // Check everything first: a bad gradient must not leave some tensors updated.
        let mut work = Vec::with_capacity(self.states.len());
        for (i, state) in self.states.iter().enumerate() {
            let Some(grad) = grads.get(&state.var) else {
                continue;
            };
            if grad.dims() != state.var.dims() {
                bail!(
                    "{OPT}: gradient of variable {i} has shape {:?}, the variable {:?}",
                    grad.dims(),
                    state.var.dims()
                );
            }
            if !grad.device().same_device(state.var.device()) {
                bail!(
                    "{OPT}: gradient of variable {i} is on {:?}, the variable on {:?}",
                    grad.device().location(),
                    state.var.device().location()
                );
            }
            if !grad.dtype().is_float() {
                bail!(
                    "{OPT}: gradient of variable {i} is {:?}, not a float dtype",
                    grad.dtype()
                );
            }
            work.push((i, grad.clone()));
        }
        let decays = Decays {
            momentum: std::array::from_fn(|k| {
                decay(MOMENTUM_BASE[k], self.params.momentum_offsets[k])
            }),
            rms: decay(RMS_BASE, self.params.rms_offset),
            adafactor: std::array::from_fn(|k| {
                decay(ADAFACTOR_BASE[k], self.params.adafactor_offsets[k])
            }),
            adafactor_tensors: {
                let dev = self.params.mlp.device();
                let betas: [f64; 3] = std::array::from_fn(|k| {
                    decay(ADAFACTOR_BASE[k], self.params.adafactor_offsets[k])
                });
                (
                    Tensor::new(&betas.map(|b| b as f32), dev)?,
                    Tensor::new(&betas.map(|b| (1.0 - b) as f32), dev)?,
                )
            },
        };
        let mlp = StepMlp::new(&self.params.mlp, &self.time_features()?)?;
        #[cfg(feature = "cuda")]
        if let Some(flat) = &self.flat {
            self.flat_step(flat, work, &decays, &mlp)?;
            self.steps += 1;
            return Ok(());
        }
        // Compute every new state and parameter, then commit them all.
        let mut updates = Vec::with_capacity(work.len());
        for (i, grad) in work {
            if let Some(update) = self.tensor_step(&self.states[i], &grad, &decays, &mlp)? {
                updates.push((i, update));
            }
        }
        for (i, (state, param)) in updates {
            let var = self.states[i].var.clone();
            var.set(&param)?;
            self.states[i] = state;
        }
        self.steps += 1;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }
}

fn srsqrt(x: &Tensor) -> Result<Tensor> {
    x.maximum(1e-9)?.sqrt()?.recip()
}

/// `max(x, 0)` that keeps NaN (as torch's relu does; candle's `relu` maps NaN to 0), so
/// non-finite gradients reach the parameters as in the reference.
fn relu_keep_nan(x: &Tensor) -> Result<Tensor> {
    (x + x.abs()?)? * 0.5
}

fn ema(acc: &Tensor, x: &Tensor, beta: f64) -> Result<Tensor> {
    (acc * beta)? + (x * (1.0 - beta))?
}

impl SmallFcLOpt {
    /// Steps taken so far (the `t` of the time features).
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsSmallFcLOpt {
        &self.params
    }

    /// `tanh(t / tau - 1)` for the 11 time scales, as a `[11, 1]` f32 column.
    fn time_features(&self) -> Result<Tensor> {
        let t = self.steps as f64;
        let values: Vec<f32> = TIME_SCALES
            .iter()
            .map(|tau| (t / tau - 1.0).tanh() as f32)
            .collect();
        Tensor::from_vec(values, (TIME_SCALES.len(), 1), self.params.mlp.device())
    }

    /// The gradient as f32 in the optimizer's shape, after the non-finite policy; `None` when
    /// the tensor is skipped this step.
    fn prepare_grad(&self, state: &TensorState, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = grad.to_dtype(DType::F32)?.reshape(state.shape.as_slice())?;
        match self.params.non_finite {
            NonFiniteGrads::Propagate => {}
            NonFiniteGrads::Zero => {
                let finite = g.abs()?.lt(f64::INFINITY)?; // false for NaN and +-inf
                g = finite.where_cond(&g, &g.zeros_like()?)?;
            }
            NonFiniteGrads::SkipTensor => {
                let worst = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                if !worst.is_finite() {
                    return Ok(None);
                }
            }
        }
        Ok(Some(g))
    }

    fn hyper(&self) -> fused::Hyper {
        fused::Hyper {
            step_mult: self.params.step_mult as f32,
            exp_mult: self.params.exp_mult as f32,
            lr: self.params.lr as f32,
            weight_decay: self.params.weight_decay as f32,
        }
    }

    /// The multi-tensor CUDA step: every tensor's state and parameter updated in place by a few
    /// launches (parameters of dtypes other than f32, or not contiguous, go through an f32 copy).
    #[cfg(feature = "cuda")]
    fn flat_step(
        &self,
        flat: &multi_tensor::DeviceState,
        work: Vec<(usize, Tensor)>,
        decays: &Decays,
        mlp: &StepMlp,
    ) -> Result<()> {
        let mut tensors: Vec<Option<(Tensor, Tensor)>> = vec![None; self.states.len()];
        let mut copied = Vec::new();
        for (i, grad) in work {
            let state = &self.states[i];
            let Some(g) = self.prepare_grad(state, &grad)? else {
                continue;
            };
            let var = state.var.as_tensor();
            let p = if var.dtype() == DType::F32 && var.is_contiguous() {
                var.flatten_all()?
            } else {
                copied.push(i);
                var.to_dtype(DType::F32)?.flatten_all()?.contiguous()?
            };
            tensors[i] = Some((g.flatten_all()?.contiguous()?, p));
        }
        flat.step(
            &tensors,
            decays.fused(),
            &mlp.packed,
            self.hyper(),
            self.params.tensor_cores,
        )?;
        for i in copied {
            if let Some((_, p)) = &tensors[i] {
                let var = &self.states[i].var;
                var.set(&p.reshape(var.dims())?.to_dtype(var.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The new state and parameter value of one tensor, or `None` when it is skipped.
    fn tensor_step(
        &self,
        state: &TensorState,
        grad: &Tensor,
        decays: &Decays,
        mlp: &StepMlp,
    ) -> Result<Option<(TensorState, Tensor)>> {
        let shape = state.shape.as_slice();
        let Some(g) = self.prepare_grad(state, grad)? else {
            return Ok(None);
        };
        let p = state.var.as_tensor().to_dtype(DType::F32)?.reshape(shape)?;
        let (new_p, acc) = if self.params.fused {
            self.fused_update(state, &g, &p, decays, mlp)?
        } else {
            let acc = Accumulators::update(state, &g, decays)?;
            (self.composed_update(shape, &g, &p, &acc, mlp)?, acc)
        };
        let new_p = new_p
            .reshape(state.var.dims())?
            .to_dtype(state.var.dtype())?;
        Ok(Some((
            TensorState {
                var: state.var.clone(),
                shape: state.shape.clone(),
                momentum: acc.momentum,
                rms: acc.rms,
                factors: acc.factors,
            },
            new_p,
        )))
    }

    /// Fused passes: feature norms, then features + MLP + update, never materialising the
    /// features.
    fn fused_update(
        &self,
        state: &TensorState,
        g: &Tensor,
        p: &Tensor,
        decays: &Decays,
        mlp: &StepMlp,
    ) -> Result<(Tensor, Accumulators)> {
        let shape = state.shape.as_slice();
        // Matrices: the small per-row / per-column tensors first (candle ops), since every
        // element's features need them.
        let (factors, scaled) = match &state.factors {
            Factors::Matrix { d0, d1, row, col } => {
                let g2 = (g.sqr()? + 1e-30)?;
                let (factors, scaled) = matrix_factors(*d0, *d1, row, col, &g2, decays)?;
                (factors, Some(scaled))
            }
            Factors::Vector { full } => (Factors::Vector { full: full.clone() }, None),
        };
        let fused_factors = |full: &[Tensor; 3]| -> Result<FusedFactors> {
            Ok(match (&factors, &scaled) {
                (Factors::Matrix { d0, d1, row, col }, Some((row_factor, col_factor))) => {
                    let stride = |d: usize| shape[d + 1..].iter().product::<usize>();
                    FusedFactors::Matrix {
                        row: unstack(row)?,
                        col: unstack(col)?,
                        row_factor: row_factor.clone(),
                        col_factor: col_factor.clone(),
                        axis0: (stride(*d0), shape[*d0]),
                        axis1: (stride(*d1), shape[*d1]),
                    }
                }
                _ => FusedFactors::Vector { full: full.clone() },
            })
        };
        let old_full = match &state.factors {
            Factors::Vector { full } => full.clone(),
            Factors::Matrix { .. } => state.momentum.clone(), // unused placeholders
        };
        let previous = FusedTensor {
            grad: g.contiguous()?,
            param: p.contiguous()?,
            momentum: state.momentum.clone(),
            rms: state.rms.clone(),
            factors: fused_factors(&old_full)?,
        };
        let (planes, sums) = fused::accumulate(&previous, decays.fused())?;
        let plane = |k: usize| planes.get(k)?.reshape(shape);
        let momentum = [plane(0)?, plane(1)?, plane(2)?];
        let rms = plane(3)?;
        let new_full = match &factors {
            Factors::Vector { .. } => [plane(4)?, plane(5)?, plane(6)?],
            Factors::Matrix { .. } => old_full,
        };
        let current = FusedTensor {
            momentum: momentum.clone(),
            rms: rms.clone(),
            factors: fused_factors(&new_full)?,
            ..previous
        };
        let factors = match factors {
            Factors::Vector { .. } => Factors::Vector { full: new_full },
            matrix => matrix,
        };
        let new_p = fused::mlp_update(&current, &sums, &mlp.packed, self.hyper())?;
        Ok((
            new_p,
            Accumulators {
                momentum,
                rms,
                factors,
                scaled,
            },
        ))
    }

    /// The reference: every feature as a tensor, stacked `[28, n]`, the MLP as matmuls.
    fn composed_update(
        &self,
        shape: &[usize],
        g: &Tensor,
        p: &Tensor,
        acc: &Accumulators,
        mlp: &StepMlp,
    ) -> Result<Tensor> {
        let momentum = &acc.momentum;
        let mut fac_g = Vec::with_capacity(3);
        let mut row_feat = Vec::with_capacity(3);
        let mut col_feat = Vec::with_capacity(3);
        let mut fac_m = Vec::with_capacity(3);
        match (&acc.factors, &acc.scaled) {
            (Factors::Matrix { row, col, .. }, Some((row_factor, col_factor))) => {
                let (row, col) = (unstack(row)?, unstack(col)?);
                for k in 0..3 {
                    fac_g.push(
                        g.broadcast_mul(&row_factor[k])?
                            .broadcast_mul(&col_factor[k])?,
                    );
                    fac_m.push(
                        momentum[k]
                            .broadcast_mul(&row_factor[k])?
                            .broadcast_mul(&col_factor[k])?,
                    );
                    row_feat.push(row[k].broadcast_as(shape)?.contiguous()?);
                    col_feat.push(col[k].broadcast_as(shape)?.contiguous()?);
                }
            }
            (Factors::Vector { full }, _) => {
                for k in 0..3 {
                    let f = &full[k];
                    fac_g.push((g * srsqrt(&(f + 1e-9)?)?)?);
                    fac_m.push((&momentum[k] * (f + 1e-6)?.sqrt()?.recip()?)?);
                    row_feat.push(f.clone());
                    col_feat.push(f.clone());
                }
            }
            _ => bail!("{OPT}: internal error, matrix factors without their scales"),
        }
        let rsqrt_v = (&acc.rms + 1e-6)?.sqrt()?.recip()?;
        let mut features: Vec<Tensor> = Vec::with_capacity(NORMALISED);
        features.push(g.clone());
        features.push(p.clone());
        features.extend(momentum.iter().cloned());
        features.push(acc.rms.clone());
        for m in momentum {
            features.push((m * &rsqrt_v)?);
        }
        features.push(rsqrt_v);
        features.extend(fac_g);
        features.extend(row_feat.iter().cloned());
        features.extend(col_feat.iter().cloned());
        for r in &row_feat {
            features.push((r + 1e-8)?.sqrt()?.recip()?);
        }
        for c in &col_feat {
            features.push((c + 1e-8)?.sqrt()?.recip()?);
        }
        features.extend(fac_m);
        debug_assert_eq!(features.len(), NORMALISED);
        let flat: Vec<Tensor> = features
            .iter()
            .map(|f| f.flatten_all())
            .collect::<Result<_>>()?;
        let x = Tensor::stack(&flat, 0)?; // [28, n]
        let norm = (x.sqr()?.mean_keepdim(1)? + 1e-5)?.sqrt()?.recip()?;
        let x = x.broadcast_mul(&norm)?;

        let [w_in, _, w_1, b_1, w_out, b_out] = &self.params.mlp.tensors;
        let h1 = w_in
            .narrow(1, 0, NORMALISED)?
            .contiguous()?
            .matmul(&x)?
            .broadcast_add(&mlp.first_bias.unsqueeze(1)?)?;
        let h1 = relu_keep_nan(&h1)?;
        let h2 = relu_keep_nan(&w_1.matmul(&h1)?.broadcast_add(&b_1.unsqueeze(1)?)?)?;
        let out = w_out.matmul(&h2)?.broadcast_add(&b_out.unsqueeze(1)?)?; // [2, n]
        let direction = out.get(0)?;
        let magnitude = out.get(1)?;
        let step =
            ((direction * (magnitude * self.params.exp_mult)?.exp()?)? * self.params.step_mult)?;
        let lr = self.params.lr;
        let mut new_p = (p.flatten_all()? - (step * lr)?)?;
        if self.params.weight_decay > 0.0 {
            new_p = (&new_p - (&new_p * (lr * self.params.weight_decay))?)?;
        }
        Ok(new_p)
    }

    /// Writes the optimizer state (step counter, and every accumulator of every variable, keyed
    /// by the variable's position in the list given to `new`) to a safetensors file.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        map.insert(
            "steps".into(),
            Tensor::new(&[self.steps as i64], &Device::Cpu)?,
        );
        for (i, s) in self.states.iter().enumerate() {
            for (k, m) in s.momentum.iter().enumerate() {
                map.insert(format!("{i}.momentum.{k}"), m.clone());
            }
            map.insert(format!("{i}.rms"), s.rms.clone());
            match &s.factors {
                Factors::Matrix { row, col, .. } => {
                    for (k, (r, c)) in unstack(row)?.iter().zip(&unstack(col)?).enumerate() {
                        map.insert(format!("{i}.row.{k}"), r.clone());
                        map.insert(format!("{i}.col.{k}"), c.clone());
                    }
                }
                Factors::Vector { full } => {
                    for (k, f) in full.iter().enumerate() {
                        map.insert(format!("{i}.full.{k}"), f.clone());
                    }
                }
            }
        }
        candle_core::safetensors::save(&map, path)
    }

    /// Restores a state written by [`SmallFcLOpt::save_state`] for the same list of variables
    /// (same count and shapes). Nothing changes when the file does not match.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let dev = self.params.mlp.device().clone();
        let map = candle_core::safetensors::load(path, &dev)?;
        let take = |name: &str, like: &Tensor| -> Result<Tensor> {
            let Some(t) = map.get(name) else {
                bail!("{OPT}: state file has no tensor `{name}`");
            };
            if t.dims() != like.dims() || t.dtype() != DType::F32 {
                bail!(
                    "{OPT}: state tensor `{name}` is {:?} {:?}, expected {:?} f32",
                    t.dims(),
                    t.dtype(),
                    like.dims()
                );
            }
            Ok(t.clone())
        };
        let steps = match map.get("steps") {
            Some(t) => t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?[0],
            None => bail!("{OPT}: state file has no `steps`"),
        };
        let expected = self.states.len();
        let stored = map.keys().filter(|k| k.ends_with(".rms")).count();
        if stored != expected {
            bail!("{OPT}: state file holds {stored} variables, this optimizer {expected}");
        }
        let mut restored = Vec::with_capacity(expected);
        for (i, s) in self.states.iter().enumerate() {
            let three = |what: &str, like: &[Tensor; 3]| -> Result<[Tensor; 3]> {
                Ok([
                    take(&format!("{i}.{what}.0"), &like[0])?,
                    take(&format!("{i}.{what}.1"), &like[1])?,
                    take(&format!("{i}.{what}.2"), &like[2])?,
                ])
            };
            let factors = match &s.factors {
                Factors::Matrix { d0, d1, row, col } => Factors::Matrix {
                    d0: *d0,
                    d1: *d1,
                    row: Tensor::stack(&three("row", &unstack(row)?)?, 0)?,
                    col: Tensor::stack(&three("col", &unstack(col)?)?, 0)?,
                },
                Factors::Vector { full } => Factors::Vector {
                    full: three("full", full)?,
                },
            };
            restored.push(TensorState {
                var: s.var.clone(),
                shape: s.shape.clone(),
                momentum: three("momentum", &s.momentum)?,
                rms: take(&format!("{i}.rms"), &s.rms)?,
                factors,
            });
        }
        #[cfg(feature = "cuda")]
        if self.flat.is_some() {
            // The states are views into the flat buffers the kernels update: copy into them.
            for (dst, src) in self.states.iter().zip(&restored) {
                dst.copy_from(src)?;
            }
            self.steps = steps.max(0) as u64;
            return Ok(());
        }
        self.states = restored;
        self.steps = steps.max(0) as u64;
        Ok(())
    }
}
