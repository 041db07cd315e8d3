//! The size-balanced assignment of whole tensors to ranks used by the sharded optimizer.

/// Assigns items of the given sizes to `ranks` bins so that the largest bin is small: the items
/// are taken largest first (ties by index) and each goes to the bin with the least total so far
/// (ties to the lowest rank). The result is `owner[i]` for item `i`; it depends only on the
/// sizes, so every rank computes the same assignment. The largest bin is at most 4/3 of the
/// optimum (Graham's bound for this greedy rule), and never more than the mean plus the largest
/// item.
pub fn partition_by_size(sizes: &[usize], ranks: usize) -> Vec<usize> {
    let ranks = ranks.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; ranks];
    let mut owner = vec![0usize; sizes.len()];
    for i in order {
        let (rank, _) = load
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(&b.0)))
            .expect("at least one rank");
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}
