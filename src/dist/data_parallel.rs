//! [`DataParallel`]: any candle optimizer, stepped on gradients averaged over the ranks.

use super::{BucketConfig, Collectives, GradAllReduce};
use candle_core::{backprop::GradStore, Result, Tensor, Var};
use candle_nn::Optimizer;

/// Data parallelism around a [`candle_nn::Optimizer`]: each rank computes the loss of its own
/// slice of the batch, [`DataParallel::backward_step`] averages the gradients over the ranks
/// ([`GradAllReduce`]) and steps the optimizer, so every rank applies the same update and the
/// replicas stay identical. Start every rank from the same parameters (the same seed, or
/// [`DataParallel::broadcast_parameters`]).
///
/// The mean of the ranks' gradients equals the gradient of the mean loss over the whole batch
/// when every rank's loss is a mean over the same number of samples.
pub struct DataParallel<O, C> {
    optimizer: O,
    reducer: GradAllReduce,
    group: C,
}

impl<O: Optimizer, C: Collectives> DataParallel<O, C> {
    /// Wraps `optimizer`, which steps the variables `vars` (named: the names order the buckets
    /// and must be the same on every rank, as must the shapes; checked here).
    pub fn new(
        optimizer: O, vars: Vec<(String, Var)>, group: C, config: BucketConfig,
    ) -> Result<Self> {
        let reducer = GradAllReduce::new(vars, config, &group)?;
        Ok(Self {
            optimizer,
            reducer,
            group,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// The process group.
    pub fn group(&self) -> &C {
        &self.group
    }

    /// The wrapped optimizer.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The wrapped optimizer, mutably (learning-rate schedules, state save / load).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// Copies rank 0's parameters to every rank.
    pub fn broadcast_parameters(&self) -> Result<()> {
        let vars: Vec<(Var, usize)> = self
            .reducer
            .vars()
            .iter()
            .map(|(_, v)| (v.clone(), 0))
            .collect();
        self.group.broadcast_vars(&vars)
    }

    /// Backward of this rank's `loss`, the gradients averaged over the ranks, one optimizer step.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        self.step(&mut grads)
    }

    /// Averages `grads` over the ranks (in place) and steps the optimizer with them.
    pub fn step(&mut self, grads: &mut GradStore) -> Result<()> {
        self.reducer.all_reduce(grads, &self.group)?;
        self.optimizer.step(grads)
    }
}
