//! [`ReducePlan`]: how the elements of a contiguous tensor fall into the groups of a reduction over
//! a set of dims, without a per-element offset table.
//!
//! Adjacent dims that are both reduced or both kept merge into one *block*, so any (shape, dims)
//! pair becomes alternating kept and reduced blocks. The element `j` of group `g` then sits at
//!
//! ```text
//! offset(g, j) = kept_offset(g / lanes) + g % lanes + reduced_offset(j)
//! ```
//!
//! where `lanes` is the size of the innermost block when it is kept (1 otherwise), and each
//! `*_offset` is a mixed-radix decomposition over at most a few blocks. Kernels compute it with
//! a handful of multiply-high divisions instead of reading an 8-byte offset per element.

use candle_core::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Most kept or reduced blocks a plan may have (a rank-12 tensor with alternating dims).
pub(crate) use crate::kernel_constants::softmax::MAX_BLOCKS;

/// A block of merged adjacent dims: its size and the stride of its innermost element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub size: usize,
    pub stride: usize,
}

/// The grouping of a reduction over `dims` of a contiguous tensor of a given shape, built once
/// and reused (the public softmax functions cache plans by shape and dims).
///
/// ```
/// use candle_fastops::ReducePlan;
/// // dims [0, 2] of a [2, 3, 4] tensor: three groups of 8 elements.
/// let plan = ReducePlan::new(&[2, 3, 4], &[2, 0])?;
/// assert_eq!((plan.num_groups(), plan.group_size()), (3, 8));
/// // Group 1 holds elements 4..8 and 16..20 of the buffer.
/// let offsets: Vec<usize> = (0..8).map(|j| plan.offset(1, j)).collect();
/// assert_eq!(offsets, [4, 5, 6, 7, 16, 17, 18, 19]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReducePlan {
    shape: Vec<usize>,
    dims: Vec<usize>,
    /// Kept blocks outside the innermost one, outermost first.
    kept: Vec<Block>,
    /// Size of the innermost block when it is kept (stride 1), else 1.
    lanes: usize,
    /// Reduced blocks, outermost first.
    reduced: Vec<Block>,
}

impl ReducePlan {
    /// Plans a reduction over `dims` (any order, no duplicates, each `< shape.len()`, at least
    /// one) of a contiguous tensor of `shape`.
    pub fn new(shape: &[usize], dims: &[usize]) -> Result<Self> {
        let rank = shape.len();
        if rank == 0 {
            bail!("reduce over dims: rank-0 tensors have no dims to reduce");
        }
        if dims.is_empty() {
            bail!("reduce over dims: the list of dims is empty (shape {shape:?})");
        }
        let mut sorted = dims.to_vec();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            if w[0] == w[1] {
                bail!("reduce over dims: dim {} appears twice in {dims:?}", w[0]);
            }
        }
        if let Some(&d) = sorted.iter().find(|&&d| d >= rank) {
            bail!("reduce over dims: dim {d} is out of range for shape {shape:?}");
        }
        // Merge runs of adjacent dims with the same status, innermost first; dims of size 1 take
        // any status, so they never split a block.
        let mut blocks: Vec<(bool, Block)> = Vec::new();
        let mut stride = 1;
        for d in (0..rank).rev() {
            let reduced = sorted.binary_search(&d).is_ok();
            let size = shape[d];
            match blocks.last_mut() {
                Some((r, block)) if *r == reduced || size == 1 => block.size *= size,
                Some((r, block)) if block.size == 1 => {
                    *r = reduced;
                    block.size = size;
                }
                _ => blocks.push((reduced, Block { size, stride })),
            }
            stride *= size;
        }
        let mut lanes = 1;
        if let Some((false, block)) = blocks.first() {
            lanes = block.size;
            blocks.remove(0);
        }
        let kept: Vec<Block> = blocks
            .iter()
            .rev()
            .filter(|(r, _)| !r)
            .map(|(_, b)| *b)
            .collect();
        let mut reduced: Vec<Block> = blocks
            .iter()
            .rev()
            .filter(|(r, _)| *r)
            .map(|(_, b)| *b)
            .collect();
        if reduced.is_empty() {
            // Every reduced dim has size 1 and merged into a kept block: one-element groups.
            reduced.push(Block { size: 1, stride: 1 });
        }
        if kept.len() > MAX_BLOCKS || reduced.len() > MAX_BLOCKS {
            bail!(
                "reduce over dims: dims {dims:?} of shape {shape:?} alternate more than {MAX_BLOCKS} times"
            );
        }
        Ok(Self {
            shape: shape.to_vec(),
            dims: sorted,
            kept,
            lanes,
            reduced,
        })
    }

    /// A plan from the process-wide cache, built on first use for this (shape, dims).
    pub fn cached(shape: &[usize], dims: &[usize]) -> Result<Arc<Self>> {
        type Cache = Mutex<HashMap<(Vec<usize>, Vec<usize>), Arc<ReducePlan>>>;
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let key = (shape.to_vec(), dims.to_vec());
        let cache = CACHE.get_or_init(Default::default);
        if let Some(plan) = cache.lock().expect("plan cache lock").get(&key) {
            return Ok(plan.clone());
        }
        let plan = Arc::new(Self::new(shape, dims)?);
        let mut cache = cache.lock().expect("plan cache lock");
        if cache.len() > 1024 {
            cache.clear();
        }
        cache.insert(key, plan.clone());
        Ok(plan)
    }

    /// The shape the plan was built for.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The reduced dims, sorted.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Number of groups (the product of the kept dims).
    pub fn num_groups(&self) -> usize {
        self.kept.iter().map(|b| b.size).product::<usize>() * self.lanes
    }

    /// Elements per group (the product of the reduced dims).
    pub fn group_size(&self) -> usize {
        self.reduced.iter().map(|b| b.size).product()
    }

    /// The shape of a reduction's result with the reduced dims kept as size 1.
    pub fn keepdim_shape(&self) -> Vec<usize> {
        let mut shape = self.shape.clone();
        for &d in &self.dims {
            shape[d] = 1;
        }
        shape
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn kept_blocks(&self) -> &[Block] {
        &self.kept
    }

    pub(crate) fn reduced_blocks(&self) -> &[Block] {
        &self.reduced
    }

    /// Size of the innermost kept block (1 when the innermost dim is reduced): groups `g` and
    /// `g + 1` with the same `g / lanes` are adjacent in memory.
    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// Storage offset (from the tensor's first element) of element `j` of group `g`.
    pub fn offset(&self, g: usize, j: usize) -> usize {
        self.group_base(g) + self.reduced_offset(j)
    }

    /// Offset of element 0 of group `g`.
    pub fn group_base(&self, g: usize) -> usize {
        mixed_radix_offset(&self.kept, g / self.lanes) + g % self.lanes
    }

    /// Offset of element `j` of a group relative to the group's element 0.
    pub fn reduced_offset(&self, j: usize) -> usize {
        mixed_radix_offset(&self.reduced, j)
    }
}

fn mixed_radix_offset(blocks: &[Block], mut index: usize) -> usize {
    let mut offset = 0;
    for block in blocks.iter().rev() {
        offset += (index % block.size) * block.stride;
        index /= block.size;
    }
    offset
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_offsets(shape: &[usize], dims: &[usize]) -> Vec<usize> {
        let plan = ReducePlan::new(shape, dims).unwrap();
        let mut out = Vec::new();
        for g in 0..plan.num_groups() {
            for j in 0..plan.group_size() {
                out.push(plan.offset(g, j));
            }
        }
        out
    }

    #[test]
    fn seed_examples() {
        // The seed design's expected permutations for [2, 3, 4].
        assert_eq!(
            all_offsets(&[2, 3, 4], &[0, 2]),
            [
                0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 16, 17, 18, 19, 8, 9, 10, 11, 20, 21, 22,
                23
            ]
        );
        assert_eq!(
            all_offsets(&[2, 3, 4], &[1]),
            [
                0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12, 16, 20, 13, 17, 21, 14, 18, 22, 15, 19,
                23
            ]
        );
    }

    #[test]
    fn every_subset_is_a_permutation_matching_a_brute_force_grouping() {
        let shape = [2, 3, 1, 4, 5];
        let rank = shape.len();
        let strides: Vec<usize> = (0..rank).map(|d| shape[d + 1..].iter().product()).collect();
        for mask in 1u32..(1 << rank) {
            let dims: Vec<usize> = (0..rank).filter(|d| mask & (1 << d) != 0).collect();
            let plan = ReducePlan::new(&shape, &dims).unwrap();
            // Brute force: group = kept multi-index in row-major order, element = reduced
            // multi-index in row-major order.
            let mut expected = Vec::new();
            let n: usize = shape.iter().product();
            let index = |flat: usize| -> Vec<usize> {
                (0..rank).map(|d| flat / strides[d] % shape[d]).collect()
            };
            let key = |idx: &[usize], reduced: bool| -> Vec<usize> {
                (0..rank)
                    .filter(|d| dims.contains(d) == reduced)
                    .map(|d| idx[d])
                    .collect()
            };
            let mut flat: Vec<usize> = (0..n).collect();
            flat.sort_by_key(|&f| (key(&index(f), false), key(&index(f), true)));
            expected.extend(flat);
            assert_eq!(all_offsets(&shape, &dims), expected, "dims {dims:?}");
            assert_eq!(plan.num_groups() * plan.group_size(), n);
        }
    }

    #[test]
    fn bad_dims_are_errors() {
        assert!(ReducePlan::new(&[], &[0]).is_err());
        assert!(ReducePlan::new(&[2, 3], &[]).is_err());
        assert!(ReducePlan::new(&[2, 3], &[1, 1]).is_err());
        assert!(ReducePlan::new(&[2, 3], &[2]).is_err());
    }
}
