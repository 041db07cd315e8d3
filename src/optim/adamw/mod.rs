//! AdamW with candle_nn's hyper-parameters and formula, stepped by one fused pass: on the CPU one
//! rayon pass per tensor (parameter updated in place), on CUDA one multi-tensor kernel for up to
//! 48 tensors per launch, moments in f32 whatever the parameters' dtype.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{backprop::GradStore, bail, DType, Device, Result, Tensor, Var};
use candle_nn::ParamsAdamW;
use std::collections::HashMap;
use std::path::Path;

const OP: &str = "optim::AdamW";

/// AdamW as [`candle_nn::AdamW`] computes it (decoupled weight decay, bias-corrected moments:
/// `p <- p (1 - lr wd) - lr m̂ / (sqrt(v̂) + eps)`), with the whole step fused: each parameter,
/// gradient and moment is read once and written once, instead of the dozen tensor ops per
/// variable that candle_nn runs. On CUDA one kernel launch steps up to 48 tensors.
///
/// * Variables: any float dtype (f32, f16, bf16; f64 on the CPU) and rank, all on one device.
///   The moments are f32 (f64 for f64 variables), so 16-bit parameters keep full-precision
///   moments; f32 variables follow candle_nn::AdamW to f32 rounding.
/// * Variables without a gradient are skipped (candle_nn's behaviour); every gradient is checked
///   (shape, device, dtype) before any variable changes.
/// * State: [`AdamW::save_state`] / [`AdamW::load_state`] write and read the moments and the
///   step counter keyed by variable name (`{name}.m`, `{name}.v`, `steps`).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_fastops::optim::AdamW;
/// use candle_nn::{Optimizer, ParamsAdamW};
/// let w = Var::from_tensor(&Tensor::new(&[[1f32, -2.], [3., 0.5]], &Device::Cpu)?)?;
/// let mut opt = AdamW::new_named(vec![("w".into(), w.clone())], ParamsAdamW::default())?;
/// opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
/// assert_eq!(opt.steps_taken(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct AdamW {
    params: ParamsAdamW,
    states: Vec<VarState>,
    steps: u64,
}

#[derive(Debug, Clone)]
struct VarState {
    name: String,
    var: Var,
    /// First and second moments, contiguous, in the variable's shape, f32 (f64 for f64 vars).
    m: Tensor,
    v: Tensor,
}

/// The scalars of one step.
#[derive(Debug, Clone, Copy)]
struct Hyper {
    lr: f64,
    decay: f64,
    beta1: f64,
    beta2: f64,
    scale_m: f64,
    scale_v: f64,
    eps: f64,
}

fn state_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// The variables keyed by position (`"0"`, `"1"`, ...); prefer [`AdamW::new_named`] or
    /// [`AdamW::from_varmap`], whose saved state reloads by name.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let named = vars
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect();
        Self::new_named(named, params)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let mut work = Vec::with_capacity(self.states.len());
        for (i, s) in self.states.iter().enumerate() {
            let Some(g) = super::checked_grad(OP, &s.name, &s.var, grads)? else {
                continue;
            };
            if s.var.elem_count() > 0 {
                work.push((i, g.to_dtype(s.var.dtype())?.contiguous()?));
            }
        }
        self.steps += 1;
        let t = self.steps as f64;
        let p = &self.params;
        let hyper = Hyper {
            lr: p.lr,
            decay: 1.0 - p.lr * p.weight_decay,
            beta1: p.beta1,
            beta2: p.beta2,
            scale_m: 1.0 / (1.0 - p.beta1.powf(t)),
            scale_v: 1.0 / (1.0 - p.beta2.powf(t)),
            eps: p.eps,
        };
        match self.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => cuda::step(&dev, &self.states, &work, hyper),
            _ => {
                for (i, g) in &work {
                    let s = &mut self.states[*i];
                    let (m, v) = cpu::step(&s.var, g, &s.m, &s.v, hyper)?;
                    s.m = m;
                    s.v = v;
                }
                Ok(())
            }
        }
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }
}

impl AdamW {
    /// AdamW over named variables (names key the saved state; unique), all on one device.
    pub fn new_named(vars: Vec<(String, Var)>, params: ParamsAdamW) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        let mut states = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            if !seen.insert(name.clone()) {
                bail!("{OP}: two variables are named `{name}`; names key the saved state");
            }
            if !var.dtype().is_float() {
                bail!("{OP}: variable `{name}` is {:?}, not a float", var.dtype());
            }
            if !var.is_contiguous() {
                bail!("{OP}: variable `{name}` is not contiguous");
            }
            if let Some(first) = states.first() {
                let first: &VarState = first;
                if !first.var.device().same_device(var.device()) {
                    bail!(
                        "{OP}: variables on mixed devices: `{}` on {:?}, `{name}` on {:?}",
                        first.name,
                        first.var.device().location(),
                        var.device().location()
                    );
                }
            }
            let dt = state_dtype(var.dtype());
            let m = Tensor::zeros(var.dims(), dt, var.device())?;
            let v = Tensor::zeros(var.dims(), dt, var.device())?;
            states.push(VarState { name, var, m, v });
        }
        Ok(Self {
            params,
            states,
            steps: 0,
        })
    }

    /// Every variable of `varmap`, keyed by its name.
    pub fn from_varmap(varmap: &candle_nn::VarMap, params: ParamsAdamW) -> Result<Self> {
        let mut vars: Vec<(String, Var)> = {
            let data = varmap.data().lock().map_err(|_| {
                candle_core::Error::Msg(format!("{OP}: the VarMap's lock is poisoned"))
            })?;
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self::new_named(vars, params)
    }

    fn device(&self) -> Device {
        self.states
            .first()
            .map_or(Device::Cpu, |s| s.var.device().clone())
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Steps taken so far (the `t` of the bias corrections).
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// The variables' names, in the optimizer's order.
    pub fn var_names(&self) -> impl Iterator<Item = &str> {
        self.states.iter().map(|s| s.name.as_str())
    }

    /// Bytes of optimizer state (the two moments).
    pub fn state_bytes(&self) -> usize {
        self.states
            .iter()
            .map(|s| 2 * s.m.elem_count() * s.m.dtype().size_in_bytes())
            .sum()
    }

    /// Writes the moments and the step counter, keyed by variable name (`{name}.m`, `{name}.v`,
    /// `steps`), to a safetensors file.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        map.insert(
            "steps".into(),
            Tensor::new(&[self.steps as i64], &Device::Cpu)?,
        );
        for s in &self.states {
            map.insert(format!("{}.m", s.name), s.m.clone());
            map.insert(format!("{}.v", s.name), s.v.clone());
        }
        candle_core::safetensors::save(&map, path)
    }

    /// Restores a state written by [`AdamW::save_state`] onto the variables of the same names,
    /// whatever their order. The file must hold exactly these names with the moments' shapes and
    /// dtypes; otherwise the error names the first mismatch and nothing changes.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let map = candle_core::safetensors::load(path, &self.device())?;
        let steps = match map.get("steps") {
            Some(t) if t.elem_count() == 1 && t.dtype() == DType::I64 => {
                t.flatten_all()?.to_vec1::<i64>()?[0]
            }
            _ => bail!("{OP}: state file has no `steps` (one i64)"),
        };
        if steps < 0 {
            bail!("{OP}: state file's `steps` is negative ({steps})");
        }
        let ours: std::collections::HashSet<String> = self
            .states
            .iter()
            .flat_map(|s| [format!("{}.m", s.name), format!("{}.v", s.name)])
            .collect();
        let mut extra: Vec<&String> = map
            .keys()
            .filter(|k| *k != "steps" && !ours.contains(*k))
            .collect();
        extra.sort();
        if let Some(k) = extra.first() {
            bail!("{OP}: state file holds `{k}`, which no variable of this optimizer has");
        }
        let mut restored = Vec::with_capacity(self.states.len());
        for s in &self.states {
            let take = |key: String, like: &Tensor| -> Result<Tensor> {
                match map.get(&key) {
                    None => bail!(
                        "{OP}: state file has no `{key}` for variable `{}` (shape {:?})",
                        s.name,
                        s.var.dims()
                    ),
                    Some(t) if t.dims() != like.dims() || t.dtype() != like.dtype() => bail!(
                        "{OP}: `{key}` is {:?} {:?}, variable `{}` needs {:?} {:?}",
                        t.dims(),
                        t.dtype(),
                        s.name,
                        like.dims(),
                        like.dtype()
                    ),
                    Some(t) => t.contiguous(),
                }
            };
            restored.push((
                take(format!("{}.m", s.name), &s.m)?,
                take(format!("{}.v", s.name), &s.v)?,
            ));
        }
        for (s, (m, v)) in self.states.iter_mut().zip(restored) {
            s.m = m;
            s.v = v;
        }
        self.steps = steps as u64;
        Ok(())
    }
}
