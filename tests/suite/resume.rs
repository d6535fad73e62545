//! Exact resumption across processes: train straight; or train part way, save, start a new
//! process that resumes, train to the end; both end with the same bits and the same metrics.

use crate::support::*;

pub(crate) fn resumed(extra: &[&str], first: &[&str], resume: impl Fn(&str) -> Vec<String>) {
    let straight = summary_of(&short_args(extra));
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap().to_string();
    let mut a = short_args(extra);
    a.extend(["--save-folder", &folder]);
    a.extend(first);
    let partial = summary_of(&a);
    assert!(
        partial["batches"].as_u64() < straight["batches"].as_u64(),
        "the first part must stop early: {partial}"
    );
    let tail = resume(&folder);
    let mut b = short_args(extra);
    b.extend(["--save-folder", &folder]);
    b.extend(tail.iter().map(String::as_str));
    let back = summary_of(&b);
    assert_eq!(
        outcome(&back),
        outcome(&straight),
        "resumed run differs from the straight one ({extra:?}, {first:?})"
    );
}

pub(crate) fn autoresume(_: &str) -> Vec<String> {
    vec!["--autoresume".into()]
}

#[test]
fn resume_mid_epoch() {
    resumed(&[], &["--stop-after", "8ba"], autoresume);
}

#[test]
fn resume_right_after_an_epoch() {
    // Stops once epoch 1 has ended (its EPOCH_END and evaluation ran), and one batch later.
    resumed(&[], &["--stop-after", "1ep"], autoresume);
    resumed(&[], &["--stop-after", "17ba"], autoresume);
}

#[test]
fn resume_at_an_epoch_boundary_before_its_end_event() {
    // The checkpoint taken at the BATCH_CHECKPOINT of the epoch's last batch (batch 16 of 16),
    // before EPOCH_END: the resumed run must run that EPOCH_END (and its evaluation) itself.
    // (The folder's later checkpoint, ep1-ba20, is replaced as the run passes it: going back
    // to an earlier checkpoint of a folder takes --overwrite.)
    resumed(
        &[],
        &["--save-interval", "8ba", "--stop-after", "20ba"],
        |folder| {
            vec![
                "--load".into(),
                format!("{folder}/ep0-ba16"),
                "--overwrite".into(),
            ]
        },
    );
}

#[test]
fn resume_with_microbatches_and_inside_warmup() {
    // Warmup is 20 batches: stopping at 12 resumes inside it.
    resumed(
        &["--microbatch-size", "8"],
        &["--stop-after", "12ba"],
        autoresume,
    );
}

#[test]
fn resume_with_other_schedules_and_optimizers() {
    resumed(
        &["--schedule", "step", "--optimizer", "sgd", "--lr", "0.05"],
        &["--stop-after", "27ba"],
        autoresume,
    );
    resumed(
        &["--schedule", "cosine-warm-restarts", "--optimizer", "adam"],
        &["--stop-after", "2ep"],
        autoresume,
    );
}

#[test]
fn resume_from_an_asynchronous_save() {
    resumed(
        &["--save-async"],
        &["--save-interval", "4ba", "--stop-after", "30ba"],
        autoresume,
    );
}

#[test]
fn resuming_a_finished_run_evaluates_without_training() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let first = summary_of(&short_args(&["--save-folder", folder]));
    let again = summary_of(&short_args(&["--save-folder", folder, "--autoresume"]));
    assert_eq!(outcome(&again), outcome(&first));
}

/// Exact resumption inside one process, through the library's saver and autoresume: the
/// backend's share of resuming (its tensors' bytes in a checkpoint and back) without an
/// example program, so a GPU backend's test subset runs these without building one.
pub(crate) mod in_process {
    use crate::support::*;
    use flashover::callbacks::StopAt;
    use flashover::checkpoint::{autoresume, SaveInterval, Saver, SaverConfig};
    use flashover::core::params::params_sha256;
    use flashover::core::time::Time;
    use flashover_examples::MnistRun;

    /// Trains `run` straight; trains it again with a checkpoint every `interval` (written on
    /// a background thread if `async_write`) and stops at `stop`; then a new trainer resumes
    /// from the newest checkpoint and trains to the end. The weights, the final test metrics
    /// and the batch count must equal the straight run's.
    pub(crate) fn resumes(run: &MnistRun, interval: Time, stop: Time, async_write: bool) {
        let outcome = |t: &mut MnistTrainer| {
            let metrics = t.eval().unwrap();
            (
                params_sha256::<TB, _>(t.model()),
                format!("{metrics:?}"),
                t.state().timestamp().batch,
            )
        };
        let straight = outcome(&mut trained(run));
        let dir = tempfile::tempdir().unwrap();
        let saver = || {
            let mut config = SaverConfig::new(dir.path());
            config.async_write = async_write;
            Saver::new(config, SaveInterval::Every(interval)).unwrap()
        };
        let mut first = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(saver())
            .callback(StopAt::new(stop))
            .build()
            .unwrap();
        first.fit().unwrap();
        let stopped = first.state().timestamp().batch;
        assert!(stopped < straight.2, "the first part must stop early");
        drop(first);
        let checkpoint = autoresume(dir.path())
            .unwrap()
            .expect("a checkpoint to resume from");
        let mut back = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(saver())
            .restore(checkpoint)
            .build()
            .unwrap();
        back.fit().unwrap();
        assert_eq!(
            outcome(&mut back),
            straight,
            "resumed after batch {stopped}, the run differs from the straight one"
        );
    }

    /// The example's short run for an epoch and a half (24 batches, epochs of 16): long enough
    /// to stop mid-epoch and resume across the epoch boundary, short enough for a software
    /// GPU.
    pub(crate) fn epoch_and_a_half() -> MnistRun {
        short_example_run("24ba")
    }

    /// Stopped mid-epoch: the resumed part crosses the epoch boundary.
    #[test]
    fn mid_epoch() {
        resumes(&epoch_and_a_half(), Time::Batch(4), Time::Batch(8), false);
    }

    /// Stopped in the second epoch, the checkpoints written on a background thread (host
    /// code: the GPU subset leaves it to the flex suite).
    #[test]
    fn from_an_asynchronous_save() {
        resumes(&epoch_and_a_half(), Time::Batch(4), Time::Batch(20), true);
    }
}

mod components {
    use std::sync::{Arc, Mutex};

    use crate::support::*;
    use flashover::callbacks::StopAt;
    use flashover::checkpoint::{autoresume, SaveInterval, Saver, SaverConfig};
    use flashover::core::callback::Callback;
    use flashover::core::callback::Control;
    use flashover::core::error::{CoreError, Result};
    use flashover::core::setup::Setup;
    use flashover::core::state::State;
    use flashover::core::time::Time;
    use flashover_examples::MnistRun;

    /// Counts the batches it has seen, and saves the count in checkpoints.
    struct Counter(Arc<Mutex<u64>>);

    impl<S: Setup> Callback<S> for Counter {
        fn name(&self) -> &str {
            "counter"
        }
        fn batch_end(&mut self, _s: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            *self.0.lock().unwrap() += 1;
            Ok(())
        }
        fn state_dict(&self) -> serde_json::Value {
            serde_json::json!({ "batches": *self.0.lock().unwrap() })
        }
        fn load_state_dict(&mut self, state: serde_json::Value) -> Result<()> {
            let n = state["batches"]
                .as_u64()
                .ok_or_else(|| CoreError::config("counter state", &state, "{\"batches\": n}"))?;
            *self.0.lock().unwrap() = n;
            Ok(())
        }
    }

    #[test]
    fn callback_state_is_saved_and_restored_and_a_missing_component_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let run = short_run(256, 32, 50, "2ep");
        let saver = || {
            Saver::new(
                SaverConfig::new(dir.path()),
                SaveInterval::Every(Time::Batch(4)),
            )
            .unwrap()
        };
        let count = Arc::new(Mutex::new(0));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Counter(count.clone()))
            .callback(saver())
            .callback(StopAt::new(Time::Batch(6)))
            .build()
            .unwrap();
        t.fit().unwrap();
        assert_eq!(*count.lock().unwrap(), 6);

        let resumed = Arc::new(Mutex::new(0));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Counter(resumed.clone()))
            .callback(saver())
            .restore(
                autoresume(dir.path())
                    .unwrap()
                    .expect("a checkpoint to resume from"),
            )
            .build()
            .unwrap();
        assert_eq!(
            *resumed.lock().unwrap(),
            6,
            "the counter's saved state is restored before training"
        );
        t.fit().unwrap();
        assert_eq!(*resumed.lock().unwrap(), 16);

        // A checkpoint carrying state for a component this run lacks is refused by name.
        let err = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .restore(autoresume(dir.path()).unwrap().unwrap())
            .build()
            .err()
            .expect("missing component");
        assert!(err.to_string().contains("callback/counter"), "{err}");
    }

    #[test]
    fn a_callback_asks_for_a_checkpoint_off_the_savers_interval_and_gets_it() {
        let dir = tempfile::tempdir().unwrap();
        let run = short_run(256, 32, 50, "1ep");
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Watch {
                event: flashover::core::event::Event::BatchEnd,
                f: |s: &MnistState, ctl: &mut Control<'_>| {
                    if s.timestamp().batch == 3 {
                        ctl.request_checkpoint();
                    }
                    Ok(())
                },
            })
            .callback(
                Saver::new(
                    SaverConfig::new(dir.path()),
                    SaveInterval::Every(Time::Epoch(1)),
                )
                .unwrap(),
            )
            .build()
            .unwrap();
        t.fit().unwrap();
        let mut batches: Vec<u64> = flashover::checkpoint::list_checkpoints(dir.path())
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        batches.sort();
        // Batch 3 on request; the epoch's end (8 batches) on the interval.
        assert_eq!(batches, [3, 8]);
    }
}

#[test]
fn weights_only_checkpoints_start_new_runs_but_do_not_resume() {
    let straight = summary_of(&short_args(&[]));
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    summary_of(&short_args(&[
        "--save-folder",
        folder,
        "--save-weights-only",
        "--stop-after",
        "8ba",
    ]));
    let ck = dir.path().join("ep0-ba8");
    let (found, skipped) = flashover::checkpoint::find_resumable(dir.path()).unwrap();
    assert_eq!(found, None, "a weights-only checkpoint cannot resume a run");
    assert!(
        skipped.iter().any(|e| e.to_string().contains("ep0-ba8")),
        "{skipped:?}"
    );
    let refused = run_mnist(&short_args(&["--load", ck.to_str().unwrap()]));
    assert!(
        !refused.status.success() && refused.stderr.contains("weights only"),
        "{}",
        refused.stderr
    );
    let fresh = summary_of(&short_args(&[
        "--load",
        ck.to_str().unwrap(),
        "--weights-only",
    ]));
    assert_eq!(
        fresh["batches"], straight["batches"],
        "a new run from loaded weights trains the whole duration"
    );
    assert_ne!(fresh["params_sha256"], straight["params_sha256"]);
}

mod predicate {
    use crate::support::*;
    use flashover::checkpoint::{list_checkpoints, SaveInterval, Saver, SaverConfig};
    use flashover::core::event::Event;
    use flashover_examples::MnistRun;

    #[test]
    fn a_save_predicate_decides_when_to_save_and_rotation_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let run = short_run(256, 32, 20, "1ep");
        let mut config = SaverConfig::new(dir.path());
        config.keep = 2;
        config.name_template = "b{batch}-e{epoch}-r{rank}".into();
        let interval = SaveInterval::Custom(Box::new(|ts, ev| {
            ev == Event::BatchCheckpoint && ts.batch % 3 == 0
        }));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Saver::new(config, interval).unwrap())
            .build()
            .unwrap();
        t.fit().unwrap();
        // Saved at batches 3 and 6 by the predicate, and 8 at the end of the fit; the
        // newest two remain.
        let mut kept = list_checkpoints(dir.path());
        kept.sort();
        assert_eq!(
            kept,
            vec![("b6-e0-r0".to_string(), 6), ("b8-e1-r0".to_string(), 8)]
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("latest")).unwrap(),
            "b8-e1-r0"
        );
    }
}
