//! Stoppers: callbacks that end a run early, cleanly (the batch finishes, its checkpoint event
//! runs, then `FIT_END`). The decisions are pure policies ([`EarlyStopping`],
//! [`Threshold`]) that see a value and a time and answer [`Decision`]; [`MetricStopper`] feeds
//! them a run's metric. [`StopAt`] stops at a fixed time.

use derive_new::new;
use flashover_core::callback::{Callback, Control};
use flashover_core::error::Result;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::{Time, TimeUnit};
use serde_json::{json, Value};

use crate::error::CallbackError;

/// Whether larger or smaller values of a metric are better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Larger is better (accuracy).
    Max,
    /// Smaller is better (loss).
    Min,
}

impl Mode {
    /// The usual mode for a metric name: `Min` when it names a loss, an error or a
    /// perplexity, `Max` otherwise.
    pub fn for_metric(name: &str) -> Mode {
        let n = name.to_ascii_lowercase();
        if ["loss", "error", "perplexity"]
            .iter()
            .any(|w| n.contains(w))
        {
            Mode::Min
        } else {
            Mode::Max
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Max => "max",
            Mode::Min => "min",
        }
    }
}

/// What a stopping policy decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Keep training.
    Continue,
    /// Stop, for the reason given.
    Stop(String),
}

/// Early stopping: stop once the metric has not improved by more than `min_delta` for
/// `patience` (measured in the patience's own unit: epochs, batches, samples, tokens or
/// wall-clock time, `30m`, counting the time a resumed run had already spent).
///
/// Each observation is a value and the time it was taken, in the patience's unit. The first
/// observation is the first best. A later one improves when it beats the best by more than
/// `min_delta` (NaN never improves). The policy stops at the first observation taken at least
/// `patience` after the best one, never earlier.
///
/// ```
/// use flashover_callbacks::stop::{Decision, EarlyStopping, Mode};
/// use flashover_core::time::Time;
/// let mut p = EarlyStopping::new(Mode::Max, Time::Epoch(2), 0.001)?;
/// assert_eq!(p.observe(0.90, 1.0), Decision::Continue);
/// assert_eq!(p.observe(0.95, 2.0), Decision::Continue); // best
/// assert_eq!(p.observe(0.9505, 3.0), Decision::Continue); // within min_delta: no improvement
/// assert!(matches!(p.observe(0.94, 4.0), Decision::Stop(_))); // 2 epochs since the best
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyStopping {
    mode: Mode,
    patience: Time,
    min_delta: f64,
    best: Option<(f64, f64)>,
}

impl EarlyStopping {
    /// A policy with no observations yet. `patience` must be greater than zero and in `ep`,
    /// `ba`, `sp`, `tok` or wall-clock time; `min_delta` finite and `>= 0`.
    pub fn new(mode: Mode, patience: Time, min_delta: f64) -> crate::error::Result<Self> {
        if patience.is_zero() || patience.unit() == TimeUnit::Duration {
            return Err(CallbackError::param(
                "early_stopping",
                "patience",
                patience,
                "a time greater than zero in ep, ba, sp or tok, or a wall-clock time (`2ep`, `500ba`, `30m`)",
            ));
        }
        if !(min_delta.is_finite() && min_delta >= 0.0) {
            return Err(CallbackError::param(
                "early_stopping",
                "min_delta",
                min_delta,
                "a finite number >= 0",
            ));
        }
        Ok(EarlyStopping {
            mode,
            patience,
            min_delta,
            best: None,
        })
    }

    /// The unit observations' times are measured in.
    pub fn unit(&self) -> TimeUnit {
        self.patience.unit()
    }

    /// The best value so far and when it was seen.
    pub fn best(&self) -> Option<(f64, f64)> {
        self.best
    }

    fn improves(&self, value: f64, best: f64) -> bool {
        match self.mode {
            Mode::Max => value > best + self.min_delta,
            Mode::Min => value < best - self.min_delta,
        }
    }

    /// Takes one observation: `value` seen at time `now` (in [`unit`](Self::unit)).
    pub fn observe(&mut self, value: f64, now: f64) -> Decision {
        match self.best {
            None if !value.is_nan() => {
                self.best = Some((value, now));
                Decision::Continue
            }
            Some((best, _)) if !value.is_nan() && self.improves(value, best) => {
                self.best = Some((value, now));
                Decision::Continue
            }
            Some((best, at)) if now - at >= self.patience.value() => Decision::Stop(format!(
                "no improvement of more than {} ({}) for {} since {best} at {at}{}",
                self.min_delta,
                self.mode.name(),
                self.patience,
                self.unit().suffix()
            )),
            _ => Decision::Continue,
        }
    }

    fn state(&self) -> Value {
        json!({ "best": self.best.map(|(v, t)| [v, t]) })
    }

    fn load(&mut self, v: &Value) -> crate::error::Result<()> {
        let bad = |reason: &str| CallbackError::BadState {
            component: "early_stopping",
            reason: format!("{reason}: {v}"),
        };
        self.best = match v.get("best") {
            Some(Value::Null) => None,
            Some(Value::Array(a)) if a.len() == 2 => {
                let f = |x: &Value| x.as_f64().ok_or_else(|| bad("best is not a number pair"));
                Some((f(&a[0])?, f(&a[1])?))
            }
            _ => return Err(bad("expected {\"best\": null or [value, time]}")),
        };
        Ok(())
    }
}

/// Threshold stopping: stop at the first observation that reaches `threshold` (`>=` in
/// `Max` mode, `<=` in `Min` mode).
///
/// ```
/// use flashover_callbacks::stop::{Decision, Mode, Threshold};
/// let p = Threshold::new(Mode::Max, 0.98)?;
/// assert_eq!(p.observe(0.979), Decision::Continue);
/// assert!(matches!(p.observe(0.98), Decision::Stop(_)));
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Threshold {
    mode: Mode,
    threshold: f64,
}

impl Threshold {
    /// A policy stopping at `threshold` (finite).
    pub fn new(mode: Mode, threshold: f64) -> crate::error::Result<Self> {
        if !threshold.is_finite() {
            return Err(CallbackError::param(
                "threshold_stopping",
                "threshold",
                threshold,
                "a finite number",
            ));
        }
        Ok(Threshold { mode, threshold })
    }

    /// Looks at one value.
    pub fn observe(&self, value: f64) -> Decision {
        let reached = match self.mode {
            Mode::Max => value >= self.threshold,
            Mode::Min => value <= self.threshold,
        };
        if reached {
            Decision::Stop(format!(
                "{value} reached the threshold {} ({})",
                self.threshold,
                self.mode.name()
            ))
        } else {
            Decision::Continue
        }
    }
}

/// A stopping policy behind a [`MetricStopper`].
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// See [`EarlyStopping`].
    Early(EarlyStopping),
    /// See [`Threshold`].
    Threshold(Threshold),
}

/// Feeds a run's metric to a stopping [`Policy`] and stops the run when it says so.
///
/// The metric is `train/loss` (the loss of each batch, at `BATCH_END`) or
/// `<evaluator>/<metric>` (read at `EVAL_AFTER_ALL` whenever that evaluator ran), for
/// example `test/accuracy`. A metric the run does not have is an error at its first
/// evaluation, naming the ones it has. The policy's state is saved in checkpoints, so a
/// resumed run stops where the uninterrupted one would have.
///
/// ```
/// use flashover_callbacks::stop::MetricStopper;
/// let early = MetricStopper::parse_early("test/accuracy:patience=2ep:min_delta=0.001")?;
/// let threshold = MetricStopper::parse_threshold("test/accuracy=0.99")?;
/// # let _ = (early, threshold);
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MetricStopper {
    metric: String,
    policy: Policy,
}

impl MetricStopper {
    /// Stops on `metric` when `policy` says so.
    pub fn new(metric: impl Into<String>, policy: Policy) -> crate::error::Result<Self> {
        let metric = metric.into();
        if !metric.contains('/') || metric.starts_with('/') || metric.ends_with('/') {
            return Err(CallbackError::param(
                "metric_stopper",
                "metric",
                format!("{metric:?}"),
                "`train/loss` or `<evaluator>/<metric>` such as `test/accuracy`",
            ));
        }
        Ok(MetricStopper { metric, policy })
    }

    /// Early stopping from `metric[:patience=<time>][:min_delta=<x>][:mode=max|min]`;
    /// defaults: patience `1ep`, min_delta 0, mode from the metric's name ([`Mode::for_metric`]).
    pub fn parse_early(spec: &str) -> crate::error::Result<Self> {
        let mut parts = spec.split(':');
        let metric = parts.next().unwrap_or_default().trim();
        let mut patience = Time::Epoch(1);
        let mut min_delta = 0.0;
        let mut mode = Mode::for_metric(metric);
        for p in parts {
            let (k, v) = p.split_once('=').ok_or_else(|| {
                CallbackError::param(
                    "early_stopping",
                    "spec",
                    format!("{spec:?}"),
                    "metric[:patience=<time>][:min_delta=<number>][:mode=max|min]",
                )
            })?;
            match k.trim() {
                "patience" => {
                    patience = v.trim().parse().map_err(|e| {
                        CallbackError::param("early_stopping", "patience", v, format!("{e}"))
                    })?
                }
                "min_delta" => {
                    min_delta = v.trim().parse().map_err(|_| {
                        CallbackError::param("early_stopping", "min_delta", v, "a number >= 0")
                    })?
                }
                "mode" => mode = parse_mode("early_stopping", v)?,
                other => {
                    return Err(CallbackError::param(
                        "early_stopping",
                        "spec",
                        format!("{other:?}"),
                        "one of patience, min_delta, mode",
                    ))
                }
            }
        }
        Self::new(
            metric,
            Policy::Early(EarlyStopping::new(mode, patience, min_delta)?),
        )
    }

    /// Threshold stopping from `metric=<value>[:mode=max|min]`; mode from the metric's name
    /// by default.
    pub fn parse_threshold(spec: &str) -> crate::error::Result<Self> {
        let mut parts = spec.split(':');
        let head = parts.next().unwrap_or_default();
        let (metric, value) = head.split_once('=').ok_or_else(|| {
            CallbackError::param(
                "threshold_stopping",
                "spec",
                format!("{spec:?}"),
                "metric=<number>[:mode=max|min], such as `test/accuracy=0.99`",
            )
        })?;
        let value: f64 = value.trim().parse().map_err(|_| {
            CallbackError::param("threshold_stopping", "threshold", value, "a finite number")
        })?;
        let mut mode = Mode::for_metric(metric);
        for p in parts {
            match p.split_once('=') {
                Some(("mode", v)) => mode = parse_mode("threshold_stopping", v)?,
                _ => {
                    return Err(CallbackError::param(
                        "threshold_stopping",
                        "spec",
                        format!("{p:?}"),
                        "mode=max or mode=min",
                    ))
                }
            }
        }
        Self::new(
            metric.trim(),
            Policy::Threshold(Threshold::new(mode, value)?),
        )
    }

    /// The metric watched.
    pub fn metric(&self) -> &str {
        &self.metric
    }

    fn observe<S: Setup>(&mut self, value: f64, state: &State<S>, ctl: &mut Control<'_>) {
        let decision = match &mut self.policy {
            Policy::Early(p) => {
                let now = state.progress().elapsed(state.timestamp(), p.unit());
                p.observe(value, now)
            }
            Policy::Threshold(p) => p.observe(value),
        };
        if let Decision::Stop(reason) = decision {
            if state.stop_requested().is_none() && ctl.stop_requested().is_none() {
                ctl.request_stop(format!("{}: {reason}", self.metric));
            }
        }
    }

    fn name_str(&self) -> &'static str {
        match self.policy {
            Policy::Early(_) => "early_stopping",
            Policy::Threshold(_) => "threshold_stopping",
        }
    }
}

fn parse_mode(component: &'static str, v: &str) -> crate::error::Result<Mode> {
    match v.trim() {
        "max" => Ok(Mode::Max),
        "min" => Ok(Mode::Min),
        other => Err(CallbackError::param(
            component,
            "mode",
            format!("{other:?}"),
            "max or min",
        )),
    }
}

impl<S: Setup> Callback<S> for MetricStopper {
    fn name(&self) -> &str {
        self.name_str()
    }

    fn fit_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if let Policy::Early(p) = &self.policy {
            state.check_countable("early_stopping patience", p.patience)?;
        }
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        if self.metric == "train/loss" {
            if let Some(loss) = state.loss_value() {
                self.observe(loss, state, ctl);
            }
        }
        Ok(())
    }

    fn eval_after_all(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        let Some((label, metric)) = self.metric.split_once('/') else {
            return Ok(());
        };
        if label == "train" || !state.evaluated().iter().any(|l| l == label) {
            return Ok(());
        }
        let value = state
            .eval_metrics()
            .get(label)
            .and_then(|m| m.get(metric))
            .copied();
        match value {
            Some(v) => {
                self.observe(v, state, ctl);
                Ok(())
            }
            None => {
                let available: Vec<String> = std::iter::once("train/loss".to_string())
                    .chain(
                        state
                            .eval_metrics()
                            .iter()
                            .flat_map(|(l, m)| m.keys().map(move |k| format!("{l}/{k}"))),
                    )
                    .collect();
                Err(CallbackError::UnknownMetric {
                    component: self.name_str(),
                    metric: self.metric.clone(),
                    available: available.join(", "),
                }
                .into())
            }
        }
    }

    fn state_dict(&self) -> Value {
        match &self.policy {
            Policy::Early(p) => p.state(),
            Policy::Threshold(_) => Value::Null,
        }
    }

    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        if let Policy::Early(p) = &mut self.policy {
            if !state.is_null() {
                p.load(&state)?;
            }
        }
        Ok(())
    }
}

/// Asks training to stop once the run reaches a given time: a count, a fraction of the run,
/// or a wall-clock time (`1h30m`, the run's wall time including what a resumed run had
/// already spent). The stop is clean: the batch finishes, its checkpoint event runs, then
/// `FIT_END` (where a checkpoint saver writes the state to resume from).
///
/// ```
/// use flashover_callbacks::StopAt;
/// use flashover_core::time::Time;
/// let stop = StopAt::new(Time::Batch(100));
/// assert_eq!(stop.at(), Time::Batch(100));
/// ```
#[derive(Debug, Clone, new)]
pub struct StopAt {
    at: Time,
}

impl StopAt {
    /// When training stops.
    pub fn at(&self) -> Time {
        self.at
    }

    fn check<S: Setup>(&self, state: &State<S>, ctl: &mut Control<'_>) {
        let reached = match self.at {
            Time::Wall(at) => state.timestamp().run_wall_time >= at,
            _ if self.at.unit() == TimeUnit::Duration => {
                state.progress().fraction(state.timestamp()) >= self.at.value()
            }
            _ => state
                .timestamp()
                .count(self.at.unit())
                .is_some_and(|c| c as f64 >= self.at.value()),
        };
        if reached && state.stop_requested().is_none() && ctl.stop_requested().is_none() {
            ctl.request_stop(format!("reached {}", self.at));
        }
    }
}

impl<S: Setup> Callback<S> for StopAt {
    fn name(&self) -> &str {
        "stop_at"
    }

    fn fit_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        state.check_countable("stop_at", self.at)
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.check(state, ctl);
        Ok(())
    }

    fn epoch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.check(state, ctl);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the values, the policy never stops before `patience` has passed since the
        /// best observation, and stops at the first observation where it has.
        #[test]
        fn early_stopping_waits_for_patience_and_no_longer(
            values in prop::collection::vec(prop_oneof![0.0f64..1.0, Just(f64::NAN)], 1..60),
            steps in prop::collection::vec(1u64..4, 60),
            patience in 1u64..8,
            min_delta in prop_oneof![Just(0.0), 0.0f64..0.05],
            max in any::<bool>(),
        ) {
            let mode = if max { Mode::Max } else { Mode::Min };
            let mut p = EarlyStopping::new(mode, Time::Batch(patience), min_delta).unwrap();
            let mut now = 0.0;
            // An independent account of the best value and when it was seen.
            let mut best: Option<(f64, f64)> = None;
            for (i, &v) in values.iter().enumerate() {
                now += steps[i] as f64;
                let improves = match best {
                    None => !v.is_nan(),
                    Some((b, _)) => !v.is_nan() && match mode {
                        Mode::Max => v > b + min_delta,
                        Mode::Min => v < b - min_delta,
                    },
                };
                if improves {
                    best = Some((v, now));
                }
                let d = p.observe(v, now);
                let due = !improves && best.is_some_and(|(_, at)| now - at >= patience as f64);
                prop_assert_eq!(matches!(d, Decision::Stop(_)), due, "at {} value {}", now, v);
                if due {
                    break;
                }
            }
        }

        /// Threshold stopping stops exactly at the first value that reaches the threshold.
        #[test]
        fn threshold_stops_exactly_when_crossed(
            values in prop::collection::vec(-1.0f64..2.0, 1..50),
            threshold in -1.0f64..2.0,
            max in any::<bool>(),
        ) {
            let mode = if max { Mode::Max } else { Mode::Min };
            let p = Threshold::new(mode, threshold).unwrap();
            let first = values.iter().position(|&v| if max { v >= threshold } else { v <= threshold });
            let stopped = values.iter().position(|&v| matches!(p.observe(v), Decision::Stop(_)));
            prop_assert_eq!(first, stopped);
        }
    }

    #[test]
    fn bad_settings_name_the_value() {
        let e = EarlyStopping::new(Mode::Max, Time::Epoch(0), 0.0).unwrap_err();
        assert!(e.to_string().contains("0ep"), "{e}");
        let e = EarlyStopping::new(Mode::Max, Time::Duration(0.5), 0.0).unwrap_err();
        assert!(e.to_string().contains("0.5dur"), "{e}");
        let e = EarlyStopping::new(Mode::Min, Time::Batch(3), -1.0).unwrap_err();
        assert!(e.to_string().contains("-1"), "{e}");
        assert!(Threshold::new(Mode::Max, f64::NAN).is_err());
        let e = MetricStopper::parse_early("accuracy:patience=2ep").unwrap_err();
        assert!(e.to_string().contains("\"accuracy\""), "{e}");
        let e = MetricStopper::parse_early("test/accuracy:patience=2parsecs").unwrap_err();
        assert!(e.to_string().contains("2parsecs"), "{e}");
        let e = MetricStopper::parse_early("test/accuracy:wait=2").unwrap_err();
        assert!(e.to_string().contains("\"wait\""), "{e}");
        let e = MetricStopper::parse_threshold("test/accuracy").unwrap_err();
        assert!(e.to_string().contains("metric=<number>"), "{e}");
        let e = MetricStopper::parse_threshold("test/accuracy=0.9:mode=up").unwrap_err();
        assert!(e.to_string().contains("\"up\""), "{e}");
    }

    #[test]
    fn specs_parse_with_defaults() {
        let s = MetricStopper::parse_early("test/loss").unwrap();
        assert_eq!(
            s.policy,
            Policy::Early(EarlyStopping::new(Mode::Min, Time::Epoch(1), 0.0).unwrap())
        );
        let s = MetricStopper::parse_early("test/accuracy:patience=300ba:min_delta=0.01").unwrap();
        assert_eq!(
            s.policy,
            Policy::Early(EarlyStopping::new(Mode::Max, Time::Batch(300), 0.01).unwrap())
        );
        let s = MetricStopper::parse_threshold("train/loss=0.05").unwrap();
        assert_eq!(
            s.policy,
            Policy::Threshold(Threshold::new(Mode::Min, 0.05).unwrap())
        );
    }

    #[test]
    fn patience_in_wall_clock_time_counts_seconds() {
        let mut p = EarlyStopping::new(Mode::Min, "30s".parse().unwrap(), 0.0).unwrap();
        assert_eq!(p.unit(), TimeUnit::Wall);
        assert_eq!(p.observe(1.0, 10.0), Decision::Continue);
        assert_eq!(p.observe(1.1, 39.9), Decision::Continue);
        match p.observe(1.2, 40.0) {
            Decision::Stop(why) => assert!(why.contains("for 30s since 1 at 10s"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn early_stopping_state_round_trips() {
        let mut p = EarlyStopping::new(Mode::Max, Time::Epoch(2), 0.0).unwrap();
        p.observe(0.5, 1.0);
        let saved = p.state();
        let mut q = EarlyStopping::new(Mode::Max, Time::Epoch(2), 0.0).unwrap();
        q.load(&saved).unwrap();
        assert_eq!(p, q);
        assert!(q.load(&json!({"best": "x"})).is_err());
    }
}
