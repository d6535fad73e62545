//! Training time: units, durations parsed from strings, and the running [`Timestamp`].
//!
//! This module owns the arithmetic of "how far along is the run". It never reads a clock
//! itself except through [`Timestamp`]'s wall-time fields, which the trainer fills in.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// A unit in which training time is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimeUnit {
    /// Whole passes over the training data (`ep`).
    Epoch,
    /// Optimizer steps (`ba`); one batch may be split into microbatches.
    Batch,
    /// Training samples seen (`sp`).
    Sample,
    /// Tokens seen (`tok`), as reported by the batch type.
    Token,
    /// Fraction of `max_duration` (`dur`), from 0 to 1.
    Duration,
}

impl TimeUnit {
    /// Every unit, in the order their suffixes are listed in messages.
    pub const ALL: [TimeUnit; 5] = [
        TimeUnit::Epoch,
        TimeUnit::Batch,
        TimeUnit::Sample,
        TimeUnit::Token,
        TimeUnit::Duration,
    ];

    /// The suffix used in time strings.
    pub fn suffix(self) -> &'static str {
        match self {
            TimeUnit::Epoch => "ep",
            TimeUnit::Batch => "ba",
            TimeUnit::Sample => "sp",
            TimeUnit::Token => "tok",
            TimeUnit::Duration => "dur",
        }
    }
}

impl fmt::Display for TimeUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

/// An amount of training time: a count of epochs, batches, samples or tokens, or a fraction of
/// the whole run.
///
/// Counts are whole numbers; fractions are finite and non-negative. Parse one from a string:
///
/// ```
/// use flashover_core::time::Time;
/// let t: Time = "1e6tok".parse().unwrap();
/// assert_eq!(t, Time::Token(1_000_000));
/// assert_eq!(t.to_string(), "1000000tok");
/// assert!("3 parsecs".parse::<Time>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Time {
    /// Epochs.
    Epoch(u64),
    /// Batches (optimizer steps).
    Batch(u64),
    /// Samples.
    Sample(u64),
    /// Tokens.
    Token(u64),
    /// Fraction of `max_duration`.
    Duration(f64),
}

/// Largest count accepted in a time string: above 2^53 an `f64` no longer holds every integer,
/// so the parsed count could differ from what the user wrote.
const MAX_EXACT_COUNT: f64 = 9_007_199_254_740_992.0;

impl Time {
    /// The unit of this time.
    pub fn unit(&self) -> TimeUnit {
        match self {
            Time::Epoch(_) => TimeUnit::Epoch,
            Time::Batch(_) => TimeUnit::Batch,
            Time::Sample(_) => TimeUnit::Sample,
            Time::Token(_) => TimeUnit::Token,
            Time::Duration(_) => TimeUnit::Duration,
        }
    }

    /// The numeric value in its own unit.
    pub fn value(&self) -> f64 {
        match *self {
            Time::Epoch(v) | Time::Batch(v) | Time::Sample(v) | Time::Token(v) => v as f64,
            Time::Duration(v) => v,
        }
    }

    /// Builds a time from a unit and a value, checking the value as a parser would.
    pub fn new(unit: TimeUnit, value: f64) -> Result<Time> {
        let input = format!("{value}{}", unit.suffix());
        Self::from_parts(&input, unit, value)
    }

    fn from_parts(input: &str, unit: TimeUnit, value: f64) -> Result<Time> {
        let bad = |reason: &str| CoreError::InvalidTime {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        if !value.is_finite() {
            return Err(bad("the number is not finite"));
        }
        if value < 0.0 {
            return Err(bad("time cannot be negative"));
        }
        if unit == TimeUnit::Duration {
            return Ok(Time::Duration(value));
        }
        if value.fract() != 0.0 {
            return Err(bad("epochs, batches, samples and tokens are whole numbers"));
        }
        if value > MAX_EXACT_COUNT {
            return Err(bad("the count is larger than 2^53"));
        }
        let v = value as u64;
        Ok(match unit {
            TimeUnit::Epoch => Time::Epoch(v),
            TimeUnit::Batch => Time::Batch(v),
            TimeUnit::Sample => Time::Sample(v),
            TimeUnit::Token => Time::Token(v),
            TimeUnit::Duration => unreachable!("handled above"),
        })
    }

    /// Multiplies a count by `ratio` (the scale-schedule ratio), rounding to the nearest whole
    /// count; a fraction of the run is left as it is, since the run itself is what gets scaled.
    pub fn scaled(&self, ratio: f64) -> Time {
        let scale = |v: u64| ((v as f64) * ratio).round().max(0.0) as u64;
        match *self {
            Time::Epoch(v) => Time::Epoch(scale(v)),
            Time::Batch(v) => Time::Batch(scale(v)),
            Time::Sample(v) => Time::Sample(scale(v)),
            Time::Token(v) => Time::Token(scale(v)),
            Time::Duration(v) => Time::Duration(v),
        }
    }

    /// Whether this is zero in its unit.
    pub fn is_zero(&self) -> bool {
        self.value() == 0.0
    }
}

impl FromStr for Time {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Time> {
        let input = s.trim();
        let bad = |reason: String| CoreError::InvalidTime {
            input: s.to_string(),
            reason,
        };
        // The longest suffix is matched first so that "tok" is never read as a number ending in
        // "ok"; the number itself may contain an exponent ("1e6tok").
        let unit = TimeUnit::ALL
            .iter()
            .copied()
            .find(|u| input.ends_with(u.suffix()))
            .ok_or_else(|| bad("no known unit at the end".to_string()))?;
        let number = input[..input.len() - unit.suffix().len()].trim();
        if number.is_empty() {
            return Err(bad("no number before the unit".to_string()));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| bad(format!("{number:?} is not a number")))?;
        Self::from_parts(s, unit, value)
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Time::Duration(v) => write!(f, "{v}dur"),
            other => write!(f, "{}{}", other.value() as u64, other.unit().suffix()),
        }
    }
}

/// Where a run stands: counts since the start of training and since the start of the current
/// epoch, and wall time. Everything a checkpoint needs to know about "when" lives here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timestamp {
    /// Completed epochs.
    pub epoch: u64,
    /// Completed batches (optimizer steps) since the start.
    pub batch: u64,
    /// Samples trained on since the start.
    pub sample: u64,
    /// Tokens trained on since the start.
    pub token: u64,
    /// Completed batches in the current epoch.
    pub batch_in_epoch: u64,
    /// Samples in the current epoch.
    pub sample_in_epoch: u64,
    /// Tokens in the current epoch.
    pub token_in_epoch: u64,
    /// Wall time spent training, summed over `fit` calls.
    pub total_wall_time: Duration,
    /// Wall time of the current epoch so far.
    pub epoch_wall_time: Duration,
    /// Wall time of the last batch.
    pub batch_wall_time: Duration,
}

impl Timestamp {
    /// Records one finished batch.
    pub fn advance_batch(&mut self, samples: u64, tokens: u64, wall: Duration) {
        self.batch += 1;
        self.batch_in_epoch += 1;
        self.sample += samples;
        self.sample_in_epoch += samples;
        self.token += tokens;
        self.token_in_epoch += tokens;
        self.batch_wall_time = wall;
        self.epoch_wall_time += wall;
        self.total_wall_time += wall;
    }

    /// Records the end of an epoch and resets the in-epoch counters.
    pub fn advance_epoch(&mut self) {
        self.epoch += 1;
        self.batch_in_epoch = 0;
        self.sample_in_epoch = 0;
        self.token_in_epoch = 0;
        self.epoch_wall_time = Duration::ZERO;
    }

    /// The whole-unit count in `unit`; `None` for [`TimeUnit::Duration`], which needs the
    /// length of the run (see [`Progress`]).
    pub fn count(&self, unit: TimeUnit) -> Option<u64> {
        match unit {
            TimeUnit::Epoch => Some(self.epoch),
            TimeUnit::Batch => Some(self.batch),
            TimeUnit::Sample => Some(self.sample),
            TimeUnit::Token => Some(self.token),
            TimeUnit::Duration => None,
        }
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {} batch {} (batch {} of the epoch), {} samples, {} tokens",
            self.epoch, self.batch, self.batch_in_epoch, self.sample, self.token
        )
    }
}

/// How far along a run is, measured against its `max_duration`. Built from the timestamp and
/// the shape of an epoch, so that times in any unit compare with any other where a conversion
/// exists (epochs, batches and samples convert; tokens only compare with tokens).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Batches in one epoch of the training loader.
    pub batches_per_epoch: u64,
    /// Samples in one epoch of the training loader.
    pub samples_per_epoch: u64,
    /// The run's length.
    pub max_duration: Time,
}

impl Progress {
    /// Elapsed time in `unit`, as a real number: an epoch part-way through counts as a
    /// fraction, so that epoch-based schedules move smoothly from batch to batch.
    pub fn elapsed(&self, ts: &Timestamp, unit: TimeUnit) -> f64 {
        match unit {
            TimeUnit::Epoch => {
                ts.epoch as f64 + ts.batch_in_epoch as f64 / self.batches_per_epoch.max(1) as f64
            }
            TimeUnit::Batch => ts.batch as f64,
            TimeUnit::Sample => ts.sample as f64,
            TimeUnit::Token => ts.token as f64,
            TimeUnit::Duration => self.fraction(ts),
        }
    }

    /// Fraction of `max_duration` done, in `[0, inf)`; 0 for an empty `max_duration`
    /// counted in itself would be meaningless, so a zero-length run reports 1.
    pub fn fraction(&self, ts: &Timestamp) -> f64 {
        let total = self.max_duration.value();
        match self.max_duration.unit() {
            TimeUnit::Duration => 1.0,
            unit if total == 0.0 => {
                let _ = unit;
                1.0
            }
            unit => self.elapsed(ts, unit) / total,
        }
    }

    /// Whether the run has reached its `max_duration`.
    pub fn is_done(&self, ts: &Timestamp) -> bool {
        self.fraction(ts) >= 1.0
    }

    /// Converts a time into batches (a real number), where a conversion exists: epochs by
    /// the epoch length, samples by the mean batch size, fractions by the run's length.
    /// Tokens have no fixed rate and give `None`.
    pub fn to_batches(&self, t: Time) -> Option<f64> {
        let bpe = self.batches_per_epoch as f64;
        match t {
            Time::Epoch(v) => Some(v as f64 * bpe),
            Time::Batch(v) => Some(v as f64),
            Time::Sample(v) => Some(v as f64 * bpe / self.samples_per_epoch.max(1) as f64),
            Time::Token(_) => None,
            Time::Duration(f) => match self.max_duration {
                Time::Duration(_) => None,
                max => self.to_batches(max).map(|b| b * f),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!("2ep".parse::<Time>().unwrap(), Time::Epoch(2));
        assert_eq!("500ba".parse::<Time>().unwrap(), Time::Batch(500));
        assert_eq!(" 64sp ".parse::<Time>().unwrap(), Time::Sample(64));
        assert_eq!("1e6tok".parse::<Time>().unwrap(), Time::Token(1_000_000));
        assert_eq!("0.3dur".parse::<Time>().unwrap(), Time::Duration(0.3));
    }

    #[test]
    fn rejects_bad_strings_with_the_input_named() {
        for bad in [
            "",
            "ep",
            "2",
            "2 parsecs",
            "2.5ep",
            "-1ba",
            "nanba",
            "infsp",
            "1e30ba",
            "2eps",
        ] {
            let err = bad.parse::<Time>().unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, CoreError::InvalidTime { .. }), "{bad}: {msg}");
            assert!(
                msg.contains(&format!("{bad:?}")),
                "message must quote the input: {msg}"
            );
            assert!(
                msg.contains("ep, ba, sp, tok, dur"),
                "message must list the units: {msg}"
            );
        }
    }

    #[test]
    fn scaling_rounds_counts_and_keeps_fractions() {
        assert_eq!(Time::Epoch(10).scaled(0.25), Time::Epoch(3));
        assert_eq!(Time::Batch(100).scaled(1.5), Time::Batch(150));
        assert_eq!(Time::Duration(0.5).scaled(0.1), Time::Duration(0.5));
    }

    #[test]
    fn progress_converts_between_units() {
        let p = Progress {
            batches_per_epoch: 10,
            samples_per_epoch: 640,
            max_duration: Time::Epoch(2),
        };
        let mut ts = Timestamp::default();
        for _ in 0..5 {
            ts.advance_batch(64, 0, Duration::ZERO);
        }
        assert_eq!(p.elapsed(&ts, TimeUnit::Epoch), 0.5);
        assert_eq!(p.fraction(&ts), 0.25);
        assert_eq!(p.to_batches(Time::Sample(128)), Some(2.0));
        assert_eq!(p.to_batches(Time::Duration(0.5)), Some(10.0));
        assert_eq!(p.to_batches(Time::Token(5)), None);
        assert!(!p.is_done(&ts));
        for _ in 0..5 {
            ts.advance_batch(64, 0, Duration::ZERO);
        }
        ts.advance_epoch();
        for _ in 0..10 {
            ts.advance_batch(64, 0, Duration::ZERO);
        }
        assert!(p.is_done(&ts));
    }

    fn unit_strategy() -> impl Strategy<Value = TimeUnit> {
        prop::sample::select(TimeUnit::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn counts_round_trip_through_strings(v in 0u64..(1u64 << 53), unit in unit_strategy()) {
            prop_assume!(unit != TimeUnit::Duration);
            let t = Time::new(unit, v as f64).unwrap();
            let back: Time = t.to_string().parse().unwrap();
            prop_assert_eq!(back, t);
            prop_assert_eq!(back.value(), v as f64);
        }

        #[test]
        fn fractions_round_trip_through_strings(v in 0.0f64..1e6) {
            let t = Time::Duration(v);
            let back: Time = t.to_string().parse().unwrap();
            prop_assert_eq!(back, t);
        }

        #[test]
        fn unknown_units_are_errors(v in 0u64..10_000, suffix in "[a-z]{1,4}") {
            prop_assume!(!TimeUnit::ALL.iter().any(|u| suffix.ends_with(u.suffix())));
            let s = format!("{v}{suffix}");
            let err = s.parse::<Time>().unwrap_err();
            let is_invalid_time = matches!(err, CoreError::InvalidTime { .. });
            prop_assert!(is_invalid_time);
        }

        #[test]
        fn fraction_grows_with_each_batch(bpe in 1u64..50, epochs in 1u64..5) {
            let p = Progress { batches_per_epoch: bpe, samples_per_epoch: bpe * 8, max_duration: Time::Epoch(epochs) };
            let mut ts = Timestamp::default();
            let mut last = p.fraction(&ts);
            prop_assert_eq!(last, 0.0);
            for _ in 0..epochs {
                for _ in 0..bpe {
                    ts.advance_batch(8, 0, Duration::ZERO);
                    let f = p.fraction(&ts);
                    prop_assert!(f > last);
                    last = f;
                }
                ts.advance_epoch();
            }
            prop_assert!((p.fraction(&ts) - 1.0).abs() < 1e-12);
            prop_assert!(p.is_done(&ts));
        }
    }
}
