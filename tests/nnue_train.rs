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

/// The three ways the example writes its first dense layer compute one function: on shared
/// weights, the same predictions and the same gradients, on every device.
#[test]
fn nnue_first_layer_modes_agree() -> anyhow::Result<()> {
    use nnue_train::{L1Mode, Nnue};
    for dev in common_devices() {
        let varmap = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dev);
        let cfg = |l1| nnue_train::Config {
            num_inputs: 300,
            hidden: 24,
            batch: 64,
            l1,
            ..Default::default()
        };
        // Built from one VarMap, the three networks share every weight.
        let nets = [L1Mode::Fused, L1Mode::BiasClamp, L1Mode::Candle]
            .map(|mode| Nnue::new(&cfg(mode), vb.clone()).map(|net| (mode, net)));
        let batch = nnue_train::random_batch(&cfg(L1Mode::Fused), &mut nnue_train::Rng(7), &dev)?;
        let mut results = Vec::new();
        for net in nets {
            let (mode, net) = net?;
            let prediction = net.forward(&batch)?;
            let grads = prediction.sqr()?.sum_all()?.backward()?;
            let mut flat = prediction.to_vec1::<f32>()?;
            for var in varmap.all_vars() {
                let grad = grads.get(&var).expect("every weight has a gradient");
                flat.extend(grad.flatten_all()?.to_vec1::<f32>()?);
            }
            results.push((mode, flat));
        }
        let (_, fused) = &results[0];
        for (mode, other) in &results[1..] {
            assert_eq!(fused.len(), other.len());
            for (i, (a, b)) in fused.iter().zip(other).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{:?}: value {i} is {a} with the fused layer, {b} with {mode:?}",
                    dev.location()
                );
            }
        }
    }
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
