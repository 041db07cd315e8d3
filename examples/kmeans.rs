//! Lloyd's k-means on synthetic Gaussian blobs: the assignment step is
//! `candle_fastops::kmeans_assign` (argmin over `x . centroids^T` without materialising it), the
//! centroid update is plain candle. Prints the inertia per iteration and the time per assignment.
//!
//! ```text
//! cargo run --release --example kmeans                      # CPU: 65536 points, 256 clusters
//! cargo run --release --example kmeans --features cuda      # GPU when present: 2^20 points, 4096 clusters
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

fn main() -> Result<()> {
    let dev = if cfg!(feature = "cuda") {
        Device::cuda_if_available(0)?
    } else {
        Device::Cpu
    };
    let (n, c, d, iterations) = if dev.is_cuda() {
        (1 << 20, 4096, 128, 10)
    } else {
        (65536, 256, 32, 10)
    };
    println!(
        "k-means on {:?}: {n} points, {c} clusters, {d} dims",
        dev.location()
    );

    // Points drawn around `c` hidden centres.
    let centres = (Tensor::randn(0f32, 1.0, (c, d), &dev)? * 4.0)?;
    let owner = Tensor::rand(0f32, c as f32, n, &dev)?
        .floor()?
        .to_dtype(DType::U32)?;
    let x = (centres.index_select(&owner, 0)? + Tensor::randn(0f32, 1.0, (n, d), &dev)?)?;

    // Initial centroids: the first `c` points.
    let mut centroids = x.narrow(0, 0, c)?.contiguous()?;
    let ones = Tensor::ones((n, 1), DType::F32, &dev)?;
    for it in 0..iterations {
        dev.synchronize()?;
        let start = Instant::now();
        let (assign, dist) = candle_fastops::kmeans_assign_with_distances(&x, &centroids)?;
        dev.synchronize()?;
        let assign_ms = start.elapsed().as_secs_f64() * 1e3;
        let inertia = dist.sum_all()?.to_scalar::<f32>()?;
        println!("iter {it:2}: inertia {inertia:14.1}   assignment {assign_ms:8.2} ms");

        // Centroid update: sums and counts per cluster; empty clusters keep their centroid.
        let sums = Tensor::zeros((c, d), DType::F32, &dev)?.index_add(&assign, &x, 0)?;
        let counts = Tensor::zeros((c, 1), DType::F32, &dev)?.index_add(&assign, &ones, 0)?;
        let empty = counts.eq(0f64)?.broadcast_as((c, d))?;
        let means = sums.broadcast_div(&counts.clamp(1f32, f32::MAX)?)?;
        centroids = empty.where_cond(&centroids, &means)?;
    }
    let final_inertia = candle_fastops::kmeans_assign_with_distances(&x, &centroids)?
        .1
        .sum_all()?
        .to_scalar::<f32>()?;
    let noise = (n * d) as f32; // the blobs' own spread: unit variance per dim
    println!(
        "final inertia {final_inertia:.1} ({:.2}x the blob noise {noise:.1})",
        final_inertia / noise
    );
    Ok(())
}
