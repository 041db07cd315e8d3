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
    type Acc: num_traits::Float + candle_core::WithDType + Send + Sync + std::iter::Sum + FastExp;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
    /// `data` itself when it already is of the accumulator type (f32, f64), to be read without
    /// a conversion pass.
    fn as_acc(data: &[Self]) -> Option<&[Self::Acc]>;
}

/// The exponential of the CPU accumulator types, branch-free for f32 so that loops over it
/// vectorize (libm's `expf` is a call per element).
pub(crate) trait FastExp: Copy {
    fn fast_exp(self) -> Self;
}

impl FastExp for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

impl FastExp for f32 {
    /// `e^a = 2^n e^r` with `n` the integer nearest `a log2 e`, `r = a - n ln 2` (ln 2 split in
    /// two parts, so `r` is exact to f32 rounding, |r| <= 0.35) and `e^r` a degree-7 Taylor
    /// polynomial: relative error below 3e-7 (about 2 ulp) for results above 1e-37. Arguments
    /// below -87.3 give 0 (`-inf` exactly 0), above 88 the value at 88; NaN stays NaN.
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        // 1 / k! for k = 7 down to 1.
        const C: [f32; 7] = [
            1.0 / 5040.0,
            1.0 / 720.0,
            1.0 / 120.0,
            1.0 / 24.0,
            1.0 / 6.0,
            0.5,
            1.0,
        ];
        const LN2_HI: f32 = 0.693_359_4; // 0x3f31_8000: n * LN2_HI is exact for |n| <= 127
        const LN2_LO: f32 = -2.121_944_4e-4;
        // 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to the nearest integer.
        const ROUND: f32 = 12_582_912.0;
        let a = self.clamp(-88.0, 88.0);
        let rounded = a * std::f32::consts::LOG2_E + ROUND;
        let n = rounded - ROUND;
        let r = (a - n * LN2_HI) - n * LN2_LO;
        let poly = C.iter().fold(0.0f32, |acc, &c| (acc + c) * r) + 1.0;
        // `rounded` holds ROUND + n exactly, so its bits are ROUND's plus n (|n| <= 127): n + 127
        // in the exponent field is 2^n, with integer operations that vectorize (a float-to-int
        // `as` does not: it saturates). n = -127 puts 0 there: the scale, and the result, are 0.
        let biased = rounded
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127);
        let scale = f32::from_bits(biased << 23);
        let e = poly * scale;
        if self.is_nan() {
            self
        } else {
            e
        }
    }
}

/// Runs `f` compiled for the widest vector instructions of this CPU that the `pulp` crate
/// dispatches to (AVX2 and FMA on x86-64 where present, the baseline otherwise): the loops of `f`
/// and of the `#[inline(always)]` functions it calls vectorize at that width. The results are
/// the baseline's, bit for bit: the compiler neither reorders floating-point operations nor
/// fuses a multiply and an add. `f` must be an `#[inline(always)]` closure, or its body is
/// compiled once, for the baseline.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `x = exp(x - shift)` for every `x` of `row` ([`FastExp`]); returns their sum, taken in eight
/// running sums (vector lanes).
#[inline(always)]
pub(crate) fn exp_shifted<A: FastExp + num_traits::Float>(row: &mut [A], shift: A) -> A {
    for x in row.iter_mut() {
        *x = (*x - shift).fast_exp();
    }
    sum_lanes(row)
}

/// The sum of `exp(x - shift)` over `row`, which stays as it is (the exponentials go through a
/// small buffer, so that their loop vectorizes as [`exp_shifted`]'s does).
#[inline(always)]
pub(crate) fn sum_exp_shifted<A: FastExp + num_traits::Float>(row: &[A], shift: A) -> A {
    let mut buf = [A::zero(); 256];
    row.chunks(buf.len()).fold(A::zero(), |total, chunk| {
        let exps = &mut buf[..chunk.len()];
        for (e, &x) in exps.iter_mut().zip(chunk) {
            *e = (x - shift).fast_exp();
        }
        total + sum_lanes(exps)
    })
}

/// The sum of `row` in eight running sums (vector lanes), then their total.
#[inline(always)]
fn sum_lanes<A: num_traits::Float>(row: &[A]) -> A {
    let mut lanes = [A::zero(); 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = *lane + x;
        }
    }
    let rest = chunks.remainder().iter().fold(A::zero(), |s, &x| s + x);
    lanes.iter().fold(A::zero(), |s, &x| s + x) + rest
}

/// The largest element of `row`, NaNs ignored (`-inf` for an empty row, or one of NaNs and
/// `-inf`s): the value of `f32::max` folded over the row, taken in eight running maxima (vector
/// lanes) so that the loop vectorizes.
#[inline(always)]
pub(crate) fn max_lanes<A: num_traits::Float>(row: &[A]) -> A {
    let mut lanes = [A::neg_infinity(); 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(A::neg_infinity(), |a, &x| a.max(x));
    lanes.iter().fold(rest, |a, &x| a.max(x))
}

/// `cpu_float!(T => Acc, widen, narrow, as_acc)`: T's [`CpuFloat`] impl with its two conversions.
macro_rules! cpu_float {
    ($($t:ty => $acc:ty, $to:expr, $from:expr, $as_acc:expr;)*) => {$(
        impl CpuFloat for $t {
            type Acc = $acc;
            fn to_acc(self) -> $acc {
                $to(self)
            }
            fn from_acc(acc: $acc) -> Self {
                $from(acc)
            }
            fn as_acc(data: &[$t]) -> Option<&[$acc]> {
                $as_acc(data)
            }
        }
    )*};
}

cpu_float! {
    f32 => f32, std::convert::identity, std::convert::identity, Some;
    f64 => f64, std::convert::identity, std::convert::identity, Some;
    half::f16 => f32, half::f16::to_f32, half::f16::from_f32, |_| None;
    half::bf16 => f32, half::bf16::to_f32, half::bf16::from_f32, |_| None;
}

#[cfg(test)]
mod tests {
    #[test]
    fn f32_exponential_is_within_its_bound() {
        let mut xs: Vec<f32> = (0..200_001).map(|i| -100.0 + i as f32 * 0.0005).collect();
        xs.extend([0.0, -0.0, 1e-30, -87.0, 80.0, 88.0]);
        let mut row = xs.clone();
        let sum = super::exp_shifted(&mut row, 0.5);
        let mut want_sum = 0.0f64;
        for (&x, &e) in xs.iter().zip(&row) {
            let want = ((x - 0.5) as f64).exp(); // the argument as f32 computes it
            want_sum += e as f64;
            if want < 1e-37 {
                assert!(e.abs() < 1e-37, "exp({x} - 0.5) = {e}, expected {want}");
                continue;
            }
            let err = (e as f64 - want).abs() / want;
            assert!(
                err < 3e-7,
                "exp({x} - 0.5) = {e}, expected {want} (error {err:.2e})"
            );
        }
        assert!((sum as f64 - want_sum).abs() / want_sum < 1e-5);
        let kept = super::sum_exp_shifted(&xs, 0.5);
        assert!((kept as f64 - want_sum).abs() / want_sum < 1e-5);
        let mut special = [f32::NEG_INFINITY, f32::NAN, -1000.0];
        super::exp_shifted(&mut special, 0.0);
        assert_eq!(special[0], 0.0);
        assert!(special[1].is_nan());
        assert_eq!(special[2], 0.0);
    }
}
