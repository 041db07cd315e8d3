//! Hyper-parameters and the decays they resolve to.

use super::{cpu, MlpWeights};
use candle_core::Tensor;

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

/// Hyper-parameters of [`SmallFcLOpt`](super::SmallFcLOpt), with the published defaults from
/// [`ParamsSmallFcLOpt::new`] (or [`ParamsSmallFcLOpt::from_safetensors`]); change a field with
/// struct update syntax, `ParamsSmallFcLOpt { lr: 0.5, ..ParamsSmallFcLOpt::new(mlp) }`. The
/// [`LOptBackend`] switches are kept apart in `backend`.
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
    /// The MLP.
    pub mlp: MlpWeights,
    /// How the step is computed: switches that change speed and rounding, not the algorithm.
    pub backend: LOptBackend,
}

/// How [`SmallFcLOpt`](super::SmallFcLOpt) computes a step. The defaults are the fast paths.
///
/// ```
/// use candle_fastops::optim::LOptBackend;
/// let exact = LOptBackend { tensor_cores: false, deterministic: Some(true), ..Default::default() };
/// assert!(exact.fused);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LOptBackend {
    /// `true` (default): the fused per-element passes (CPU threads or CUDA kernels), which never
    /// materialise the features. `false`: the reference built from candle ops, which stacks the
    /// `[28, n]` features and `[32, n]` activations of each tensor (for testing).
    pub fused: bool,
    /// CUDA, fused path: evaluate the MLP's two 32-wide layers on f16 tensor cores (default)
    /// instead of f32 FMAs. Every operand is split into two f16 halves and the three significant
    /// products are accumulated in f32, so the result stays within 1e-4 of the golden vectors
    /// (f32 arithmetic). On compute capability 9.0 (H100, H200) the products run on Hopper's
    /// `wgmma`, the same split products in the same order (the environment variable
    /// `CANDLE_FASTOPS_LOPT_KERNELS=portable`, read once per process, keeps the `mma.sync`
    /// kernel every other GPU runs). Ignored on the CPU, which always uses f32.
    pub tensor_cores: bool,
    /// CUDA, fused path: `Some(true)` makes every step bit-reproducible (the per-tensor sums are
    /// taken in a fixed order instead of with float atomics; slower, see BENCHMARKS.md);
    /// `None` (default) follows [`crate::deterministic`]. The CPU step is always deterministic.
    pub deterministic: Option<bool>,
}

impl Default for LOptBackend {
    fn default() -> Self {
        Self {
            fused: true,
            tensor_cores: true,
            deterministic: None,
        }
    }
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
            mlp,
            backend: LOptBackend::default(),
        }
    }

    /// The published defaults with the MLP read from a safetensors file (see
    /// [`MlpWeights::from_safetensors`]).
    pub fn from_safetensors(
        path: impl AsRef<std::path::Path>, device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        Ok(Self::new(MlpWeights::from_safetensors(path, device)?))
    }

    /// These parameters with another backend.
    pub fn with_backend(self, backend: LOptBackend) -> Self {
        Self { backend, ..self }
    }
}

pub(super) fn decay(base: f64, offset: f64) -> f64 {
    (1.0 - (1.0 - base) * (10.0 * offset).exp()).clamp(0.0, 1.0)
}

/// The decays, resolved from the offsets once per step.
pub(super) struct Decays {
    pub(super) momentum: [f64; 3],
    pub(super) rms: f64,
    pub(super) adafactor: [f64; 3],
    /// `adafactor` and `1 - adafactor` as `[3]` f32 tensors on the optimizer's device, to update
    /// the three stacked matrix accumulators in one op.
    pub(super) adafactor_tensors: (Tensor, Tensor),
}

impl Decays {
    /// As the fused passes take them.
    pub(super) fn fused(&self) -> cpu::Decays {
        cpu::Decays::new(
            self.momentum.map(|d| d as f32),
            self.rms as f32,
            self.adafactor.map(|d| d as f32),
        )
    }
}
