use super::*;
use crate::activation::{acc_of, clipped_relu};
use candle_core::StorageRef;

/// Read locks on a call's feature tensors, held while the op borrows their data.
pub(super) struct Locks<'a> {
    indices: Vec<(StorageRef<'a>, &'a Layout)>,
    values: Vec<Option<(StorageRef<'a>, &'a Layout)>>,
    side_first: Option<(StorageRef<'a>, &'a Layout)>,
}

/// The feature data of a call as slices.
pub(super) struct Sides<'a> {
    pub(super) indices: Vec<&'a [i32]>,
    values: Vec<Option<&'a [f32]>>,
    side_first: Option<&'a [u8]>,
}

pub(super) fn lock(f: &Features) -> Result<Locks<'_>> {
    Ok(Locks {
        indices: f
            .sides
            .iter()
            .map(|s| s.indices.storage_and_layout())
            .collect(),
        values: f
            .sides
            .iter()
            .map(|s| s.values.as_ref().map(|v| v.storage_and_layout()))
            .collect(),
        side_first: f.side_first.as_ref().map(|t| t.storage_and_layout()),
    })
}

fn slice<'a, T: WithDType>(lock: &'a (StorageRef<'_>, &Layout)) -> Result<&'a [T]> {
    crate::cpu::locked_slice(lock, OP)
}

impl Locks<'_> {
    pub(super) fn sides(&self) -> Result<Sides<'_>> {
        Ok(Sides {
            indices: self
                .indices
                .iter()
                .map(slice::<i32>)
                .collect::<Result<_>>()?,
            values: self
                .values
                .iter()
                .map(|v| v.as_ref().map(slice::<f32>).transpose())
                .collect::<Result<_>>()?,
            side_first: self.side_first.as_ref().map(slice::<u8>).transpose()?,
        })
    }
}

impl Sides<'_> {
    /// The half of the output row that perspective `p` of position `b` fills.
    fn half(&self, b: usize, p: usize) -> usize {
        match self.side_first {
            Some(first) if first[b] == 0 => 1 - p,
            _ => p,
        }
    }

    /// The active (index, value) pairs of perspective `p` of position `b`.
    fn features(
        &self, b: usize, p: usize, max_active: usize,
    ) -> impl Iterator<Item = (usize, f32)> + '_ {
        let row = b * max_active..(b + 1) * max_active;
        let values = self.values[p].map(|v| &v[row.clone()]);
        self.indices[p][row]
            .iter()
            .take_while(|&&i| i != -1)
            .enumerate()
            .map(move |(k, &i)| (i as usize, values.map_or(1.0, |v| v[k])))
    }
}

pub(super) fn forward<T: CpuFloat>(
    f: &Features, sides: &Sides, weight: &[T], weight_stride: usize, bias: &[T],
) -> Vec<T> {
    let (n_out, row_len) = (f.out, f.perspectives() * f.out);
    let len = f.batch * row_len;
    if len == 0 {
        return Vec::new();
    }
    let ceiling: Option<T::Acc> = f.clip_ceiling.map(acc_of);
    let write_all = |out: &mut [std::mem::MaybeUninit<_>]| {
        out.par_chunks_mut(row_len)
            .with_min_len(16)
            .enumerate()
            .for_each_init(
                || vec![T::Acc::zero(); n_out],
                |acc, (b, dst)| {
                    for p in 0..f.perspectives() {
                        for (a, &bias) in acc.iter_mut().zip(bias) {
                            *a = bias.to_acc();
                        }
                        for (index, value) in sides.features(b, p, f.max_active) {
                            let value: T::Acc = acc_of(value);
                            let row = &weight[index * weight_stride..][..n_out];
                            for (a, &w) in acc.iter_mut().zip(row) {
                                *a += value * w.to_acc();
                            }
                        }
                        let half = sides.half(b, p);
                        let dst = dst[half * n_out..][..n_out].iter_mut();
                        match ceiling {
                            None => dst.zip(acc.iter()).for_each(|(d, &a)| {
                                d.write(T::from_acc(a));
                            }),
                            Some(c) => dst.zip(acc.iter()).for_each(|(d, &a)| {
                                d.write(T::from_acc(clipped_relu(a, c)));
                            }),
                        }
                    }
                },
            )
    };
    // SAFETY: every row of `len` elements is written (both halves of each row).
    unsafe { crate::cpu::written_output(len, write_all) }
}

/// Weight rows handed to one rayon task in the backward pass.
const ROWS_PER_TASK_MIN: usize = 64;

pub(super) fn backward<T: CpuFloat>(f: &Features, sides: &Sides, grad: &[T]) -> Vec<T::Acc> {
    let (n_out, row_len) = (f.out, f.perspectives() * f.out);
    let mut out = vec![T::Acc::zero(); (f.num_inputs + 1) * n_out];
    if n_out == 0 {
        return out;
    }
    let (grad_weight, grad_bias) = out.split_at_mut(f.num_inputs * n_out);
    let rows_per_task = f
        .num_inputs
        .div_ceil(4 * rayon::current_num_threads())
        .max(ROWS_PER_TASK_MIN);
    rayon::join(
        || {
            // Each task owns a range of weight rows and scans every feature for them: no two
            // tasks write one element, and each element's sum runs in batch order.
            grad_weight
                .par_chunks_mut(rows_per_task * n_out)
                .enumerate()
                .for_each(|(task, rows)| {
                    let first = task * rows_per_task;
                    let owned = first..first + rows.len() / n_out;
                    for b in 0..f.batch {
                        for p in 0..f.perspectives() {
                            let g = &grad[b * row_len + sides.half(b, p) * n_out..][..n_out];
                            for (index, value) in sides.features(b, p, f.max_active) {
                                if owned.contains(&index) {
                                    let value: T::Acc = acc_of(value);
                                    let row = &mut rows[(index - first) * n_out..][..n_out];
                                    for (r, &g) in row.iter_mut().zip(g) {
                                        *r += value * g.to_acc();
                                    }
                                }
                            }
                        }
                    }
                })
        },
        || {
            grad_bias
                .par_chunks_mut(64)
                .enumerate()
                .for_each(|(chunk, sums)| {
                    let first = chunk * 64;
                    for row in grad.chunks(n_out) {
                        for (s, &g) in sums.iter_mut().zip(&row[first..]) {
                            *s += g.to_acc();
                        }
                    }
                })
        },
    );
    out
}
