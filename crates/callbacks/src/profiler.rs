//! The profiler: a Chrome trace (JSON; open it in <https://ui.perfetto.dev> or
//! `chrome://tracing`) of the training steps it is scheduled to record, with the phases of
//! each step nested inside it: data loading, forward, loss, backward (once per microbatch),
//! the optimizer step, and evaluation; plus a marker for every event.
//!
//! Phases are timed at the events that bound them (`BEFORE_FORWARD` to `AFTER_FORWARD`, and
//! so on), when the profiler's callback sees them: after the algorithms of that event. The
//! event boundaries are exactly the phase boundaries, which is why the profiler reads them
//! rather than `tracing` spans inside the trainer. On an asynchronous device (wgpu, CUDA) a
//! phase measures the time to *queue* its work unless something reads a value back.
//!
//! A [`ProfilerSchedule`] keeps files small on long runs, as in PyTorch's profiler: skip the
//! first `skip_first` steps, then repeat cycles of `wait` steps (not recorded), `warmup` steps
//! (recorded and discarded, so start-up costs stay out) and `active` steps (recorded); `repeat`
//! cycles in all (0: until the end).

use std::path::{Path, PathBuf};
use std::time::Instant;

use flashover_core::callback::{Callback, Control};
use flashover_core::collective::Ranks;
use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use serde_json::{json, Value};

use crate::error::CallbackError;

/// What the profiler does with a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAction {
    /// Not recorded.
    Skip,
    /// Recorded, then discarded.
    Warmup,
    /// Recorded and written.
    Record,
}

/// Which steps to record (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfilerSchedule {
    /// Steps ignored at the start.
    pub skip_first: u64,
    /// Steps not recorded at the start of each cycle.
    pub wait: u64,
    /// Steps recorded and discarded after the wait.
    pub warmup: u64,
    /// Steps recorded in each cycle (at least 1).
    pub active: u64,
    /// Number of cycles; 0 repeats until the end of training.
    pub repeat: u64,
}

impl Default for ProfilerSchedule {
    /// Skip 10 steps, then one cycle: wait 1, warm up 1, record 5.
    fn default() -> Self {
        ProfilerSchedule {
            skip_first: 10,
            wait: 1,
            warmup: 1,
            active: 5,
            repeat: 1,
        }
    }
}

impl ProfilerSchedule {
    /// Checks the schedule: `active` must be at least 1.
    pub fn validate(&self) -> crate::error::Result<()> {
        if self.active == 0 {
            return Err(CallbackError::param(
                "profiler",
                "active",
                0,
                "at least 1 step per cycle",
            ));
        }
        Ok(())
    }

    /// What to do with step `step` (0-based count of training batches).
    pub fn action(&self, step: u64) -> StepAction {
        let Some(s) = step.checked_sub(self.skip_first) else {
            return StepAction::Skip;
        };
        let cycle = self.wait + self.warmup + self.active;
        if self.repeat > 0 && s / cycle >= self.repeat {
            return StepAction::Skip;
        }
        match s % cycle {
            i if i < self.wait => StepAction::Skip,
            i if i < self.wait + self.warmup => StepAction::Warmup,
            _ => StepAction::Record,
        }
    }

    /// Whether `step` is the last recorded step of its cycle.
    fn ends_cycle(&self, step: u64) -> bool {
        self.action(step) == StepAction::Record
            && (step + 1 - self.skip_first).is_multiple_of(self.wait + self.warmup + self.active)
    }

    /// Parses `skip_first,wait,warmup,active,repeat` (five integers, as in `10,1,1,5,1`).
    pub fn parse(s: &str) -> crate::error::Result<Self> {
        let bad = || {
            CallbackError::param(
                "profiler",
                "schedule",
                format!("{s:?}"),
                "five integers skip_first,wait,warmup,active,repeat such as `10,1,1,5,1`",
            )
        };
        let v: Vec<u64> = s
            .split(',')
            .map(|x| x.trim().parse::<u64>().map_err(|_| bad()))
            .collect::<crate::error::Result<_>>()?;
        let [skip_first, wait, warmup, active, repeat] = v[..] else {
            return Err(bad());
        };
        let sched = ProfilerSchedule {
            skip_first,
            wait,
            warmup,
            active,
            repeat,
        };
        sched.validate()?;
        Ok(sched)
    }
}

/// Records a Chrome trace of scheduled training steps (see the module docs) into one JSON
/// file, rewritten (atomically: a temporary file renamed into place) after every recorded
/// cycle and at `FIT_END`.
///
/// ```no_run
/// use flashover_callbacks::profiler::{Profiler, ProfilerSchedule};
/// let profiler = Profiler::new("runs/mnist/trace.json", ProfilerSchedule::default())?;
/// // trainer builder: .callback(profiler)
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct Profiler {
    path: PathBuf,
    schedule: ProfilerSchedule,
    origin: Instant,
    events: Vec<Value>,
    step: Vec<Value>,
    action: StepAction,
    step_index: u64,
    open: Vec<(&'static str, f64)>,
    in_cycle: bool,
    pid: u32,
}

/// Phase names and the events that open and close them.
const PHASES: &[(Event, Event, &str)] = &[
    (Event::BeforeDataloader, Event::AfterDataloader, "data"),
    (Event::BeforeForward, Event::AfterForward, "forward"),
    (Event::BeforeLoss, Event::AfterLoss, "loss"),
    (Event::BeforeBackward, Event::AfterBackward, "backward"),
    (Event::AfterTrainBatch, Event::BatchEnd, "optimizer"),
    (Event::EvalBeforeAll, Event::EvalAfterAll, "eval"),
];

impl Profiler {
    /// A profiler writing to `path` on `schedule`.
    pub fn new(path: impl AsRef<Path>, schedule: ProfilerSchedule) -> crate::error::Result<Self> {
        schedule.validate()?;
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| CallbackError::io("profiler", dir, e))?;
        }
        let pid = std::process::id();
        let meta = json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                          "args": {"name": "training"}});
        Ok(Profiler {
            path,
            schedule,
            origin: Instant::now(),
            events: vec![meta],
            step: Vec::new(),
            action: StepAction::Skip,
            step_index: 0,
            open: Vec::new(),
            in_cycle: false,
            pid,
        })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn now_us(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * 1e6
    }

    fn span(&self, name: &str, cat: &str, start: f64, end: f64, args: Value) -> Value {
        json!({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": (end - start).max(0.0),
               "pid": self.pid, "tid": 0, "args": args})
    }

    fn write(&self) -> crate::error::Result<()> {
        let doc = json!({
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "flashover profiler",
                "schedule": {
                    "skip_first": self.schedule.skip_first, "wait": self.schedule.wait,
                    "warmup": self.schedule.warmup, "active": self.schedule.active,
                    "repeat": self.schedule.repeat,
                },
            },
        });
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, doc.to_string())
            .map_err(|e| CallbackError::io("profiler", &tmp, e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| CallbackError::io("profiler", &self.path, e))
    }

    fn on_event(&mut self, event: Event, batch: u64) -> crate::error::Result<()> {
        let now = self.now_us();
        if event == Event::BeforeDataloader {
            self.step_index = batch;
            self.action = self.schedule.action(batch);
            self.step.clear();
            self.open.clear();
            if self.action != StepAction::Skip {
                self.open.push(("train_step", now));
            }
            if self.action == StepAction::Record {
                self.in_cycle = true;
            }
        }
        // Evaluation at an epoch's end falls between steps: it is recorded while a cycle is
        // recording (after a recorded step whose cycle has not ended).
        let recording = self.action != StepAction::Skip || (event.is_eval() && self.in_cycle);
        if !recording {
            return Ok(());
        }
        for &(open, close, name) in PHASES {
            if event == open {
                self.open.push((name, now));
            } else if event == close {
                if let Some(i) = self.open.iter().rposition(|(n, _)| *n == name) {
                    let (_, start) = self.open.remove(i);
                    let span =
                        self.span(name, "phase", start, now, json!({"batch": self.step_index}));
                    self.step.push(span);
                }
            }
        }
        self.step.push(
            json!({"name": event.name(), "cat": "event", "ph": "i", "s": "t",
                              "ts": now, "pid": self.pid, "tid": 0}),
        );
        if event == Event::BatchCheckpoint {
            if let Some(i) = self.open.iter().rposition(|(n, _)| *n == "train_step") {
                let (_, start) = self.open.remove(i);
                let span = self.span(
                    "train_step",
                    "step",
                    start,
                    now,
                    json!({"batch": self.step_index}),
                );
                self.step.push(span);
            }
            let finished = std::mem::take(&mut self.step);
            if self.action == StepAction::Record {
                self.events.extend(finished);
                if self.schedule.ends_cycle(self.step_index) {
                    self.in_cycle = false;
                    self.write()?;
                }
            }
            self.action = StepAction::Skip;
        } else if event == Event::EvalAfterAll && self.action == StepAction::Skip {
            // An evaluation at an epoch's end, right after a recorded step of the cycle.
            self.events.append(&mut self.step);
        }
        Ok(())
    }
}

impl<S: Setup> Callback<S> for Profiler {
    /// Only rank 0 of a data-parallel run writes (wrap in `OnEveryRank` to change that).
    fn ranks(&self) -> Ranks {
        Ranks::Main
    }

    fn name(&self) -> &str {
        "profiler"
    }

    fn run_event(&mut self, event: Event, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if event == Event::FitEnd {
            self.write()?;
            return Ok(());
        }
        if event.is_predict() {
            return Ok(());
        }
        self.on_event(event, state.timestamp().batch)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_its_definition() {
        let s = ProfilerSchedule {
            skip_first: 2,
            wait: 1,
            warmup: 1,
            active: 2,
            repeat: 2,
        };
        use StepAction::*;
        let got: Vec<StepAction> = (0..14).map(|i| s.action(i)).collect();
        assert_eq!(
            got,
            [
                Skip, Skip, Skip, Warmup, Record, Record, Skip, Warmup, Record, Record, Skip, Skip,
                Skip, Skip
            ]
        );
        let ends: Vec<u64> = (0..14).filter(|&i| s.ends_cycle(i)).collect();
        assert_eq!(ends, [5, 9]);
        let forever = ProfilerSchedule { repeat: 0, ..s };
        assert_eq!(forever.action(1000 * 4 + 2 + 3), Record);
        assert_eq!(ProfilerSchedule::parse("2,1,1,2,2").unwrap(), s);
        let e = ProfilerSchedule::parse("1,2,3").unwrap_err();
        assert!(e.to_string().contains("\"1,2,3\""), "{e}");
        let e = ProfilerSchedule::parse("0,0,0,0,1").unwrap_err();
        assert!(e.to_string().contains("active"), "{e}");
    }
}
