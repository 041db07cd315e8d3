//! The CPU attention: FlashAttention-2's tiled algorithm over contiguous copies of q, k and v
//! in the accumulator type, with rayon over (batch, head, query tile) for the forward. The
//! backward takes one pass where there are at least as many (batch, kv head) pairs as threads (a
//! task per pair: S and dP formed once per tile pair, five products), else two: rayon over
//! (batch, head, query tile) for the query gradient and over (batch, kv head, key tile) for the
//! key and value gradients (seven products); both give the same bits. Products of tiles go
//! through the `gemm` crate; no `m x n` buffer exists, only `ROWS x COLS` tiles of scores per
//! task. Empty tiles are skipped, full tiles are not masked element by element.

use super::mask::{document_tile_state, generated_tile_state, Kind, TileData};
use super::Problem;
use crate::matmul::core::CpuGemm;
use crate::tile_summary::{TILE_EMPTY, TILE_FULL};
use rayon::prelude::*;

/// The accumulator types of the CPU attention (f32, f64).
pub(super) trait AttentionFloat: CpuGemm + crate::cpu::FastExp {}
impl AttentionFloat for f64 {}
impl AttentionFloat for f32 {}

/// Query rows and keys per tile.
pub(super) const ROWS: usize = 128;
pub(super) const COLS: usize = 64;

/// `dst[m x n] (row-major) = (dst if accumulate) + lhs . rhs`, where `lhs` is `m x k` with
/// element `(r, c)` at `lhs.0[r * lhs.1 + c * lhs.2]` and `rhs` is `k x n` likewise.
#[allow(clippy::too_many_arguments)]
fn gemm_into<A: CpuGemm>(
    (m, n, k): (usize, usize, usize), dst: &mut [A], lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize), accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(A::zero());
        }
        return;
    }
    let last = |(s, rs, cs): (&[A], usize, usize), rows: usize, cols: usize| {
        assert!(
            (rows - 1) * rs + (cols - 1) * cs < s.len(),
            "attention: tile outside its buffer"
        );
    };
    last(lhs, m, k);
    last(rhs, k, n);
    assert!(dst.len() >= m * n, "attention: tile outside its buffer");
    // SAFETY: every element read or written lies inside its slice (checked above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            A::one(),
            A::one(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The mask of one (batch entry, head) as the CPU reads it.
pub(super) enum HeadMask<'a> {
    Generated {
        kind: &'a Kind,
        offset: i64,
    },
    Documents {
        ids: &'a [i64],
        causal: bool,
        rows: &'a [(i64, i64)],
        cols: &'a [(i64, i64)],
    },
    Dense {
        mask: &'a [u8],
        base: usize,
        row_stride: usize,
        col_stride: usize,
        states: &'a [u8],
        col_tiles: usize,
    },
}

impl HeadMask<'_> {
    /// The state of query tile `qt` against key tile `kt`.
    fn tile_state(&self, qt: usize, kt: usize, m: usize, n: usize) -> u8 {
        let rows = qt * ROWS..((qt + 1) * ROWS).min(m);
        let cols = kt * COLS..((kt + 1) * COLS).min(n);
        match self {
            HeadMask::Generated { kind, offset } => generated_tile_state(kind, rows, cols, *offset),
            HeadMask::Documents {
                causal,
                rows: row_ranges,
                cols: col_ranges,
                ..
            } => document_tile_state((row_ranges[qt], col_ranges[kt]), rows, cols, *causal),
            HeadMask::Dense {
                states, col_tiles, ..
            } => states[qt * col_tiles + kt],
        }
    }

    /// Query `i`'s scores against keys `j0..j0 + row.len()` (inside a partial tile): each
    /// multiplied by `scale` where the query sees the key, `-inf` where it does not.
    #[inline(always)]
    fn scale_row<A: num_traits::Float>(&self, row: &mut [A], i: usize, j0: usize, scale: A) {
        let keep = |x: &mut A, visible: bool| {
            *x = if visible {
                *x * scale
            } else {
                A::neg_infinity()
            };
        };
        match self {
            HeadMask::Generated { kind, offset } => {
                // Query `i` at position `pos = i + n - m` sees keys `first..=last`: causal, `j <= pos`;
                // a window also `pos - j < window`.
                let pos = i as i64 + offset;
                let (first, last) = match kind {
                    Kind::Causal => (i64::MIN, pos),
                    Kind::Window(w) => (pos - *w as i64 + 1, pos),
                    _ => (i64::MIN, i64::MAX),
                };
                for (j, x) in (j0 as i64..).zip(row.iter_mut()) {
                    keep(x, first <= j && j <= last);
                }
            }
            HeadMask::Documents { ids, causal, .. } => {
                let (id, keys) = (ids[i], &ids[j0..j0 + row.len()]);
                for ((j, x), &key) in (j0..).zip(row.iter_mut()).zip(keys) {
                    keep(x, key == id && (!causal || j <= i));
                }
            }
            HeadMask::Dense {
                mask,
                base,
                row_stride,
                col_stride,
                ..
            } => {
                let at = base + i * row_stride + j0 * col_stride;
                for (x, jj) in row.iter_mut().zip(0..) {
                    keep(x, mask[at + jj * col_stride] != 0);
                }
            }
        }
    }
}

/// The masks of every (batch entry, head) of a problem.
pub(super) struct CpuMask<'a> {
    pub kind: &'a Kind,
    pub tiles: Option<&'a TileData>,
    /// A dense mask: its bytes, start, strides `[batch, head, row, col]`, its batch and head
    /// counts (1 when broadcast), and its tile states `[mb * mh, row_tiles, col_tiles]`.
    pub dense: Option<DenseBytes<'a>>,
}

pub(super) struct DenseBytes<'a> {
    pub mask: &'a [u8],
    pub start: usize,
    pub strides: [usize; 4],
    pub batch: usize,
    pub heads: usize,
    pub states: &'a [u8],
}

impl CpuMask<'_> {
    fn head(&self, p: &Problem, b: usize, h: usize) -> HeadMask<'_> {
        match (self.kind, self.tiles, &self.dense) {
            (
                Kind::Documents {
                    ids, seq, causal, ..
                },
                Some(TileData::DocRanges { rows, cols }),
                _,
            ) => {
                let (rt, ct) = (seq.div_ceil(ROWS), seq.div_ceil(COLS));
                HeadMask::Documents {
                    ids: &ids[b * seq..(b + 1) * seq],
                    causal: *causal,
                    rows: &rows[b * rt..(b + 1) * rt],
                    cols: &cols[b * ct..(b + 1) * ct],
                }
            }
            (Kind::Dense { .. }, _, Some(d)) => {
                let (bi, hi) = (
                    if d.batch == 1 { 0 } else { b },
                    if d.heads == 1 { 0 } else { h },
                );
                let (rt, ct) = (p.m.div_ceil(ROWS), p.n.div_ceil(COLS));
                let at = (bi * d.heads + hi) * rt * ct;
                HeadMask::Dense {
                    mask: d.mask,
                    base: d.start + bi * d.strides[0] + hi * d.strides[1],
                    row_stride: d.strides[2],
                    col_stride: d.strides[3],
                    states: &d.states[at..at + rt * ct],
                    col_tiles: ct,
                }
            }
            (kind, _, _) => HeadMask::Generated {
                kind,
                offset: p.n as i64 - p.m as i64,
            },
        }
    }
}

/// The scores of one tile: `s[r x c] = scale * q_rows . k_colsᵀ`, masked to `-inf` where the
/// query does not see the key (partial tiles only).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_scores<A: AttentionFloat>(
    s: &mut [A], q: &[A], k: &[A], (r, c, d): (usize, usize, usize), scale: A, mask: &HeadMask<'_>,
    partial: bool, (i0, j0): (usize, usize),
) {
    gemm_into((r, c, d), s, (q, d, 1), (k, 1, d), false);
    let s = &mut s[..r * c];
    if !partial {
        for x in s.iter_mut() {
            *x = *x * scale;
        }
        return;
    }
    for (ri, row) in s.chunks_mut(c).enumerate() {
        mask.scale_row(row, i0 + ri, j0, scale);
    }
}

/// One query tile of one head, walked over the key tiles its mask leaves.
struct QueryTile<'a, A> {
    head: &'a HeadMask<'a>,
    /// The tile's index and first query, its rows (`r x d`), the problem's sizes.
    qt: usize,
    i0: usize,
    q: &'a [A],
    p: &'a Problem,
    scale: A,
}

impl<'a, A: AttentionFloat> QueryTile<'a, A> {
    fn new(head: &'a HeadMask<'a>, qt: usize, q: &'a [A], p: &'a Problem, scale: A) -> Self {
        let i0 = qt * ROWS;
        Self {
            head,
            qt,
            i0,
            q,
            p,
            scale,
        }
    }

    /// For each key tile the mask does not hide, in order: the masked scores of the tile into
    /// `s` (`r x c`), then `f(s, c, keys, values)` with the tile's rows of `k` and `v`.
    #[inline(always)]
    fn for_each_key_tile(
        &self, (k, v): (&[A], &[A]), s: &mut [A], mut f: impl FnMut(&mut [A], usize, &[A], &[A]),
    ) {
        let Problem { m, n, d, dv, .. } = *self.p;
        let r = self.q.len() / d;
        for kt in 0..n.div_ceil(COLS) {
            let state = self.head.tile_state(self.qt, kt, m, n);
            if state == TILE_EMPTY {
                continue;
            }
            let j0 = kt * COLS;
            let c = COLS.min(n - j0);
            let (keys, values) = (&k[j0 * d..(j0 + c) * d], &v[j0 * dv..(j0 + c) * dv]);
            let partial = state != TILE_FULL;
            let at = (self.i0, j0);
            tile_scores(
                s,
                self.q,
                keys,
                (r, c, d),
                self.scale,
                self.head,
                partial,
                at,
            );
            f(&mut s[..r * c], c, keys, values);
        }
    }
}

/// Forward of every (batch entry, head): `out` `[b, h, m, dv]` and `lse` `[b, h, m]` (natural
/// log; `-inf` for a query that sees no key, whose output row is zero). `q` `[b, h, m, d]`, `k`
/// `[b, hk, n, d]`, `v` `[b, hk, n, dv]`, contiguous.
pub(super) fn forward<A: AttentionFloat>(
    p: &Problem, mask: &CpuMask<'_>, (q, k, v): (&[A], &[A], &[A]), out: &mut [A], lse: &mut [f64],
) {
    let (m, n, d, dv) = (p.m, p.n, p.d, p.dv);
    if m == 0 {
        return;
    }
    let scale = A::from(p.scale).unwrap_or_else(A::one);
    let group = p.heads / p.kv_heads;
    out.par_chunks_mut(m * dv.max(1))
        .zip(lse.par_chunks_mut(m))
        .enumerate()
        .for_each(|(bh, (out, lse))| {
            let (b, h) = (bh / p.heads, bh % p.heads);
            let hk = h / group;
            let head = mask.head(p, b, h);
            let q = &q[bh * m * d..(bh + 1) * m * d];
            let kv = b * p.kv_heads + hk;
            let (k, v) = (
                &k[kv * n * d..(kv + 1) * n * d],
                &v[kv * n * dv..(kv + 1) * n * dv],
            );
            out.par_chunks_mut(ROWS * dv.max(1))
                .zip(lse.par_chunks_mut(ROWS))
                .enumerate()
                .for_each(|(qt, (out, lse))| {
                    let i0 = qt * ROWS;
                    let q = &q[i0 * d..(i0 + lse.len()) * d];
                    let tile = QueryTile::new(&head, qt, q, p, scale);
                    crate::cpu::vectorized(
                        #[inline(always)]
                        || forward_query_tile(&tile, (k, v), out, lse),
                    );
                });
        });
}

/// The forward of one query tile (its `r` rows of `out`, `r x dv`, and of `lse`): the online
/// softmax over the key tiles its mask leaves.
#[inline(always)]
fn forward_query_tile<A: AttentionFloat>(
    tile: &QueryTile<'_, A>, (k, v): (&[A], &[A]), out: &mut [A], lse: &mut [f64],
) {
    let dv = tile.p.dv;
    let r = lse.len();
    let mut s = vec![A::zero(); r * COLS];
    let mut max = vec![A::neg_infinity(); r];
    let mut sum = vec![A::zero(); r];
    let mut acc = vec![A::zero(); r * dv];
    tile.for_each_key_tile(
        (k, v),
        &mut s,
        #[inline(always)]
        |s, c, _, vt| {
            for ri in 0..r {
                let row = &mut s[ri * c..(ri + 1) * c];
                let new_max = max[ri].max(crate::cpu::max_lanes(row));
                if new_max == A::neg_infinity() {
                    row.fill(A::zero());
                    continue;
                }
                let alpha = (max[ri] - new_max).fast_exp();
                let total = crate::cpu::exp_shifted(row, new_max);
                sum[ri] = sum[ri] * alpha + total;
                max[ri] = new_max;
                if alpha != A::one() {
                    for a in &mut acc[ri * dv..(ri + 1) * dv] {
                        *a = *a * alpha;
                    }
                }
            }
            gemm_into((r, dv, c), &mut acc, (s, c, 1), (vt, dv, 1), true);
        },
    );
    for ri in 0..r {
        let row = &mut out[ri * dv..(ri + 1) * dv];
        if sum[ri] > A::zero() {
            let inv = A::one() / sum[ri];
            for (o, &a) in row.iter_mut().zip(&acc[ri * dv..(ri + 1) * dv]) {
                *o = a * inv;
            }
            lse[ri] = (max[ri] + sum[ri].ln()).to_f64().unwrap_or(f64::NAN);
        } else {
            row.fill(A::zero());
            lse[ri] = f64::NEG_INFINITY;
        }
    }
}

/// The probabilities of a tile recomputed from the saved log-sum-exp: `s` holds the masked
/// scores on entry and `exp(s - lse)` on return (0 for masked entries and for rows that see no
/// key).
#[inline(always)]
fn probabilities<A: AttentionFloat>(s: &mut [A], c: usize, lse: &[f64]) {
    for (row, &l) in s.chunks_mut(c).zip(lse) {
        if l == f64::NEG_INFINITY {
            row.fill(A::zero());
            continue;
        }
        crate::cpu::exp_shifted(row, A::from(l).unwrap_or_else(A::zero));
    }
}

/// `dS = P * (dP - delta)` in place of `dP`, row by row (`c` keys a row; `p` and `delta` give
/// the rows there are).
#[inline(always)]
fn score_gradients<A: AttentionFloat>(dp: &mut [A], p: &[A], c: usize, delta: &[A]) {
    for ((dp, p), &delta) in dp.chunks_mut(c).zip(p.chunks(c)).zip(delta) {
        for (dp, &p) in dp.iter_mut().zip(p) {
            *dp = p * (*dp - delta);
        }
    }
}

/// Inputs of the backward, contiguous in the accumulator type: the forward's inputs, its output
/// and log-sum-exp, and the output's gradient.
pub(super) struct Saved<'a, A> {
    pub q: &'a [A],
    pub k: &'a [A],
    pub v: &'a [A],
    pub out: &'a [A],
    pub lse: &'a [f64],
    pub grad_out: &'a [A],
}

/// `dq` `[b, h, m, d]`, `dk` `[b, hk, n, d]` and `dv` `[b, hk, n, dv]` (written completely).
pub(super) fn backward<A: AttentionFloat>(
    p: &Problem, mask: &CpuMask<'_>, x: &Saved<'_, A>,
    (dq, dk, dv_out): (&mut [A], &mut [A], &mut [A]),
) {
    let (m, n, d, dv) = (p.m, p.n, p.d, p.dv);
    let scale = A::from(p.scale).unwrap_or_else(A::one);
    let group = p.heads / p.kv_heads;
    // delta[i] = rowsum(dO[i] * O[i]) for every query row.
    let rows = p.batch * p.heads * m;
    let delta: Vec<A> = (0..rows)
        .into_par_iter()
        .map(|row| {
            let (o, g) = (
                &x.out[row * dv..(row + 1) * dv],
                &x.grad_out[row * dv..(row + 1) * dv],
            );
            o.iter().zip(g).fold(A::zero(), |acc, (&o, &g)| acc + o * g)
        })
        .collect();
    if one_pass(p) {
        // A task per (batch entry, kv head): its key tiles in order, each adding its share of
        // the group's query gradient (so dq sums over key tiles in the order of the two passes
        // below, and every value is theirs, bit for bit), with S and dP formed once.
        let query_rows = group * m * d;
        dq.par_chunks_mut(query_rows)
            .zip(dk.par_chunks_mut(n * d))
            .zip(dv_out.par_chunks_mut(n * dv))
            .enumerate()
            .for_each(|(kvh, ((dq, dk_head), dv_head))| {
                dq.fill(A::zero());
                let tiles = dk_head
                    .chunks_mut(COLS * d)
                    .zip(dv_head.chunks_mut(COLS * dv));
                for (kt, (dk, dv)) in tiles.enumerate() {
                    crate::cpu::vectorized(
                        #[inline(always)]
                        || {
                            key_value_gradient_tile(
                                p,
                                mask,
                                x,
                                &delta,
                                (kvh, kt),
                                (dk, dv),
                                Some(dq),
                            )
                        },
                    )
                }
                for g in dq.iter_mut() {
                    *g = *g * scale;
                }
            });
        return;
    }
    // The query gradient: a task per (batch entry, head, query tile).
    if m > 0 && d > 0 {
        dq.par_chunks_mut(m * d).enumerate().for_each(|(bh, dq)| {
            let (b, h) = (bh / p.heads, bh % p.heads);
            let kv = b * p.kv_heads + h / group;
            let head = mask.head(p, b, h);
            let k = &x.k[kv * n * d..(kv + 1) * n * d];
            let v = &x.v[kv * n * dv..(kv + 1) * n * dv];
            dq.par_chunks_mut(ROWS * d)
                .enumerate()
                .for_each(|(qt, dq)| {
                    let row0 = bh * m + qt * ROWS;
                    let q = &x.q[row0 * d..row0 * d + dq.len()];
                    let tile = QueryTile::new(&head, qt, q, p, scale);
                    crate::cpu::vectorized(
                        #[inline(always)]
                        || query_gradient_tile(&tile, x, &delta, row0, (k, v), dq),
                    )
                });
        });
    }
    // The key and value gradients: a task per (batch entry, kv head, key tile), over the query
    // heads of its group.
    let kv_heads = p.batch * p.kv_heads;
    dk.par_chunks_mut((n * d).max(1))
        .zip(dv_out.par_chunks_mut((n * dv).max(1)))
        .take(kv_heads)
        .enumerate()
        .for_each(|(kvh, (dk, dv))| {
            let mut dk_tiles: Vec<&mut [A]> = dk.chunks_mut(COLS * d).collect();
            let mut dv_tiles: Vec<&mut [A]> = dv.chunks_mut(COLS * p.dv).collect();
            dk_tiles
                .par_iter_mut()
                .zip(dv_tiles.par_iter_mut())
                .enumerate()
                .for_each(|(kt, (dk, dv))| {
                    crate::cpu::vectorized(
                        #[inline(always)]
                        || key_value_gradient_tile(p, mask, x, &delta, (kvh, kt), (dk, dv), None),
                    )
                });
        });
}

/// The query gradient of one query tile (`dq`, its `r x d` rows; `row0` its first row over
/// every (batch entry, head)), written completely.
#[inline(always)]
fn query_gradient_tile<A: AttentionFloat>(
    tile: &QueryTile<'_, A>, x: &Saved<'_, A>, delta: &[A], row0: usize, (k, v): (&[A], &[A]),
    dq: &mut [A],
) {
    let Problem { d, dv, .. } = *tile.p;
    let r = dq.len() / d;
    let go = &x.grad_out[row0 * dv..(row0 + r) * dv];
    let lse = &x.lse[row0..row0 + r];
    let delta = &delta[row0..row0 + r];
    dq.fill(A::zero());
    let (mut s, mut dp) = (vec![A::zero(); r * COLS], vec![A::zero(); r * COLS]);
    tile.for_each_key_tile(
        (k, v),
        &mut s,
        #[inline(always)]
        |s, c, keys, values| {
            probabilities(s, c, lse);
            // dP = dO . Vᵀ, dS = P * (dP - delta).
            gemm_into((r, c, dv), &mut dp, (go, dv, 1), (values, 1, dv), false);
            score_gradients(&mut dp, s, c, delta);
            gemm_into((r, d, c), dq, (&dp, c, 1), (keys, d, 1), true);
        },
    );
    for g in dq.iter_mut() {
        *g = *g * tile.scale;
    }
}

/// Whether the backward takes one pass (`backward`): a task per (batch entry, kv head), enough
/// of them to keep every thread busy, and no empty dimension.
fn one_pass(p: &Problem) -> bool {
    let tasks = p.batch * p.kv_heads;
    p.m > 0 && p.n > 0 && p.d > 0 && p.dv > 0 && tasks >= rayon::current_num_threads()
}

/// The key and value gradients of key tile `kt` of (batch entry, kv head) `kvh` (`dk` `c x d`,
/// `dv` `c x dv`), over the query heads of its group, written completely; with `dq` (the
/// group's query gradients, `[group, m, d]`, before the scale), the tile's share of them added.
#[inline(always)]
fn key_value_gradient_tile<A: AttentionFloat>(
    p: &Problem, mask: &CpuMask<'_>, x: &Saved<'_, A>, delta: &[A], (kvh, kt): (usize, usize),
    (dk, dvv): (&mut [A], &mut [A]), mut dq: Option<&mut [A]>,
) {
    let Problem { m, n, d, dv, .. } = *p;
    let scale = A::from(p.scale).unwrap_or_else(A::one);
    let group = p.heads / p.kv_heads;
    let (b, hk) = (kvh / p.kv_heads, kvh % p.kv_heads);
    let j0 = kt * COLS;
    let c = COLS.min(n - j0);
    let keys = &x.k[(kvh * n + j0) * d..(kvh * n + j0 + c) * d];
    let values = &x.v[(kvh * n + j0) * dv..(kvh * n + j0 + c) * dv];
    dk.fill(A::zero());
    dvv.fill(A::zero());
    let (mut s, mut ds) = (vec![A::zero(); ROWS * c], vec![A::zero(); ROWS * c]);
    for h in hk * group..(hk + 1) * group {
        let bh = b * p.heads + h;
        let head = mask.head(p, b, h);
        for qt in 0..m.div_ceil(ROWS) {
            let state = head.tile_state(qt, kt, m, n);
            if state == TILE_EMPTY {
                continue;
            }
            let i0 = qt * ROWS;
            let r = ROWS.min(m - i0);
            let row0 = bh * m + i0;
            let q = &x.q[row0 * d..(row0 + r) * d];
            let go = &x.grad_out[row0 * dv..(row0 + r) * dv];
            let partial = state != TILE_FULL;
            tile_scores(&mut s, q, keys, (r, c, d), scale, &head, partial, (i0, j0));
            let s = &mut s[..r * c];
            probabilities(s, c, &x.lse[row0..row0 + r]);
            // dV += Pᵀ . dO
            gemm_into((c, dv, r), dvv, (s, 1, c), (go, dv, 1), true);
            // dS = P * (dO . Vᵀ - delta); dK += dSᵀ . Q
            gemm_into((r, c, dv), &mut ds, (go, dv, 1), (values, 1, dv), false);
            score_gradients(&mut ds, s, c, &delta[row0..row0 + r]);
            gemm_into((c, d, r), dk, (&ds, 1, c), (q, d, 1), true);
            // dQ += dS . K (scaled by the caller)
            if let Some(dq) = dq.as_deref_mut() {
                let at = ((h - hk * group) * m + i0) * d;
                gemm_into(
                    (r, d, c),
                    &mut dq[at..at + r * d],
                    (&ds, c, 1),
                    (keys, d, 1),
                    true,
                );
            }
        }
    }
    for g in dk.iter_mut() {
        *g = *g * scale;
    }
}
