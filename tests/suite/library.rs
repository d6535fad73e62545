//! Flashover used as a library, as a newcomer's first hour meets it: the weights a run ends
//! with are the ones it evaluated (EMA and SWA leave their average in the model, and the
//! example writes it), a model whose loss ignores the soft targets that label smoothing,
//! MixUp or CutMix set is stopped at the first batch with an error naming the algorithm and
//! the function to call, and the README's quickstart example runs.

use crate::support::*;
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use flashover::algorithms::cutmix::CutMix;
use flashover::algorithms::label_smoothing::LabelSmoothing;
use flashover::algorithms::mixup::MixUp;
use flashover::algorithms::spec::parse_list;
use flashover::core::loss::cross_entropy;
use flashover::core::model::{ClassificationBatch, ClassificationOutput, EvalModel, TrainModel};
use flashover::core::params::params_sha256;
use flashover::core::time::Time;
use flashover::core::trainer::Trainer;
use flashover_examples::{mnist_loaders, MnistCnn, MnistRun};

/// The example's run with `algorithms` and `--out`; then the written weights, loaded into a
/// fresh CNN and evaluated on the same test digits, give exactly the reported metrics.
fn written_weights_reproduce_the_summary(algorithms: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_str().unwrap();
    let summary = summary_of(&short_args(&["--algorithms", algorithms, "--out", out_s]));
    let fresh = MnistCnn::<TB>::new(&device(), 1234);
    let loaded =
        flashover::checkpoint::load_weights(fresh, &out.join("model.safetensors")).unwrap();
    // The example's test set (SHORT: the first 200 test digits, in one batch of 200).
    let run = short_run(512, 32, 200, "1ba");
    let mut t = run
        .builder_with::<TB, _, _>(loaded, MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .unwrap();
    let metrics = t.eval().unwrap();
    let test = &metrics["test"];
    assert_eq!(
        summary["test_accuracy"].as_f64(),
        Some(test["accuracy"]),
        "{algorithms}: the written weights score {test:?}, the run reported {summary}"
    );
    assert_eq!(
        summary["test_loss"].as_f64(),
        Some(test["loss"]),
        "{algorithms}: the written weights score {test:?}, the run reported {summary}"
    );
}

#[test]
fn an_ema_run_writes_the_averaged_weights_it_evaluated() {
    written_weights_reproduce_the_summary("ema:half_life=20ba");
}

#[test]
fn an_swa_run_writes_the_averaged_weights_it_evaluated() {
    written_weights_reproduce_the_summary("swa:swa_start=0.5");
}

#[test]
fn ema_ends_fit_with_the_average_and_a_continued_fit_trains_on_from_the_training_weights() {
    let with_ema = |max: &str| {
        let mut run = short_run(192, 32, 100, max);
        run.algorithms = parse_list("ema:half_life=4ba").unwrap();
        run
    };
    let plain = short_run(192, 32, 100, "6ba");
    let digest = |t: &MnistTrainer| params_sha256::<TB, _>(t.model());
    let build = |r: &MnistRun| {
        r.builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .unwrap()
    };
    // EMA does not change training: the plain run's weights are the EMA run's training ones.
    let mut plain_t = build(&plain);
    plain_t.fit().unwrap();
    let mut ema_t = build(&with_ema("6ba"));
    ema_t.fit().unwrap();
    assert_ne!(
        digest(&ema_t),
        digest(&plain_t),
        "after fit the model holds the average, not the training weights"
    );
    assert_eq!(
        ema_t.state().loss_value(),
        plain_t.state().loss_value(),
        "EMA does not change training"
    );
    // Evaluating after fit scores the model as it is (the average), and leaves it so.
    let before = digest(&ema_t);
    ema_t.eval().unwrap();
    assert_eq!(digest(&ema_t), before);
    // Training on (`fit_for` extends the run) starts from the training weights: it ends where
    // a run of that length ends, bit for bit.
    ema_t.fit_for(Time::Batch(6)).unwrap();
    let mut whole = build(&with_ema("12ba"));
    whole.fit().unwrap();
    assert_eq!(digest(&ema_t), digest(&whole));
    plain_t.fit_for(Time::Batch(6)).unwrap();
    assert_ne!(digest(&whole), digest(&plain_t));
}

/// The MNIST CNN with a loss that scores the class indices only, as a user's first model
/// might (`cross_entropy` on `targets`), ignoring any soft targets.
#[derive(Module, Debug)]
pub struct IndexLoss<B: burn::tensor::backend::Backend> {
    cnn: MnistCnn<B>,
}

impl TrainModel<TB> for IndexLoss<TB> {
    type Batch = ClassificationBatch<TB, 4>;
    type Output = Tensor<TB, 2>;

    fn forward(&self, batch: &Self::Batch) -> Tensor<TB, 2> {
        TrainModel::forward(&self.cnn, batch)
    }

    fn loss(&self, logits: &Tensor<TB, 2>, batch: &Self::Batch) -> Tensor<TB, 1> {
        cross_entropy(logits.clone(), batch.targets.clone())
    }
}

impl EvalModel<<TB as AutodiffBackend>::InnerBackend> for IndexLoss<Inner> {
    type Batch = ClassificationBatch<Inner, 4>;
    type Output = ClassificationOutput<Inner>;

    fn forward_eval(&self, batch: &Self::Batch) -> ClassificationOutput<Inner> {
        EvalModel::forward_eval(&self.cnn, batch)
    }
}

#[test]
fn a_loss_that_ignores_soft_targets_stops_the_run_naming_the_algorithm() {
    let run = short_run(128, 32, 100, "2ba");
    let cases: Vec<(&str, Box<dyn flashover::core::callback::Algorithm<_>>)> = vec![
        (
            "label_smoothing",
            Box::new(LabelSmoothing::new(0.1).unwrap()),
        ),
        ("mixup", Box::new(MixUp::new(0.2).unwrap())),
        (
            "mixup",
            Box::new(MixUp::new(0.2).unwrap().with_interpolate_loss(true)),
        ),
        ("cutmix", Box::new(CutMix::new(1.0).unwrap())),
    ];
    for (name, algorithm) in cases {
        let model = IndexLoss {
            cnn: MnistCnn::<TB>::new(&device(), 7),
        };
        let (train, _) = mnist_loaders::<TB>(&run.data, &device()).unwrap();
        let optimizer = burn::optim::AdamWConfig::new().init::<TB, IndexLoss<TB>>();
        let mut t = Trainer::builder(model, optimizer, train, Time::Batch(2), device())
            .boxed_algorithm(algorithm)
            .build()
            .unwrap();
        let err = t
            .fit()
            .expect_err("a run whose loss ignores soft targets stops")
            .to_string();
        assert!(
            err.contains(name)
                && err.contains("classification_loss")
                && err.contains("cross_entropy"),
            "{name}: {err}"
        );
        assert_eq!(
            t.state().timestamp().batch,
            0,
            "{name}: stopped in the first batch"
        );
    }
    // The same algorithms on the CNN, whose loss reads them, train.
    let mut ok = short_run(128, 32, 100, "2ba");
    ok.algorithms = parse_list("label_smoothing,mixup,cutmix").unwrap();
    trained(&ok);
}

/// Runs the quickstart example with `args`; its summary (last stdout line).
fn quickstart(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(example_bin("quickstart"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("the quickstart example starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "quickstart {args:?} failed:\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("no summary ({e}):\n{stdout}\n{stderr}"))
}

#[test]
fn the_quickstart_trains_and_resumes_to_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let parts = dir.path().join("parts");
    let w = quickstart(&["--save-folder", whole.to_str().unwrap()]);
    assert_eq!(w["batches"], 128, "{w}");
    assert!(w["test_accuracy"].as_f64().unwrap() > 0.9, "{w}");
    let first = quickstart(&[
        "--save-folder",
        parts.to_str().unwrap(),
        "--stop-after",
        "40",
    ]);
    assert_eq!(first["batches"], 40, "{first}");
    let resumed = quickstart(&["--save-folder", parts.to_str().unwrap()]);
    assert_eq!(resumed["batches"], 128, "{resumed}");
    assert_eq!(resumed["params_sha256"], w["params_sha256"]);
    assert_eq!(resumed["test_accuracy"], w["test_accuracy"]);
    // The weights it wrote are the ones it reports (EMA's average).
    assert!(whole.with_extension("safetensors").is_file());
}

#[test]
fn log_lines_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    // The tests read the example's stderr through a pipe, as a log file would be written.
    let out = run_mnist(&[
        "--train-limit",
        "256",
        "--test-limit",
        "100",
        "--max-duration",
        "2ba",
        "--warmup",
        "0ba",
        "--log-every",
        "1",
    ]);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stderr.contains("INFO"), "{}", out.stderr);
    assert!(
        !out.stderr.contains('\u{1b}'),
        "ANSI escape codes in a piped log: {:?}",
        &out.stderr[..out.stderr.len().min(400)]
    );
}
