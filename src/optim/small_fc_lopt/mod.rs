//! small_fc_lopt: an MLP learned optimizer (`AdafacMLPLOpt`). Per element it builds 39 features
//! from the gradient, the parameter, three momenta, an rms accumulator and Adafactor row/column
//! factors, normalises them per tensor, runs a 39-32-32-2 MLP and steps by
//! `direction * exp(exp_mult * magnitude) * step_mult`. The algorithm is PyLO's naive version;
//! tests replay golden vectors made with it (`tests/fixtures/small_fc_lopt_golden.safetensors`).
//!
//! CPU, per tensor: for matrices the small per-row / per-column Adafactor tensors with candle
//! ops, then two fused per-element passes (`cpu.rs`, rayon) — the first updates the momenta /
//! rms (/ vector Adafactor) accumulators and sums the squared features, the second rebuilds the
//! features, runs the MLP and writes the parameter — so the `[39, n]` features never exist in
//! memory. CUDA: the same passes, plus the Adafactor reductions, as four or five kernels over
//! all tensors at once, on state kept in flat device buffers and updated in place
//! (`cuda.rs`). `LOptBackend::fused = false` selects the reference built from
//! candle ops only (it materialises `[28, n]` features and `[32, n]` activations).

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod mlp;
mod params;
mod reference;
mod state;
mod step;

pub use mlp::MlpWeights;
pub use params::{LOptBackend, NonFiniteGrads, ParamsSmallFcLOpt};

use candle_core::{bail, DType, Result, Tensor, Var};
use mlp::StepMlp;
use params::{decay, Decays};
use state::TensorState;

const OP: &str = "small_fc_lopt";
/// Features per element; the first `NORMALISED` are normalised per tensor, the rest are time
/// features.
const NUM_FEATURES: usize = 39;
use crate::kernel_constants::small_fc_lopt::{FEATURES as NORMALISED, HIDDEN};
const TIME_SCALES: [f64; 11] = [
    1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0, 100000.0,
];
const MOMENTUM_BASE: [f64; 3] = [0.9, 0.99, 0.999];
const RMS_BASE: f64 = 0.999;
const ADAFACTOR_BASE: [f64; 3] = [0.9, 0.99, 0.999];

/// small_fc_lopt as a [`candle_nn::Optimizer`]: [`SmallFcLOpt::from_varmap`] (or
/// [`SmallFcLOpt::new_named`], or `SmallFcLOpt::new(vars, params)` with positions as names),
/// then `step(&grads)` or `backward_step(&loss)` like candle's `AdamW`.
///
/// * Variables: any rank (0-D included) and float dtype (the optimizer state is f32), all on one
///   device (CPU or CUDA). Variables without a gradient are skipped, as candle's optimizers do.
/// * State: 3 momenta and an rms accumulator per element, plus Adafactor factors (3 per row and
///   3 per column of a matrix, 3 per element of a vector); [`SmallFcLOpt::save_state`] /
///   [`SmallFcLOpt::load_state`] round-trip it with the step counter, keyed by variable name, so
///   a run resumes exactly whatever the order of the variables.
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
    flat: Option<cuda::DeviceState>,
}

impl candle_nn::Optimizer for SmallFcLOpt {
    type Config = ParamsSmallFcLOpt;

    /// The variables keyed by their position in `vars` (`"0"`, `"1"`, ...): a state saved by
    /// [`SmallFcLOpt::save_state`] reloads only onto the same list in the same order. Prefer
    /// [`SmallFcLOpt::from_varmap`] or [`SmallFcLOpt::new_named`], whose state is keyed by name
    /// (`VarMap::all_vars` iterates a `HashMap`, so its order changes between processes).
    fn new(vars: Vec<Var>, params: ParamsSmallFcLOpt) -> Result<Self> {
        let named = vars
            .into_iter()
            .enumerate()
            .map(|(i, var)| (i.to_string(), var))
            .collect();
        Self::new_named(named, params)
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        // Check everything first: a bad gradient must not leave some tensors updated.
        let mut work = Vec::with_capacity(self.states.len());
        for (i, state) in self.states.iter().enumerate() {
            let Some(grad) = super::checked_grad(OP, &state.name, &state.var, grads)? else {
                continue;
            };
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

impl SmallFcLOpt {
    /// An optimizer over named variables. The names key the state in
    /// [`SmallFcLOpt::save_state`] / [`SmallFcLOpt::load_state`], so a resumed run may list the
    /// variables in any order. Names must be unique; every variable is a float tensor and all
    /// are on one device.
    pub fn new_named(vars: Vec<(String, Var)>, params: ParamsSmallFcLOpt) -> Result<Self> {
        let device = match vars.first() {
            Some((_, v)) => v.device().clone(),
            None => params.mlp.device().clone(),
        };
        let mut seen = std::collections::HashSet::with_capacity(vars.len());
        let mut ids = std::collections::HashMap::with_capacity(vars.len());
        for (name, var) in &vars {
            if !seen.insert(name.as_str()) {
                bail!("{OP}: two variables are named `{name}`; names key the saved state");
            }
            if let Some(first) = ids.insert(var.id(), name.as_str()) {
                bail!("{OP}: `{first}` and `{name}` are the same variable; give it once");
            }
            if !var.dtype().is_float() {
                bail!(
                    "{OP}: variable `{name}` (shape {:?}) is {:?}, not a float dtype",
                    var.dims(),
                    var.dtype()
                );
            }
            if !var.device().same_device(&device) {
                bail!(
                    "{OP}: variables on mixed devices: `{}` is on {:?}, `{name}` on {:?}",
                    vars[0].0,
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
        if device.is_cuda() && params.backend.fused {
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
            .map(|(name, var)| TensorState::new(name, var))
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            states,
            steps: 0,
            #[cfg(feature = "cuda")]
            flat: None,
        })
    }

    /// An optimizer over every variable of `varmap`, keyed by its names (taken in name order).
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
    /// use candle_nn::{Optimizer, VarBuilder, VarMap};
    /// let dev = Device::Cpu;
    /// let mlp = MlpWeights::from_safetensors(
    ///     concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/small_fc_lopt_mlp.safetensors"),
    ///     &dev,
    /// )?;
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    /// let layer = candle_nn::linear(4, 3, vb.pp("layer"))?;
    /// let mut opt = SmallFcLOpt::from_varmap(&varmap, ParamsSmallFcLOpt::new(mlp))?;
    /// let xs = candle_core::Tensor::randn(0f32, 1., (8, 4), &dev)?;
    /// opt.backward_step(&candle_nn::Module::forward(&layer, &xs)?.sqr()?.sum_all()?)?;
    /// let path = std::env::temp_dir().join("fastops_doc_lopt_state.safetensors");
    /// opt.save_state(&path)?; // keys "layer.weight.momentum.0", ...
    /// let mut resumed = SmallFcLOpt::from_varmap(&varmap, opt.params().clone())?;
    /// resumed.load_state(&path)?;
    /// assert_eq!(resumed.steps_taken(), 1);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn from_varmap(varmap: &candle_nn::VarMap, params: ParamsSmallFcLOpt) -> Result<Self> {
        let mut vars: Vec<(String, Var)> = {
            let data = varmap.data().lock().map_err(|_| {
                candle_core::Error::Msg(format!("{OP}: the VarMap's lock is poisoned"))
            })?;
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self::new_named(vars, params)
    }

    /// The variables' names, in the optimizer's order (positions `"0"`, `"1"`, ... for
    /// [`candle_nn::Optimizer::new`]).
    pub fn var_names(&self) -> impl Iterator<Item = &str> {
        self.states.iter().map(|s| s.name.as_str())
    }
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

    fn hyper(&self) -> cpu::Hyper {
        cpu::Hyper {
            step_mult: self.params.step_mult as f32,
            exp_mult: self.params.exp_mult as f32,
            lr: self.params.lr as f32,
            weight_decay: self.params.weight_decay as f32,
        }
    }
}
