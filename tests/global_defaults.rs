//! The process-wide defaults, in a test binary of their own: flipping them changes what every
//! call without its own options computes, so no other test may run beside these.

use candle_core::{Device, Result, Tensor};
use candle_fastops::{
    f32_matmul, masked_bmm, masked_bmm_with, matmul_tf32, set_f32_matmul, set_matmul_tf32,
    F32Matmul, MatmulOptions,
};

fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if let Ok(gpu) = Device::new_cuda(0) {
        devices.push(gpu);
    }
    devices
}

fn masked_in(a: &Tensor, b: &Tensor, mask: &Tensor, fill: f64, mode: F32Matmul) -> Result<Tensor> {
    masked_bmm_with(a, b, mask, fill, None, &MatmulOptions::with_f32(mode))
}

/// A call without a mode follows the process-wide default; a call with one ignores it.
#[test]
fn calls_without_a_mode_follow_the_global_default() -> Result<()> {
    let exact = 1.0 + 2f32.powi(-15);
    assert_eq!(f32_matmul(), F32Matmul::Compensated);
    for dev in devices() {
        let a = Tensor::new(&[[[exact]]], &dev)?;
        let b = Tensor::new(&[[[1f32]]], &dev)?;
        let mask = Tensor::new(&[[1u8]], &dev)?;
        let run = |options: Option<F32Matmul>| -> Result<f32> {
            let out = match options {
                None => masked_bmm(&a, &b, &mask, 0.0)?,
                Some(mode) => masked_in(&a, &b, &mask, 0.0, mode)?,
            };
            out.flatten_all()?.to_vec1::<f32>().map(|v| v[0])
        };
        let rounded = if dev.is_cuda() { 1.0 } else { exact };
        set_matmul_tf32(true);
        assert!(matmul_tf32());
        let (global, explicit) = (run(None)?, run(Some(F32Matmul::Fma))?);
        set_f32_matmul(F32Matmul::default());
        assert_eq!(global, rounded, "{dev:?}: the global TF32 default");
        assert_eq!(explicit, exact, "{dev:?}: the per-call FMA mode");
        assert_eq!(
            run(None)?,
            exact,
            "{dev:?}: back to the compensated default"
        );
    }
    Ok(())
}
