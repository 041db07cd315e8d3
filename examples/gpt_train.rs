//! Trains a small decoder-only transformer on this crate's own sources (bytes as tokens), with
//! packed sequences: each window of the batch holds several files back to back, and
//! `AttentionMask::documents` keeps every token's attention inside its own file (causal). Prints
//! the loss and the tokens per second over the steps since the previous line.
//!
//! ```text
//! cargo run --release --example gpt_train                        # AdamW, CPU
//! cargo run --release --example gpt_train -- --opt lopt          # the small_fc_lopt learned optimizer
//! cargo run --release --example gpt_train -- --steps 200 --layers 4 --batch 16 --seq 256
//! ```
//!
//! It runs on the CPU, or on CUDA device 0 when built with `--features cuda`.
//! On CUDA, the model runs in f32 and attention in bf16.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_fastops::optim::{MlpWeights, ParamsSmallFcLOpt, SmallFcLOpt};
use candle_fastops::{masked_attention_qkv, AttentionMask, AttentionOptions};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use std::time::Instant;

/// One optimizer step from a loss.
type StepFn = Box<dyn FnMut(&Tensor) -> Result<()>>;

struct Config {
    steps: usize,
    layers: usize,
    d_model: usize,
    heads: usize,
    batch: usize,
    seq: usize,
    lr: f64,
    lopt: bool,
}

impl Config {
    fn from_args() -> Result<Self> {
        let mut c = Config {
            steps: 60,
            layers: 2,
            d_model: 256,
            heads: 4,
            batch: 8,
            seq: 128,
            lr: 3e-3,
            lopt: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || {
                args.next()
                    .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
            };
            match arg.as_str() {
                "--steps" => c.steps = value()?.parse()?,
                "--layers" => c.layers = value()?.parse()?,
                "--d-model" => c.d_model = value()?.parse()?,
                "--heads" => c.heads = value()?.parse()?,
                "--batch" => c.batch = value()?.parse()?,
                "--seq" => c.seq = value()?.parse()?,
                "--lr" => c.lr = value()?.parse()?,
                "--opt" => match value()?.as_str() {
                    "adamw" => c.lopt = false,
                    "lopt" => c.lopt = true,
                    other => bail!("--opt is adamw or lopt, got {other}"),
                },
                other => bail!("unknown argument {other}"),
            }
        }
        if !c.d_model.is_multiple_of(c.heads) {
            bail!("--d-model must be a multiple of --heads");
        }
        Ok(c)
    }
}

/// The corpus: every `.rs` and `.md` file of the crate, one document each.
fn corpus() -> Result<Vec<Vec<u8>>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut stack = vec![root.join("src"), root.join("examples")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "md") {
                files.push(path);
            }
        }
    }
    for doc in ["README.md", "ARCHITECTURE.md"] {
        files.push(root.join(doc));
    }
    files.sort();
    files
        .iter()
        .map(|f| Ok(std::fs::read(f)?))
        .collect::<Result<Vec<_>>>()
}

/// A batch of `batch` windows of `seq` tokens from the documents laid end to end (starting at
/// random offsets), the next-token targets, and each token's document id.
fn batch(
    docs: &[Vec<u8>], c: &Config, rng: &mut u64, dev: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let stream: Vec<(u8, u32)> = docs
        .iter()
        .enumerate()
        .flat_map(|(i, d)| d.iter().map(move |&b| (b, i as u32)))
        .collect();
    let (mut inputs, mut targets, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..c.batch {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let start = (*rng as usize) % (stream.len() - c.seq - 1);
        for t in 0..c.seq {
            let (token, doc) = stream[start + t];
            let (next, next_doc) = stream[start + t + 1];
            inputs.push(token as u32);
            ids.push(doc);
            // The last token of a document predicts nothing across the boundary: -1 is ignored.
            targets.push(if next_doc == doc { next as i64 } else { -1 });
        }
    }
    let shape = (c.batch, c.seq);
    Ok((
        Tensor::from_vec(inputs, shape, dev)?,
        Tensor::from_vec(targets, shape, dev)?,
        Tensor::from_vec(ids, shape, dev)?,
    ))
}

struct Block {
    norm1: candle_nn::LayerNorm,
    qkv: candle_nn::Linear,
    proj: candle_nn::Linear,
    norm2: candle_nn::LayerNorm,
    up: candle_nn::Linear,
    down: candle_nn::Linear,
}

struct Gpt {
    embed: candle_nn::Embedding,
    pos: Tensor,
    blocks: Vec<Block>,
    norm: candle_nn::LayerNorm,
    head: candle_nn::Linear,
    heads: usize,
}

impl Gpt {
    fn new(c: &Config, vb: VarBuilder) -> Result<Self> {
        let d = c.d_model;
        let blocks = (0..c.layers)
            .map(|l| {
                let vb = vb.pp(format!("block{l}"));
                Ok(Block {
                    norm1: candle_nn::layer_norm(d, 1e-5, vb.pp("norm1"))?,
                    qkv: candle_nn::linear(d, 3 * d, vb.pp("qkv"))?,
                    proj: candle_nn::linear(d, d, vb.pp("proj"))?,
                    norm2: candle_nn::layer_norm(d, 1e-5, vb.pp("norm2"))?,
                    up: candle_nn::linear(d, 4 * d, vb.pp("up"))?,
                    down: candle_nn::linear(4 * d, d, vb.pp("down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed: candle_nn::embedding(256, d, vb.pp("embed"))?,
            pos: vb.get_with_hints(
                (c.seq, d),
                "pos",
                candle_nn::Init::Randn {
                    mean: 0.,
                    stdev: 0.02,
                },
            )?,
            blocks,
            norm: candle_nn::layer_norm(d, 1e-5, vb.pp("norm"))?,
            head: candle_nn::linear(d, 256, vb.pp("head"))?,
            heads: c.heads,
        })
    }

    /// Logits `[batch, seq, 256]` for tokens `[batch, seq]` under `mask`.
    fn forward(&self, tokens: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
        let mut x = self.embed.forward(tokens)?.broadcast_add(&self.pos)?;
        let d = x.dim(2)?;
        let dh = d / self.heads;
        for blk in &self.blocks {
            // One projection [b, t, 3 d] (each token's query, key and value heads): attention
            // reads its parts in place, and its gradient comes back as one tensor of that shape.
            // Attention in bf16 on the tensor cores of a GPU, in f32 on the CPU.
            let dtype = if x.device().is_cuda() {
                DType::BF16
            } else {
                DType::F32
            };
            let qkv = blk.qkv.forward(&blk.norm1.forward(&x)?)?.to_dtype(dtype)?;
            let options = AttentionOptions {
                scale: Some(1.0 / (dh as f64).sqrt()),
                ..Default::default()
            };
            // [b, t, 3 d] in (the projection as it comes), [b, t, d] out: no reshape nodes.
            let att = masked_attention_qkv(&qkv, self.heads, self.heads, mask, &options)?
                .to_dtype(DType::F32)?;
            x = (x + blk.proj.forward(&att)?)?;
            let h = blk.up.forward(&blk.norm2.forward(&x)?)?.gelu()?;
            x = (x + blk.down.forward(&h)?)?;
        }
        Ok(self.head.forward(&self.norm.forward(&x)?)?)
    }
}

/// Mean cross-entropy over the targets that are not -1.
fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.flatten_to(1)?;
    let targets = targets.flatten_all()?;
    let keep = targets.ge(0i64)?;
    let safe = keep.where_cond(&targets, &targets.zeros_like()?)?;
    let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let picked = log_probs.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let keep = keep.to_dtype(DType::F32)?;
    Ok((picked * &keep)?
        .sum_all()?
        .neg()?
        .broadcast_div(&keep.sum_all()?)?)
}

fn main() -> Result<()> {
    let c = Config::from_args()?;
    let dev = if cfg!(feature = "cuda") {
        Device::cuda_if_available(0)?
    } else {
        Device::Cpu
    };
    println!("device: {:?}", dev.location());
    let docs = corpus()?;
    let bytes: usize = docs.iter().map(Vec::len).sum();
    println!(
        "corpus: {} files, {bytes} bytes; model: {} layers, d_model {}, {} heads; batch {} x {} tokens; {}",
        docs.len(),
        c.layers,
        c.d_model,
        c.heads,
        c.batch,
        c.seq,
        if c.lopt { "small_fc_lopt" } else { "AdamW" }
    );
    let varmap = VarMap::new();
    let model = Gpt::new(&c, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    println!("{params} parameters");
    let mut step_fn: StepFn = if c.lopt {
        let mlp = MlpWeights::from_safetensors(
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/small_fc_lopt_mlp.safetensors"
            ),
            &dev,
        )?;
        let params = ParamsSmallFcLOpt {
            lr: c.lr,
            ..ParamsSmallFcLOpt::new(mlp)
        };
        let mut opt = SmallFcLOpt::from_varmap(&varmap, params)?;
        Box::new(move |loss| Ok(opt.backward_step(loss)?))
    } else {
        let params = ParamsAdamW {
            lr: c.lr,
            weight_decay: 0.01,
            ..Default::default()
        };
        let mut opt = AdamW::new(varmap.all_vars(), params)?;
        Box::new(move |loss| Ok(opt.backward_step(loss)?))
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut first, mut last) = (None, 0f32);
    // Tokens a second over the steps since the previous line (the first line's step also pays
    // for loading kernels and warming up).
    let mut mark = (Instant::now(), 0usize);
    for step in 1..=c.steps {
        let (tokens, targets, ids) = batch(&docs, &c, &mut rng, &dev)?;
        let mask = AttentionMask::documents(&ids, true)?;
        let l = loss(&model.forward(&tokens, &mask)?, &targets)?;
        step_fn(&l)?;
        last = l.to_scalar::<f32>()?;
        first.get_or_insert(last);
        if step % 10 == 0 || step == 1 || step == c.steps {
            let (since, at) = mark;
            let tokens = ((step - at) * c.batch * c.seq) as f64;
            println!(
                "step {step:4}  loss {last:.3}  {:.0} tokens/s",
                tokens / since.elapsed().as_secs_f64()
            );
            mark = (Instant::now(), step);
        }
    }
    let first = first.unwrap_or(last);
    println!("loss {first:.3} -> {last:.3}");
    if c.steps >= 30 && last >= first {
        bail!("the loss did not fall ({first:.3} -> {last:.3})");
    }
    Ok(())
}
