// Session 43: the CPU attention forward (f32, b 1, h 8, n 1024, d 64, causal) timed alone, 15 calls
// (median, min), beside the unmasked candle composite; built as an example (copied into examples/)
// from two builds, the f32 exponential before and after, and run alternately.
use candle_core::{Device, Tensor};
fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, 8, 1024, 64), &dev)?;
    let mask = candle_fastops::AttentionMask::causal();
    for _ in 0..3 { candle_fastops::masked_attention(&q, &k, &v, &mask, 0.125)?; }
    let mut times = Vec::new();
    for _ in 0..15 {
        let t = std::time::Instant::now();
        candle_fastops::masked_attention(&q, &k, &v, &mask, 0.125)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let sm = candle_nn::ops::softmax_last_dim(&q.matmul(&k.t()?)?)?;
    let t = std::time::Instant::now();
    for _ in 0..5 { let s = (q.matmul(&k.t()?)? * 0.125)?; candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?; }
    let _ = sm;
    println!("forward median {:.2} ms (min {:.2}); unmasked composite {:.2} ms", times[7], times[0], t.elapsed().as_secs_f64() * 1e3 / 5.0);
    Ok(())
}
