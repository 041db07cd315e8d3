//! The CUDA side of `masked_attention`: the kernels' argument structs, the mask's data on the
//! device, and the launches (`src/cuda/attention.cu`; on compute capability 9.0 the forward and
//! the non-deterministic backward from `src/cuda/sm90/attention.cu`).
//!
//! f16 and bf16 run the tensor-core kernels, whose head dims are padded to 64, 128 or 256; f32
//! runs the warp-per-row kernels. Operands must have unit column strides, head dims a multiple of
//! 8 and, for 16-bit types, 16-byte aligned rows: `super::cuda_operand` makes them so.

use super::mask::{Kind, TileData};
use super::{AttentionMask, Problem, OP};
use crate::cuda::{alloc_output, Kernel, Module};
use crate::dispatch::mirrored_struct;
use crate::dispatch::with_float_cuda_type;
use crate::kernel_constants::attention as C;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    self, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor, WithDType,
};
use std::ops::Deref;

/// Mirrors `MaskArgs` in `src/cuda/attention_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MaskArgs {
    dense_strides: [i64; 4],
    states_batch_stride: i64,
    states_head_stride: i64,
    window: i64,
    kind: i32,
    doc_causal: i32,
}
// Mirrored by `MaskArgs` in src/cuda/attention_common.cuh.
mirrored_struct!(MaskArgs, 64);

/// Mirrors `AttentionArgs` in `src/cuda/attention_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttentionArgs {
    q_strides: [i64; 3],
    k_strides: [i64; 3],
    v_strides: [i64; 3],
    o_strides: [i64; 3],
    dq_strides: [i64; 3],
    dk_strides: [i64; 3],
    dv_strides: [i64; 3],
    batch: i64,
    heads: i64,
    kv_heads: i64,
    m: i64,
    n: i64,
    d: i64,
    dv: i64,
    row_tiles: i64,
    col_tiles: i64,
    scale: f32,
    scale_log2: f32,
    mask: MaskArgs,
    /// The one-pass backward's blocks go this many (batch, kv head) pairs at a time.
    bwd_pair_group: i64,
}
// Mirrored by `AttentionArgs` in src/cuda/attention_common.cuh.
mirrored_struct!(AttentionArgs, 320, kernel_arg);

const TILE_Q: usize = C::TILE_Q;
const TILE_K: usize = C::TILE_K;
const TC_THREADS: u32 = (C::WARPS * 32) as u32;
const ROW_WARPS: usize = C::ROW_WARPS;

/// What an operand must look like for the kernels: unit column stride, and for 16-bit types rows
/// and heads starting on 16 bytes.
pub(super) fn operand_ok(layout: &Layout, dtype: DType) -> bool {
    let (dims, strides) = (layout.dims(), layout.stride());
    let unit_columns = dims[3] <= 1 || strides[3] == 1;
    if dtype == DType::F32 {
        return unit_columns;
    }
    let aligned = |x: usize| x.is_multiple_of(8);
    unit_columns
        && aligned(layout.start_offset())
        && (0..3).all(|i| dims[i] <= 1 || aligned(strides[i]))
}

/// `t` as the kernels take it ([`operand_ok`]): itself, a contiguous copy, or (contiguous but
/// starting off a 16-byte boundary) a fresh copy. Candle ops, so gradients flow through them.
pub(super) fn kernel_operand(t: Tensor) -> Result<Tensor> {
    if operand_ok(t.layout(), t.dtype()) {
        Ok(t)
    } else if !t.is_contiguous() {
        t.contiguous()
    } else {
        t.affine(1.0, 0.0)
    }
}

/// The mask's data on the device, with the kernels' mask arguments.
#[derive(Clone)]
pub(super) struct DeviceMask {
    args: MaskArgs,
    states: Option<Tensor>,
    dense: Option<Tensor>,
    ids: Option<Tensor>,
    /// Documents in contiguous runs: each position's document (`document_runs`), which the
    /// tensor-core kernels (Hopper and portable) read in place of the ids and tile states.
    runs: Option<Tensor>,
}

impl DeviceMask {
    pub(super) fn new(
        mask: &AttentionMask, p: &Problem, device: &candle_core::Device,
    ) -> Result<Self> {
        let mut dm = DeviceMask {
            args: MaskArgs::default(),
            states: None,
            dense: None,
            ids: None,
            runs: None,
        };
        let tiles = p.m.div_ceil(TILE_Q) * p.n.div_ceil(TILE_K);
        let data = mask.tile_data(TILE_Q, TILE_K, p.m, p.n, device)?;
        match (mask.kind(), data.as_deref()) {
            (Kind::Full, _) => dm.args.kind = C::MASK_FULL,
            (Kind::Causal, _) => dm.args.kind = C::MASK_CAUSAL,
            (Kind::Window(w), _) => {
                dm.args.kind = C::MASK_WINDOW;
                dm.args.window = (*w).min(p.m + p.n + 1) as i64;
            }
            (Kind::Documents { causal, .. }, Some(TileData::DocDevice { states, ids, runs })) => {
                dm.args.kind = C::MASK_DOCUMENTS;
                dm.args.doc_causal = *causal as i32;
                dm.args.states_batch_stride = tiles as i64;
                dm.states = Some(states.clone());
                dm.ids = Some(ids.clone());
                dm.runs = runs.clone().filter(|_| runs_chosen());
            }
            (Kind::Dense { mask }, Some(TileData::DenseStates(states))) => {
                let (mb, mh, _, _) = mask.dims4()?;
                let s = mask.layout().stride();
                let broadcast =
                    |count: usize, stride: usize| if count == 1 { 0 } else { stride as i64 };
                dm.args.kind = C::MASK_DENSE;
                dm.args.dense_strides = [
                    broadcast(mb, s[0]),
                    broadcast(mh, s[1]),
                    s[2] as i64,
                    s[3] as i64,
                ];
                dm.args.states_batch_stride = broadcast(mb, mh * tiles);
                dm.args.states_head_stride = broadcast(mh, tiles);
                dm.states = Some(states.contiguous()?);
                dm.dense = Some(mask.clone());
            }
            _ => bail!("{OP}: internal error, the mask has no device data"),
        }
        Ok(dm)
    }

    /// The mask as the tensor-core kernels (Hopper and portable) read it: documents in
    /// contiguous runs become `MASK_RUNS` (each query sees one run of keys: the per-position runs
    /// in place of the ids, no tile states); every other mask stays as it is. The f32 kernels
    /// read the mask as it is.
    fn with_runs(&self) -> DeviceMask {
        match &self.runs {
            Some(runs) => DeviceMask {
                args: MaskArgs {
                    kind: C::MASK_RUNS,
                    states_batch_stride: 0,
                    ..self.args
                },
                states: None,
                dense: None,
                ids: Some(runs.clone()),
                runs: None,
            },
            None => self.clone(),
        }
    }

    /// The mask as the kernels of `path` read it: [`Self::with_runs`] for the tensor-core
    /// kernels, as it is for the f32 ones.
    fn for_path(&self, path: Path) -> DeviceMask {
        match path {
            Path::TensorCores { .. } => self.with_runs(),
            Path::Rows => self.clone(),
        }
    }
}

/// Whether the tensor-core kernels read documents in contiguous runs as runs (`MASK_RUNS`), the
/// default; `CANDLE_FASTOPS_ATTENTION_RUNS=0` makes them read the tile states and ids instead (as
/// for documents whose ids recur), for comparisons. Read once per process.
fn runs_chosen() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| std::env::var("CANDLE_FASTOPS_ATTENTION_RUNS").as_deref() != Ok("0"))
}

/// The one-pass backward's head tile, keys and threads per block (`bwd_tc` in
/// `src/cuda/attention.cu`).
const ONE_PASS_HEAD_TILE: usize = 128;
/// How many (batch, kv head) pairs the one-pass backward's blocks take at a time: few enough
/// that their Q / dO tiles and dq_accum rows stay in L2 (4 pairs of 8192 tokens at head dim 128:
/// ~32 MB), enough that a group's longest key blocks do not outlast it (BENCHMARKS.md,
/// masked_attention, session 43).
const ONE_PASS_PAIR_GROUP: i64 = 4;
const ONE_PASS_KEYS: usize = C::ONE_PASS_KEYS;
const ONE_PASS_THREADS: u32 = (C::ONE_PASS_WARPS * 32) as u32;

/// The one-pass backward's dynamic shared memory: K and V (ONE_PASS_KEYS rows each),
/// ONE_PASS_STAGES stages of Q and dO and two buffers of P and dS (TILE_Q rows each), rows of 128
/// elements (swizzled, no padding); then ONE_PASS_STAGES stages of the tile's lse and delta (f32).
fn one_pass_shared_bytes(elem: usize) -> usize {
    let rows = 2 * ONE_PASS_KEYS + 2 * C::ONE_PASS_STAGES * TILE_Q + 4 * TILE_Q;
    rows * ONE_PASS_HEAD_TILE * elem + 2 * C::ONE_PASS_STAGES * TILE_Q * 4
}

/// Whether the backward runs as one pass (`bwd_tc`: S and dP once per tile pair, dq summed with
/// float atomics) rather than as the dq and dk / dv passes: f16 / bf16 at head tile 128, not
/// deterministic, with the shared memory it needs (`one_pass_shared_bytes`, 226 KiB: what compute
/// capability 9.0 lets a block have); any mask
/// (documents in runs through their own instance). `CANDLE_FASTOPS_ATTENTION_ONE_PASS=0` turns
/// it off, for comparisons (read once per process).
fn one_pass_backward(dev: &CudaDevice, p: &Problem, path: Path) -> Result<bool> {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let allowed = *ALLOWED
        .get_or_init(|| std::env::var("CANDLE_FASTOPS_ATTENTION_ONE_PASS").as_deref() != Ok("0"));
    if !allowed
        || p.deterministic
        || !matches!(
            path,
            Path::TensorCores {
                head_tile: ONE_PASS_HEAD_TILE
            }
        )
    {
        return Ok(false);
    }
    Ok(crate::cuda::max_shared_per_block(dev)? >= one_pass_shared_bytes(2))
}

/// A tensor's storage, held (read-locked) for a launch.
struct Held<'a> {
    guard: Box<dyn Deref<Target = Storage> + 'a>,
    start: usize,
}

impl<'a> Held<'a> {
    fn new(t: &'a Tensor) -> Self {
        let (guard, layout) = t.storage_and_layout();
        let start = layout.start_offset();
        Self {
            guard: Box::new(guard),
            start,
        }
    }

    fn view<T: CudaDType + DeviceRepr>(&self) -> Result<CudaView<'_, T>> {
        match &**self.guard {
            Storage::Cuda(s) => Ok(s.as_cuda_slice::<T>()?.slice(self.start..)),
            _ => bail!("{OP}: internal error, an operand is not on the GPU"),
        }
    }
}

/// The mask's buffers as kernel arguments (absent ones as null pointers).
struct MaskViews<'a> {
    states: Option<CudaView<'a, u8>>,
    dense: Option<CudaView<'a, u8>>,
    ids: Option<CudaView<'a, i64>>,
    null: u64,
}

impl<'a> MaskViews<'a> {
    fn push(&'a self, args: &mut LaunchArgs<'a>) {
        match &self.states {
            Some(v) => args.arg(v),
            None => args.arg(&self.null),
        };
        match &self.dense {
            Some(v) => args.arg(v),
            None => args.arg(&self.null),
        };
        match &self.ids {
            Some(v) => args.arg(v),
            None => args.arg(&self.null),
        };
    }
}

fn hold_all(m: &DeviceMask) -> [Option<Held<'_>>; 3] {
    [
        m.states.as_ref().map(Held::new),
        m.dense.as_ref().map(Held::new),
        m.ids.as_ref().map(Held::new),
    ]
}

fn mask_views<'a>(held: &'a [Option<Held<'_>>; 3]) -> Result<MaskViews<'a>> {
    Ok(MaskViews {
        states: held[0].as_ref().map(|h| h.view::<u8>()).transpose()?,
        dense: held[1].as_ref().map(|h| h.view::<u8>()).transpose()?,
        ids: held[2].as_ref().map(|h| h.view::<i64>()).transpose()?,
        null: 0,
    })
}

/// The batch, head and row strides of a 4-d operand's layout.
fn strides_of(layout: &Layout) -> [usize; 3] {
    let s = layout.stride();
    [s[0], s[1], s[2]]
}

fn signed(s: [usize; 3]) -> [i64; 3] {
    s.map(|x| x as i64)
}

/// Where the kernels put the output (and find it and its gradient, which the backward takes in
/// the same layout) and put the gradients of q, k and v.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Io {
    /// `masked_attention`: out `[b, heads, m, dv]`, and dq, dk, dv buffers of their own shaped
    /// as q, k, v; all contiguous.
    HeadMajor,
    /// `masked_attention_packed` (m = n, d = dv): out token-major `[b, n, heads, dv]`, and one
    /// gradient `[b, n, heads + 2 kv_heads, d]` holding dq, dk and dv as qkv holds q, k and v;
    /// both contiguous.
    Packed,
    /// `masked_attention_tokens`: out `[b, m, heads, dv]`, and dq, dk, dv token-major buffers
    /// of their own (`[b, m, heads, d]`, `[b, n, kv_heads, d]`, `[b, n, kv_heads, dv]`); all
    /// contiguous.
    Tokens,
}

impl Io {
    /// The output's batch, head and row strides.
    fn out_strides(self, p: &Problem) -> [usize; 3] {
        match self {
            Io::HeadMajor => [p.heads * p.m * p.dv, p.m * p.dv, p.dv],
            Io::Packed | Io::Tokens => [p.m * p.heads * p.dv, p.dv, p.heads * p.dv],
        }
    }

    /// The output's shape (`[b, heads, m, dv]`, or token-major).
    fn out_dims(self, p: &Problem) -> [usize; 4] {
        match self {
            Io::HeadMajor => [p.batch, p.heads, p.m, p.dv],
            Io::Packed | Io::Tokens => [p.batch, p.m, p.heads, p.dv],
        }
    }

    /// The elements of the gradient buffers (one for Packed).
    fn grad_lens(self, p: &Problem) -> Vec<usize> {
        let (q, kv) = (p.batch * p.heads * p.m, p.batch * p.kv_heads * p.n);
        match self {
            Io::HeadMajor | Io::Tokens => vec![q * p.d, kv * p.d, kv * p.dv],
            Io::Packed => vec![q * p.d + 2 * kv * p.d],
        }
    }

    /// dq, dk and dv: (buffer, first element in it, batch / head / row strides).
    fn grad_parts(self, p: &Problem) -> [(usize, usize, [usize; 3]); 3] {
        match self {
            Io::HeadMajor => [
                (0, 0, [p.heads * p.m * p.d, p.m * p.d, p.d]),
                (1, 0, [p.kv_heads * p.n * p.d, p.n * p.d, p.d]),
                (2, 0, [p.kv_heads * p.n * p.dv, p.n * p.dv, p.dv]),
            ],
            Io::Tokens => [
                (0, 0, [p.m * p.heads * p.d, p.d, p.heads * p.d]),
                (1, 0, [p.n * p.kv_heads * p.d, p.d, p.kv_heads * p.d]),
                (2, 0, [p.n * p.kv_heads * p.dv, p.dv, p.kv_heads * p.dv]),
            ],
            Io::Packed => {
                let row = (p.heads + 2 * p.kv_heads) * p.d;
                let strides = [p.n * row, p.d, row];
                [
                    (0, 0, strides),
                    (0, p.heads * p.d, strides),
                    (0, (p.heads + p.kv_heads) * p.d, strides),
                ]
            }
        }
    }
}

fn args(p: &Problem, mask: &DeviceMask, layouts: [&Layout; 3], io: Io) -> AttentionArgs {
    let grads = io.grad_parts(p).map(|(_, _, strides)| signed(strides));
    AttentionArgs {
        q_strides: signed(strides_of(layouts[0])),
        k_strides: signed(strides_of(layouts[1])),
        v_strides: signed(strides_of(layouts[2])),
        o_strides: signed(io.out_strides(p)),
        dq_strides: grads[0],
        dk_strides: grads[1],
        dv_strides: grads[2],
        batch: p.batch as i64,
        heads: p.heads as i64,
        kv_heads: p.kv_heads as i64,
        m: p.m as i64,
        n: p.n as i64,
        d: p.d as i64,
        dv: p.dv as i64,
        row_tiles: p.m.div_ceil(TILE_Q) as i64,
        col_tiles: p.n.div_ceil(TILE_K) as i64,
        scale: p.scale as f32,
        // The tensor-core forward needs scale_log2 > 0: `cuda_attention` turns a negative scale
        // into a negated q, and a zero scale (or one below f32's range) gets the least normal
        // f32, which rounds every score's product to zero as a zero scale does; dq and dk still
        // take `scale` itself.
        scale_log2: ((p.scale * std::f64::consts::LOG2_E) as f32).max(f32::MIN_POSITIVE),
        mask: mask.args,
        bwd_pair_group: crate::cuda::tuning("FASTOPS_ATTENTION_PAIR_GROUP")
            .map_or(ONE_PASS_PAIR_GROUP, i64::from),
    }
}

/// The kernels that run a problem: the tensor cores' padded head dim (64, 128, 256), or the
/// f32 row kernels.
#[derive(Debug, Clone, Copy)]
enum Path {
    TensorCores { head_tile: usize },
    Rows,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Pass {
    Forward,
    /// The portable backward: dq (and delta), then dk / dv (no atomics: deterministic).
    Dq,
    Dkdv,
    /// delta = rowsum(dO * O), the row pass before the Hopper backward.
    Delta,
}

impl Path {
    fn of(p: &Problem, dtype: DType) -> Self {
        if dtype == DType::F32 {
            return Path::Rows;
        }
        let head_tile = match p.d.max(p.dv) {
            0..=64 => 64,
            65..=128 => 128,
            _ => 256,
        };
        Path::TensorCores { head_tile }
    }

    /// The kernel of a pass for a mask as [`DeviceMask::for_path`] gives it: the tensor-core
    /// passes have an instance per [`mask_family`] (`attention_{stem}_{family}_d{head_tile}_*`).
    fn kernel<T: WithDType>(
        self, dev: &CudaDevice, pass: Pass, mask: &DeviceMask,
    ) -> Result<Kernel> {
        let stem = match pass {
            Pass::Forward => "attention_fwd",
            Pass::Dq => "attention_dq",
            Pass::Dkdv => "attention_dkdv",
            Pass::Delta => "attention_delta",
        };
        let tile = match (self, pass) {
            (_, Pass::Delta) => String::new(),
            (Path::TensorCores { head_tile }, _) => {
                format!("{}_d{head_tile}", mask_family(mask))
            }
            (Path::Rows, _) => "rows".to_string(),
        };
        let kernel = Kernel::load_typed::<T>(dev, Module::Attention, &[stem, &tile])?;
        let shared = self.shared_bytes(pass, T::DTYPE.size_in_bytes());
        if shared > 48 * 1024 {
            kernel.allow_dynamic_shared(shared)?;
        }
        Ok(kernel)
    }

    /// Mask tiles of `TILE_Q` queries per block of the query-tile passes (forward, dq): two up to
    /// a head tile of 128, one at 256 (mirrors `query_tiles` of the kernels).
    fn query_tiles(self) -> usize {
        match self {
            Path::TensorCores { head_tile } if head_tile <= 128 => 2,
            _ => 1,
        }
    }

    /// Dynamic shared memory of a pass (mirrors the tile layout and `stages` of the kernels):
    /// 64-row tiles of `head_tile + ROW_PAD` elements; the resident operands (`query_tiles` tiles
    /// of q, and of dO for dq; one of k and v for dk / dv) and one or two stages of the streamed
    /// ones.
    fn shared_bytes(self, pass: Pass, elem: usize) -> usize {
        let Path::TensorCores { head_tile } = self else {
            return 0;
        };
        let tile = 64 * (head_tile + C::ROW_PAD) * elem;
        let one_stage = head_tile > 128 || (head_tile == 128 && pass == Pass::Dq);
        let stages = if one_stage { 1 } else { 2 };
        let query_tiles = self.query_tiles();
        match pass {
            Pass::Forward => (query_tiles + 2 * stages) * tile,
            Pass::Dq => (2 * query_tiles + 2 * stages) * tile,
            Pass::Dkdv => (2 + 2 * stages) * tile + 2 * stages * TILE_Q * 4,
            Pass::Delta => 0,
        }
    }

    fn config(self, p: &Problem, pass: Pass, elem: usize) -> LaunchConfig {
        let shared_mem_bytes = self.shared_bytes(pass, elem) as u32;
        match (self, pass) {
            (Path::TensorCores { head_tile }, Pass::Forward | Pass::Dq | Pass::Dkdv) => {
                let blocks = match pass {
                    Pass::Dkdv => p.batch * p.kv_heads * p.n.div_ceil(TILE_K),
                    _ => p.batch * p.heads * p.m.div_ceil(TILE_Q).div_ceil(self.query_tiles()),
                };
                let slices = if pass == Pass::Dkdv && head_tile > 128 {
                    2
                } else {
                    1
                };
                LaunchConfig {
                    grid_dim: (blocks as u32, slices, 1),
                    block_dim: (TC_THREADS, 1, 1),
                    shared_mem_bytes,
                }
            }
            _ => {
                let rows = match pass {
                    Pass::Dkdv => p.batch * p.kv_heads * p.n,
                    _ => p.batch * p.heads * p.m,
                };
                let rows_per_warp = match pass {
                    Pass::Delta => delta_rows_per_warp(p.dv),
                    _ => 1,
                };
                LaunchConfig {
                    grid_dim: (rows.div_ceil(ROW_WARPS * rows_per_warp) as u32, 1, 1),
                    block_dim: ((ROW_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes,
                }
            }
        }
    }
}

/// Rows a warp of the delta pass covers (`delta_rows` in attention.cu): a row is read 16 bytes a
/// lane by the power of two >= dv / 8 lanes, DELTA_STEPS steps of 32 / lanes rows at once.
fn delta_rows_per_warp(dv: usize) -> usize {
    32 / (dv / 8).max(1).next_power_of_two() * C::DELTA_STEPS
}

/// Which forward kernels run on compute capability 9.0: `CANDLE_FASTOPS_ATTENTION_KERNELS=portable`
/// or `=sm90` picks one (the test suite runs both this way), otherwise [`HOPPER_FORWARD_DEFAULT`].
/// Read once per process.
fn hopper_forward_chosen() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(
        || match std::env::var("CANDLE_FASTOPS_ATTENTION_KERNELS").as_deref() {
            Ok("portable") => false,
            Ok("sm90") => true,
            _ => HOPPER_FORWARD_DEFAULT,
        },
    )
}

/// Whether the Hopper forward is the default on compute capability 9.0: only where it is the
/// faster one (BENCHMARKS.md, "Hopper forward").
const HOPPER_FORWARD_DEFAULT: bool = true;

impl Path {
    /// The head tile (64 or 128) of the Hopper forward (`src/cuda/sm90/attention.cu`) where it
    /// runs the problem: f16 / bf16 with `max(d, dv) <= 128` on compute capability 9.0, when
    /// [`hopper_forward_chosen`].
    fn hopper_forward(self, dev: &CudaDevice) -> Result<Option<usize>> {
        match self {
            Path::TensorCores { head_tile } if head_tile <= 128 && hopper_forward_chosen() => {
                Ok(crate::cuda::is_hopper(dev)?.then_some(head_tile))
            }
            _ => Ok(None),
        }
    }
}

/// The instance family of the tensor-core kernels (portable and Hopper) that reads `mask`: the
/// `generated`, `runs` or `stored` in `attention_{stem}_{family}_d{head_tile}_{dtype}` (generated
/// masks: full, causal, window; runs: documents in contiguous runs; stored tile states: other
/// documents, dense). Mirrors `MaskFamily` of attention_common.cuh.
fn mask_family(mask: &DeviceMask) -> &'static str {
    match mask.args.kind {
        C::MASK_FULL | C::MASK_CAUSAL | C::MASK_WINDOW => "generated",
        C::MASK_RUNS => "runs",
        _ => "stored",
    }
}

/// The Hopper kernel `stem_{family}_d{head_tile}_{dtype}` for a mask ([`mask_family`]), allowed
/// `shared` bytes of dynamic shared memory.
fn hopper_kernel<T: WithDType>(
    dev: &CudaDevice, stem: &str, mask: &DeviceMask, head_tile: usize, shared: usize,
) -> Result<Kernel> {
    let kernel = Kernel::load_typed::<T>(
        dev,
        Module::AttentionSm90,
        &[stem, mask_family(mask), &format!("d{head_tile}")],
    )?;
    kernel.allow_dynamic_shared(shared)?;
    Ok(kernel)
}

/// The Hopper forward kernel of a mask and head tile, and its launch: a block of a producer
/// warpgroup and `HOPPER_CONSUMERS` consumer warpgroups per `HOPPER_CONSUMERS` query tiles of a
/// (batch, head); shared memory for its mbarriers, a Q tile per consumer and `HOPPER_STAGES_D*`
/// stages of a K and a V tile (64 rows of `head_tile` 16-bit elements each). Generated masks
/// (full, causal, window) and masks with stored tile states (documents, dense) have a kernel each.
fn hopper_forward_kernel<T: WithDType>(
    dev: &CudaDevice, p: &Problem, mask: &DeviceMask, head_tile: usize,
) -> Result<(Kernel, LaunchConfig)> {
    let consumers = C::HOPPER_CONSUMERS;
    let stages = if head_tile == 64 {
        C::HOPPER_STAGES_D64
    } else {
        C::HOPPER_STAGES_D128
    };
    let shared = C::HOPPER_BARRIER_BYTES + (consumers + 2 * stages) * 64 * head_tile * 2;
    let kernel = hopper_kernel::<T>(dev, "attention_fwd_sm90", mask, head_tile, shared)?;
    let blocks = p.batch * p.heads * p.m.div_ceil(TILE_Q).div_ceil(consumers);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((128 * (consumers + 1)) as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    Ok((kernel, cfg))
}

/// Warpgroups of the Hopper backward's block, a key tile each (`BWD_WARPGROUPS` of the kernel).
const HOPPER_BWD_WARPGROUPS: usize = 2;

/// The Hopper backward kernel of a mask and head tile, and its launch: a block of
/// `HOPPER_BWD_WARPGROUPS` warpgroups per as many key tiles of a (batch, kv head); shared memory
/// for its mbarriers, a K and a V tile per warpgroup, `HOPPER_BWD_STAGES_D*` stages of a Q and a
/// dO tile, and per warpgroup two dSᵀ tiles and the statistics of two items (mirrors
/// `BackwardLayout` of the kernel, which traps when given less).
fn hopper_backward_kernel<T: WithDType>(
    dev: &CudaDevice, p: &Problem, mask: &DeviceMask, head_tile: usize,
) -> Result<(Kernel, LaunchConfig)> {
    let tile = 64 * head_tile * 2;
    let stages = if head_tile == 64 {
        C::HOPPER_BWD_STAGES_D64
    } else {
        C::HOPPER_BWD_STAGES_D128
    };
    let warpgroups = HOPPER_BWD_WARPGROUPS;
    let shared = C::HOPPER_BARRIER_BYTES
        + (2 * warpgroups + 2 * stages) * tile
        + warpgroups * (2 * TILE_K * TILE_Q * 2 + 2 * 2 * TILE_Q * 4);
    let kernel = hopper_kernel::<T>(dev, "attention_bwd_sm90", mask, head_tile, shared)?;
    let blocks = p.batch * p.kv_heads * p.n.div_ceil(TILE_K * warpgroups);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((128 * warpgroups) as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    Ok((kernel, cfg))
}

/// A TMA descriptor (the driver's `CUtensorMap`) as a kernel argument; mirrored by `TensorMap`
/// in `src/cuda/sm90/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorMap(driver::sys::CUtensorMap);
// SAFETY: a plain 128-byte value the kernel takes by value (a `__grid_constant__` parameter).
unsafe impl DeviceRepr for TensorMap {}
const _: () = assert!(std::mem::size_of::<TensorMap>() == 128);

impl TensorMap {
    /// The map of an operand `[batch, heads, rows, cols]` at `ptr` (16-bit elements, `strides`
    /// of batch, head and row in elements, rows and heads 16-byte aligned) that the Hopper kernels
    /// copy 64-row tiles through: dims (cols, rows, heads, batch) and a box of 64 x 64 in the
    /// 128-byte swizzle (a tile takes one box per 64 columns of the head tile), zeros past rows
    /// and cols. `None` where TMA cannot describe the layout (a zero stride on a dim of several
    /// entries).
    fn tiles<T: WithDType>(
        ptr: u64, [batch, heads, rows]: [usize; 3], cols: usize, strides: [usize; 3],
    ) -> Result<Option<TensorMap>> {
        use driver::sys::{
            CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Fill,
            CUtensorMapInterleave as Interleave, CUtensorMapL2promotion as Promotion,
            CUtensorMapSwizzle as Swizzle,
        };
        let elem = T::DTYPE.size_in_bytes();
        let data_type = match T::DTYPE {
            DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => bail!("{OP}: internal error, a TMA map of {:?}", T::DTYPE),
        };
        let dims = [batch, heads, rows];
        // A dim of one entry: any stride does (TMA wants a multiple of 16 bytes).
        let stride = |i: usize| {
            if dims[i] <= 1 {
                16
            } else {
                (strides[i] * elem) as u64
            }
        };
        if (0..3).any(|i| stride(i) == 0) {
            return Ok(None);
        }
        let global_dim: [u64; 4] = [
            cols.max(1) as u64,
            rows.max(1) as u64,
            heads as u64,
            batch as u64,
        ];
        let global_strides: [u64; 3] = [stride(2), stride(1), stride(0)];
        let box_dim: [u32; 4] = [64, TILE_K as u32, 1, 1];
        let element_strides = [1u32; 4];
        let mut map = std::mem::MaybeUninit::<driver::sys::CUtensorMap>::uninit();
        // SAFETY: every array holds the rank (4) or rank - 1 entries the driver reads; `map` is
        // written by the call before it is read.
        let status = unsafe {
            driver::sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type,
                4,
                ptr as *mut std::ffi::c_void,
                global_dim.as_ptr(),
                global_strides.as_ptr(),
                box_dim.as_ptr(),
                element_strides.as_ptr(),
                Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                Promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                Fill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if status != driver::sys::CUresult::CUDA_SUCCESS {
            bail!("{OP}: encoding a TMA map failed ({status:?}; dims {global_dim:?}, strides {global_strides:?})");
        }
        // SAFETY: written by the successful call above.
        Ok(Some(TensorMap(unsafe { map.assume_init() })))
    }
}

fn check_grid(p: &Problem) -> Result<()> {
    let blocks = (p.batch * p.heads * p.m.div_ceil(TILE_Q))
        .max(p.batch * p.kv_heads * p.n.div_ceil(TILE_K))
        .max((p.batch * p.heads * p.m).div_ceil(ROW_WARPS))
        .max((p.batch * p.kv_heads * p.n).div_ceil(ROW_WARPS));
    if blocks > i32::MAX as usize {
        bail!("{OP}: the problem needs {blocks} blocks, more than a CUDA grid holds");
    }
    Ok(())
}

/// The Hopper backward's dq accumulator, `[b, h, padded_m, head_tile]` f32, zeroed: by the
/// forward when gradients are tracked (its producer's idle warps), by a memset otherwise.
pub(super) type ZeroedDq = CudaSlice<f32>;

/// The length of a dq accumulator (the Hopper or the one-pass backward's) at `head_tile`.
fn dq_accum_len(p: &Problem, head_tile: usize) -> usize {
    p.batch * p.heads * p.m.div_ceil(TILE_Q) * TILE_Q * head_tile
}

/// The forward: the output (`[b, h, m, dv]`, laid out as `io` says) and the log-sum-exp (f32
/// `[b, h, m]`); with `zero_dq` (gradients tracked), the Hopper backward's dq accumulator, zeroed
/// by the Hopper forward on the way, when that forward ran.
pub(super) fn forward(
    p: &Problem, mask: &DeviceMask, q: (&CudaStorage, &Layout), k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout), io: Io, zero_dq: bool,
) -> Result<(CudaStorage, Tensor, Option<ZeroedDq>)> {
    let dev = &q.0.device;
    check_grid(p)?;
    let rows = p.batch * p.heads * p.m;
    let lse = alloc_output::<f32>(dev, rows)?;
    let (out, dq) = with_float_cuda_type!(OP, q.0.dtype(), T => forward_typed::<T>(p, mask, q, k, v, io, &lse, zero_dq)?);
    Ok((out, cuda_tensor(dev, lse, (p.batch, p.heads, p.m)), dq))
}

#[allow(clippy::too_many_arguments)]
fn forward_typed<T: WithDType + CudaDType + DeviceRepr>(
    p: &Problem, mask: &DeviceMask, (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout), (v, vl): (&CudaStorage, &Layout), io: Io,
    lse: &CudaSlice<f32>, zero_dq: bool,
) -> Result<(CudaStorage, Option<ZeroedDq>)> {
    let dev = &q.device;
    let out = alloc_output::<T>(dev, p.batch * p.heads * p.m * p.dv)?;
    let mut zeroed_dq = None;
    if p.batch * p.heads * p.m > 0 {
        let path = Path::of(p, T::DTYPE);
        let mask = &mask.for_path(path);
        let a = args(p, mask, [ql, kl, vl], io);
        let (qv, kv, vv) = (
            q.as_cuda_slice::<T>()?.slice(ql.start_offset()..),
            k.as_cuda_slice::<T>()?.slice(kl.start_offset()..),
            v.as_cuda_slice::<T>()?.slice(vl.start_offset()..),
        );
        let held = hold_all(mask);
        let views = mask_views(&held)?;
        let hopper = match path.hopper_forward(dev)? {
            Some(head_tile) => {
                let stream = dev.cuda_stream();
                let (k_ptr, _k_sync) = kv.device_ptr(&stream);
                let (v_ptr, _v_sync) = vv.device_ptr(&stream);
                let kv_dims = [p.batch, p.kv_heads, p.n];
                let maps = (
                    TensorMap::tiles::<T>(k_ptr, kv_dims, p.d, strides_of(kl))?,
                    TensorMap::tiles::<T>(v_ptr, kv_dims, p.dv, strides_of(vl))?,
                );
                match maps {
                    (Some(k_map), Some(v_map)) => {
                        let (kernel, cfg) = hopper_forward_kernel::<T>(dev, p, mask, head_tile)?;
                        // Only the non-deterministic backward is the Hopper one that reads it.
                        let dq = if zero_dq && !p.deterministic && p.n > 0 {
                            // (The kernel writes every element: each block its query tiles'
                            // rows, below row_tiles.)
                            Some(alloc_output::<f32>(dev, dq_accum_len(p, head_tile))?)
                        } else {
                            None
                        };
                        let null = 0u64;
                        // SAFETY: the arguments match `attention_fwd_sm90_*(q, k_map, v_map,
                        // out, lse, states, dense, ids, args, dq_zero)`. The kernel reads q, the
                        // mask's buffers and writes out and lse as the portable forward below
                        // does; k and v are read through the maps, which cover exactly their
                        // layouts (the TMA unit returns zeros outside them); dq_zero, when not
                        // null, is written whole (b * h * row_tiles tiles of 64 x head_tile f32).
                        unsafe {
                            kernel.launch(cfg, |a_| {
                                a_.arg(&qv).arg(&k_map).arg(&v_map).arg(&out).arg(lse);
                                views.push(a_);
                                a_.arg(&a);
                                match &dq {
                                    Some(dq) => a_.arg(dq),
                                    None => a_.arg(&null),
                                };
                            })?;
                        }
                        zeroed_dq = dq;
                        true
                    }
                    _ => false,
                }
            }
            None => false,
        };
        if !hopper {
            let kernel = path.kernel::<T>(dev, Pass::Forward, mask)?;
            let cfg = path.config(p, Pass::Forward, T::DTYPE.size_in_bytes());
            // SAFETY: the arguments match `attention_fwd_*(q, k, v, out, lse, states, dense,
            // ids, args)`. Every element read lies in the operands' layouts (rows below m or n,
            // columns below d or dv, by the layouts' strides) or in the mask's buffers (tile
            // states of [mb * mh or batch, row_tiles, col_tiles], dense bytes by their strides,
            // ids of [batch * seq]); the kernels write rows below m and columns below dv of
            // `out` (b * h * m * dv elements, by `io`'s strides) and `lse`.
            unsafe {
                kernel.launch(cfg, |a_| {
                    a_.arg(&qv).arg(&kv).arg(&vv).arg(&out).arg(lse);
                    views.push(a_);
                    a_.arg(&a);
                })?;
            }
        }
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), zeroed_dq))
}

/// What the backward reads: the forward's operands as it got them, its output and the output's
/// gradient (both laid out as the backward's `io` says, contiguous, 16-byte aligned) and the
/// log-sum-exp.
pub(super) struct BackwardInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub out: &'a Tensor,
    pub grad_out: &'a Tensor,
    pub lse: &'a Tensor,
}

/// The backward's gradients, as its `io` lays them out.
pub(super) enum Gradients {
    /// dq, dk and dv (`Io::HeadMajor`: shaped as q, k and v; `Io::Tokens`: token-major),
    /// contiguous.
    Parts(Tensor, Tensor, Tensor),
    /// The gradient of the packed `[b, n, heads + 2 kv_heads, d]` input (`Io::Packed`).
    Packed(Tensor),
}

/// A new buffer of the device as a tensor of `shape` (no gradient).
fn cuda_tensor<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice, s: CudaSlice<T>, shape: impl Into<candle_core::Shape>,
) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
        shape,
        BackpropOp::none(),
        false,
    )
}

/// The backward: the gradients of q, k and v in the dtype of the operands, laid out as `io`
/// says.
pub(super) fn backward(
    p: &Problem, mask: &DeviceMask, x: &BackwardInputs<'_>, io: Io, zeroed_dq: Option<ZeroedDq>,
) -> Result<Gradients> {
    check_grid(p)?;
    let out_dims = io.out_dims(p);
    let laid_out = |t: &Tensor| {
        t.dims() == out_dims
            && t.is_contiguous()
            && operand_ok(t.layout(), t.dtype())
            && t.dtype() == x.q.dtype()
    };
    if (io == Io::Packed && (p.m != p.n || p.d != p.dv))
        || !laid_out(x.out)
        || !laid_out(x.grad_out)
    {
        bail!(
            "{OP}: internal error, the backward got out {:?} and its gradient {:?} for {io:?}",
            x.out.layout(),
            x.grad_out.layout()
        );
    }
    with_float_cuda_type!(OP, x.q.dtype(), T => backward_typed::<T>(p, mask, x, io, zeroed_dq))
}

fn backward_typed<T: WithDType + CudaDType + DeviceRepr>(
    p: &Problem, mask: &DeviceMask,
    &BackwardInputs {
        q,
        k,
        v,
        out,
        grad_out,
        lse,
    }: &BackwardInputs<'_>,
    io: Io, zeroed_dq: Option<ZeroedDq>,
) -> Result<Gradients> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        bail!("{OP}: internal error, the CUDA backward got CPU tensors");
    };
    let path = Path::of(p, T::DTYPE);
    let (hq, hk, hv) = (Held::new(q), Held::new(k), Held::new(v));
    let (ho, hg, hl) = (Held::new(out), Held::new(grad_out), Held::new(lse));
    let (qv, kv, vv, ov, gv) = (
        hq.view::<T>()?,
        hk.view::<T>()?,
        hv.view::<T>()?,
        ho.view::<T>()?,
        hg.view::<T>()?,
    );
    // The gradient buffers, and dq, dk and dv as views into them.
    let buffers = io
        .grad_lens(p)
        .into_iter()
        .map(|len| alloc_output::<T>(dev, len))
        .collect::<Result<Vec<_>>>()?;
    let parts = io.grad_parts(p);
    let [dq, dk, dv] = parts.map(|(buffer, first, _)| buffers[buffer].slice(first..));
    // The Hopper backward where it runs the problem (not in deterministic mode: it adds dq with
    // 16-byte reductions in a varying order) and TMA describes the operands and dk / dv. The maps
    // hold raw addresses: the guards keep the buffers' stream ordering until the launches are
    // queued (dk and dv, written through their maps, are new buffers on this one stream).
    let stream = dev.cuda_stream();
    let (q_ptr, _q_read) = qv.device_ptr(&stream);
    let (k_ptr, _k_read) = kv.device_ptr(&stream);
    let (v_ptr, _v_read) = vv.device_ptr(&stream);
    let (g_ptr, _g_read) = gv.device_ptr(&stream);
    let (dk_ptr, dk_guard) = dk.device_ptr(&stream);
    let (dv_ptr, dv_guard) = dv.device_ptr(&stream);
    // (The kernel walks (query head of the group, query tile) items in 32-bit integers.)
    let items = (p.heads / p.kv_heads) * p.m.div_ceil(TILE_Q);
    let hopper = match path.hopper_forward(dev)? {
        Some(head_tile) if !p.deterministic && items <= i32::MAX as usize => {
            let (q_dims, kv_dims) = ([p.batch, p.heads, p.m], [p.batch, p.kv_heads, p.n]);
            let grad_strides = io.out_strides(p);
            let (dk_strides, dv_strides) = (parts[1].2, parts[2].2);
            let maps = [
                TensorMap::tiles::<T>(q_ptr, q_dims, p.d, strides_of(q.layout()))?,
                TensorMap::tiles::<T>(k_ptr, kv_dims, p.d, strides_of(k.layout()))?,
                TensorMap::tiles::<T>(v_ptr, kv_dims, p.dv, strides_of(v.layout()))?,
                TensorMap::tiles::<T>(g_ptr, q_dims, p.dv, grad_strides)?,
                TensorMap::tiles::<T>(dk_ptr, kv_dims, p.d, dk_strides)?,
                TensorMap::tiles::<T>(dv_ptr, kv_dims, p.dv, dv_strides)?,
            ];
            match maps {
                [Some(q), Some(k), Some(v), Some(g), Some(dk), Some(dv)] => {
                    Some((head_tile, [q, k, v, g, dk, dv]))
                }
                _ => None,
            }
        }
        _ => None,
    };
    // The Hopper pass adds scale * dS K into dq_accum (f32, zeroed, padded to whole query tiles
    // and the head tile: [b, h, padded_m, head_tile], in its own order), which its dq_rows kernel
    // turns into dq; the portable dq pass writes dq itself (no atomics).
    let padded_m = p.m.div_ceil(TILE_Q) * TILE_Q;
    let dq_accum = match &hopper {
        Some((head_tile, _)) => Some(match zeroed_dq {
            Some(zeroed) if zeroed.len() == dq_accum_len(p, *head_tile) => zeroed,
            _ => dev.alloc_zeros::<f32>(dq_accum_len(p, *head_tile))?,
        }),
        None => None,
    };
    let mask = &mask.for_path(path);
    let one_pass = hopper.is_none() && one_pass_backward(dev, p, path)?;
    // delta = rowsum(dO * O), f32 [b, h, m]: written by the dq or delta pass, read by dk / dv.
    let delta = alloc_output::<f32>(dev, p.batch * p.heads * p.m)?;
    // (The delta pass, run before the Hopper and the one-pass backwards, reads no mask.)
    let a = args(p, mask, [q.layout(), k.layout(), v.layout()], io);
    let lv = hl.view::<f32>()?;
    let held = hold_all(mask);
    let views = mask_views(&held)?;
    let elem = T::DTYPE.size_in_bytes();
    // Every backward pass takes one argument list (BACKWARD_PARAMS of the kernels): q, k, v,
    // grad_out, out, lse, delta, dq, dk, dv, the mask's buffers and the arguments.
    let run = |pass: Pass| -> Result<()> {
        let kernel = path.kernel::<T>(dev, pass, mask)?;
        // SAFETY: the arguments match BACKWARD_PARAMS. Reads are as in the forward plus rows
        // below m of grad_out and out (by the output's strides of `io`, which `backward` checked
        // they have, rows 16-byte aligned) and of lse. dq and delta write rows below m of delta
        // ([b, h, m], before dk / dv read them on the same stream); dq writes rows below m and
        // columns below d of dq ([b, h, m, d]); dkdv rows below n of dk ([b, hk, n, d]) and dv
        // ([b, hk, n, dv]): dq, dk and dv by the strides of `io`, inside their buffers and
        // disjoint.
        unsafe {
            kernel.launch(path.config(p, pass, elem), |a_| {
                for x in [&qv, &kv, &vv, &gv, &ov] {
                    a_.arg(x);
                }
                a_.arg(&lv).arg(&delta).arg(&dq).arg(&dk).arg(&dv);
                views.push(a_);
                a_.arg(&a);
            })
        }
    };
    // dq = scale * dq_accum, from the fragment order the atomic backwards add in (dq_fragment in
    // attention_common.cuh), by the module's attention_dq_rows kernel `name`.
    let dq_from_accum = |module: Module, name: &str, acc: &CudaSlice<f32>| {
        let kernel = Kernel::load_typed::<T>(dev, module, &[name])?;
        // A block per (query tile, column block of head_tile / 2) unit, grid-strided.
        let units = p.batch * p.heads * (padded_m / TILE_Q) * 2;
        if units == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (units.min(1 << 16) as u32, 1, 1),
            block_dim: (C::DQ_ROWS_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `attention_dq_rows_*(dq_accum, dq, args)`; the kernel
        // reads all of dq_accum (float4 at a time; b * h * padded_m * head_tile f32, two column
        // blocks a query tile) and writes rows below m and columns below d of dq ([b, h, m, d]
        // by the strides of `io`, rows 16-byte aligned: d is a multiple of 8).
        unsafe {
            kernel.launch(cfg, |a_| {
                a_.arg(acc).arg(&dq).arg(&a);
            })
        }
    };
    let gradients = |buffers: Vec<CudaSlice<T>>| -> Result<Gradients> {
        let mut buffers = buffers.into_iter();
        let mut next = |shape: &[usize]| match buffers.next() {
            Some(s) => Ok(cuda_tensor(dev, s, shape)),
            None => bail!("{OP}: internal error, a gradient buffer is missing"),
        };
        Ok(match io {
            Io::HeadMajor => Gradients::Parts(next(q.dims())?, next(k.dims())?, next(v.dims())?),
            Io::Tokens => {
                // The operands' head-major dims, token-major.
                let tokens = |t: &Tensor| {
                    let d = t.dims();
                    [d[0], d[2], d[1], d[3]]
                };
                Gradients::Parts(next(&tokens(q))?, next(&tokens(k))?, next(&tokens(v))?)
            }
            Io::Packed => Gradients::Packed(next(&[p.batch, p.n, p.heads + 2 * p.kv_heads, p.d])?),
        })
    };
    let (queries, keys) = (p.batch * p.heads * p.m, p.batch * p.kv_heads * p.n);
    if let Some((head_tile, maps)) = &hopper {
        if queries > 0 && keys > 0 {
            run(Pass::Delta)?;
        }
        if keys > 0 {
            let (kernel, cfg) = hopper_backward_kernel::<T>(dev, p, mask, *head_tile)?;
            let acc = dq_accum.as_ref().expect("the Hopper backward has dq_accum");
            // SAFETY: the arguments match `attention_bwd_sm90_*(q_map, k_map, v_map, do_map,
            // lse, delta, dk_map, dv_map, dq_accum, states, dense, ids, args)`. q, k, v and
            // grad_out are read through the maps, which cover exactly their layouts; lse and
            // delta rows below m; the mask's buffers as in the forward. The kernel writes dk and
            // dv through their maps (exactly their [b, hk, n, d] / [.., dv] parts by `io`) and
            // adds into all of dq_accum ([b, h, padded_m, head_tile]).
            unsafe {
                kernel.launch(cfg, |a_| {
                    let [q_map, k_map, v_map, g_map, dk_map, dv_map] = maps;
                    for map in [q_map, k_map, v_map, g_map] {
                        a_.arg(map);
                    }
                    a_.arg(&lv).arg(&delta).arg(dk_map).arg(dv_map).arg(acc);
                    views.push(a_);
                    a_.arg(&a);
                })?;
            }
            dq_from_accum(
                Module::AttentionSm90,
                &format!("attention_dq_rows_sm90_d{head_tile}"),
                acc,
            )?;
        }
    } else if one_pass {
        // delta, then the one-pass backward (dq summed into an f32 buffer), then dq from it.
        if queries > 0 && keys > 0 {
            run(Pass::Delta)?;
            // dS K, summed over the key blocks in fragment order: f32, b * h * padded_m * 128, zeroed.
            let acc = dev.alloc_zeros::<f32>(dq_accum_len(p, ONE_PASS_HEAD_TILE))?;
            let kernel = Kernel::load_typed::<T>(
                dev,
                Module::Attention,
                &["attention_bwd", mask_family(mask), "d128"],
            )?;
            let shared = one_pass_shared_bytes(elem);
            kernel.allow_dynamic_shared(shared)?;
            let cfg = LaunchConfig {
                grid_dim: (
                    (p.batch * p.kv_heads * p.n.div_ceil(ONE_PASS_KEYS)) as u32,
                    1,
                    1,
                ),
                block_dim: (ONE_PASS_THREADS, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            // SAFETY: the arguments match `attention_bwd_{family}_d128_*(BACKWARD_PARAMS, dq_accum)`;
            // the operands are those of the two-pass kernels above (dq unused: dq_from_accum
            // writes it), and the kernel adds into the b * h * padded_m * 128 floats of acc.
            unsafe {
                kernel.launch(cfg, |args| {
                    for x in [&qv, &kv, &vv, &gv, &ov] {
                        args.arg(x);
                    }
                    args.arg(&lv).arg(&delta).arg(&dq).arg(&dk).arg(&dv);
                    views.push(args);
                    args.arg(&a).arg(&acc);
                })?;
            }
            dq_from_accum(Module::Attention, "attention_dq_rows_d128", &acc)?;
            drop((dk_guard, dv_guard)); // every launch is queued
            return gradients(buffers);
        }
        if keys > 0 {
            run(Pass::Dq)?;
            run(Pass::Dkdv)?;
        }
    } else {
        if queries > 0 {
            run(Pass::Dq)?;
        }
        if keys > 0 {
            run(Pass::Dkdv)?;
        }
    }
    drop((dk_guard, dv_guard)); // every launch is queued
    gradients(buffers)
}
