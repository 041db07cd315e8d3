//! Output poisoning for tests: when on, GPU outputs are filled with 0xFF bytes (NaN for floats,
//! `u32::MAX` for indices) before a kernel writes them, so an element a kernel forgets to write
//! fails the comparison with the reference instead of passing on leftover memory.

use std::sync::atomic::{AtomicU8, Ordering};

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static POISON: AtomicU8 = AtomicU8::new(UNSET);

/// Turns output poisoning on or off for this process (the test helpers turn it on). Without a
/// call, the `CANDLE_FASTOPS_POISON` environment variable decides (`1` = on). It costs one
/// memset per output while on, nothing while off.
pub fn set_poison_outputs(on: bool) {
    POISON.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn poison_outputs() -> bool {
    match POISON.load(Ordering::Relaxed) {
        UNSET => {
            let on = std::env::var("CANDLE_FASTOPS_POISON").is_ok_and(|v| v == "1");
            set_poison_outputs(on);
            on
        }
        state => state == ON,
    }
}
