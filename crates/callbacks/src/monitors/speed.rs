//! Throughput and time-left monitors. Both read a [`Clock`] (the real one by default) and
//! leave evaluation time out of their windows, so that a figure describes training alone.

use std::collections::VecDeque;
use std::time::Duration;

use flashover_core::callback::{Callback, Control};
use flashover_core::error::Result;
use flashover_core::model::TrainModel;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::clock::{Clock, SystemClock};
use crate::error::CallbackError;

/// One reading: training time (evaluation excluded) and the counters at that moment.
#[derive(Debug, Clone, Copy)]
struct Mark {
    t: Duration,
    batch: u64,
    sample: u64,
    token: u64,
    fraction: f64,
}

/// A training-time clock: the clock minus the evaluation time seen so far, and a window of
/// the last `size + 1` marks (so `size` batches between its ends).
struct TrainClock {
    clock: Box<dyn Clock>,
    eval_started: Option<Duration>,
    excluded: Duration,
    marks: VecDeque<Mark>,
    size: usize,
}

impl TrainClock {
    fn new(clock: Box<dyn Clock>, size: usize) -> Self {
        TrainClock {
            clock,
            eval_started: None,
            excluded: Duration::ZERO,
            marks: VecDeque::with_capacity(size + 1),
            size,
        }
    }

    fn now(&self) -> Duration {
        self.clock.now().saturating_sub(self.excluded)
    }

    fn mark<S: Setup>(&mut self, state: &State<S>) {
        let ts = state.timestamp();
        let mark = Mark {
            t: self.now(),
            batch: ts.batch,
            sample: ts.sample,
            token: ts.token,
            fraction: state.progress().fraction(ts),
        };
        if self.marks.len() > self.size {
            self.marks.pop_front();
        }
        self.marks.push_back(mark);
    }

    /// First and last marks of the window, when they are apart in time.
    fn span(&self) -> Option<(Mark, Mark, f64)> {
        let (a, b) = (*self.marks.front()?, *self.marks.back()?);
        let secs = (b.t - a.t).as_secs_f64();
        (self.marks.len() >= 2 && secs > 0.0).then_some((a, b, secs))
    }

    /// The time between the last two marks.
    fn last_interval(&self) -> Option<Duration> {
        let n = self.marks.len();
        (n >= 2).then(|| self.marks[n - 1].t - self.marks[n - 2].t)
    }

    fn eval_before(&mut self) {
        self.eval_started = Some(self.clock.now());
    }

    fn eval_after(&mut self) {
        if let Some(s) = self.eval_started.take() {
            self.excluded += self.clock.now().saturating_sub(s);
        }
    }
}

/// The `Callback` methods that take evaluation time out of a monitor's `clock`.
macro_rules! leave_out_evaluation {
    () => {
        fn eval_before_all(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            self.clock.eval_before();
            Ok(())
        }

        fn eval_after_all(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            self.clock.eval_after();
            Ok(())
        }
    };
}

fn check_window(component: &'static str, size: usize) -> crate::error::Result<usize> {
    if size == 0 {
        return Err(CallbackError::param(
            component,
            "window_size",
            size,
            "at least 1 batch",
        ));
    }
    Ok(size)
}

/// Logs training throughput over the last `window_size` batches (Composer's default: 100):
/// `throughput/batches_per_sec`, `throughput/samples_per_sec`, `throughput/tokens_per_sec`
/// (when batches count tokens), the wall time of the last batch `time/batch_seconds`, and,
/// when the model reports [`flops_per_sample`](TrainModel::flops_per_sample),
/// `throughput/flops_per_sec` and, given the device's peak, `throughput/mfu` (model FLOPs
/// utilisation: achieved model FLOPs per second over the peak).
///
/// The window starts at `FIT_START` and leaves out time spent in evaluation.
///
/// ```
/// use flashover_callbacks::monitors::SpeedMonitor;
/// // 100-batch window; MFU against a 1 TFLOP/s device.
/// let speed = SpeedMonitor::new(100)?.with_peak_flops(1e12)?;
/// # let _ = speed;
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct SpeedMonitor {
    clock: TrainClock,
    peak_flops: Option<f64>,
}

impl SpeedMonitor {
    /// Throughput over the last `window_size` batches (at least 1).
    pub fn new(window_size: usize) -> crate::error::Result<Self> {
        let size = check_window("speed_monitor", window_size)?;
        Ok(SpeedMonitor {
            clock: TrainClock::new(Box::new(SystemClock::default()), size),
            peak_flops: None,
        })
    }

    /// Reads time from `clock` instead of the system's (for tests and simulations).
    pub fn with_clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock.clock = Box::new(clock);
        self
    }

    /// The device's peak FLOPs per second, which `throughput/mfu` divides by.
    pub fn with_peak_flops(mut self, peak: f64) -> crate::error::Result<Self> {
        if !(peak.is_finite() && peak > 0.0) {
            return Err(CallbackError::param(
                "speed_monitor",
                "peak_flops",
                peak,
                "a finite number of FLOPs per second > 0",
            ));
        }
        self.peak_flops = Some(peak);
        Ok(self)
    }
}

impl<S: Setup> Callback<S> for SpeedMonitor {
    fn name(&self) -> &str {
        "speed_monitor"
    }

    fn fit_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.clock.marks.clear();
        self.clock.mark(state);
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.clock.mark(state);
        let mut values: Vec<(&str, f64)> = Vec::with_capacity(6);
        if let Some(d) = self.clock.last_interval() {
            values.push(("time/batch_seconds", d.as_secs_f64()));
        }
        if let Some((a, b, secs)) = self.clock.span() {
            let samples_per_sec = (b.sample - a.sample) as f64 / secs;
            values.push((
                "throughput/batches_per_sec",
                (b.batch - a.batch) as f64 / secs,
            ));
            values.push(("throughput/samples_per_sec", samples_per_sec));
            if b.token > a.token {
                values.push((
                    "throughput/tokens_per_sec",
                    (b.token - a.token) as f64 / secs,
                ));
            }
            if let Some(fps) = state.model().flops_per_sample() {
                let flops = fps * samples_per_sec;
                values.push(("throughput/flops_per_sec", flops));
                if let Some(peak) = self.peak_flops {
                    values.push(("throughput/mfu", flops / peak));
                }
            }
        }
        if values.is_empty() {
            return Ok(());
        }
        ctl.logger().log_metrics(state.timestamp(), &values)
    }

    leave_out_evaluation!();
}

/// Estimates the training time left: the fraction of `max_duration` still to go (in whatever
/// unit `max_duration` is given: epochs, batches, samples or tokens) divided by the rate at
/// which the fraction grew over the last `window_size` batches. Logs
/// `time/remaining_estimate_seconds` and `time/elapsed_seconds` (training time of this fit
/// call). Evaluation time is left out of both.
///
/// ```
/// use flashover_callbacks::monitors::RuntimeEstimator;
/// let eta = RuntimeEstimator::new(50)?;
/// # let _ = eta;
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct RuntimeEstimator {
    clock: TrainClock,
    start: Duration,
}

impl RuntimeEstimator {
    /// Estimates from the last `window_size` batches (at least 1).
    pub fn new(window_size: usize) -> crate::error::Result<Self> {
        let size = check_window("runtime_estimator", window_size)?;
        Ok(RuntimeEstimator {
            clock: TrainClock::new(Box::new(SystemClock::default()), size),
            start: Duration::ZERO,
        })
    }

    /// Reads time from `clock` instead of the system's.
    pub fn with_clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock.clock = Box::new(clock);
        self
    }
}

impl<S: Setup> Callback<S> for RuntimeEstimator {
    fn name(&self) -> &str {
        "runtime_estimator"
    }

    fn fit_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.clock.marks.clear();
        self.clock.mark(state);
        self.start = self.clock.now();
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.clock.mark(state);
        let elapsed = (self.clock.now() - self.start).as_secs_f64();
        let mut values = vec![("time/elapsed_seconds", elapsed)];
        if let Some((a, b, secs)) = self.clock.span() {
            let rate = (b.fraction - a.fraction) / secs;
            if rate > 0.0 {
                values.push((
                    "time/remaining_estimate_seconds",
                    (1.0 - b.fraction).max(0.0) / rate,
                ));
            }
        }
        ctl.logger().log_metrics(state.timestamp(), &values)
    }

    leave_out_evaluation!();
}
