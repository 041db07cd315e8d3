//! The NNUE training example must actually learn: its loss has to fall clearly.

#[path = "../examples/nnue_train.rs"]
mod nnue_train;

#[test]
fn nnue_example_loss_falls_clearly() -> anyhow::Result<()> {
    let cfg = nnue_train::Config {
        num_inputs: 512,
        hidden: 32,
        batch: 256,
        steps: 300,
        log_every: 50,
        out: Some(
            std::env::temp_dir().join(format!("fastops-nnue-{}.safetensors", std::process::id())),
        ),
        ..Default::default()
    };
    for dev in common_devices() {
        let report = nnue_train::train(&cfg, &dev)?;
        assert!(
            report.losses.iter().all(|(_, l)| l.is_finite()),
            "a training loss is not finite"
        );
        let (before, after) = (report.held_out_before, report.held_out_after);
        assert!(
            after < 0.6 * before,
            "held-out loss on {:?} fell only from {before} to {after}",
            dev.location()
        );
        // The saved weights load back and hold the trained layer.
        let saved =
            candle_core::safetensors::load(cfg.out.as_ref().unwrap(), &candle_core::Device::Cpu)?;
        assert_eq!(saved["ft.weight"].dims(), [512, 32]);
    }
    std::fs::remove_file(cfg.out.as_ref().unwrap()).ok();
    Ok(())
}

fn common_devices() -> Vec<candle_core::Device> {
    let mut devs = vec![candle_core::Device::Cpu];
    if cfg!(feature = "cuda") {
        if let Ok(dev) = candle_core::Device::new_cuda(0) {
            devs.push(dev);
        }
    }
    devs
}
