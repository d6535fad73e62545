//! Trainer behaviour: repeated fits, stop requests, non-finite losses, eval and predict.

use crate::support::*;
use burn::tensor::Tensor;
use flashover::core::error::CoreError;
use flashover::core::event::Event;
use flashover::core::params::params_sha256;
use flashover::core::time::Time;
use flashover_examples::{mnist_loaders, MnistRun};

#[test]
fn fit_in_two_calls_equals_one_call() {
    let run = short_run(256, 32, 100, "2ep");
    let mut once = trained(&run);

    let mut half = run.clone();
    half.max_duration = Time::Epoch(1);
    let mut twice = half
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .unwrap();
    let first = twice.fit().unwrap();
    assert_eq!(first.batches, 8);
    let second = twice.fit_for(Time::Batch(8)).unwrap();
    assert_eq!(second.batches, 8);
    assert_eq!(twice.state().timestamp().epoch, 2);
    assert_eq!(
        params_sha256::<TB, _>(twice.model()),
        params_sha256::<TB, _>(once.model())
    );
    // And once max_duration is reached, fit says so and does nothing.
    let err = once.fit().unwrap_err();
    assert!(matches!(err, CoreError::DurationReached { .. }), "{err}");
    assert!(err.to_string().contains("2ep"), "{err}");
}

#[test]
fn a_stop_request_ends_the_fit_after_the_batch_and_fit_resumes_after_it() {
    let run = short_run(256, 32, 100, "1ep");
    let log = new_log();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            event: Event::BatchEnd,
            f: |s: &flashover::core::state::State<flashover::core::setup::SetupOf<TB, _, _>>,
                ctl: &mut Control<'_>| {
                if s.timestamp().batch == 3 {
                    ctl.request_stop("enough");
                }
                Ok(())
            },
        })
        .callback(Recorder {
            prefix: String::new(),
            log: log.clone(),
        })
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    assert_eq!(report.stopped.as_deref(), Some("enough"));
    assert_eq!(t.state().timestamp().batch, 3);
    let events = lines(&log);
    assert_eq!(events.last().map(String::as_str), Some("FIT_END"));
    assert_eq!(
        events.iter().filter(|e| *e == "BATCH_CHECKPOINT").count(),
        3
    );
    assert!(!events.iter().any(|e| e == "EPOCH_END"));
    // A second fit continues mid-epoch (no second EPOCH_START) to max_duration.
    let report = t.fit().unwrap();
    assert_eq!(report.batches, 5);
    assert_eq!(t.state().timestamp().epoch, 1);
    assert_eq!(
        lines(&log).iter().filter(|e| *e == "EPOCH_START").count(),
        1
    );
}

fn poison_loss_at(batch: u64) -> impl FnMut(&mut MnistState) -> flashover::core::Result<()> + Send {
    move |s| {
        if s.timestamp().batch == batch {
            let loss = s.loss_mut()?.expect("loss is set at AFTER_LOSS");
            *loss = loss.clone().mul_scalar(f32::NAN);
        }
        Ok(())
    }
}

#[test]
fn a_nan_loss_is_an_error_naming_the_batch() {
    let run = short_run(128, 32, 50, "1ep");
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .algorithm(At {
            event: Event::AfterLoss,
            f: poison_loss_at(2),
        })
        .build()
        .unwrap();
    let err = t.fit().unwrap_err();
    match &err {
        CoreError::NonFiniteLoss {
            batch,
            epoch,
            value,
            ..
        } => {
            assert_eq!((*batch, *epoch), (2, 0));
            assert!(value.is_nan());
        }
        other => panic!("expected NonFiniteLoss, got {other}"),
    }
    assert!(err.to_string().contains("batch 2"), "{err}");
    assert_eq!(
        t.state().timestamp().batch,
        2,
        "no step is taken on the poisoned batch"
    );
}

#[test]
fn non_finite_batches_can_be_skipped_and_counted() {
    let mut run = short_run(128, 32, 50, "1ep");
    run.skip_nonfinite_loss = true;
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .algorithm(At {
            event: Event::AfterLoss,
            f: poison_loss_at(1),
        })
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    assert_eq!(report.batches, 4);
    assert_eq!(report.steps, 3);
    assert_eq!(t.state().skipped_batches(), 1);
}

/// Makes the loss of microbatch `micro` (counted from 0 within the batch) of batch `batch`
/// not finite.
fn poison_microbatch(
    batch: u64,
    micro: usize,
) -> impl FnMut(&mut MnistState) -> flashover::core::Result<()> + Send {
    let mut seen = (u64::MAX, 0);
    move |s| {
        if seen.0 != s.timestamp().batch {
            seen = (s.timestamp().batch, 0);
        }
        if s.timestamp().batch == batch && seen.1 == micro {
            let loss = s.loss_mut()?.expect("loss is set at AFTER_LOSS");
            *loss = loss.clone().mul_scalar(f32::INFINITY);
        }
        seen.1 += 1;
        Ok(())
    }
}

#[test]
fn a_non_finite_loss_in_a_later_microbatch_skips_the_whole_batch() {
    // Batches of 32 in microbatches of 8: the loss is read once per batch, after the four
    // backward passes; an infinite third microbatch must still discard the batch's
    // gradients, the first two microbatches' included.
    let mut run = short_run(128, 32, 50, "1ep");
    run.microbatch_size = Some(8);
    run.skip_nonfinite_loss = true;
    let fit = |micro: usize| {
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .algorithm(At {
                event: Event::AfterLoss,
                f: poison_microbatch(1, micro),
            })
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!((report.batches, report.steps), (4, 3), "microbatch {micro}");
        assert_eq!(t.state().skipped_batches(), 1);
        params_sha256::<TB, _>(t.model())
    };
    assert_eq!(
        fit(2),
        fit(0),
        "skipping batch 1 at its third microbatch left other weights than at its first"
    );
    // Without skipping: the error names the batch and the value.
    run.skip_nonfinite_loss = false;
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .algorithm(At {
            event: Event::AfterLoss,
            f: poison_microbatch(1, 3),
        })
        .build()
        .unwrap();
    match t.fit().unwrap_err() {
        CoreError::NonFiniteLoss { batch, value, .. } => {
            assert_eq!(batch, 1);
            assert!(value.is_infinite(), "{value}");
        }
        other => panic!("expected NonFiniteLoss, got {other}"),
    }
    assert_eq!(
        t.state().timestamp().batch,
        1,
        "no step on the poisoned batch"
    );
}

#[test]
fn eval_and_predict_report_sane_values() {
    let mut run = short_run(512, 32, 300, "1ep");
    // Evaluate and predict in the same batches, so both compute exactly the same logits on
    // every backend (a GPU may round differently for another batch shape).
    run.data.eval_batch_size = 100;
    let mut t = trained(&run);
    let metrics = t.eval().unwrap();
    let test = &metrics["test"];
    let (acc, top2, loss) = (test["accuracy"], test["top2_accuracy"], test["loss"]);
    assert!(
        (0.0..=1.0).contains(&acc) && acc > 0.5,
        "accuracy {acc} after one short epoch"
    );
    assert!(top2 >= acc && top2 <= 1.0, "top-2 {top2} vs top-1 {acc}");
    assert!(loss.is_finite() && loss > 0.0);

    let (_, test_loader) = mnist_loaders::<TB>(&run.data, &device()).unwrap();
    let outputs = t.predict(&test_loader).unwrap();
    assert_eq!(outputs.len(), 3, "300 digits in batches of 100");
    let logits = Tensor::cat(outputs.iter().map(|o| o.logits.clone()).collect(), 0);
    assert_eq!(logits.dims(), [300, 10]);
    // Predictions come in dataset order: their targets are the test labels, in order.
    let targets = Tensor::cat(outputs.iter().map(|o| o.targets.clone()).collect(), 0);
    let labels: Vec<i64> = targets
        .clone()
        .into_data()
        .convert::<i64>()
        .to_vec()
        .unwrap();
    let dataset = flashover::core::data::MnistDataset::from_dir(
        &run.data.dir,
        flashover::core::data::MnistSplit::Test,
    )
    .unwrap();
    let expected: Vec<i64> = (0..300)
        .map(|i| {
            flashover::core::data::Dataset::get(&dataset, i)
                .unwrap()
                .label as i64
        })
        .collect();
    assert_eq!(labels, expected);
    // Accuracy recomputed from the predictions equals the evaluator's exactly, on every
    // backend: the two passes run the same kernels on the same batches. (On wgpu this held
    // only to one sample while batches were built on the loader thread: see
    // `data::loader::threads_safe`.)
    let correct = logits
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(targets)
        .int()
        .sum()
        .into_scalar();
    let correct: i64 = burn::tensor::ElementConversion::elem(correct);
    assert!(
        (correct as f64 / 300.0 - acc).abs() <= 1e-12,
        "predict gives accuracy {} and eval {acc} on {BACKEND}",
        correct as f64 / 300.0
    );
}

#[test]
fn the_learning_rate_follows_the_schedule_formula() {
    // 256 digits in batches of 32: 8 batches per epoch, 2 epochs = 16 batches. Cosine over
    // the run with 4 batches of warmup, peak 0.01.
    let mut run = short_run(256, 32, 10, "2ep");
    run.lr = 0.01;
    run.scheduler = flashover::core::schedule::Scheduler::cosine(Time::Duration(1.0), 0.0)
        .with_warmup(Time::Batch(4));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            event: Event::BatchStart,
            f: move |s: &flashover::core::state::State<
                flashover::core::setup::SetupOf<TB, _, _>,
            >,
                     _: &mut Control<'_>| {
                sink.lock().unwrap().push((s.timestamp().batch, s.lr()));
                Ok(())
            },
        })
        .build()
        .unwrap();
    t.fit().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 16);
    for (batch, lr) in seen {
        let b = batch as f64;
        let expected = if b < 4.0 {
            0.01 * b / 4.0
        } else {
            0.01 * 0.5 * (1.0 + (std::f64::consts::PI * (b - 4.0) / 12.0).cos())
        };
        assert!(
            (lr - expected).abs() < 1e-12,
            "batch {batch}: lr {lr}, formula {expected}"
        );
    }
}

#[test]
fn sgd_with_momentum_adam_and_adamw_all_train_through_the_trainer() {
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::{AdamConfig, SgdConfig};
    use flashover_examples::MnistCnn;
    let run = short_run(1024, 32, 200, "1ep");
    let start = params_sha256::<TB, _>(&MnistCnn::<TB>::new(&device(), run.seed));
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init::<TB, MnistCnn<TB>>();
    let adam = AdamConfig::new().init::<TB, MnistCnn<TB>>();
    let mut accuracies = Vec::new();
    let mut digests = vec![start];
    macro_rules! train_with {
        ($opt:expr, $lr:expr) => {{
            let mut t = run
                .builder::<TB, _>($opt, &device())
                .unwrap()
                .lr($lr)
                .build()
                .unwrap();
            t.fit().unwrap();
            accuracies.push(t.state().eval_metrics()["test"]["accuracy"]);
            digests.push(params_sha256::<TB, _>(t.model()));
        }};
    }
    train_with!(sgd, 0.05);
    train_with!(adam, 2e-3);
    train_with!(MnistRun::adamw::<TB>(), 2e-3);
    // Each optimizer moved the weights somewhere else, and each learned (chance is 10%).
    let distinct: std::collections::BTreeSet<_> = digests.iter().collect();
    assert_eq!(distinct.len(), 4);
    assert!(
        accuracies.iter().all(|&a| a > 0.5),
        "accuracies after 32 steps: {accuracies:?}"
    );
}

mod wall_clock {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use crate::support::*;
    use flashover::callbacks::StopAt;
    use flashover::checkpoint::{autoresume, SaveInterval, Saver, SaverConfig};
    use flashover::core::callback::Callback;
    use flashover::core::callback::Control;
    use flashover::core::error::Result;
    use flashover::core::setup::Setup;
    use flashover::core::state::State;
    use flashover::core::time::Time;
    use flashover_examples::MnistRun;

    /// Sleeps at every batch end and records the run's wall time as the trainer saw it there.
    struct Slow(Arc<Mutex<Vec<Duration>>>);

    impl<S: Setup> Callback<S> for Slow {
        fn name(&self) -> &str {
            "slow"
        }
        fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            self.0.lock().unwrap().push(state.timestamp().run_wall_time);
            std::thread::sleep(Duration::from_millis(40));
            Ok(())
        }
    }

    #[test]
    fn a_wall_clock_max_duration_stops_at_the_first_batch_end_past_it() {
        // 32 batches an epoch sleep at least 1.28 s, so the limit falls inside the first
        // epoch whatever the kernels' speed (with 8 a fast backend finished the epoch just
        // short of it, and the epoch end's evaluation then crossed it between batches).
        let run = short_run(1024, 32, 20, "0.5s");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Slow(seen.clone()))
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        let seen = seen.lock().unwrap().clone();
        let limit = Duration::from_millis(500);
        assert_eq!(report.batches as usize, seen.len());
        // From the run's start (zero) to each batch end: every point before the last is
        // short of the limit, the last is past it (however fast a batch is here).
        let ends: Vec<Duration> = std::iter::once(Duration::ZERO)
            .chain(seen.clone())
            .collect();
        assert!(*ends.last().unwrap() >= limit, "{ends:?}");
        assert!(ends[ends.len() - 2] < limit, "stopped late: {ends:?}");
        assert!(t.is_finished());
        // The run's wall time is monotonic and includes the time spent between batches.
        assert!(seen
            .windows(2)
            .all(|w| w[1] >= w[0] + Duration::from_millis(40)));
    }

    #[test]
    fn a_horizon_schedule_over_a_wall_clock_run_is_refused_by_name() {
        let mut run = short_run(256, 32, 20, "1h30m");
        run.scheduler = MnistRun::default().scheduler;
        let err = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .err()
            .expect("a cosine over a wall-clock run has no batch count");
        let msg = err.to_string();
        assert!(
            msg.contains("1h30m") && msg.contains("wall-clock") && msg.contains("constant"),
            "{msg}"
        );
    }

    #[test]
    fn fit_for_a_wall_clock_time_cannot_slip_past_the_schedule_check() {
        let mut run = short_run(64, 32, 20, "1ep");
        // A cosine with warmup, as the example's default, with a warmup that fits the
        // two-batch run.
        run.scheduler = flashover::core::schedule::Scheduler::cosine(Time::Duration(1.0), 0.0)
            .with_warmup(Time::Batch(1));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .unwrap();
        t.fit().unwrap();
        let err = t.fit_for("1m".parse().unwrap()).unwrap_err();
        assert!(
            err.to_string().contains("wall-clock") && err.to_string().contains("constant"),
            "{err}"
        );
        assert_eq!(
            t.state().max_duration(),
            Time::Epoch(1),
            "the run's length is unchanged"
        );
        // A count extends it as before.
        assert_eq!(t.fit_for(Time::Batch(2)).unwrap().batches, 2);
    }

    #[test]
    fn a_resumed_run_counts_the_wall_time_already_spent() {
        let dir = tempfile::tempdir().unwrap();
        let run = short_run(256, 32, 20, "1h");
        let saver = || {
            Saver::new(
                SaverConfig::new(dir.path()),
                SaveInterval::Every(Time::Epoch(1)),
            )
            .unwrap()
        };
        // First run: 3 slow batches, then a stop (the saver writes at FIT_END).
        let mut first = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Slow(Arc::new(Mutex::new(Vec::new()))))
            .callback(saver())
            .callback(StopAt::new(Time::Batch(3)))
            .build()
            .unwrap();
        first.fit().unwrap();
        let spent = first.state().timestamp().run_wall_time;
        assert!(spent >= Duration::from_millis(80), "{spent:?}");
        // Second run, resumed, limited to 0.1 s more than the first spent: it stops after a
        // few batches, not after 0.1 s of its own plus everything the first run spent.
        let limit = spent + Duration::from_millis(100);
        let mut second = run.clone();
        second.max_duration = Time::Wall(limit);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut t = second
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Slow(seen.clone()))
            .callback(saver())
            .restore(autoresume(dir.path()).unwrap().expect("a checkpoint"))
            .build()
            .unwrap();
        assert_eq!(
            t.state().timestamp().run_wall_time,
            spent,
            "restored with the checkpoint"
        );
        let report = t.fit().unwrap();
        let seen = seen.lock().unwrap().clone();
        assert!(seen[0] > spent, "{seen:?} after {spent:?}");
        assert!(*seen.last().unwrap() >= limit);
        assert!(
            report.batches <= 4,
            "{} batches for 0.1 s at 40 ms each",
            report.batches
        );
    }

    #[test]
    fn a_wall_clock_stop_at_reads_the_same_clock() {
        let run = short_run(256, 32, 20, "1h");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Slow(seen.clone()))
            .callback(StopAt::new("0.2s".parse().unwrap()))
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!(report.stopped.as_deref(), Some("reached 0.2s"));
        let ends: Vec<Duration> = std::iter::once(Duration::ZERO)
            .chain(seen.lock().unwrap().clone())
            .collect();
        let at = Duration::from_millis(200);
        assert!(
            *ends.last().unwrap() >= at && ends[ends.len() - 2] < at,
            "{ends:?}"
        );
    }
}
