// Session 44, jobs 2 and 3's probe (built with --features cuda as an example, carried compressed;
// PROBE_STAMPS=1, job 3, prints a wall-clock stamp before each form).
// Probe (session 44): where the explicit fwd+bwd's time goes on CUDA at causal 8192 (bf16 b4 h16
// d128): GPU event time and host enqueue time per call, forward and backward apart, against the
// autograd form; then the same after a 16 GiB allocation is made and dropped.
use candle_core::{DType, Device, Tensor, Var};
use candle_fastops::{masked_attention, masked_attention_backward, masked_attention_with_lse, AttentionMask, AttentionOptions};
use std::time::Instant;

fn stats(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    format!("median {:9.1} min {:9.1} max {:9.1}", v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> candle_core::Result<()> {
    let dev = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &dev else { unreachable!() };
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    use candle_core::cuda_backend::WrapErr;
    let stream = cuda.cuda_stream();
    let n: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(8192);
    let shape = (4, 16, n, 128);
    let r = |dev: &Device| Tensor::randn(0f32, 1., shape, dev)?.to_dtype(DType::BF16);
    let (q, k, v, g) = (r(&dev)?, r(&dev)?, r(&dev)?, r(&dev)?);
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let mask = AttentionMask::causal();
    let o = AttentionOptions { scale: Some(1.0 / (128f64).sqrt()), ..Default::default() };
    let fwd = || masked_attention_with_lse(&q, &k, &v, &mask, &o);
    let (out, lse) = fwd()?;
    type F<'a> = Box<dyn FnMut() -> candle_core::Result<()> + 'a>;
    let mut cases: Vec<(&str, F)> = vec![
        ("explicit fwd+bwd", Box::new(|| {
            let (out, lse) = fwd()?;
            masked_attention_backward(&q, &k, &v, (&out, &lse), &g, &mask, &o).map(drop)
        })),
        ("forward with lse", Box::new(|| fwd().map(drop))),
        ("backward alone", Box::new(|| masked_attention_backward(&q, &k, &v, (&out, &lse), &g, &mask, &o).map(drop))),
        ("autograd fwd+bwd", Box::new(|| masked_attention(&qv, &kv, &vv, &mask, o.scale.unwrap())?.backward().map(drop))),
    ];
    for round in 0..2 {
        if round == 1 {
            let big = Tensor::zeros((4usize << 30,), DType::F32, &dev)?; // 16 GiB
            dev.synchronize()?;
            drop(big);
            dev.synchronize()?;
            println!("-- after a 16 GiB allocation, dropped");
        }
        for (name, f) in cases.iter_mut() {
            if std::env::var("PROBE_STAMPS").is_ok() {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
                println!("stamp {now:.3} {name} (round {round})");
            }
            for _ in 0..3 { f()?; }
            dev.synchronize()?;
            let (mut gpu, mut host, mut events) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..20 {
                let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
                let t = Instant::now();
                f()?;
                host.push(t.elapsed().as_secs_f64() * 1e6);
                let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
                events.push((start, end));
            }
            dev.synchronize()?;
            for (s, e) in events { gpu.push(s.elapsed_ms(&e).w()? as f64 * 1e3); }
            println!("{name:18} gpu us {}   host enqueue us {}", stats(gpu), stats(host));
        }
    }
    if std::env::var("PROBE_STAMPS").is_ok() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        println!("stamp {now:.3} end");
    }
    Ok(())
}
