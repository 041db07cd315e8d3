//! Optimizers implementing [`candle_nn::Optimizer`].
//!
//! [`SmallFcLOpt`] is the small_fc_lopt learned optimizer (google/learned_optimization's
//! `AdafacMLPLOpt`, with the pretrained MLP weights PyLO and μLO publish):
//!
//! ```no_run
//! use candle_core::{DType, Device};
//! use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
//! use candle_nn::{Optimizer, VarMap};
//! let dev = Device::Cpu;
//! let varmap = VarMap::new();
//! // ... build a model from VarBuilder::from_varmap(&varmap, DType::F32, &dev) ...
//! let mlp = MlpWeights::from_safetensors("small_fc_lopt.safetensors", &dev)?;
//! // State keyed by the VarMap's names: it reloads onto the right variables in any process.
//! let mut opt = SmallFcLOpt::from_varmap(&varmap, ParamsSmallFcLOpt::new(mlp))?;
//! // each training step: opt.backward_step(&loss)?;
//! opt.save_state("lopt_state.safetensors")?; // resume later with opt.load_state(...)
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! [`AdamW`] is candle_nn's AdamW with the step fused (one pass over each parameter, gradient
//! and moment; one CUDA launch for up to 48 tensors) and its state saved by name.

mod adamw;
mod small_fc_lopt;

pub use adamw::AdamW;

pub use small_fc_lopt::{LOptBackend, MlpWeights, NonFiniteGrads, ParamsSmallFcLOpt, SmallFcLOpt};

/// The gradient of variable `name` in `grads` (`None` when it has none), checked against the
/// variable: same shape, same device, a float dtype. Optimizers check every gradient this way
/// before they change any variable, so a bad one leaves the model as it was.
pub(crate) fn checked_grad<'g>(
    op: &str, name: &str, var: &candle_core::Var, grads: &'g candle_core::backprop::GradStore,
) -> candle_core::Result<Option<&'g candle_core::Tensor>> {
    let Some(grad) = grads.get(var) else {
        return Ok(None);
    };
    if grad.dims() != var.dims() {
        candle_core::bail!(
            "{op}: gradient of variable `{name}` has shape {:?}, the variable {:?}",
            grad.dims(),
            var.dims()
        );
    }
    if !grad.device().same_device(var.device()) {
        candle_core::bail!(
            "{op}: gradient of variable `{name}` is on {:?}, the variable on {:?}",
            grad.device().location(),
            var.device().location()
        );
    }
    if !grad.dtype().is_float() {
        candle_core::bail!(
            "{op}: gradient of variable `{name}` is {:?}, not a float dtype",
            grad.dtype()
        );
    }
    Ok(Some(grad))
}
