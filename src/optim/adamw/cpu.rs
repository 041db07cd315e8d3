//! The CPU step: one rayon pass per tensor that reads the parameter, gradient and moments once,
//! updates the parameter in place (through candle's in-place op) and writes the new moments.

use super::{Hyper, OP};
use crate::cpu::CpuFloat;
use candle_core::{bail, CpuStorage, Device, Layout, Result, Storage, Tensor, Var, WithDType};
use num_traits::{Float, One};
use rayon::prelude::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// AdamW on one variable: the variable is updated in place; returns the new moments.
pub(super) fn step(
    var: &Var, grad: &Tensor, m: &Tensor, v: &Tensor, h: Hyper,
) -> Result<(Tensor, Tensor)> {
    let op = Update {
        grad,
        m,
        v,
        h,
        out: RefCell::new(None),
    };
    var.as_tensor().inplace_op1(&op)?;
    match op.out.into_inner() {
        Some((m, v)) => Ok((m.reshape(var.dims())?, v.reshape(var.dims())?)),
        None => bail!("{OP}: internal error, the CPU step produced no moments"),
    }
}

struct Update<'a> {
    grad: &'a Tensor,
    m: &'a Tensor,
    v: &'a Tensor,
    h: Hyper,
    out: RefCell<Option<(Tensor, Tensor)>>,
}

/// `f` on the contiguous CPU elements of `t`.
fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!(
            "{OP}: internal error, a CPU step on {:?}",
            t.device().location()
        );
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{OP}: internal error, a non-contiguous operand");
    };
    f(&cpu.as_slice::<T>()?[start..end])
}

/// The update of `p` in place, in its accumulator type (f32; f64 for f64 parameters). The
/// moments come back as new tensors, written without a zero fill.
fn update<T: CpuFloat>(op: &Update, p: &mut [T]) -> Result<(Tensor, Tensor)> {
    let h = op.h;
    let c = |x: f64| <T::Acc as num_traits::NumCast>::from(x).expect("a finite f64 converts");
    let (b1, b2, lr, decay) = (c(h.beta1), c(h.beta2), c(h.lr), c(h.decay));
    let (sm, sv, eps) = (c(h.scale_m), c(h.scale_v), c(h.eps));
    let (ob1, ob2) = (T::Acc::one() - b1, T::Acc::one() - b2);
    let n = p.len();
    let mut v_out = Vec::new();
    let m_out = with_slice::<T, _>(op.grad, |g| {
        with_slice::<T::Acc, _>(op.m, |m| {
            with_slice::<T::Acc, _>(op.v, |v| {
                if g.len() != n || m.len() != n || v.len() != n {
                    bail!(
                        "{OP}: internal error, a variable of {n} elements with a gradient of {} \
                         and moments of {} / {}",
                        g.len(),
                        m.len(),
                        v.len()
                    );
                }
                let write_all = |m_out: &mut [MaybeUninit<T::Acc>]| {
                    let fill = |v_out: &mut [MaybeUninit<T::Acc>]| {
                        p.par_chunks_mut(CHUNK)
                            .zip(g.par_chunks(CHUNK))
                            .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
                            .zip(m_out.par_chunks_mut(CHUNK).zip(v_out.par_chunks_mut(CHUNK)))
                            .for_each(|(((p, g), (m, v)), (mo, vo))| {
                                crate::cpu::vectorized(
                                    #[inline(always)]
                                    || {
                                        let moments = m.iter().zip(v).zip(mo).zip(vo);
                                        for ((p, &g), (((&m, &v), mo), vo)) in
                                            p.iter_mut().zip(g).zip(moments)
                                        {
                                            let g = g.to_acc();
                                            let mn = b1 * m + ob1 * g;
                                            let vn = b2 * v + ob2 * (g * g);
                                            mo.write(mn);
                                            vo.write(vn);
                                            let step = (mn * sm) / ((vn * sv).sqrt() + eps);
                                            *p = T::from_acc(p.to_acc() * decay - lr * step);
                                        }
                                    },
                                )
                            })
                    };
                    // SAFETY: p, g, m, v and v_out all have n elements (checked above), so the chunks
                    // cover 0..n and write every element of v_out.
                    v_out = unsafe { crate::cpu::written_output(n, fill) };
                };
                // SAFETY: as for v_out, every element of m_out is written.
                Ok(unsafe { crate::cpu::written_output(n, write_all) })
            })
        })
    })?;
    Ok((
        Tensor::from_vec(m_out, n, &Device::Cpu)?,
        Tensor::from_vec(v_out, n, &Device::Cpu)?,
    ))
}

impl candle_core::InplaceOp1 for Update<'_> {
    fn name(&self) -> &'static str {
        "fastops-adamw"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{OP}: the variable is not contiguous");
        };
        let moments = match storage {
            CpuStorage::F32(p) => update(self, &mut p[start..end])?,
            CpuStorage::F64(p) => update(self, &mut p[start..end])?,
            CpuStorage::F16(p) => update(self, &mut p[start..end])?,
            CpuStorage::BF16(p) => update(self, &mut p[start..end])?,
            other => bail!(
                "{OP}: a variable of dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        *self.out.borrow_mut() = Some(moments);
        Ok(())
    }
}
