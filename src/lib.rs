//! Fast custom ops for [candle](https://github.com/huggingface/candle): each op is a CUDA kernel
//! (compiled to PTX at build time with the `cuda` feature) with a multi-threaded CPU fallback,
//! exposed as a candle custom op so it composes with candle tensors and autograd.
//!
//! | op | what | status |
//! | --- | --- | --- |
//! | [`bias_add`] / [`bias_add_`] / [`bias_add_with`] | TensorFlow `BiasAdd`: a 1-D bias along any dim, optionally with a fused [`Activation`] (a dense layer's bias and clipped ReLU in one pass) | implemented |
//! | [`sparse_linear`] / [`sparse_linear_pair`] / [`FeatureTransformer`] | NNUE input layer (sparse feature transformer), forward and backward | implemented |
//! | [`masked_bmm`] / [`masked_bmm_with_plan`] / [`MaskPlan`] | batched matmul masked by a u8 mask, fully masked tiles skipped | implemented (f32-accurate 3-pass TF32 by default, or FMA / TF32 via [`set_f32_matmul`]; f16/bf16 on tensor cores; backward skips empty tiles) |
//! | [`argmin_matmul`] / [`kmeans_assign`] | argmin over the columns of `a . b` without materialising it (k-means assignment) | implemented (same precision modes) |
//! | [`softmax_dims`] / [`log_softmax_dims`] | softmax over any set of dims, via a [`ReducePlan`] | implemented |
//! | [`masked_attention`] / [`masked_attention_with`] / [`masked_attention_with_lse`] / [`masked_attention_backward`] / [`masked_attention_combine`] / [`masked_attention_packed`] / [`masked_attention_qkv`] / [`masked_attention_tokens`] / [`AttentionMask`] | trainable attention under full, causal, sliding-window, document or dense masks; grouped-query heads; no `m x n` buffer | CPU and CUDA (tensor cores for f16 / bf16, exact f32), forward and backward |
//! | [`optim::SmallFcLOpt`] | small_fc_lopt learned optimizer as a `candle_nn::Optimizer`: fused per-element passes (CPU threads; on CUDA one multi-tensor step with the MLP on tensor cores), state save/load | implemented |
//! | [`optim::AdamW`] | candle_nn's AdamW with the step fused (one pass; one CUDA launch per 48 tensors), state save/load by name | implemented |
//! | [`dist`] | data-parallel training: NCCL process groups (feature `nccl`) or threads, bucketed gradient all-reduce, `DataParallel`, ZeRO-1 sharded small_fc_lopt, launcher | implemented (measured on one GPU; two-GPU figures pending) |
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! let dev = Device::Cpu; // or Device::new_cuda(0)? with the `cuda` feature
//! let xs = Tensor::randn(0f32, 1., (8, 16, 4, 4), &dev)?; // NCHW
//! let bias = Tensor::randn(0f32, 1., 16, &dev)?;
//! let ys = candle_fastops::bias_add(&xs, &bias, 1)?; // out of place, differentiable
//! candle_fastops::bias_add_(&xs, &bias, 1)?; // in place, allocates nothing
//! let diff = (ys - &xs)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-6);
//!
//! // Softmax over dims 1 and 3 together (each [16, 4] slice sums to 1), and its log form.
//! let probs = candle_fastops::softmax_dims(&xs, &[1, 3])?;
//! let log_probs = candle_fastops::log_softmax_dims(&xs, &[3, 1])?;
//! // The plan behind them, reusable for a (shape, dims) pair: 8 * 4 groups of 16 * 4.
//! let plan = candle_fastops::ReducePlan::new(xs.dims(), &[1, 3])?;
//! assert_eq!((plan.num_groups(), plan.group_size()), (32, 64));
//!
//! // NNUE feature transformer: rows of active feature indices ending at -1, both perspectives
//! // in one launch, the side to move's half first; gradients reach weight and bias.
//! let weight = candle_core::Var::randn(0f32, 0.01, (768, 32), &dev)?;
//! let ft_bias = candle_core::Var::zeros(32, DType::F32, &dev)?;
//! let white = Tensor::new(&[[3i32, 70, 500, -1], [8, -1, 0, 0]], &dev)?;
//! let black = Tensor::new(&[[5i32, 9, -1, -1], [600, 601, 602, 603]], &dev)?;
//! let stm = Tensor::new(&[1u8, 0], &dev)?;
//! let acc = candle_fastops::sparse_linear_pair(&white, &black, &stm, &weight, &ft_bias)?;
//! assert_eq!(acc.dims(), [2, 64]);
//! let grads = acc.clamp(0f32, 1f32)?.sum_all()?.backward()?;
//! assert_eq!(grads.get(&weight).unwrap().dims(), [768, 32]);
//!
//! // Causal attention scores: the product masked to -inf above the diagonal, upper tiles skipped.
//! let q = Tensor::randn(0f32, 1., (4, 200, 32), &dev)?;
//! let k = Tensor::randn(0f32, 1., (4, 200, 32), &dev)?;
//! let causal = Tensor::tril2(200, DType::U8, &dev)?;
//! let plan = candle_fastops::MaskPlan::new(&causal)?; // reusable while the mask is unchanged
//! let scores = candle_fastops::masked_bmm_with_plan(&q, &k.t()?, &causal, &plan, f64::NEG_INFINITY)?;
//! let attn = candle_fastops::softmax_dims(&scores, &[2])?;
//!
//! // k-means assignment without the n x c distance matrix (u32 index of the nearest centroid).
//! let points = Tensor::randn(0f32, 1., (1000, 16), &dev)?;
//! let centroids = Tensor::randn(0f32, 1., (10, 16), &dev)?;
//! let assign = candle_fastops::kmeans_assign(&points, &centroids)?;
//! assert_eq!((attn.dims(), assign.dims()), (&[4, 200, 200][..], &[1000][..]));
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! Enable the GPU path with the `cuda` feature; without it everything runs on the CPU.

mod activation;
mod attention;
mod bias_add;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod determinism;
mod dispatch;
pub mod dist;
mod kernel_constants;
mod matmul;
pub mod optim;
mod poison;
mod softmax;
mod sparse_linear;
mod tile_summary;

pub use activation::Activation;
pub use attention::{
    masked_attention, masked_attention_backward, masked_attention_combine, masked_attention_packed,
    masked_attention_qkv, masked_attention_tokens, masked_attention_with,
    masked_attention_with_lse, AttentionMask, AttentionOptions,
};
pub use bias_add::{bias_add, bias_add_, bias_add_with, BiasAddOptions};
#[doc(hidden)]
pub use bias_add::{bias_add_with_hint, CacheHint};
pub use determinism::{deterministic, set_deterministic};
pub use matmul::{
    argmin_matmul, argmin_matmul_with, f32_matmul, kmeans_assign, kmeans_assign_with_distances,
    masked_bmm, masked_bmm_with, masked_bmm_with_plan, matmul_tf32, set_f32_matmul,
    set_matmul_tf32, F32Matmul, MaskPlan, MatmulOptions,
};
#[doc(hidden)]
pub use poison::set_poison_outputs;
pub use softmax::plan::ReducePlan;
pub use softmax::{log_softmax_dims, softmax_dims, ReduceDims};
#[doc(hidden)]
pub use sparse_linear::sparse_linear_backward;
pub use sparse_linear::{
    check_sparse_indices, sparse_linear, sparse_linear_pair, sparse_linear_pair_with,
    sparse_linear_with, FeatureTransformer, IndexCheck, SparseActivation, SparseFeatures,
    SparseLinearOptions,
};
