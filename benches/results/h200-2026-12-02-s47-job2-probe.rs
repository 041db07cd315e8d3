// Session 47, job 2: the probe as job 3 ran it (job 2 ran the same file without its TIMELINE branch).
// Probe (session 47): is the causal 8192 forward's speed (two modes, ~3240 / ~3410 us in the
// portable kernels, one per process) a property of where the operands lie? One process allocates
// COPIES fresh q, k and v each (bf16 b4 h16 n8192 d128, all kept alive, so every copy lies at new
// addresses), then times the forward (20 calls, after 3) on each (q_i, k_j, v_j) pair and on
// (q_0, k_j, v_l) with j != l, printing each operand's device address beside the medians.
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Storage, Tensor};
use candle_fastops::{masked_attention, AttentionMask};

fn address(t: &Tensor, stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>) -> u64 {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => s.as_cuda_slice::<half::bf16>().unwrap().device_ptr(stream).0,
        _ => 0,
    }
}

fn main() -> candle_core::Result<()> {
    let dev = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &dev else { unreachable!() };
    let stream = cuda.cuda_stream();
    let n: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(8192);
    let copies: usize = std::env::var("COPIES").ok().and_then(|s| s.parse().ok()).unwrap_or(4);
    let shape = (4, 16, n, 128);
    let r = || Tensor::randn(0f32, 1., shape, &dev)?.to_dtype(DType::BF16);
    let mut qs = Vec::new();
    let mut ks = Vec::new();
    let mut vs = Vec::new();
    for _ in 0..copies {
        qs.push(r()?);
        ks.push(r()?);
        vs.push(r()?);
    }
    let mask = AttentionMask::causal();
    let scale = 1.0 / (128f64).sqrt();
    let time = |q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<(f64, f64, f64, u64)> {
        let mut out_at = 0;
        for _ in 0..3 {
            let o = masked_attention(q, k, v, &mask, scale)?;
            out_at = address(&o, &stream);
        }
        dev.synchronize()?;
        let mut gpu = Vec::new();
        for _ in 0..20 {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
            let o = masked_attention(q, k, v, &mask, scale)?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
            end.synchronize().w()?;
            gpu.push(start.elapsed_ms(&end).w()? as f64 * 1e3);
            drop(o);
        }
        gpu.sort_by(|a, b| a.partial_cmp(b).unwrap());
        Ok((gpu[gpu.len() / 2], gpu[0], gpu[gpu.len() - 1], out_at))
    };
    let hex = |a: u64| format!("{a:#014x}");
    if std::env::var("TIMELINE").is_ok() {
        // Every call's time, 150 back to back, for (q0, k0, v0), (q2, k0, v0) and (q0, k0, v0)
        // again, each after a 3 s pause, with a wall-clock stamp at the start of each run.
        for (i, j) in [(0usize, 0usize), (2 % copies, 0), (0, 0), (0, 1 % copies)] {
            std::thread::sleep(std::time::Duration::from_secs(3));
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
            let mut line = format!("stamp {now:.3} q{i} k{j} v{j}:");
            for _ in 0..150 {
                let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
                let o = masked_attention(&qs[i], &ks[j], &vs[j], &mask, scale)?;
                let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
                end.synchronize().w()?;
                line += &format!(" {:.0}", start.elapsed_ms(&end).w()? as f64 * 1e3);
                drop(o);
            }
            println!("{line}");
        }
        return Ok(());
    }
    for i in 0..copies {
        for j in 0..copies {
            let (med, min, max, out) = time(&qs[i], &ks[j], &vs[j])?;
            println!(
                "q{i} k{j} v{j} | median {med:8.1} min {min:8.1} max {max:8.1} | q {} k {} v {} out {}",
                hex(address(&qs[i], &stream)),
                hex(address(&ks[j], &stream)),
                hex(address(&vs[j], &stream)),
                hex(out)
            );
        }
    }
    for j in 0..copies {
        for l in 0..copies {
            if j == l {
                continue;
            }
            let (med, min, max, out) = time(&qs[0], &ks[j], &vs[l])?;
            println!(
                "q0 k{j} v{l} | median {med:8.1} min {min:8.1} max {max:8.1} | out {}",
                hex(out)
            );
        }
    }
    Ok(())
}
