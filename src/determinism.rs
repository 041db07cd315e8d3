//! A process-wide switch for deterministic algorithms, in the spirit of PyTorch's
//! `torch.use_deterministic_algorithms`: ops whose fast GPU path sums in an order that varies from
//! run to run (atomic additions) switch to an ordered one while it is on.

use std::sync::atomic::{AtomicBool, Ordering};

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Makes every op of this crate produce bit-identical results from run to run on the same inputs
/// and device (off by default). Today it changes one thing: the CUDA backward pass of
/// [`crate::sparse_linear`] / [`crate::sparse_linear_pair`], which otherwise adds into the weight
/// gradient with atomics. In deterministic mode that backward reads the feature indices on the
/// host (one device-to-host copy, so one synchronisation per backward), sorts them by feature
/// keeping batch order, and sums each gradient row in that order on the GPU without atomics.
/// CPU paths are always deterministic.
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
