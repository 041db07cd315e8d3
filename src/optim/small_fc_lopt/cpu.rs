//! The two per-element passes of a small_fc_lopt step, fused: one computes the 28 per-tensor
//! feature norms without materialising the features, the other rebuilds the features, runs the
//! MLP and writes the new parameter, on the CPU (rayon). The CUDA step (`multi_tensor.rs`) runs
//! the same passes over all tensors at once; the composed-ops path in `small_fc_lopt.rs` is
//! their reference.

use crate::dispatch::mirrored_struct;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, StorageRef, Tensor};
use rayon::prelude::*;

use super::OP;
pub(super) use crate::kernel_constants::small_fc_lopt::{FEATURES, HIDDEN};
/// `w_in[:, :28]`, `b_eff`, `w_1`, `b_1`, `w_out`, `b_out`, packed.
pub(super) const MLP_FLOATS: usize =
    HIDDEN * FEATURES + HIDDEN + HIDDEN * HIDDEN + HIDDEN + 2 * HIDDEN + 2;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// One tensor's inputs to the fused passes: every tensor f32 and contiguous, on one device.
#[derive(Debug, Clone)]
pub(super) struct FusedTensor {
    pub grad: Tensor,
    pub param: Tensor,
    pub momentum: [Tensor; 3],
    pub rms: Tensor,
    pub factors: FusedFactors,
}

#[derive(Debug, Clone)]
pub(super) enum FusedFactors {
    /// Rank >= 2: `row` / `row_factor` have axis d0 removed, `col` / `col_factor` axis d1.
    Matrix {
        row: [Tensor; 3],
        col: [Tensor; 3],
        row_factor: [Tensor; 3],
        col_factor: [Tensor; 3],
        /// (stride, size) of axis d0 and of axis d1 in the tensor.
        axis0: (usize, usize),
        axis1: (usize, usize),
    },
    Vector {
        full: [Tensor; 3],
    },
}

impl FusedTensor {
    /// The tensors in the order of the CUDA struct: grad, param, momentum x3, rms, then
    /// row x3, col x3, row_factor x3, col_factor x3 (matrix) or full x3 (vector).
    fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.grad, &self.param];
        v.extend(self.momentum.iter());
        v.push(&self.rms);
        match &self.factors {
            FusedFactors::Matrix {
                row,
                col,
                row_factor,
                col_factor,
                ..
            } => {
                v.extend(row.iter());
                v.extend(col.iter());
                v.extend(row_factor.iter());
                v.extend(col_factor.iter());
            }
            FusedFactors::Vector { full } => v.extend(full.iter()),
        }
        v
    }
}

/// Decays of the three momenta, the rms and the three Adafactor accumulators, then their
/// complements `1 - decay` rounded to f32 (the layout of `Decays` in the kernels, which read both
/// from the parameter bank). Build it with [`Decays::new`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Decays {
    pub momentum: [f32; 3],
    pub rms: f32,
    pub adafactor: [f32; 3],
    pub pad: f32,
    pub momentum_rest: [f32; 3],
    pub rms_rest: f32,
    pub adafactor_rest: [f32; 3],
    pub pad_rest: f32,
}
// Mirrored by `Decays` in src/cuda/small_fc_lopt.cuh.
mirrored_struct!(Decays, 64, kernel_arg);

impl Decays {
    /// The decays as given and their complements, each `1 - decay` rounded once to f32.
    pub fn new(momentum: [f32; 3], rms: f32, adafactor: [f32; 3]) -> Self {
        Self {
            momentum,
            rms,
            adafactor,
            pad: 0.0,
            momentum_rest: momentum.map(|d| 1.0 - d),
            rms_rest: 1.0 - rms,
            adafactor_rest: adafactor.map(|d| 1.0 - d),
            pad_rest: 0.0,
        }
    }
}

/// Pass 1 over `t` (holding the previous accumulators): the updated accumulators as `[planes,
/// n]` (momentum 0..3, rms, then for vectors the 3 Adafactor accumulators) and the sums over the
/// tensor of the squares of the 28 normalised features (`[28]`).
pub(super) fn accumulate(t: &FusedTensor, decays: Decays) -> Result<(Tensor, Tensor)> {
    let n = t.grad.elem_count();
    let planes = planes(t);
    let out = t.grad.apply_op1_no_bwd(&Stats {
        t: t.clone(),
        decays,
    })?;
    Ok((
        out.narrow(0, 0, planes * n)?.reshape((planes, n))?,
        out.narrow(0, planes * n, FEATURES)?,
    ))
}

/// Accumulator planes pass 1 writes: 3 momenta and the rms, plus 3 for vectors.
fn planes(t: &FusedTensor) -> usize {
    match t.factors {
        FusedFactors::Matrix { .. } => 4,
        FusedFactors::Vector { .. } => 7,
    }
}

/// Scalars of the update pass (the layout of `Hyper` in the kernels).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Hyper {
    pub step_mult: f32,
    pub exp_mult: f32,
    pub lr: f32,
    pub weight_decay: f32,
}
// Mirrored by `Hyper` in src/cuda/small_fc_lopt.cu.
mirrored_struct!(Hyper, 16, kernel_arg);

/// The new parameter values (flat f32) from pass 1's feature `sums` of squares (`[28]`) and the
/// packed MLP; the per-tensor norms `1 / sqrt(sum / n + 1e-5)` are taken inside the pass.
pub(super) fn mlp_update(
    t: &FusedTensor, sums: &Tensor, mlp: &Tensor, hyper: Hyper,
) -> Result<Tensor> {
    t.param.apply_op1_no_bwd(&Update {
        t: t.clone(),
        sums: sums.clone(),
        mlp: mlp.clone(),
        hyper,
    })
}

struct Stats {
    t: FusedTensor,
    decays: Decays,
}

struct Update {
    t: FusedTensor,
    sums: Tensor,
    mlp: Tensor,
    hyper: Hyper,
}

/// Read locks on a list of tensors.
fn lock<'a>(tensors: &[&'a Tensor]) -> Vec<(StorageRef<'a>, &'a Layout)> {
    tensors.iter().map(|t| t.storage_and_layout()).collect()
}

fn cpu_slice<'a>(lock: &'a (StorageRef<'_>, &Layout)) -> Result<&'a [f32]> {
    crate::cpu::locked_slice(lock, OP)
}

/// Runs `f` on the CPU slices of `t`'s tensors, read-locked for the call.
fn with_cpu_tensor<R>(t: &FusedTensor, f: impl FnOnce(&CpuTensor) -> Result<R>) -> Result<R> {
    let tensors = t.tensors();
    let locks = lock(&tensors);
    let slices: Vec<&[f32]> = locks.iter().map(cpu_slice).collect::<Result<_>>()?;
    f(&CpuTensor::new(t, &slices))
}

/// One tensor's data as CPU slices.
struct CpuTensor<'a> {
    grad: &'a [f32],
    param: &'a [f32],
    momentum: [&'a [f32]; 3],
    rms: &'a [f32],
    factors: CpuFactors<'a>,
}

enum CpuFactors<'a> {
    Matrix {
        row: [&'a [f32]; 3],
        col: [&'a [f32]; 3],
        row_factor: [&'a [f32]; 3],
        col_factor: [&'a [f32]; 3],
        axis0: (usize, usize),
        axis1: (usize, usize),
    },
    Vector {
        full: [&'a [f32]; 3],
    },
}

impl<'a> CpuTensor<'a> {
    fn new(t: &FusedTensor, s: &'a [&'a [f32]]) -> Self {
        let three = |at: usize| [s[at], s[at + 1], s[at + 2]];
        let factors = match &t.factors {
            FusedFactors::Matrix { axis0, axis1, .. } => CpuFactors::Matrix {
                row: three(6),
                col: three(9),
                row_factor: three(12),
                col_factor: three(15),
                axis0: *axis0,
                axis1: *axis1,
            },
            FusedFactors::Vector { .. } => CpuFactors::Vector { full: three(6) },
        };
        Self {
            grad: s[0],
            param: s[1],
            momentum: three(2),
            rms: s[5],
            factors,
        }
    }

    /// Element `e` with its accumulators as stored.
    #[inline(always)]
    fn load(&self, e: usize) -> Element {
        let full = match &self.factors {
            CpuFactors::Vector { full } => [full[0][e], full[1][e], full[2][e]],
            CpuFactors::Matrix { .. } => [0.0; 3],
        };
        Element {
            g: self.grad[e],
            p: self.param[e],
            m: [
                self.momentum[0][e],
                self.momentum[1][e],
                self.momentum[2][e],
            ],
            v: self.rms[e],
            full,
        }
    }

    /// The 28 normalised-feature inputs of element `e` in state `s` (spec order, 0..27).
    #[inline(always)]
    fn features(&self, e: usize, s: &Element) -> [f32; FEATURES] {
        let mut x = [0f32; FEATURES];
        let (g, m) = (s.g, s.m);
        let rsqrt_v = 1.0 / (s.v + 1e-6).sqrt();
        x[0] = g;
        x[1] = s.p;
        for k in 0..3 {
            x[2 + k] = m[k];
            x[6 + k] = m[k] * rsqrt_v;
        }
        x[5] = s.v;
        x[9] = rsqrt_v;
        match &self.factors {
            CpuFactors::Matrix {
                row,
                col,
                row_factor,
                col_factor,
                axis0,
                axis1,
            } => {
                let r = drop_axis(e, *axis0);
                let c = drop_axis(e, *axis1);
                for k in 0..3 {
                    let (rf, cf) = (row_factor[k][r], col_factor[k][c]);
                    let (rk, ck) = (row[k][r], col[k][c]);
                    x[10 + k] = g * rf * cf;
                    x[13 + k] = rk;
                    x[16 + k] = ck;
                    x[19 + k] = 1.0 / (rk + 1e-8).sqrt();
                    x[22 + k] = 1.0 / (ck + 1e-8).sqrt();
                    x[25 + k] = m[k] * rf * cf;
                }
            }
            CpuFactors::Vector { .. } => {
                for k in 0..3 {
                    let f = s.full[k];
                    x[10 + k] = g / (f + 1e-9).max(1e-9).sqrt();
                    x[13 + k] = f;
                    x[16 + k] = f;
                    x[19 + k] = 1.0 / (f + 1e-8).sqrt();
                    x[22 + k] = x[19 + k];
                    x[25 + k] = m[k] / (f + 1e-6).sqrt();
                }
            }
        }
        x
    }
}

/// One element's values after this step's accumulator updates.
#[derive(Debug, Clone, Copy)]
struct Element {
    g: f32,
    p: f32,
    m: [f32; 3],
    v: f32,
    /// Vector tensors' Adafactor accumulators (unused for matrices).
    full: [f32; 3],
}

/// The index of element `e` in a tensor with one axis (stride, size) removed.
fn drop_axis(e: usize, (inner, size): (usize, usize)) -> usize {
    (e / (inner * size)) * inner + e % inner
}

fn relu_keep_nan(x: f32) -> f32 {
    if x > 0.0 || x.is_nan() {
        x
    } else {
        0.0
    }
}

impl CustomOp1 for Stats {
    fn name(&self) -> &'static str {
        "fastops-lopt-stats"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        with_cpu_tensor(&self.t, |t| {
            let n = t.grad.len();
            let planes = planes(&self.t);
            let d = self.decays;
            let mut out = vec![0f32; planes * n + FEATURES];
            let (accumulators, sums_out) = out.split_at_mut(planes * n);
            // Plane-major output: chunk c of every plane belongs to the rayon task of chunk c.
            let mut plane_chunks: Vec<Vec<&mut [f32]>> =
                (0..n.div_ceil(CHUNK)).map(|_| Vec::new()).collect();
            for plane in accumulators.chunks_mut(n.max(1)) {
                for (c, chunk) in plane.chunks_mut(CHUNK).enumerate() {
                    plane_chunks[c].push(chunk);
                }
            }
            let sums = plane_chunks
                .into_par_iter()
                .enumerate()
                .map(|(chunk, mut dst)| {
                    let mut acc = [0f64; FEATURES];
                    for (i, e) in (chunk * CHUNK..((chunk + 1) * CHUNK).min(n)).enumerate() {
                        let mut s = t.load(e);
                        let g2 = s.g * s.g;
                        for (k, plane) in dst.iter_mut().take(3).enumerate() {
                            s.m[k] = d.momentum[k] * s.m[k] + (1.0 - d.momentum[k]) * s.g;
                            plane[i] = s.m[k];
                        }
                        s.v = d.rms * s.v + (1.0 - d.rms) * g2;
                        dst[3][i] = s.v;
                        if planes == 7 {
                            for k in 0..3 {
                                s.full[k] = d.adafactor[k] * s.full[k]
                                    + (1.0 - d.adafactor[k]) * (g2 + 1e-30);
                                dst[4 + k][i] = s.full[k];
                            }
                        }
                        let x = t.features(e, &s);
                        for (a, &v) in acc.iter_mut().zip(&x) {
                            *a += (v * v) as f64;
                        }
                    }
                    acc
                })
                .reduce(
                    || [0f64; FEATURES],
                    |mut a, b| {
                        a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                        a
                    },
                );
            for (o, s) in sums_out.iter_mut().zip(&sums) {
                *o = *s as f32;
            }
            let len = out.len();
            Ok((CpuStorage::F32(out), Shape::from(len)))
        })
    }
}

/// The packed MLP with its two hidden layers transposed, so the loops below run over
/// contiguous 32-wide columns.
struct CpuMlp {
    /// Column f of the first layer's weights (feature f's weight into each hidden unit).
    w_in_t: [[f32; HIDDEN]; FEATURES],
    b_eff: [f32; HIDDEN],
    w_1_t: [[f32; HIDDEN]; HIDDEN],
    b_1: [f32; HIDDEN],
    w_direction: [f32; HIDDEN],
    w_magnitude: [f32; HIDDEN],
    b_out: [f32; 2],
}

impl CpuMlp {
    /// From the packed buffer; fixed-size arrays let the compiler keep each 32-wide row in
    /// vector registers.
    fn new(packed: &[f32]) -> Self {
        let (w_in, rest) = packed.split_at(HIDDEN * FEATURES);
        let (b_eff, rest) = rest.split_at(HIDDEN);
        let (w_1, rest) = rest.split_at(HIDDEN * HIDDEN);
        let (b_1, rest) = rest.split_at(HIDDEN);
        let (w_out, b_out) = rest.split_at(2 * HIDDEN);
        let array = |s: &[f32]| -> [f32; HIDDEN] { std::array::from_fn(|j| s[j]) };
        Self {
            w_in_t: std::array::from_fn(|f| std::array::from_fn(|j| w_in[j * FEATURES + f])),
            b_eff: array(b_eff),
            w_1_t: std::array::from_fn(|i| std::array::from_fn(|j| w_1[j * HIDDEN + i])),
            b_1: array(b_1),
            w_direction: array(&w_out[..HIDDEN]),
            w_magnitude: array(&w_out[HIDDEN..]),
            b_out: [b_out[0], b_out[1]],
        }
    }
}

/// New parameter values for elements `first..first + dst.len()`. The indexed loops over
/// fixed-size arrays are deliberate: they compile to 32-wide vector multiply-adds.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn update_chunk(
    t: &CpuTensor, net: &CpuMlp, scale: &[f32], h: Hyper, first: usize,
    dst: &mut [std::mem::MaybeUninit<f32>],
) {
    for (i, d) in dst.iter_mut().enumerate() {
        let e = first + i;
        let s = t.load(e);
        let mut x = t.features(e, &s);
        for (x, s) in x.iter_mut().zip(scale) {
            *x *= s;
        }
        // Plain multiply-adds (not `mul_add`, a libm call without hardware FMA), laid out for
        // the vectoriser: each input scales a column of the transposed weights, accumulated
        // into all 32 outputs at once.
        let mut h1 = net.b_eff;
        for (col, &xf) in net.w_in_t.iter().zip(&x) {
            for j in 0..HIDDEN {
                h1[j] += col[j] * xf;
            }
        }
        let mut h2 = net.b_1;
        for (col, &hi) in net.w_1_t.iter().zip(&h1) {
            let hi = relu_keep_nan(hi);
            for j in 0..HIDDEN {
                h2[j] += col[j] * hi;
            }
        }
        let (mut direction, mut magnitude) = (net.b_out[0], net.b_out[1]);
        for j in 0..HIDDEN {
            let s = relu_keep_nan(h2[j]);
            direction += net.w_direction[j] * s;
            magnitude += net.w_magnitude[j] * s;
        }
        let step = direction * (h.exp_mult * magnitude).exp() * h.step_mult;
        let mut p = s.p - h.lr * step;
        if h.weight_decay > 0.0 {
            p -= h.lr * h.weight_decay * p;
        }
        d.write(p);
    }
}

impl CustomOp1 for Update {
    fn name(&self) -> &'static str {
        "fastops-lopt-update"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        with_cpu_tensor(&self.t, |t| {
            let extra = lock(&[&self.sums, &self.mlp]);
            let n_elems = self.t.grad.elem_count().max(1) as f32;
            let scale: Vec<f32> = cpu_slice(&extra[0])?
                .iter()
                .map(|&sum| 1.0 / (sum / n_elems + 1e-5).sqrt())
                .collect();
            let scale = scale.as_slice();
            let mlp = cpu_slice(&extra[1])?;
            let net = CpuMlp::new(mlp);
            let h = self.hyper;
            let n = t.grad.len();
            let write_all = |out: &mut [std::mem::MaybeUninit<_>]| {
                out.par_chunks_mut(CHUNK)
                    .enumerate()
                    .for_each(|(chunk, dst)| {
                        crate::cpu::vectorized(
                            #[inline(always)]
                            || update_chunk(t, &net, scale, h, chunk * CHUNK, dst),
                        )
                    })
            };
            // SAFETY: the chunks cover 0..n and write every element.
            let out = unsafe { crate::cpu::written_output::<f32>(n, write_all) };
            Ok((CpuStorage::F32(out), Shape::from(n)))
        })
    }
}
