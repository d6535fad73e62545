//! Core's scale-out seams, exercised by two ranks on two threads of this process through a
//! small shared-memory collective (sums in rank order, so every rank gets the same bits):
//! rank 0's weights reach every rank, two ranks on half batches train like one process on the
//! combined batch, evaluation metrics are global, one rank's stop stops both, a non-finite
//! loss on one rank skips the step on both, and only rank 0's writers act.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::threads::{two_ranks, Hub, ThreadCollective};
use crate::support::*;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Sgd, SgdConfig};
use burn::tensor::Tensor;
use flashover::callbacks::StopAt;
use flashover::core::callback::{Algorithm, Callback};
use flashover::core::collective::{OnEveryRank, Ranks};
use flashover::core::data::{DataLoader, Dataset, MnistBatcher, MnistDataset, MnistSplit, Sampler};
use flashover::core::error::Result;
use flashover::core::event::Event;
use flashover::core::logger::Logger;
use flashover::core::metric::{Accuracy, LossMetric};
use flashover::core::params::params_sha256;
use flashover::core::setup::{Setup, SetupOf};
use flashover::core::state::{State, World};
use flashover::core::time::Time;
use flashover::core::trainer::{Evaluator, Trainer, TrainerBuilder};
use flashover::distributed::LocalGroup;
use flashover_examples::{bundled_mnist_dir, MnistCnn};

type Sgd32 = OptimizerAdaptor<Sgd<Inner>, MnistCnn<TB>, TB>;
type Run = SetupOf<TB, MnistCnn<TB>, Sgd32>;

const TRAIN: usize = 256;
const TEST: usize = 200;

/// A trainer on `train` digits in batches of `batch` (sharded for `world`), evaluating the
/// test digits (sharded likewise), with SGD at 0.05 and the model drawn from `seed`.
fn builder(world: World, batch: usize, seed: u64, max: &str) -> TrainerBuilder<Run> {
    let dir = bundled_mnist_dir();
    let mut train = MnistDataset::from_dir(&dir, MnistSplit::Train).unwrap();
    train.truncate(TRAIN);
    let mut test = MnistDataset::from_dir(&dir, MnistSplit::Test).unwrap();
    test.truncate(TEST);
    let sampler = Sampler::new(train.len(), batch, true, 7)
        .unwrap()
        .sharded(world.rank, world.size)
        .unwrap();
    let test_sampler = Sampler::new(test.len(), 50, false, 0)
        .unwrap()
        .sharded(world.rank, world.size)
        .unwrap();
    let train = DataLoader::new(
        "train",
        Arc::new(train),
        Arc::new(MnistBatcher),
        sampler,
        device(),
    )
    .unwrap();
    let test = DataLoader::<Inner, _, _>::new(
        "test",
        Arc::new(test),
        Arc::new(MnistBatcher),
        test_sampler,
        Default::default(),
    )
    .unwrap();
    let evaluator = Evaluator::new(
        "test",
        test,
        vec![
            Box::new(LossMetric::default()),
            Box::new(Accuracy::default()),
        ],
    );
    Trainer::builder(
        MnistCnn::<TB>::new(&device(), seed),
        SgdConfig::new().init::<TB, MnistCnn<TB>>(),
        train,
        max.parse::<Time>().unwrap(),
        device(),
    )
    .lr(0.05)
    .seed(7)
    .evaluator(evaluator)
}

/// Every parameter value, in the model's order.
fn weights(model: &MnistCnn<TB>) -> Vec<f32> {
    use burn::module::{Module, ModuleVisitor, Param};
    struct All(Vec<f32>);
    impl ModuleVisitor<TB> for All {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<TB, D>>) {
            self.0.extend(p.val().into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut v = All(Vec::new());
    model.visit(&mut v);
    v.0
}

/// Records the loss of every batch.
struct Losses(Arc<Mutex<Vec<f64>>>);

impl<S: Setup> Callback<S> for Losses {
    fn name(&self) -> &str {
        "losses"
    }
    fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.0
            .lock()
            .unwrap()
            .push(state.loss_value().unwrap_or(f64::NAN));
        Ok(())
    }
}

#[test]
fn two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch() {
    // One process: batches of 32 for one epoch (8 steps).
    let one_losses = Arc::new(Mutex::new(Vec::new()));
    let mut one = builder(World::default(), 32, 11, "1ep")
        .callback(Losses(one_losses.clone()))
        .build()
        .unwrap();
    one.fit().unwrap();
    let one_weights = weights(one.model());
    // Two ranks: batches of 16 each, the union of each step's two batches is the single
    // process's batch. Rank 1 draws its model from another seed: the broadcast replaces it.
    let ((w0, l0, sha0), (w1, l1, sha1)) = two_ranks(|rank, c| {
        let losses = Arc::new(Mutex::new(Vec::new()));
        let world = World { rank, size: 2 };
        let mut t = builder(world, 16, 11 + rank as u64, "1ep")
            .collective(c)
            .callback(Losses(losses.clone()))
            .build()
            .unwrap();
        let initial = params_sha256(t.model());
        t.fit().unwrap();
        let l = losses.lock().unwrap().clone();
        (weights(t.model()), l, initial)
    });
    assert_eq!(sha0, sha1, "every rank starts from rank 0's weights");
    assert_eq!(
        sha0,
        params_sha256(&MnistCnn::<TB>::new(&device(), 11)),
        "rank 0's own model is the one broadcast"
    );
    assert_eq!(w0, w1, "both ranks hold the same bits after every step");
    let one_losses = one_losses.lock().unwrap().clone();
    assert_eq!(l0, l1, "the logged loss is the global one on every rank");
    assert_eq!(l0.len(), 8);
    for (a, b) in l0.iter().zip(&one_losses) {
        assert!((a - b).abs() < 1e-5, "loss {a} vs one process {b}");
    }
    let max_diff = w0
        .iter()
        .zip(&one_weights)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        max_diff < 1e-5,
        "weights differ from one process by up to {max_diff}"
    );
    // The step did move the weights well beyond that tolerance.
    let moved = one_weights
        .iter()
        .zip(weights(&MnistCnn::<TB>::new(&device(), 11)))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "training moved the weights by {moved}");
}

/// Runs `f(rank, member)` on two threads of one `LocalGroup` (burn-collective's local mode).
fn two_local_ranks<T: Send + 'static>(
    timeout: Duration,
    f: impl Fn(usize, LocalGroup) -> T + Send + Sync + 'static,
) -> (T, T) {
    // burn-collective keeps one local group per backend in a process: one test at a time.
    static ONE_GROUP: Mutex<()> = Mutex::new(());
    let _turn = ONE_GROUP.lock().unwrap_or_else(|p| p.into_inner());
    let group = LocalGroup::new(2, timeout).unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (g, f) = (group.clone(), f.clone());
            std::thread::spawn(move || f(rank, g))
        })
        .collect();
    let mut out = handles.into_iter().map(|h| h.join().expect("rank thread"));
    (out.next().expect("rank 0"), out.next().expect("rank 1"))
}

#[test]
fn two_devices_of_one_process_train_like_one_process_on_the_whole_batch() {
    // The same check as above through flashover-distributed's LocalGroup: device buffers
    // through burn-collective's local all-reduce and broadcast, host numbers in shared memory.
    let mut one = builder(World::default(), 32, 11, "1ep").build().unwrap();
    one.fit().unwrap();
    let one_weights = weights(one.model());
    let (r0, r1) = two_local_ranks(Duration::from_secs(60), |rank, group| {
        let member = group.member::<Inner>(rank, Default::default()).unwrap();
        let world = World { rank, size: 2 };
        let mut t = builder(world, 16, 11 + rank as u64, "1ep")
            .collective(member)
            .build()
            .unwrap();
        t.fit().unwrap();
        (weights(t.model()), t.state().eval_metrics().clone())
    });
    assert_eq!(
        r0.0, r1.0,
        "both devices hold the same bits after every step"
    );
    assert_eq!(r0.1, r1.1, "evaluation metrics are the global ones on both");
    let max_diff =
        r0.0.iter()
            .zip(&one_weights)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
    assert!(
        max_diff < 1e-5,
        "weights differ from one process by up to {max_diff}"
    );
}

#[test]
fn a_failed_or_missing_device_thread_ends_the_others_with_an_error_naming_it() {
    // Rank 1 fails before its trainer exists: rank 0's build (its first collective) returns
    // rank 1's error instead of waiting for it.
    let (r0, _) = two_local_ranks(Duration::from_secs(60), |rank, group| {
        if rank == 1 {
            group.fail(1, "cannot read its data");
            return None;
        }
        let member = group.member::<Inner>(rank, Default::default()).unwrap();
        Some(
            builder(World { rank, size: 2 }, 16, 11, "1ep")
                .collective(member)
                .build()
                .err()
                .map(|e| e.to_string()),
        )
    });
    let e = r0.flatten().expect("rank 0 fails");
    assert!(
        e.contains("rank 1") && e.contains("cannot read its data"),
        "{e}"
    );
    // Rank 1 never comes: rank 0 gives up after the timeout, naming it.
    let started = std::time::Instant::now();
    let (r0, _) = two_local_ranks(Duration::from_millis(500), |rank, group| {
        if rank == 1 {
            return None;
        }
        let member = group.member::<Inner>(rank, Default::default()).unwrap();
        Some(
            builder(World { rank, size: 2 }, 16, 11, "1ep")
                .collective(member)
                .build()
                .err()
                .map(|e| e.to_string()),
        )
    });
    let e = r0.flatten().expect("rank 0 fails");
    assert!(
        e.contains("rank(s) 1") && e.contains("did not arrive"),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn evaluation_metrics_are_summed_over_ranks() {
    let mut one = builder(World::default(), 32, 5, "1ep").build().unwrap();
    let whole = one.eval().unwrap()["test"].clone();
    let (r0, r1) = two_ranks(|rank, c| {
        let mut t = builder(World { rank, size: 2 }, 16, 5, "1ep")
            .collective(c)
            .build()
            .unwrap();
        t.eval().unwrap()["test"].clone()
    });
    // Each rank saw 100 of the 200 test digits; both report the accuracy over all 200.
    assert_eq!(r0["accuracy"], whole["accuracy"]);
    assert_eq!(r1["accuracy"], whole["accuracy"]);
    assert!((r0["loss"] - whole["loss"]).abs() < 1e-6);
    assert_eq!(r0["loss"], r1["loss"]);
}

#[test]
fn one_rank_asking_to_stop_stops_both_at_the_same_batch() {
    let (a, b) = two_ranks(|rank, c| {
        let mut b = builder(World { rank, size: 2 }, 16, 3, "2ep").collective(c);
        if rank == 1 {
            b = b.callback(StopAt::new(Time::Batch(3)));
        }
        let mut t = b.build().unwrap();
        let report = t.fit().unwrap();
        (t.state().timestamp().batch, report.stopped)
    });
    assert_eq!(a.0, 3);
    assert_eq!(b.0, 3);
    assert_eq!(a.1.as_deref(), Some("rank 1 asked to stop"));
    assert_eq!(b.1.as_deref(), Some("reached 3ba"));
}

/// Makes the loss of batch `at` not finite.
struct PoisonLoss {
    at: u64,
}

impl<S: Setup> Algorithm<S> for PoisonLoss {
    fn name(&self) -> &str {
        "poison_loss"
    }
    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterLoss && state.timestamp().batch == self.at
    }
    fn apply(&mut self, _event: Event, state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        if let Some(loss) = state.loss_mut()? {
            *loss = loss.clone().mul_scalar(f64::NAN);
        }
        Ok(())
    }
}

#[test]
fn a_non_finite_loss_on_one_rank_skips_the_step_on_both() {
    let (a, b) = two_ranks(|rank, c| {
        let mut b = builder(World { rank, size: 2 }, 16, 3, "4ba")
            .collective(c)
            .skip_nonfinite_loss(true);
        if rank == 0 {
            b = b.algorithm(PoisonLoss { at: 1 });
        }
        let mut t = b.build().unwrap();
        let report = t.fit().unwrap();
        (
            report.steps,
            t.state().skipped_batches(),
            weights(t.model()),
        )
    });
    assert_eq!((a.0, a.1), (3, 1));
    assert_eq!(
        (b.0, b.1),
        (3, 1),
        "rank 1's loss was finite, but it skipped with rank 0"
    );
    assert_eq!(a.2, b.2);
}

/// Under float16 loss scaling, gradients that overflow on one rank (its scale is 2^100, the
/// other's 1) skip the step on both, and both lower their scale; the steps after are taken
/// alike, so the ranks keep equal weights.
#[test]
fn a_float16_overflow_on_one_rank_skips_the_step_on_both() {
    use flashover::core::precision::{LossScaling, Precision};
    use flashover::core::setup::Setup;
    let supported = <<Run as Setup>::Backend as burn::tensor::backend::Backend>::supports_dtype(
        &device(),
        burn::tensor::DType::F16,
    );
    if !supported {
        eprintln!("skipped on {BACKEND}: no float16");
        return;
    }
    let (a, b) = two_ranks(|rank, c| {
        let init_scale = if rank == 0 { 2f64.powi(100) } else { 1.0 };
        let mut t = builder(World { rank, size: 2 }, 16, 3, "2ba")
            .collective(c)
            .precision(Precision::AmpFp16)
            .loss_scaling(LossScaling {
                init_scale,
                ..LossScaling::default()
            })
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        let scaler = t.state().loss_scaler().unwrap();
        (
            report.steps,
            scaler.skipped_steps,
            scaler.scale,
            weights(t.model()),
        )
    });
    assert_eq!(
        (a.0, a.1, a.2),
        (0, 2, 2f64.powi(98)),
        "rank 0 overflowed twice"
    );
    assert_eq!(
        (b.0, b.1, b.2),
        (0, 2, 0.25),
        "rank 1's gradients fitted, but it skipped and backed off with rank 0"
    );
    assert_eq!(a.3, b.3);
}

/// A callback that writes, and so acts on rank 0 only.
struct Writer(Log);

impl<S: Setup> Callback<S> for Writer {
    fn name(&self) -> &str {
        "writer"
    }
    fn fit_start(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.0.lock().unwrap().push("FIT_START".into());
        Ok(())
    }
    fn ranks(&self) -> Ranks {
        Ranks::Main
    }
}

#[test]
fn only_rank_zero_writes_unless_told_otherwise() {
    let (a, b) = two_ranks(|rank, c| {
        let (logger, writer, everywhere) = (new_log(), new_log(), new_log());
        let mut t = builder(World { rank, size: 2 }, 16, 3, "2ba")
            .collective(c)
            .logger(RecordingLogger {
                name: "L".into(),
                log: logger.clone(),
            })
            .callback(Writer(writer.clone()))
            .callback(OnEveryRank(Writer(everywhere.clone())))
            .build()
            .unwrap();
        t.fit().unwrap();
        (lines(&logger).len(), lines(&writer), lines(&everywhere))
    });
    assert!(a.0 > 0, "rank 0's logger sees events");
    assert_eq!(a.1, ["FIT_START"]);
    assert_eq!(b.0, 0, "rank 1's logger sees nothing");
    assert!(b.1.is_empty(), "rank 1's writer stays silent");
    assert_eq!(b.2, ["FIT_START"], "OnEveryRank acts on rank 1 too");
}

#[test]
fn a_world_that_contradicts_the_collective_is_refused() {
    let hub = Hub::new(2);
    let err = builder(World { rank: 1, size: 3 }, 16, 3, "1ba")
        .world(World { rank: 1, size: 3 })
        .collective(ThreadCollective { rank: 0, hub })
        .build()
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1 of 3") && msg.contains("rank 0 of 2"),
        "{msg}"
    );
    let err = builder(World::default(), 16, 3, "1ba")
        .world(World { rank: 2, size: 2 })
        .build()
        .err()
        .expect("refused");
    assert!(err.to_string().contains("rank 2 of 2"), "{err}");
}

/// Sleeps at every batch end (a slow rank).
struct Slow(u64);

impl<S: Setup> Callback<S> for Slow {
    fn name(&self) -> &str {
        "slow"
    }
    fn batch_end(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        std::thread::sleep(Duration::from_millis(self.0));
        Ok(())
    }
}

#[test]
fn ranks_agree_on_samples_and_on_the_slowest_clock() {
    // A wall-clock run with one slow rank: both stop after the same batch, with the same
    // clock (the slow rank's), and count the samples of both ranks' batches.
    let (a, b) = two_ranks(|rank, c| {
        let mut b = builder(World { rank, size: 2 }, 16, 3, "0.4s").collective(c);
        if rank == 1 {
            b = b.callback(Slow(30));
        }
        let mut t = b.build().unwrap();
        let report = t.fit().unwrap();
        let ts = t.state().timestamp().clone();
        (
            report.batches,
            ts.sample,
            ts.run_wall_time,
            t.state().samples_per_epoch(),
        )
    });
    assert_eq!(a, b);
    let (batches, samples, wall, per_epoch) = a;
    // On flex several batches fit in 0.4 s; on a software GPU the first may not.
    assert!(batches >= 1, "{batches}");
    assert_eq!(
        samples,
        batches * 32,
        "each batch counts 16 samples of each rank"
    );
    assert_eq!(per_epoch, TRAIN as u64);
    assert!(wall >= Duration::from_millis(400));
}

#[test]
fn sam_steps_alike_on_every_rank() {
    let (a, b) = two_ranks(|rank, c| {
        let mut t = builder(World { rank, size: 2 }, 16, 3, "4ba")
            .collective(c)
            .algorithm(flashover::algorithms::sam::Sam::new(0.05, 1e-12, 1).unwrap())
            .build()
            .unwrap();
        t.fit().unwrap();
        weights(t.model())
    });
    assert_eq!(a, b, "SAM's second-pass gradients are averaged too");
}

/// Asks to stop at `FIT_START`.
struct StopAtStart;

impl<S: Setup> Callback<S> for StopAtStart {
    fn name(&self) -> &str {
        "stop_at_start"
    }
    fn fit_start(&mut self, _state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        ctl.request_stop("not today");
        Ok(())
    }
}

#[test]
fn a_stop_at_fit_start_on_one_rank_stops_both_before_any_batch() {
    let (a, b) = two_ranks(|rank, c| {
        let mut b = builder(World { rank, size: 2 }, 16, 3, "1ep").collective(c);
        if rank == 0 {
            b = b.callback(StopAtStart);
        }
        let mut t = b.build().unwrap();
        let report = t.fit().unwrap();
        (report.batches, report.stopped)
    });
    assert_eq!(a, (0, Some("not today".to_string())));
    assert_eq!(b, (0, Some("rank 0 asked to stop".to_string())));
}
