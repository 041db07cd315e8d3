//! The reference step built from candle ops (`ParamsSmallFcLOpt::fused = false`): every feature
//! as a tensor, the MLP as matmuls. Tests hold the fused passes to it.

use super::state::{unstack, Factors, TensorState};
use super::{Decays, SmallFcLOpt, StepMlp, NORMALISED, OP};
use candle_core::{bail, Result, Tensor};

/// One tensor's accumulators after this step's gradient, and for matrices the per-row and
/// per-column Adafactor scales derived from them.
pub(super) struct Accumulators {
    pub(super) momentum: [Tensor; 3],
    pub(super) rms: Tensor,
    pub(super) factors: Factors,
    /// `(row_factor[k], col_factor[k])` for matrices (axis d0 resp. d1 kept with size 1).
    pub(super) scaled: Option<([Tensor; 3], [Tensor; 3])>,
}

pub(super) type Scales = ([Tensor; 3], [Tensor; 3]);

/// A matrix's new row and column accumulators from `g2 = g^2 + 1e-30`, and its row and column
/// factors (`srsqrt` of the row accumulator over its mean along d1, `srsqrt` of the column one).
pub(super) fn matrix_factors(
    d0: usize, d1: usize, row: &Tensor, col: &Tensor, g2: &Tensor, decays: &Decays,
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
    pub(super) fn update(state: &TensorState, g: &Tensor, decays: &Decays) -> Result<Self> {
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

pub(super) fn srsqrt(x: &Tensor) -> Result<Tensor> {
    x.maximum(1e-9)?.sqrt()?.recip()
}

/// `max(x, 0)` that keeps NaN (as torch's relu does; candle's `relu` maps NaN to 0), so
/// non-finite gradients reach the parameters as in the reference.
pub(super) fn relu_keep_nan(x: &Tensor) -> Result<Tensor> {
    (x + x.abs()?)? * 0.5
}

pub(super) fn ema(acc: &Tensor, x: &Tensor, beta: f64) -> Result<Tensor> {
    (acc * beta)? + (x * (1.0 - beta))?
}

impl SmallFcLOpt {
    /// The reference: every feature as a tensor, stacked `[28, n]`, the MLP as matmuls.
    pub(super) fn composed_update(
        &self, shape: &[usize], g: &Tensor, p: &Tensor, acc: &Accumulators, mlp: &StepMlp,
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
            _ => bail!("{OP}: internal error, matrix factors without their scales"),
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
}
