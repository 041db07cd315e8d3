//! The process-wide default for deterministic algorithms, in the spirit of PyTorch's
//! `torch.use_deterministic_algorithms`: ops whose fast GPU path sums in an order that varies from
//! run to run (atomic additions) switch to an ordered one while it is on. Per-call options
//! override it.

use std::sync::atomic::{AtomicBool, Ordering};

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// The process-wide default for the ops whose fast GPU path is not bit-reproducible (off by
/// default); a call's own options override it ([`crate::SparseLinearOptions::deterministic`]).
///
/// Run to run on the same inputs and device, these give identical bits whatever this switch
/// says: every CPU path; on CUDA the forward and backward of [`crate::bias_add`] and
/// [`crate::softmax_dims`] / [`crate::log_softmax_dims`], [`crate::masked_bmm`] (forward and
/// backward), [`crate::argmin_matmul`] / [`crate::kmeans_assign`], and the forward of
/// [`crate::sparse_linear`] / [`crate::sparse_linear_pair`] (no atomics: each output element
/// is summed by one thread in a fixed order).
///
/// What this switch changes (each also has a per-call form):
/// - the CUDA backward of [`crate::sparse_linear`] / [`crate::sparse_linear_pair`], which
///   otherwise adds into the weight gradient with atomics. Deterministic, it reads the feature
///   indices on the host (one synchronisation per backward), sorts them by feature keeping batch
///   order and sums each gradient row in that order ([`crate::SparseLinearOptions::deterministic`]);
/// - the CUDA step of [`crate::optim::SmallFcLOpt`], which otherwise sums its per-tensor
///   statistics (Adafactor row / column sums, feature norms) with float atomics. Deterministic,
///   each sum is taken in index order ([`crate::optim::LOptBackend::deterministic`]).
/// - the CUDA backward of [`crate::masked_attention`] in f16 / bf16 at head dims up to 128 on
///   compute capability 9.0 (the Hopper backward), and at head dims over 64 on GPUs where the
///   portable one-pass backward fits, which otherwise add dq with float reductions in a varying
///   order. Deterministic, they run the two-pass backward, whose dq has a pass of its own
///   ([`crate::AttentionOptions::deterministic`]). Its forward, and the backward on other GPUs,
///   head dims and dtypes, are deterministic either way.
///
/// ```
/// candle_fastops::set_deterministic(true);
/// assert!(candle_fastops::deterministic());
/// candle_fastops::set_deterministic(false);
/// ```
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether [`set_deterministic`] is on.
pub fn deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}
