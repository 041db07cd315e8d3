//! One step of every tensor: the fused per-tensor passes (CPU) and the multi-tensor CUDA step.

use super::cpu::{self, FusedFactors, FusedTensor};
#[cfg(feature = "cuda")]
use super::cuda;
use super::reference::{matrix_factors, Accumulators};
use super::state::{unstack, Factors, TensorState};
use super::{Decays, SmallFcLOpt, StepMlp};
use candle_core::{DType, Result, Tensor};

impl SmallFcLOpt {
    /// The multi-tensor CUDA step: every tensor's state and parameter updated in place by a few
    /// launches (parameters of dtypes other than f32, or not contiguous, go through an f32 copy).
    #[cfg(feature = "cuda")]
    pub(super) fn flat_step(
        &self, flat: &cuda::DeviceState, work: Vec<(usize, Tensor)>, decays: &Decays, mlp: &StepMlp,
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
            super::cuda::Backend {
                tensor_cores: self.params.backend.tensor_cores,
                deterministic: self
                    .params
                    .backend
                    .deterministic
                    .unwrap_or_else(crate::deterministic),
            },
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
    pub(super) fn tensor_step(
        &self, state: &TensorState, grad: &Tensor, decays: &Decays, mlp: &StepMlp,
    ) -> Result<Option<(TensorState, Tensor)>> {
        let shape = state.shape.as_slice();
        let Some(g) = self.prepare_grad(state, grad)? else {
            return Ok(None);
        };
        let p = state.var.as_tensor().to_dtype(DType::F32)?.reshape(shape)?;
        let (new_p, acc) = if self.params.backend.fused {
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
                name: state.name.clone(),
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
    pub(super) fn fused_update(
        &self, state: &TensorState, g: &Tensor, p: &Tensor, decays: &Decays, mlp: &StepMlp,
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
        let (planes, sums) = cpu::accumulate(&previous, decays.fused())?;
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
        let new_p = cpu::mlp_update(&current, &sums, &mlp.packed, self.hyper())?;
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
}
