//! Activations fused into an op's output, shared by [`crate::sparse_linear_with`] and
//! [`crate::bias_add_with`]: the forward applies them before its store, the backward passes
//! the output gradient through them from the stored output, so neither direction takes a pass
//! of its own over the activations.

use crate::cpu::CpuFloat;
use candle_core::{bail, Result};
use num_traits::{NumCast, Zero};
use rayon::prelude::*;

/// An activation applied to an op's output inside the op, with its gradient.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Activation {
    /// The plain output (the default).
    #[default]
    Identity,
    /// NNUE's clipped ReLU, `clamp(y, 0, ceiling)` (a NaN stays NaN). Its gradient passes the
    /// output gradient where the stored output lies strictly between 0 and `ceiling` (the
    /// ceiling rounded to the output dtype) and is zero elsewhere, as for `relu` at 0. Fused,
    /// it costs no pass over the activations in either direction: the forward clamps before
    /// its store and the backward reads the output beside its gradient, where
    /// `y.clamp(0, ceiling)` on candle ops takes two passes forward and about a dozen backward.
    /// `ceiling` must be finite and positive.
    ClippedRelu { ceiling: f32 },
}

impl Activation {
    /// The clipped ReLU's ceiling (`None` for the identity), or an error from `op` naming a
    /// ceiling that is not finite and positive.
    pub(crate) fn clip_ceiling(self, op: &str) -> Result<Option<f32>> {
        match self {
            Activation::Identity => Ok(None),
            Activation::ClippedRelu { ceiling } => {
                if !(ceiling.is_finite() && ceiling > 0.0) {
                    bail!("{op}: the clipped ReLU's ceiling must be finite and positive, got {ceiling}");
                }
                Ok(Some(ceiling))
            }
        }
    }
}

/// `clamp(x, 0, ceiling)`, a NaN passing through.
pub(crate) fn clipped_relu<A: num_traits::Float>(x: A, ceiling: A) -> A {
    if x < A::zero() {
        A::zero()
    } else if x > ceiling {
        ceiling
    } else {
        x
    }
}

/// A value of the CPU accumulator type from an f32 (f32 or f64: never fails).
pub(crate) fn acc_of<A: NumCast + Zero>(v: f32) -> A {
    A::from(v).unwrap_or_else(A::zero)
}

/// The output gradient behind a clipped ReLU: `grad` where `0 < output < ceiling` (the ceiling
/// rounded to `T`, as the output was), zero elsewhere. In parallel over the elements.
pub(crate) fn through_clipped_relu<T: CpuFloat>(grad: &[T], output: &[T], ceiling: f32) -> Vec<T> {
    let ceiling = T::from_acc(acc_of(ceiling)).to_acc();
    let zero = T::Acc::zero();
    grad.par_iter()
        .zip(output.par_iter())
        .with_min_len(4096)
        .map(|(&g, &y)| {
            let y = y.to_acc();
            if y > zero && y < ceiling {
                g
            } else {
                T::from_acc(zero)
            }
        })
        .collect()
}
