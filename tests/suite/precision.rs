//! Precision (`--precision`, `TrainerBuilder::precision`): every precision trains the CNN
//! about as well as float32; mixed precision keeps float32 weights and the pure half
//! precisions the half type (running statistics included); float16 overflow skips the step,
//! lowers the scale and leaves the weights, and clean steps grow it; SAM's second pass is
//! scaled, unscaled and checked like the first; runs in each kind of
//! precision resume bit for bit; checkpoints record the precision and resume in another one.
//!
//! Runs on the test backend when it computes the half types (flex does, through `gemm`'s
//! float16 kernels and bfloat16 through float32; wgpu needs shader-f16 and has no bfloat16),
//! and says which precisions it skipped otherwise.

use crate::support::*;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};
use flashover::core::params::params_sha256;
use flashover::core::precision::{params_dtype, LossScaling, Precision};
use flashover::models::ResNetConfig;
use flashover_examples::MnistRun;

use crate::resume::{autoresume, resumed};

/// Whether the test backend computes `p`'s type; prints the skip otherwise.
fn runs(p: Precision) -> bool {
    let ok = p
        .compute_dtype()
        .is_none_or(|d| <TB as Backend>::supports_dtype(&device(), DType::from(d)));
    if !ok {
        eprintln!("skipped on {BACKEND}: it does not compute {p}'s type on this device");
    }
    ok
}

/// Every float tensor of a module (parameters and running statistics) and its type.
fn dtypes<B: Backend, M: Module<B>>(m: &M) -> Vec<DType> {
    struct All(Vec<DType>);
    impl<B: Backend> ModuleVisitor<B> for All {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().dtype());
        }
    }
    let mut v = All(Vec::new());
    m.visit(&mut v);
    v.0
}

/// In one process (the GPU subset runs it without an example program): the short run of the
/// example's test arguments in each precision the backend computes.
#[test]
fn every_precision_trains_the_cnn_about_as_well_as_float32() {
    let outcome = |p: Precision| {
        let mut run = short_example_run("3ep");
        run.precision = p;
        let mut t = trained(&run);
        let test = t.eval().unwrap()["test"].clone();
        let scale = t.state().loss_scaler().map(|s| s.scale);
        let batches = t.state().timestamp().batch;
        (test, scale, batches, params_sha256::<TB, _>(t.model()))
    };
    let (base, base_scale, base_batches, base_digest) = outcome(Precision::Fp32);
    assert!(base_scale.is_none());
    assert_eq!(base_batches, 48);
    for p in [
        Precision::AmpBf16,
        Precision::AmpFp16,
        Precision::Bf16,
        Precision::Fp16,
    ] {
        if !runs(p) {
            continue;
        }
        let (test, scale, batches, digest) = outcome(p);
        assert_eq!(batches, base_batches, "{p}");
        assert!(test["loss"].is_finite(), "{p}: {test:?}");
        // 200 test digits: 0.03 is six digits either way, on a run that reaches about 0.85.
        let (accuracy, base_accuracy) = (test["accuracy"], base["accuracy"]);
        assert!(
            (accuracy - base_accuracy).abs() <= 0.03,
            "{p}: accuracy {accuracy} against float32's {base_accuracy}"
        );
        assert_eq!(scale.is_none(), !p.scales_loss(), "{p}: scale {scale:?}");
        assert_ne!(digest, base_digest, "{p} trained in float32");
    }
}

#[test]
fn mixed_precision_keeps_float32_weights_and_pure_precision_the_half_type() {
    use FloatDType::*;
    for (p, stored) in [
        (Precision::Fp32, F32),
        (Precision::AmpFp16, F32),
        (Precision::AmpBf16, F32),
        (Precision::Fp16, F16),
        (Precision::Bf16, BF16),
    ] {
        if !runs(p) {
            continue;
        }
        let mut run = short_run(64, 32, 32, "2ba");
        run.precision = p;
        // The ResNet: its batch norms' running statistics are float tensors too.
        let model = ResNetConfig::cifar(8, 8)
            .unwrap()
            .with_io(1, 10)
            .unwrap()
            .init::<TB>(&device(), run.seed);
        let optimizer = burn::optim::AdamWConfig::new().init();
        let mut t = run
            .builder_with::<TB, _, _>(model, optimizer, &device())
            .unwrap()
            .build()
            .unwrap();
        t.fit().unwrap();
        let all = dtypes::<TB, _>(t.model());
        assert!(
            all.iter().all(|&d| d == DType::from(stored)),
            "{p}: expected every tensor in {stored:?}, got {all:?}"
        );
        let metrics = t.eval().unwrap();
        assert!(metrics["test"]["loss"].is_finite(), "{p}");
        let cnn = trained(&run);
        assert_eq!(
            params_dtype::<TB, _>(cnn.model()),
            Some(DType::from(stored))
        );
    }
}

#[test]
fn an_overflow_skips_the_step_lowers_the_scale_and_leaves_the_weights() {
    if !runs(Precision::AmpFp16) {
        return;
    }
    // A scale of 2^100 overflows float16 in the first backward pass, and in the next ones.
    let mut run = short_run(96, 32, 32, "3ba");
    run.precision = Precision::AmpFp16;
    run.loss_scaling = LossScaling {
        init_scale: 2f64.powi(100),
        ..LossScaling::default()
    };
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    assert_eq!(report.steps, 0, "every step overflowed");
    assert_eq!(report.batches, 3);
    let state = t.state();
    let scaler = state.loss_scaler().unwrap();
    assert_eq!(scaler.skipped_steps, 3);
    assert_eq!(scaler.scale, 2f64.powi(97));
    assert_eq!(
        state.skipped_batches(),
        0,
        "a finite loss is not a skipped batch"
    );
    assert!(
        state.loss_value().unwrap().is_finite(),
        "the loss is reported unscaled"
    );
    let untrained = flashover_examples::MnistCnn::<TB>::new(&device(), run.seed);
    assert_eq!(
        params_sha256::<TB, _>(t.model()),
        params_sha256::<TB, _>(&untrained),
        "a skipped step changes no weight"
    );

    // From 2^24 the scale halves until the gradients fit, then training goes on: every
    // batch is either a step or a skip, and each skip halved the scale once.
    run.max_duration = "12ba".parse().unwrap();
    run.loss_scaling.init_scale = 2f64.powi(24);
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    let scaler = t.state().loss_scaler().unwrap();
    assert!(scaler.skipped_steps >= 1, "2^24 overflows float16 at first");
    assert!(report.steps >= 1, "the scale came down to one that fits");
    assert_eq!(report.steps + scaler.skipped_steps, 12);
    assert_eq!(
        scaler.scale,
        2f64.powi(24 - scaler.skipped_steps as i32),
        "one halving per skipped step"
    );
}

#[test]
fn the_scale_doubles_after_each_interval_of_clean_steps() {
    if !runs(Precision::Fp16) {
        return;
    }
    for p in [Precision::AmpFp16, Precision::Fp16] {
        let mut run = short_run(384, 32, 32, "1ep");
        run.precision = p;
        run.loss_scaling = LossScaling {
            init_scale: 1.0,
            growth_interval: 4,
            ..LossScaling::default()
        };
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!(report.steps, 12, "{p}");
        let scaler = t.state().loss_scaler().unwrap();
        assert_eq!((scaler.scale, scaler.skipped_steps), (8.0, 0), "{p}");
    }
}

#[test]
fn runs_in_each_kind_of_precision_resume_bit_for_bit() {
    // A growth interval of 5 doubles the scale until float16 overflows, so the resumed run
    // must carry the scale, its clean-step count and the skips to end with the same bits.
    if runs(Precision::AmpFp16) {
        resumed(
            &[
                "--precision",
                "amp_fp16",
                "--loss-scale-growth-interval",
                "5",
            ],
            &["--stop-after", "8ba"],
            autoresume,
        );
    }
    if runs(Precision::Bf16) {
        resumed(
            &["--precision", "bf16"],
            &["--stop-after", "8ba"],
            autoresume,
        );
    }
}

/// The test above inside one process (the GPU subset's form of it).
#[test]
fn runs_in_each_kind_of_precision_resume_bit_for_bit_in_one_process() {
    use flashover::core::time::Time;
    for p in [Precision::AmpFp16, Precision::Bf16] {
        if !runs(p) {
            continue;
        }
        // Stopped mid-epoch: the resumed part crosses the epoch boundary and at least one
        // growth of the loss scale.
        let mut run = crate::resume::in_process::epoch_and_a_half();
        run.precision = p;
        run.loss_scaling.growth_interval = 5;
        crate::resume::in_process::resumes(&run, Time::Batch(4), Time::Batch(8), false);
    }
}

#[test]
fn a_checkpoint_records_its_precision_and_resumes_in_another() {
    if !runs(Precision::Fp16) || !runs(Precision::AmpBf16) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let partial = summary_of(&short_args(&[
        "--precision",
        "fp16",
        "--save-folder",
        folder,
        "--stop-after",
        "8ba",
    ]));
    assert_eq!(partial["batches"], 8);
    let name = flashover::checkpoint::format::read_latest(dir.path()).unwrap();
    let text = std::fs::read_to_string(dir.path().join(name).join("trainer_state.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(saved["precision"], "fp16");
    assert_eq!(saved["loss_scaler"]["scale"], partial["loss_scale"]);

    let out = run_mnist(&short_args(&[
        "--precision",
        "amp_bf16",
        "--save-folder",
        folder,
        "--autoresume",
    ]));
    assert!(out.status.success(), "{}", out.stderr);
    let s = out.summary.unwrap();
    assert_eq!(s["precision"], "amp_bf16");
    assert_eq!(
        s["batches"], 48,
        "resumed at batch 8 and trained to the end"
    );
    assert!(s["test_loss"].as_f64().unwrap().is_finite());
    assert!(
        out.stderr.contains("resuming in another precision"),
        "{}",
        out.stderr
    );
}

/// Every algorithm the CNN takes trains in `p`, to a finite loss with weights in the
/// precision's type.
fn every_algorithm_trains_in(p: Precision) {
    if !runs(p) {
        return;
    }
    for spec in crate::algorithms::ACTIVE {
        let mut run = crate::algorithms::tiny(spec);
        run.precision = p;
        let mut t = trained(&run);
        let loss = t.eval().unwrap()["test"]["loss"];
        assert!(loss.is_finite(), "{p} {spec}: loss {loss}");
        assert_eq!(
            params_dtype::<TB, _>(t.model()),
            Some(DType::from(p.parameter_dtype())),
            "{p} {spec}"
        );
    }
}

/// Every algorithm the CNN takes trains in a pure half precision (weights in the half type,
/// SAM's perturbation and second gradients included): bfloat16 where the backend computes
/// it, else float16.
#[test]
fn every_algorithm_trains_in_pure_half_precision() {
    every_algorithm_trains_in(if runs(Precision::Bf16) {
        Precision::Bf16
    } else {
        Precision::Fp16
    });
}

/// Every algorithm the CNN takes trains in mixed float16 (float32 weights, loss scaling).
/// A test of its own so that a test runner's two threads run it beside the one above.
#[test]
fn every_algorithm_trains_in_mixed_float16() {
    every_algorithm_trains_in(Precision::AmpFp16);
}

/// SAM's second forward and backward pass under float16 loss scaling: its loss is scaled
/// like the batch's and its gradients divided by the scale. Multiplying by a power of two is
/// exact in float16 short of its range, so at scales 2^10 and 2^14, which keep this CNN's
/// gradients in float16's normal range, they are the same but for float32's rounding of the
/// division (a missing division would make them 16 times larger at 2^14). And they are the
/// float32 run's within the rounding float16 brings to the batch's own gradients (SAM's are
/// the batch's gradients at nearby weights, so their rounding error is of the same size).
#[test]
fn sams_second_pass_gradients_are_unscaled_under_loss_scaling() {
    if !runs(Precision::AmpFp16) {
        return;
    }
    // The gradients the optimizer gets at the first step (SAM's when `sam` is set).
    let grads = |p: Precision, scale_log2: i32, sam: bool| {
        let mut run = short_run(64, 32, 32, "1ba");
        run.precision = p;
        run.loss_scaling.init_scale = 2f64.powi(scale_log2);
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        let mut b = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap();
        if sam {
            b = b.algorithm(flashover::algorithms::sam::Sam::new(0.05, 1e-12, 1).unwrap());
        }
        let mut t = b
            // Callbacks run after the algorithms at an event: with SAM, its gradients.
            .callback(Watch {
                event: flashover::core::event::Event::AfterTrainBatch,
                f: move |s: &MnistState, _: &mut Control<'_>| {
                    let g = s.grads().expect("the step's gradients");
                    *sink.lock().unwrap() = flat_grads::<TB, _>(s.model(), g);
                    Ok(())
                },
            })
            .build()
            .unwrap();
        assert_eq!(t.fit().unwrap().steps, 1, "{p}");
        let g = seen.lock().unwrap().clone();
        g
    };
    let relative = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        let norm =
            |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        norm(&mut a.iter().zip(b).map(|(x, y)| x - y)) / norm(&mut a.iter().copied())
    };
    let sam_at_10 = grads(Precision::AmpFp16, 10, true);
    let across_scales = relative(&sam_at_10, &grads(Precision::AmpFp16, 14, true));
    let batch_error = relative(
        &grads(Precision::Fp32, 0, false),
        &grads(Precision::AmpFp16, 10, false),
    );
    let sam_error = relative(&grads(Precision::Fp32, 0, true), &sam_at_10);
    eprintln!(
        "{BACKEND}: SAM's gradients at 2^10 against 2^14: {across_scales:e}; against float32: \
         {sam_error:e} (the batch's own gradients: {batch_error:e})"
    );
    assert!(
        across_scales < 1e-6,
        "SAM's gradients in amp_fp16 change with the loss scale: {across_scales} (relative L2)"
    );
    assert!(
        sam_error < 2.0 * batch_error,
        "SAM's gradients in amp_fp16 differ from float32's by {sam_error} (relative L2), the \
         batch's own gradients by {batch_error}"
    );
}

/// When SAM's second pass overflows float16 (here: a radius so large that the perturbed
/// weights overflow it, while the first pass at scale 1 fits), the step is skipped and the
/// scale halved, as for an overflow of the batch's own gradients; no weight changes.
#[test]
fn an_overflow_in_sams_second_pass_skips_the_step_and_lowers_the_scale() {
    if !runs(Precision::AmpFp16) {
        return;
    }
    let mut run = short_run(96, 32, 32, "3ba");
    run.precision = Precision::AmpFp16;
    run.loss_scaling.init_scale = 1.0;
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .algorithm(flashover::algorithms::sam::Sam::new(1e6, 1e-12, 1).unwrap())
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    let state = t.state();
    let scaler = state.loss_scaler().unwrap();
    assert_eq!(
        (report.steps, scaler.skipped_steps, scaler.scale),
        (0, 3, 0.125),
        "every second pass overflowed: three skips, three halvings"
    );
    assert_eq!(
        state.skipped_batches(),
        0,
        "the batches' losses were finite"
    );
    let untrained = flashover_examples::MnistCnn::<TB>::new(&device(), run.seed);
    assert_eq!(
        params_sha256::<TB, _>(t.model()),
        params_sha256::<TB, _>(&untrained),
        "a skipped step changes no weight"
    );
}
