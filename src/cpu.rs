//! CPU helpers shared by the ops' fallbacks.

use std::mem::MaybeUninit;

/// A vector with capacity for `len` elements, for an output the caller writes completely before
/// `set_len`. Large outputs are first-touched page by page, and on a 2-core VM one 4 KiB page
/// fault per 1024 f32 costs more than the arithmetic (a 64 MiB output: ~25 ms of faults against
/// ~3 ms of adds). On Linux the buffer is therefore advised for transparent huge pages, where
/// the system allows them on request (`madvise` mode, the common default), so it faults in 2 MiB
/// at a time.
fn output_vec<T>(len: usize) -> Vec<T> {
    let vec = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    advise_huge_pages(vec.as_ptr() as usize, len * std::mem::size_of::<T>());
    vec
}

/// The data of a contiguous CPU tensor held under a read lock (`Tensor::storage_and_layout`):
/// how ops reach tensors they keep beside their candle arguments. `op` names the op in errors.
pub(crate) fn locked_slice<'a, T: candle_core::WithDType>(
    lock: &'a (candle_core::StorageRef<'_>, &candle_core::Layout), op: &str,
) -> candle_core::Result<&'a [T]> {
    let (storage, layout) = lock;
    let candle_core::Storage::Cpu(storage) = &**storage else {
        candle_core::bail!("{op}: internal error, a held tensor is not on the CPU");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{op}: internal error, a held tensor is not contiguous");
    };
    Ok(&storage.as_slice::<T>()?[start..end])
}

/// A vector of `len` elements written by `fill` (in parallel, as it likes), from an
/// [`output_vec`].
///
/// # Safety
/// `fill` must initialise every element of the slice it is given.
pub(crate) unsafe fn written_output<T>(
    len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>]),
) -> Vec<T> {
    let mut out = output_vec(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: guaranteed by the caller.
    unsafe { out.set_len(len) };
    out
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(addr: usize, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    if bytes < 4 * HUGE_PAGE {
        return;
    }
    // Only whole huge pages inside the allocation are advised: the advice never reaches memory
    // the allocator handed to anyone else.
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: [start, end) lies inside this allocation; MADV_HUGEPAGE changes how the pages
        // are backed, never their contents. A failure (THP disabled) leaves normal pages.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// A float dtype's CPU arithmetic type: f32 for f32, f16 and bf16, f64 for f64. Converting
/// through it (rather than through `WithDType::to_f64`) keeps f32 loops free of conversions
/// so they vectorise.
pub(crate) trait CpuFloat: candle_core::WithDType {
    type Acc: num_traits::Float + candle_core::WithDType + Send + Sync + std::iter::Sum;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
}

/// `cpu_float!(T => Acc, widen, narrow)`: T's [`CpuFloat`] impl with its two conversions.
macro_rules! cpu_float {
    ($($t:ty => $acc:ty, $to:expr, $from:expr;)*) => {$(
        impl CpuFloat for $t {
            type Acc = $acc;
            fn to_acc(self) -> $acc {
                $to(self)
            }
            fn from_acc(acc: $acc) -> Self {
                $from(acc)
            }
        }
    )*};
}

cpu_float! {
    f32 => f32, std::convert::identity, std::convert::identity;
    f64 => f64, std::convert::identity, std::convert::identity;
    half::f16 => f32, half::f16::to_f32, half::f16::from_f32;
    half::bf16 => f32, half::bf16::to_f32, half::bf16::from_f32;
}
