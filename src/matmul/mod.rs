//! The matmul family: one tiled product ([`core`]: operand views, the CPU block product, the CUDA
//! core launch and the f32 precision modes) behind three ops, each in its own directory with the
//! same files (`mod.rs`: API, checks and the CustomOp; `cuda.rs`: argument struct and launch):
//!
//! * [`masked_bmm`](masked_bmm::masked_bmm): a batched product masked by a u8 mask, fully masked
//!   tiles skipped ([`MaskPlan`]);
//! * [`backward`]: the two products of its backward, each output tile reducing only over the span
//!   of non-empty mask tiles;
//! * [`argmin_matmul`](argmin::argmin_matmul): the argmin over the columns of a product, never
//!   materialised (k-means assignment).

pub(crate) mod argmin;
pub(crate) mod backward;
pub(crate) mod core;
pub(crate) mod masked_bmm;

pub use self::argmin::{
    argmin_matmul, argmin_matmul_with, kmeans_assign, kmeans_assign_with_distances,
};
pub use self::core::{
    f32_matmul, matmul_tf32, set_f32_matmul, set_matmul_tf32, F32Matmul, MatmulOptions,
};
pub use self::masked_bmm::{masked_bmm, masked_bmm_with, masked_bmm_with_plan, MaskPlan};
