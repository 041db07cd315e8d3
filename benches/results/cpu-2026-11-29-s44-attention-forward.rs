// Session 44: the CPU attention forward (f32, b 1, h 8, n 1024, d 64, causal) timed alone, ITERS calls
// (median, min); COMPOSITE=1 adds the unmasked candle composite. Built as an example (copied into
// examples/) from two builds (ddbef52 and this session's), run alternately.
use candle_core::{Device, Tensor};
fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let iters: usize = std::env::var("ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let q = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let mask = candle_fastops::AttentionMask::causal();
    for _ in 0..3 {
        candle_fastops::masked_attention(&q, &k, &v, &mask, 0.125)?;
    }
    let mut times = Vec::new();
    for _ in 0..iters {
        let t = std::time::Instant::now();
        candle_fastops::masked_attention(&q, &k, &v, &mask, 0.125)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mut ct = Vec::new();
    if std::env::var("COMPOSITE").is_ok() {
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let s = (q.matmul(&k.t()?)? * 0.125)?;
            candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?;
            ct.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ct.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    println!(
        "forward median {:.2} ms (min {:.2}); composite median {:?}",
        times[iters / 2],
        times[0],
        ct.get(2)
    );
    Ok(())
}
