//! The event lifecycle as users see it.

use std::collections::BTreeMap;

use crate::support::*;
use flashover::core::event::Event;
use flashover_examples::MnistRun;

fn run_recorded(run: &MnistRun, algorithms: bool) -> Vec<String> {
    let log = new_log();
    let mut b = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap();
    if algorithms {
        b = b
            .algorithm(RecordingAlgorithm {
                name: "A".into(),
                log: log.clone(),
            })
            .algorithm(RecordingAlgorithm {
                name: "B".into(),
                log: log.clone(),
            });
    }
    b = b.callback(Recorder {
        prefix: String::new(),
        log: log.clone(),
    });
    if algorithms {
        b = b.logger(RecordingLogger {
            name: "L".into(),
            log: log.clone(),
        });
    }
    let mut t = b.build().unwrap();
    t.fit().unwrap();
    lines(&log)
}

/// One epoch of two batches, each split into two microbatches, then one evaluation batch.
const SHORT_RUN_TRACE: &str = "\
INIT BEFORE_LOAD AFTER_LOAD
FIT_START
EPOCH_START
BEFORE_DATALOADER AFTER_DATALOADER BATCH_START BEFORE_TRAIN_BATCH
BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS BEFORE_BACKWARD AFTER_BACKWARD
BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS BEFORE_BACKWARD AFTER_BACKWARD
AFTER_TRAIN_BATCH BATCH_END BATCH_CHECKPOINT
BEFORE_DATALOADER AFTER_DATALOADER BATCH_START BEFORE_TRAIN_BATCH
BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS BEFORE_BACKWARD AFTER_BACKWARD
BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS BEFORE_BACKWARD AFTER_BACKWARD
AFTER_TRAIN_BATCH BATCH_END BATCH_CHECKPOINT
EPOCH_END
EVAL_BEFORE_ALL EVAL_START
EVAL_BATCH_START EVAL_BEFORE_FORWARD EVAL_AFTER_FORWARD EVAL_BATCH_END
EVAL_END EVAL_AFTER_ALL
EPOCH_CHECKPOINT
FIT_END
";

/// Formats a trace with a line break before each event that starts a group, so that a
/// mismatch shows as a readable diff.
fn format_trace(events: &[String]) -> String {
    let breaks = [
        "BEFORE_LOAD",
        "FIT_START",
        "EPOCH_START",
        "BEFORE_DATALOADER",
        "BEFORE_FORWARD",
        "AFTER_TRAIN_BATCH",
        "EPOCH_END",
        "EVAL_BEFORE_ALL",
        "EVAL_BATCH_START",
        "EVAL_END",
        "EPOCH_CHECKPOINT",
        "FIT_END",
    ];
    let mut out = String::new();
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            let group = breaks.contains(&e.as_str()) && e != "BEFORE_LOAD";
            out.push(if group { '\n' } else { ' ' });
        }
        out.push_str(e);
    }
    out.push('\n');
    out
}

#[test]
fn short_run_trace_matches_the_snapshot() {
    let mut run = short_run(8, 4, 4, "1ep");
    run.microbatch_size = Some(2);
    let trace = format_trace(&run_recorded(&run, false));
    assert_eq!(trace, SHORT_RUN_TRACE, "event trace changed:\n{trace}");
}

#[test]
fn exact_call_counts_per_event() {
    // (epochs, batches per epoch, microbatches per batch, evaluation batches)
    for (epochs, batches, micro, eval_batches) in
        [(1u64, 1u64, 1u64, 1u64), (2, 3, 2, 2), (3, 2, 4, 1)]
    {
        let batch_size = 4 * micro as usize;
        let eval_size = 5;
        let mut run = short_run(
            batches as usize * batch_size,
            batch_size,
            eval_batches as usize * eval_size,
            &format!("{epochs}ep"),
        );
        run.data.eval_batch_size = eval_size;
        run.microbatch_size = Some(4);
        let trace = run_recorded(&run, false);
        let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
        for e in &trace {
            *counts.entry(e.as_str()).or_default() += 1;
        }
        let (e, b, m, eb) = (
            epochs,
            epochs * batches,
            epochs * batches * micro,
            epochs * eval_batches,
        );
        for event in Event::ALL {
            let expected = match event {
                Event::Init
                | Event::BeforeLoad
                | Event::AfterLoad
                | Event::FitStart
                | Event::FitEnd => 1,
                Event::EpochStart | Event::EpochEnd | Event::EpochCheckpoint => e,
                Event::BeforeDataloader
                | Event::AfterDataloader
                | Event::BatchStart
                | Event::BeforeTrainBatch
                | Event::AfterTrainBatch
                | Event::BatchEnd
                | Event::BatchCheckpoint => b,
                Event::BeforeForward
                | Event::AfterForward
                | Event::BeforeLoss
                | Event::AfterLoss
                | Event::BeforeBackward
                | Event::AfterBackward => m,
                Event::EvalBeforeAll | Event::EvalStart | Event::EvalEnd | Event::EvalAfterAll => e,
                Event::EvalBatchStart
                | Event::EvalBeforeForward
                | Event::EvalAfterForward
                | Event::EvalBatchEnd => eb,
                _ => 0,
            };
            assert_eq!(
                counts.get(event.name()).copied().unwrap_or(0),
                expected,
                "{} for {epochs} epochs x {batches} batches x {micro} microbatches",
                event.name()
            );
        }
    }
}

#[test]
fn algorithms_then_callbacks_then_loggers_with_after_events_reversed() {
    let run = short_run(4, 4, 4, "1ba");
    let log = run_recorded(&run, true);
    let at = |event: &str| -> Vec<String> {
        // The entries for the first occurrence of `event`, in order.
        let mut out = Vec::new();
        let mut seen = false;
        for l in &log {
            let (who, what) = l.split_once(' ').unwrap_or(("C", l.as_str()));
            if what == event {
                if out.iter().any(|w: &String| w == who) {
                    break;
                }
                seen = true;
                out.push(who.to_string());
            } else if seen {
                break;
            }
        }
        out
    };
    assert_eq!(at("INIT"), ["L", "A", "B", "C"], "loggers first at INIT");
    assert_eq!(at("BEFORE_FORWARD"), ["A", "B", "C", "L"]);
    assert_eq!(
        at("AFTER_FORWARD"),
        ["B", "A", "C", "L"],
        "first in, last out at AFTER_*"
    );
    assert_eq!(at("AFTER_TRAIN_BATCH"), ["B", "A", "C", "L"]);
    assert_eq!(at("BATCH_END"), ["A", "B", "C", "L"]);
}
