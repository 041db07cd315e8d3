use super::*;
use crate::cpu::{CpuFloat, FastExp};
use num_traits::Float;

/// Lanes per task in column mode, so a plan with one huge kept block still spreads over
/// every core.
const LANE_CHUNK: usize = 1024;

/// Output pointer shared by tasks that write disjoint element sets.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: each task writes only the elements of its own groups; the plan maps every element
// to exactly one group.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// Taking `self` makes closures capture the whole (Send) wrapper, not the raw field.
    fn get(self) -> *mut T {
        self.0
    }
}

/// Max of a group, NaN if it holds one. The compare-select max and the separate NaN flag
/// compile to packed max / unordered-compare instructions.
#[inline(always)]
fn max_and_nan<C: Float>(values: impl Iterator<Item = C>) -> C {
    let (mut m, mut nan) = (C::neg_infinity(), false);
    for v in values {
        m = if v > m { v } else { m };
        nan |= v.is_nan();
    }
    if nan {
        C::nan()
    } else {
        m
    }
}

/// The output of one element given its group's max `m` and `log_s = ln(sum(exp(x - m)))`.
#[inline(always)]
fn normalise<C: Float>(x: C, m: C, inv_s: C, log_s: C, log: bool) -> C {
    match (m == C::neg_infinity(), log) {
        (true, true) => C::neg_infinity(),
        (true, false) => C::zero(),
        (false, true) => x - m - log_s,
        (false, false) => (x - m).exp() * inv_s,
    }
}

/// Softmax of contiguous `xs` over the plan's groups, accumulating in `T::Acc`.
pub(super) fn softmax<T: CpuFloat>(xs: &[T], plan: &ReducePlan, log: bool) -> Vec<T> {
    let (groups, size) = (plan.num_groups(), plan.group_size());
    let write_all = |ys: &mut [std::mem::MaybeUninit<T>]| {
        if groups == 0 || size == 0 {
            return;
        }
        let out = OutPtr(ys.as_mut_ptr().cast::<T>());
        let lanes = plan.lanes();
        if lanes == 1 {
            (0..groups)
                .into_par_iter()
                .for_each_init(Vec::new, |buf, g| {
                    crate::cpu::vectorized(
                        #[inline(always)]
                        || row_group(xs, out.get(), plan, g, log, buf),
                    )
                });
        } else {
            let outer = groups / lanes;
            let chunks = lanes.div_ceil(LANE_CHUNK);
            (0..outer * chunks).into_par_iter().for_each(|task| {
                let (g_outer, chunk) = (task / chunks, task % chunks);
                let first = chunk * LANE_CHUNK;
                let width = LANE_CHUNK.min(lanes - first);
                crate::cpu::vectorized(
                    #[inline(always)]
                    || column_group(xs, out.get(), plan, g_outer * lanes + first, width, log),
                )
            });
        }
    };
    // SAFETY: the groups cover every element of the tensor and write each once.
    unsafe { crate::cpu::written_output(xs.len(), write_all) }
}

/// One group whose innermost reduced block is contiguous: gathered run by run into `buf`
/// (one read of the input), normalised there, scattered back (one write).
#[inline(always)]
fn row_group<T: CpuFloat>(
    xs: &[T], ys: *mut T, plan: &ReducePlan, g: usize, log: bool, buf: &mut Vec<T::Acc>,
) {
    let run = plan.reduced_blocks().last().map_or(1, |b| b.size);
    let runs = plan.group_size() / run;
    let base = plan.group_base(g);
    let offsets = (0..runs).map(|r| base + plan.reduced_offset(r * run));
    buf.clear();
    for off in offsets.clone() {
        buf.extend(xs[off..off + run].iter().map(|&x| x.to_acc()));
    }
    let m = max_and_nan(buf.iter().copied());
    let s: T::Acc = if log {
        crate::cpu::sum_exp_shifted(buf, m)
    } else {
        crate::cpu::exp_shifted(buf, m)
    };
    let (inv_s, log_s) = (s.recip(), s.ln());
    let masked = m == <T::Acc as Float>::neg_infinity();
    for (r, off) in offsets.enumerate() {
        // SAFETY: `off..off + run` are elements of group `g`, written by this task only.
        let out = unsafe {
            std::slice::from_raw_parts_mut(ys.add(off) as *mut std::mem::MaybeUninit<T>, run)
        };
        let vals = &buf[r * run..(r + 1) * run];
        match (masked, log) {
            (true, _) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                o.write(T::from_acc(normalise(v, m, inv_s, log_s, log)));
            }),
            (false, true) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                o.write(T::from_acc(v - m - log_s));
            }),
            (false, false) => out.iter_mut().zip(vals).for_each(|(o, &v)| {
                o.write(T::from_acc(v * inv_s));
            }),
        }
    }
}

/// `width` adjacent groups starting at `g0` whose elements are strided: for each reduced
/// index the groups form a contiguous run of `width` values.
#[inline(always)]
fn column_group<T: CpuFloat>(
    xs: &[T], ys: *mut T, plan: &ReducePlan, g0: usize, width: usize, log: bool,
) {
    let base = plan.group_base(g0);
    let offsets = (0..plan.group_size()).map(|j| base + plan.reduced_offset(j));
    let neg_inf = <T::Acc as Float>::neg_infinity();
    let mut m = vec![neg_inf; width];
    let mut nan = vec![false; width];
    for off in offsets.clone() {
        for ((m, nan), &x) in m.iter_mut().zip(&mut nan).zip(&xs[off..off + width]) {
            let x = x.to_acc();
            *m = m.max(x);
            *nan |= x.is_nan();
        }
    }
    for (m, &nan) in m.iter_mut().zip(&nan) {
        if nan {
            *m = <T::Acc as Float>::nan();
        }
    }
    let zero = <T::Acc as num_traits::Zero>::zero();
    let mut s = vec![zero; width];
    if !log {
        // Softmax: each exponential once ([`FastExp`], in loops that vectorize), kept in
        // `exps` (reduced index-major), then scaled by its group's 1 / sum.
        let mut exps = vec![zero; plan.group_size() * width];
        for (off, run) in offsets.clone().zip(exps.chunks_exact_mut(width)) {
            for ((e, &m), &x) in run.iter_mut().zip(&m).zip(&xs[off..off + width]) {
                *e = (x.to_acc() - m).fast_exp();
            }
            for (s, &e) in s.iter_mut().zip(run.iter()) {
                *s += e;
            }
        }
        let inv_s: Vec<T::Acc> = s.iter().map(|s| s.recip()).collect();
        for (off, run) in offsets.zip(exps.chunks_exact(width)) {
            // SAFETY: the run's `width` elements belong to groups `g0..g0 + width`, owned here.
            let out = unsafe {
                std::slice::from_raw_parts_mut(ys.add(off) as *mut std::mem::MaybeUninit<T>, width)
            };
            // A group of only -inf (m = -inf) is zero; a NaN stays NaN.
            for (((o, &e), &inv), &m) in out.iter_mut().zip(run).zip(&inv_s).zip(&m) {
                o.write(T::from_acc(if m == neg_inf { zero } else { e * inv }));
            }
        }
        return;
    }
    for off in offsets.clone() {
        for ((s, &m), &x) in s.iter_mut().zip(&m).zip(&xs[off..off + width]) {
            *s += (x.to_acc() - m).exp();
        }
    }
    let inv_s: Vec<T::Acc> = s.iter().map(|s| s.recip()).collect();
    let log_s: Vec<T::Acc> = s.iter().map(|s| s.ln()).collect();
    for off in offsets {
        for (lane, &x) in xs[off..off + width].iter().enumerate() {
            let y = normalise(x.to_acc(), m[lane], inv_s[lane], log_s[lane], log);
            // SAFETY: element `lane` of the run belongs to group `g0 + lane`, owned here.
            unsafe { ys.add(off + lane).write(T::from_acc(y)) };
        }
    }
}
