//! Every op's tests in one binary (one GPU binary to carry, one link): each module checks one
//! op family against plain references on the CPU, and on CUDA device 0 when the crate is built
//! with `cuda` and a GPU is present. `cargo test --test ops <module>` runs one family.

mod common;
#[path = "../shared/dist_checks.rs"]
mod dist_checks;

mod adamw;
mod attention;

mod bias_add;
mod dist;
mod matmul;
mod matmul_f32_modes;
mod props;
mod scale;
mod small_fc_lopt;
mod softmax;
mod sparse_linear;
mod threads;
