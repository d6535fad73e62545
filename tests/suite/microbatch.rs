//! Gradient accumulation: the summed, weighted microbatch gradients equal the full-batch
//! gradient within float tolerance, also when the microbatch size does not divide the batch.

use std::sync::{Arc, Mutex};

use flashover::core::event::Event;
use flashover_examples::MnistRun;
use flashover_tests::*;

fn first_step_grads(microbatch: Option<usize>) -> Vec<f32> {
    let mut run = short_run(32, 32, 10, "1ba");
    run.microbatch_size = microbatch;
    let captured = Arc::new(Mutex::new(Vec::new()));
    let sink = captured.clone();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(At {
            event: Event::AfterTrainBatch,
            f: move |s: &mut flashover::core::state::State<
                flashover::core::setup::SetupOf<TB, _, _>,
            >| {
                let grads = s
                    .grads
                    .as_ref()
                    .expect("gradients are set at AFTER_TRAIN_BATCH");
                *sink.lock().unwrap() = flat_grads::<TB, _>(s.model(), grads);
                Ok(())
            },
        })
        .build()
        .unwrap();
    t.fit().unwrap();
    let g = captured.lock().unwrap().clone();
    g
}

#[test]
fn microbatch_gradients_equal_the_full_batch_gradient() {
    let full = first_step_grads(None);
    assert!(full.iter().any(|g| *g != 0.0));
    let scale = full.iter().fold(0f32, |m, g| m.max(g.abs()));
    // 2 and 4 equal microbatches, and 7 uneven ones (6 of 5 samples and one of 2).
    for size in [16, 8, 5] {
        let micro = first_step_grads(Some(size));
        assert_eq!(micro.len(), full.len());
        let worst = micro
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5 * scale.max(1.0),
            "microbatch {size}: max abs difference {worst} (largest gradient {scale})"
        );
    }
}

/// The training step reads from the device once per batch, however many microbatches it
/// has (and with loss scaling's overflow check): its losses are read together after the
/// last backward pass is queued.
#[test]
fn the_step_reads_from_the_device_once_per_batch() {
    use flashover::core::precision::Precision;
    for (microbatch, precision) in [
        (None, Precision::Fp32),
        (Some(8), Precision::Fp32),
        (Some(5), Precision::AmpFp16),
    ] {
        let mut run = short_run(128, 32, 10, "1ep");
        run.microbatch_size = microbatch;
        run.precision = precision;
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!(report.batches, 4);
        assert_eq!(
            report.device_reads, report.batches,
            "{microbatch:?} {precision}"
        );
    }
}
