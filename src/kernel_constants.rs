//! Constants shared by the Rust side and the CUDA kernels, defined once here.
//!
//! `build.rs` reads this file and writes `fastops_constants.cuh`, which the kernels include: each
//! `pub mod NAME` becomes `namespace fastops_constants::NAME` and each `pub const X: usize = V;` a
//! `constexpr int X = V;`. Only that form (one constant per line, a literal value, an integer
//! type) is read; `build.rs` fails on anything else inside a module. Without the `cuda` feature
//! the CPU paths use the same values.

// Most of these are read by the CUDA launch code only.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// The tiled matmul core (masked_bmm, argmin_matmul and the masked_bmm backward).
pub mod matmul {
    /// Output tile edge of a block (and of a `MaskPlan` tile).
    pub const TILE: usize = 128;
    /// Threads per block of every matmul kernel.
    pub const THREADS: usize = 256;
    /// Resident blocks per multiprocessor the kernels are built for (`__launch_bounds__`).
    pub const BLOCKS_PER_SM: usize = 2;
    /// Dynamic shared memory of the async (cp.async) kernels: 4 stages x 2 operands x
    /// `TILE` rows of 80 bytes.
    pub const ASYNC_SHARED_BYTES: usize = 81920;
    /// Operand load modes: k contiguous, the outer dimension contiguous, or neither.
    pub const K_CONTIGUOUS: i32 = 0;
    pub const OUTER_CONTIGUOUS: i32 = 1;
    pub const STRIDED: i32 = 2;
    /// Tile states of a mask plan: no kept element, some, all.
    pub const TILE_EMPTY: u8 = 0;
    pub const TILE_PARTIAL: u8 = 1;
    pub const TILE_FULL: u8 = 2;
}

/// The Hopper argmin_matmul (`src/cuda/sm90/argmin.cu`: f32 as TF32 on wgmma).
pub mod argmin_sm90 {
    /// Threads per block: a producer warpgroup (one thread of it streams `b`) and two consumer
    /// warpgroups of 64 rows each.
    pub const THREADS: usize = 384;
    /// Rows of `a` a block keeps in shared memory (two warpgroups of 64).
    pub const ROWS: usize = 128;
    /// Columns of a tile (the wgmma N).
    pub const COLS: usize = 128;
    /// Bytes of k in one pipeline stage of `b` (16 f32, 32 16-bit elements).
    pub const STAGE_K_BYTES: usize = 64;
    /// Buffers of `b` stages (6 fit beside a compensated row tile at k = 128: 2 x 64 KiB +
    /// 6 x 16 KiB).
    pub const STAGES: usize = 6;
    /// The longest row of `a` (k rounded up to a stage, in bytes) whose row tile fits in shared
    /// memory: k <= 128 in f32, 256 in f16 / bf16.
    pub const MAX_ROW_BYTES: usize = 512;
}

/// The Hopper span products of the masked_bmm backward (`src/cuda/sm90/span.cu`: grad_a = g . b^T
/// and grad_b = a^T . g in f32 as three TF32 passes on wgmma).
pub mod span_sm90 {
    /// Threads per block: two warpgroups of 64 x 64 output each, both copying and computing.
    pub const THREADS: usize = 256;
    /// masked_bmm's k, at most this: the output's columns (grad_a) or rows (grad_b), the wgmma N
    /// or M.
    pub const COLS: usize = 64;
    /// Raw buffers of stages (16 f32 of the reduction each).
    pub const STAGES: usize = 4;
    /// Dynamic shared memory of the grad_a kernel: `STAGES` raw stages of a 128-row and a
    /// `COLS`-row operand tile (rows of 64 bytes of k, padded to 80) and of the mask's 128 rows
    /// (16 bytes each), and two buffers of the second tile split (big and small TF32 parts, 4096
    /// bytes each).
    pub const SHARED_BYTES: usize = 86016;
    /// Dynamic shared memory of the grad_b kernel: `STAGES` raw stages of 16 rows of `a` (`COLS`
    /// f32, rows padded to 288 bytes), of the output gradient (128 f32) and of the mask (128
    /// bytes), and two buffers of the gradient's stage split (big and small TF32 parts, 8192
    /// bytes each).
    pub const GRAD_B_SHARED_BYTES: usize = 92160;
}

/// The tile summary of a mask (empty / partial / full per tile).
pub mod tile_summary {
    /// Threads per block (a block per tile).
    pub const THREADS: usize = 256;
}

/// bias_add.
pub mod bias_add {
    /// Threads per block.
    pub const THREADS: usize = 256;
}

/// softmax / log_softmax over a set of dims.
pub mod softmax {
    /// Threads per block.
    pub const THREADS: usize = 256;
    /// The most kept or reduced runs a reduce plan may have.
    pub const MAX_BLOCKS: usize = 6;
    /// Units one thread of the `_cached` kernels holds in registers: single elements, or
    /// 16-byte vectors / lanes of `LANE_WIDTH` groups.
    pub const CACHED_ELEMENTS: usize = 16;
    pub const CACHED_VECTORS: usize = 4;
    /// Groups one thread of the `_lanes` kernels reduces side by side.
    pub const LANE_WIDTH: usize = 4;
    /// 16-byte vectors one thread of the `_row_block` kernel (a block per contiguous row) holds.
    pub const ROW_BLOCK_VECTORS: usize = 2;
    /// Most threads of a `_row_block` block.
    pub const ROW_BLOCK_MAX_THREADS: usize = 1024;
    /// Most shared memory of one `_staged` block (its groups' elements, their offsets and the
    /// reduction's pairs): three blocks fit a Hopper SM.
    pub const STAGED_BYTES: usize = 76800;
}

/// sparse_linear.
pub mod sparse_linear {
    /// Threads per block (a warp per task).
    pub const THREADS: usize = 256;
    /// Threads of the backward's one-block scan of per-feature counts.
    pub const SCAN_THREADS: usize = 1024;
}

/// small_fc_lopt, the learned optimizer.
pub mod small_fc_lopt {
    /// Threads per block of every step kernel.
    pub const THREADS: usize = 256;
    /// Tensors per launch (the size of the kernels' `StepTensors` argument).
    pub const GROUP: usize = 128;
    /// Elements per chunk of the multi-tensor walk.
    pub const CHUNK: usize = 8192;
    /// Chunks per work item of the square-sum kernel.
    pub const SQUARE_SUM_RUN: usize = 8;
    /// Columns of a square-sum tile of a 2-D gradient (one float4 per thread).
    pub const TILE_COLS: usize = 1024;
    /// Features normalised per tensor (the MLP's inputs besides the 11 time features).
    pub const FEATURES: usize = 28;
    /// Width of the MLP's two hidden layers.
    pub const HIDDEN: usize = 32;
}

/// optim::AdamW, the multi-tensor step.
pub mod adamw {
    /// Threads per block.
    pub const THREADS: usize = 256;
    /// Tensors per launch (the size of the kernel's `AdamWTensors` argument).
    pub const GROUP: usize = 48;
    /// Elements per block (a block walks one chunk of one tensor).
    pub const CHUNK: usize = 8192;
}

/// masked_attention.
pub mod attention {
    /// Queries and keys per tile of the tensor-core kernels (and of the mask's tile states).
    pub const TILE_Q: usize = 64;
    pub const TILE_K: usize = 64;
    /// Warps per block of the tensor-core kernels (16 or 32 query rows each in the forward and
    /// dq, 16 key rows each in dk / dv).
    pub const WARPS: usize = 4;
    /// Elements of padding after each shared-memory row (keeps ldmatrix free of bank conflicts).
    pub const ROW_PAD: usize = 8;
    /// Warps per block of the f32 kernels (a warp per query or key row).
    pub const ROW_WARPS: usize = 8;
    /// Threads per block of the kernels that turn the atomic backwards' f32 dq sum into dq
    /// (`dq_rows`: a block per query tile and column block).
    pub const DQ_ROWS_THREADS: usize = 256;
    /// Steps of rows a warp of the delta pass reads at once (each step 32 / lanes rows, a row
    /// read by the power of two >= dv / 8 lanes).
    pub const DELTA_STEPS: usize = 4;
    /// The one-pass tensor-core backward (head tile 128): keys per block and warps per block
    /// (each warp 32 queries x 32 keys of S and dP, 32 keys x 64 head columns of dK / dV).
    pub const ONE_PASS_KEYS: usize = 128;
    pub const ONE_PASS_WARPS: usize = 8;
    /// Shared-memory stages of the one-pass backward's Q / dO tiles (with two P / dS buffers, one
    /// barrier per query tile; its tiles are swizzled, unpadded, to fit).
    pub const ONE_PASS_STAGES: usize = 3;
    /// The Hopper forward's block: a producer warpgroup and this many consumer warpgroups (128
    /// threads, a mask tile of 64 queries each), which share the block's K / V tiles.
    pub const HOPPER_CONSUMERS: usize = 2;
    /// Shared-memory stages of K / V tiles in the Hopper forward, at head tiles 64 and 128 (as
    /// many as fit: the copies of a stage start only once both consumers are done with it).
    pub const HOPPER_STAGES_D64: usize = 8;
    pub const HOPPER_STAGES_D128: usize = 6;
    /// Bytes before the Hopper forward's tiles in shared memory (its mbarriers; the tiles start
    /// 1024-byte aligned, as the 128-byte swizzle needs).
    pub const HOPPER_BARRIER_BYTES: usize = 1024;
    /// Shared-memory stages of Q / dO tiles in the Hopper backward, at head tiles 64 and 128
    /// (beside a block's K / V and dSᵀ tiles).
    pub const HOPPER_BWD_STAGES_D64: usize = 3;
    pub const HOPPER_BWD_STAGES_D128: usize = 3;
    /// Mask kinds.
    pub const MASK_FULL: i32 = 0;
    pub const MASK_CAUSAL: i32 = 1;
    pub const MASK_WINDOW: i32 = 2;
    pub const MASK_DOCUMENTS: i32 = 3;
    pub const MASK_DENSE: i32 = 4;
    /// Documents whose ids form one contiguous run each (the Hopper kernels only): every query
    /// sees one run of keys, read from the per-position runs instead of tile states.
    pub const MASK_RUNS: i32 = 5;
}
