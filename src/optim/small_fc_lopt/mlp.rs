//! The optimizer's MLP: its published weights, loaded and checked, and the per-step packing.

use super::{cpu, HIDDEN, NORMALISED, NUM_FEATURES, OP, TIME_SCALES};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::Path;

/// The six tensors of the optimizer's MLP, named as PyLO and μLO publish them.
pub(super) const WEIGHT_NAMES: [(&str, &[usize]); 6] = [
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
    pub(super) tensors: [Tensor; 6],
}

impl MlpWeights {
    /// Reads the six tensors from a safetensors file (the published μLO / PyLO weights load
    /// unchanged) onto `device`. A missing tensor, a wrong shape or a dtype other than f32 is an
    /// error naming the tensor.
    pub fn from_safetensors(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let path = path.as_ref();
        let tensors = candle_core::safetensors::load(path, device).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{OP}: cannot read MLP weights from {}: {e}",
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
                bail!("{OP}: MLP weights are missing tensor `{name}` (shape {shape:?})");
            };
            if t.dims() != shape {
                bail!(
                    "{OP}: MLP tensor `{name}` has shape {:?}, expected {shape:?}",
                    t.dims()
                );
            }
            if t.dtype() != DType::F32 {
                bail!("{OP}: MLP tensor `{name}` is {:?}, expected f32", t.dtype());
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
                .map_err(|e| candle_core::Error::Msg(format!("{OP}: MLP tensor `{name}`: {e}")))?;
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

    pub(super) fn device(&self) -> &Device {
        self.tensors[0].device()
    }
}

/// The MLP as one step uses it: the first layer's bias with the 11 time features folded in,
/// and (for the fused passes) every weight packed into one buffer.
pub(super) struct StepMlp {
    pub(super) first_bias: Tensor,
    pub(super) packed: Tensor,
}

impl StepMlp {
    pub(super) fn new(mlp: &MlpWeights, time: &Tensor) -> Result<Self> {
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
        debug_assert_eq!(packed.elem_count(), cpu::MLP_FLOATS);
        Ok(Self { first_bias, packed })
    }
}
