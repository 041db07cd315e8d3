//! [`GradAllReduce`]: gradients averaged over the ranks in flat buckets.

use super::{check_same_on_every_rank, Collectives, ReduceOp};
use candle_core::{backprop::GradStore, bail, DType, Result, Tensor, Var};
use std::ops::Range;

/// The dtype gradients travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireDType {
    /// f32 on the wire and in the sum (exact to f32 rounding).
    #[default]
    F32,
    /// bf16 on the wire: half the bytes; each gradient is rounded to bf16 before the sum and
    /// the partial sums are rounded to bf16 along NCCL's ring (relative error ~2^-8 a hop).
    Bf16,
}

impl WireDType {
    fn dtype(self) -> DType {
        match self {
            WireDType::F32 => DType::F32,
            WireDType::Bf16 => DType::BF16,
        }
    }
}

/// How gradients are bucketed for the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketConfig {
    /// The most bytes (on the wire) a bucket holds; a variable larger than this gets a bucket of
    /// its own. Default 25 MiB, as PyTorch's DDP.
    pub bucket_bytes: usize,
    /// The dtype on the wire.
    pub wire: WireDType,
}

impl Default for BucketConfig {
    fn default() -> Self {
        Self {
            bucket_bytes: 25 << 20,
            wire: WireDType::F32,
        }
    }
}

/// Averages gradients over the ranks of a process group: the variables, ordered by name, are
/// packed into flat buckets (one all-reduce each), and each variable's gradient is replaced by
/// the mean over the ranks, in its own dtype.
///
/// A variable that has no gradient on some rank counts as a zero gradient there; one that has a
/// gradient on no rank stays without one (a flag per variable travels in the bucket), so that
/// optimizers skip it as they would on one device.
#[derive(Debug, Clone)]
pub struct GradAllReduce {
    vars: Vec<(String, Var)>,
    buckets: Vec<Range<usize>>,
    config: BucketConfig,
    /// Per bucket, the presence flags of a step where every variable has a gradient (all ones,
    /// wire dtype, on the group's device), made once: the common step uploads nothing.
    all_present: Vec<Tensor>,
}

impl GradAllReduce {
    /// Buckets `vars` (sorted by name here; empty ones left out) and checks, with one all-gather, that every rank of
    /// `group` holds the same names, shapes and dtypes and the same bucket configuration.
    /// Names must be unique.
    pub fn new<C: Collectives + ?Sized>(
        mut vars: Vec<(String, Var)>, config: BucketConfig, group: &C,
    ) -> Result<Self> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = vars.windows(2).find(|w| w[0].0 == w[1].0) {
            bail!(
                "dist: two variables are named `{}`; names order the buckets",
                w[0].0
            );
        }
        for (name, var) in &vars {
            if !var.dtype().is_float() {
                bail!("dist: variable `{name}` is {:?}, not a float", var.dtype());
            }
            if !var.device().same_device(group.device()) {
                bail!(
                    "dist: variable `{name}` is on {:?}, the group's device is {:?}",
                    var.device().location(),
                    group.device().location()
                );
            }
        }
        let wire_bytes = config.wire.dtype().size_in_bytes();
        let mut buckets = Vec::new();
        let mut start = 0;
        let mut bytes = 0;
        let hash = layout_hash(&vars, &config);
        // Empty variables have nothing to average (and CUDA launches nothing for them): their
        // gradients are left as they are.
        vars.retain(|(_, var)| var.elem_count() > 0);
        for (i, (_, var)) in vars.iter().enumerate() {
            let var_bytes = (var.elem_count() + 1) * wire_bytes;
            if i > start && bytes + var_bytes > config.bucket_bytes {
                buckets.push(start..i);
                start = i;
                bytes = 0;
            }
            bytes += var_bytes;
        }
        if start < vars.len() {
            buckets.push(start..vars.len());
        }
        let all_present = buckets
            .iter()
            .map(|b| Tensor::ones(b.len(), config.wire.dtype(), group.device()))
            .collect::<Result<_>>()?;
        let reducer = Self {
            vars,
            buckets,
            config,
            all_present,
        };
        check_same_on_every_rank(group, hash, "variables")?;
        Ok(reducer)
    }

    /// The variables, in bucket order (by name), without the empty ones.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Replaces every gradient in `grads` by its mean over the ranks.
    pub fn all_reduce<C: Collectives + ?Sized>(
        &self, grads: &mut GradStore, group: &C,
    ) -> Result<()> {
        if group.world_size() == 1 {
            return Ok(()); // the mean over one rank
        }
        let wire = self.config.wire.dtype();
        for (bucket, all_present) in self.buckets.iter().zip(&self.all_present) {
            let vars = &self.vars[bucket.clone()];
            // [gradients..., one presence flag per variable]
            let mut parts = Vec::with_capacity(vars.len() + 1);
            let mut flags = Vec::with_capacity(vars.len());
            for (name, var) in vars {
                match grads.get(var) {
                    Some(g) => {
                        if g.dims() != var.dims() {
                            bail!(
                                "dist: gradient of `{name}` has shape {:?}, the variable {:?}",
                                g.dims(),
                                var.dims()
                            );
                        }
                        parts.push(g.to_dtype(wire)?.flatten_all()?);
                        flags.push(1f32);
                    }
                    None => {
                        parts.push(Tensor::zeros(var.elem_count(), wire, var.device())?);
                        flags.push(0f32);
                    }
                }
            }
            parts.push(if flags.iter().all(|f| *f > 0.0) {
                all_present.clone()
            } else {
                Tensor::new(flags.as_slice(), group.device())?.to_dtype(wire)?
            });
            let flat = Tensor::cat(&parts, 0)?;
            // `flat` is this call's own buffer: reduced in place.
            let mean = group.all_reduce_in_place(flat, ReduceOp::Avg)?;
            let total: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
            // Every variable has a gradient here, so it has one after the mean: no need to read
            // the flags back (which would wait for the device).
            let present = if flags.iter().all(|f| *f > 0.0) {
                flags
            } else {
                mean.narrow(0, total, vars.len())?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
            };
            let mut offset = 0;
            for ((_, var), flag) in vars.iter().zip(present) {
                let n = var.elem_count();
                if flag > 0.0 {
                    let g = mean
                        .narrow(0, offset, n)?
                        .reshape(var.dims())?
                        .to_dtype(var.dtype())?;
                    grads.insert(var, g);
                }
                offset += n;
            }
        }
        Ok(())
    }
}

/// FNV-1a over the names, shapes, dtypes and bucket configuration.
fn layout_hash(vars: &[(String, Var)], config: &BucketConfig) -> u64 {
    let mut h = Fnv::default();
    h.write(&(config.bucket_bytes as u64).to_le_bytes());
    h.write(&[config.wire as u8]);
    for (name, var) in vars {
        h.write(name.as_bytes());
        h.write(&[0xff]);
        for d in var.dims() {
            h.write(&(*d as u64).to_le_bytes());
        }
        h.write(var.dtype().as_str().as_bytes());
    }
    h.0
}

/// 64-bit FNV-1a: a stable hash (std's `DefaultHasher` may differ between builds).
pub(crate) struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= *b as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}
