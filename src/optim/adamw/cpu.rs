//! The CPU step: one rayon pass per tensor that reads the parameter, gradient and moments once,
//! updates the parameter in place (through candle's in-place op) and writes the new moments.

use super::{Hyper, OP};
use candle_core::{bail, CpuStorage, Device, Layout, Result, Storage, Tensor, Var, WithDType};
use num_traits::Float;
use rayon::prelude::*;
use std::cell::RefCell;

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

/// The update of `p` in place, in the accumulator type `A` (f32; f64 for f64 parameters).
fn update<T: WithDType, A: WithDType + Float>(
    op: &Update, p: &mut [T], to: fn(T) -> A, from: fn(A) -> T,
) -> Result<(Tensor, Tensor)> {
    let h = op.h;
    let c = |x: f64| A::from(x).expect("a finite f64 converts");
    let (b1, b2, lr, decay) = (c(h.beta1), c(h.beta2), c(h.lr), c(h.decay));
    let (sm, sv, eps) = (c(h.scale_m), c(h.scale_v), c(h.eps));
    let (ob1, ob2) = (A::one() - b1, A::one() - b2);
    let n = p.len();
    let mut m_out = vec![A::zero(); n];
    let mut v_out = vec![A::zero(); n];
    with_slice::<T, _>(op.grad, |g| {
        with_slice::<A, _>(op.m, |m| {
            with_slice::<A, _>(op.v, |v| {
                p.par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
                    .zip(m_out.par_chunks_mut(CHUNK).zip(v_out.par_chunks_mut(CHUNK)))
                    .for_each(|(((p, g), (m, v)), (mo, vo))| {
                        for i in 0..p.len() {
                            let gi = to(g[i]);
                            let mn = b1 * m[i] + ob1 * gi;
                            let vn = b2 * v[i] + ob2 * (gi * gi);
                            mo[i] = mn;
                            vo[i] = vn;
                            let step = (mn * sm) / ((vn * sv).sqrt() + eps);
                            p[i] = from(to(p[i]) * decay - lr * step);
                        }
                    });
                Ok(())
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
            CpuStorage::F32(p) => update::<f32, f32>(self, &mut p[start..end], |x| x, |x| x)?,
            CpuStorage::F64(p) => update::<f64, f64>(self, &mut p[start..end], |x| x, |x| x)?,
            CpuStorage::F16(p) => update::<half::f16, f32>(
                self,
                &mut p[start..end],
                half::f16::to_f32,
                half::f16::from_f32,
            )?,
            CpuStorage::BF16(p) => update::<half::bf16, f32>(
                self,
                &mut p[start..end],
                half::bf16::to_f32,
                half::bf16::from_f32,
            )?,
            other => bail!(
                "{OP}: a variable of dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        *self.out.borrow_mut() = Some(moments);
        Ok(())
    }
}
