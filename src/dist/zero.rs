//! [`Sharded`]: an optimizer's state sharded over the ranks (ZeRO-1): [`ShardedSmallFcLOpt`],
//! [`ShardedAdamW`].

use super::{partition_by_size, BucketConfig, Collectives, GradAllReduce};
use crate::optim::{AdamW, SmallFcLOpt};
use candle_core::{backprop::GradStore, bail, Result, Tensor, Var};
use std::path::{Path, PathBuf};

/// An optimizer [`Sharded`] can shard: built over named variables, its state saved and loaded
/// by name. Implemented by [`SmallFcLOpt`] and [`AdamW`].
pub trait ShardableOptimizer: candle_nn::Optimizer + Sized {
    /// The optimizer over `vars` (possibly none: a rank may own no tensor).
    fn new_named(vars: Vec<(String, Var)>, config: Self::Config) -> Result<Self>;
    /// Writes the state of its variables to `path`.
    fn save_state(&self, path: &Path) -> Result<()>;
    /// Reads a state written by `save_state` onto the same names.
    fn load_state(&mut self, path: &Path) -> Result<()>;
    /// Bytes of optimizer state held.
    fn state_bytes(&self) -> usize;
    /// Steps taken.
    fn steps_taken(&self) -> u64;
}

impl ShardableOptimizer for SmallFcLOpt {
    fn new_named(vars: Vec<(String, Var)>, config: Self::Config) -> Result<Self> {
        SmallFcLOpt::new_named(vars, config)
    }
    fn save_state(&self, path: &Path) -> Result<()> {
        SmallFcLOpt::save_state(self, path)
    }
    fn load_state(&mut self, path: &Path) -> Result<()> {
        SmallFcLOpt::load_state(self, path)
    }
    fn state_bytes(&self) -> usize {
        SmallFcLOpt::state_bytes(self)
    }
    fn steps_taken(&self) -> u64 {
        SmallFcLOpt::steps_taken(self)
    }
}

impl ShardableOptimizer for AdamW {
    fn new_named(vars: Vec<(String, Var)>, config: Self::Config) -> Result<Self> {
        AdamW::new_named(vars, config)
    }
    fn save_state(&self, path: &Path) -> Result<()> {
        AdamW::save_state(self, path)
    }
    fn load_state(&mut self, path: &Path) -> Result<()> {
        AdamW::load_state(self, path)
    }
    fn state_bytes(&self) -> usize {
        AdamW::state_bytes(self)
    }
    fn steps_taken(&self) -> u64 {
        AdamW::steps_taken(self)
    }
}

/// [`SmallFcLOpt`] sharded over a process group.
pub type ShardedSmallFcLOpt<C> = Sharded<SmallFcLOpt, C>;
/// [`AdamW`] sharded over a process group.
pub type ShardedAdamW<C> = Sharded<AdamW, C>;

/// An optimizer with its state sharded over the ranks of a process group (ZeRO stage 1).
///
/// Whole tensors are assigned to ranks by a size-balanced partition ([`partition_by_size`] over
/// the element counts, variables in name order): the learned optimizer's features need
/// statistics over a whole tensor, so tensors are not split. Each rank keeps the state of its
/// own tensors only (about `1 / world_size` of it) and a step
/// 1. averages the gradients over the ranks ([`GradAllReduce`]),
/// 2. steps the rank's own tensors with a local optimizer,
/// 3. broadcasts every tensor from its owner (one grouped call), so that every rank again holds
///    every parameter.
///
/// With the same gradients the parameters equal those of the unsharded optimizer (each tensor
/// is stepped by the same code on the same data). [`Sharded::save_state`] writes one file per
/// rank; [`Sharded::load_state`] reads them back on the same world size.
pub struct Sharded<O, C> {
    local: O,
    owners: Vec<usize>,
    reducer: GradAllReduce,
    group: C,
}

impl<O: ShardableOptimizer, C: Collectives> Sharded<O, C> {
    /// Shards the optimizer over `group`. `vars` are named (the names order the partition and
    /// key the saved state) and must be the same on every rank (checked).
    pub fn new(
        vars: Vec<(String, Var)>, params: O::Config, group: C, config: BucketConfig,
    ) -> Result<Self> {
        let reducer = GradAllReduce::new(vars, config, &group)?;
        let sizes: Vec<usize> = reducer.vars().iter().map(|(_, v)| v.elem_count()).collect();
        let owners = partition_by_size(&sizes, group.world_size());
        let owned = reducer
            .vars()
            .iter()
            .zip(&owners)
            .filter(|(_, owner)| **owner == group.rank())
            .map(|((name, var), _)| (name.clone(), var.clone()))
            .collect();
        let local = O::new_named(owned, params)?;
        Ok(Self {
            local,
            owners,
            reducer,
            group,
        })
    }

    /// Every variable of `varmap`, by name.
    pub fn from_varmap(
        varmap: &candle_nn::VarMap, params: O::Config, group: C, config: BucketConfig,
    ) -> Result<Self> {
        let vars = {
            let data = varmap.data().lock().map_err(|_| {
                candle_core::Error::Msg("dist: the VarMap's lock is poisoned".into())
            })?;
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        Self::new(vars, params, group, config)
    }

    /// Backward of this rank's `loss`, then [`Sharded::step`].
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        self.step(&mut grads)
    }

    /// Averages `grads` over the ranks (in place), steps this rank's tensors and broadcasts
    /// every tensor from its owner.
    pub fn step(&mut self, grads: &mut GradStore) -> Result<()> {
        self.reducer.all_reduce(grads, &self.group)?;
        self.step_averaged(grads)
    }

    /// The step on gradients that are already the same on every rank (no all-reduce): the local
    /// step and the broadcast from the owners.
    pub fn step_averaged(&mut self, grads: &GradStore) -> Result<()> {
        candle_nn::Optimizer::step(&mut self.local, grads)?;
        let vars: Vec<(Var, usize)> = self
            .reducer
            .vars()
            .iter()
            .zip(&self.owners)
            .map(|((_, var), owner)| (var.clone(), *owner))
            .collect();
        self.group.broadcast_vars(&vars)
    }

    /// The rank that owns (keeps the state of and steps) variable `name`.
    pub fn owner_of(&self, name: &str) -> Option<usize> {
        let vars = self.reducer.vars();
        let i = vars.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok()?;
        Some(self.owners[i])
    }

    /// The optimizer over this rank's own variables.
    pub fn local(&self) -> &O {
        &self.local
    }

    /// Bytes of optimizer state this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.local.state_bytes()
    }

    /// Steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.local.steps_taken()
    }

    /// The process group.
    pub fn group(&self) -> &C {
        &self.group
    }

    /// The file that holds this rank's shard for a state saved at `path`:
    /// `state.safetensors` becomes `state.rank{r}-of-{w}.safetensors`.
    pub fn shard_path(path: impl AsRef<Path>, rank: usize, world_size: usize) -> PathBuf {
        let path = path.as_ref();
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ext = path
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        path.with_file_name(format!("{stem}.rank{rank}-of-{world_size}{ext}"))
    }

    /// Writes this rank's shard (its variables' state and the step counter) to
    /// [`Sharded::shard_path`]; every rank calls it.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let shard = Self::shard_path(path, self.group.rank(), self.group.world_size());
        self.local.save_state(&shard)
    }

    /// Reads this rank's shard written by [`Sharded::save_state`] with the same
    /// world size; every rank calls it. A missing shard (another world size) or one holding
    /// other variables is an error and changes nothing.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let shard = Self::shard_path(&path, rank, world);
        if !shard.exists() {
            bail!(
                "dist: no optimizer shard {} for rank {rank} of {world}; a sharded state reloads \
                 only on the world size that saved it",
                shard.display()
            );
        }
        self.local.load_state(&shard)
    }
}
