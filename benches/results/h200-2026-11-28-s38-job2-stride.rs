use candle_core::{DType, Device, Result, Tensor};
use std::time::Instant;

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let (batch, active) = (16384usize, 32usize);
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as i32
    };
    let unchecked = candle_fastops::SparseLinearOptions {
        index_check: candle_fastops::IndexCheck::Unchecked,
        ..Default::default()
    };
    // (rows, allocated cols, used cols)
    let mut cases = Vec::new();
    for used in [1024usize, 128] {
        for alloc in [used, 1024, 1056, 1088, 1152, 1536, 2048, 4096, 8192] {
            if alloc >= used && !cases.contains(&(22528usize, alloc, used)) {
                cases.push((22528usize, alloc, used));
            }
        }
    }
    cases.push((1024, 1024, 1024));
    cases.push((1024, 1024, 128));
    for &(rows, cols, used) in &cases {
        let host: Vec<i32> = (0..batch * active).map(|_| next(rows)).collect();
        let idx = Tensor::from_vec(host, (batch, active), &dev)?;
        let full = Tensor::randn(0f32, 1f32, (rows, cols), &dev)?;
        let weight = full.narrow(1, 0, used)?;
        let bias = Tensor::randn(0f32, 1f32, used, &dev)?;
        let mut times = Vec::new();
        for i in 0..8 {
            dev.synchronize()?;
            let t = Instant::now();
            for _ in 0..20 {
                let y = candle_fastops::sparse_linear_with(candle_fastops::SparseFeatures::new(&idx), &weight, &bias, &unchecked)?;
                drop(y);
            }
            dev.synchronize()?;
            if i >= 1 {
                times.push(t.elapsed().as_secs_f64() * 1e6 / 20.0);
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[times.len() / 2];
        println!(
            "rows {rows} alloc cols {cols} used {used}: {med:.1} us, {:.1} us a 128-column stripe, weight {} MB",
            med / (used as f64 / 128.0),
            rows * cols * 4 >> 20
        );
    }
    let _ = DType::F32;
    Ok(())
}
