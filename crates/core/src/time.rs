//! Training time: units, durations parsed from strings, their arithmetic, and the running
//! [`Timestamp`].
//!
//! This module owns the arithmetic of "how far along is the run". It never reads a clock
//! itself: the trainer fills in [`Timestamp`]'s wall-time fields.

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
    /// Wall-clock time (`1h30m`, `45m`, `90s`), measured by [`Timestamp::run_wall_time`].
    Wall,
}

impl TimeUnit {
    /// Every unit, in the order their suffixes are listed in messages.
    pub const ALL: [TimeUnit; 6] = [
        TimeUnit::Epoch,
        TimeUnit::Batch,
        TimeUnit::Sample,
        TimeUnit::Token,
        TimeUnit::Duration,
        TimeUnit::Wall,
    ];

    /// The suffix used in time strings; wall-clock times combine `h`, `m` and `s` (this
    /// returns `s`, the unit of [`Time::value`] for them).
    pub fn suffix(self) -> &'static str {
        match self {
            TimeUnit::Epoch => "ep",
            TimeUnit::Batch => "ba",
            TimeUnit::Sample => "sp",
            TimeUnit::Token => "tok",
            TimeUnit::Duration => "dur",
            TimeUnit::Wall => "s",
        }
    }

    /// Whether times in this unit are whole counts (epochs, batches, samples, tokens).
    pub fn is_count(self) -> bool {
        !matches!(self, TimeUnit::Duration | TimeUnit::Wall)
    }

    /// The count units and the fraction unit, whose suffixes end a time string.
    const SUFFIXED: [TimeUnit; 5] = [
        TimeUnit::Epoch,
        TimeUnit::Batch,
        TimeUnit::Sample,
        TimeUnit::Token,
        TimeUnit::Duration,
    ];
}

impl fmt::Display for TimeUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

/// An amount of training time: a count of epochs, batches, samples or tokens, a fraction of
/// the whole run, or wall-clock time.
///
/// Counts are whole numbers; fractions are finite and non-negative. Parse one from a string:
/// units are case-insensitive, `_` may separate digits, and wall-clock times combine hours,
/// minutes and seconds (or are Composer's `<n>sec`).
///
/// ```
/// use std::time::Duration;
/// use flashover_core::time::Time;
/// let t: Time = "1e6tok".parse().unwrap();
/// assert_eq!(t, Time::Token(1_000_000));
/// assert_eq!(t.to_string(), "1000000tok");
/// assert_eq!("4_000TOK".parse::<Time>().unwrap(), Time::Token(4000));
/// assert_eq!("1h30m".parse::<Time>().unwrap(), Time::Wall(Duration::from_secs(5400)));
/// // Composer's spelling of seconds.
/// assert_eq!("3600sec".parse::<Time>().unwrap(), Time::Wall(Duration::from_secs(3600)));
/// assert!("1h60m".parse::<Time>().is_err()); // minutes after hours go 0-59
/// assert!("3 parsecs".parse::<Time>().is_err());
/// ```
///
/// Times of one unit add, subtract and divide into a ratio; any time multiplies or divides
/// by a number (counts round to the nearest whole count, as the scale-schedule ratio does).
/// Each operation returns a `Result`: mixing units, a negative result or a division by zero
/// is a typed error, never a panic.
///
/// ```
/// use flashover_core::time::Time;
/// use flashover_core::CoreError;
/// let warmup = (Time::Batch(1000) * 0.1)?;
/// assert_eq!(warmup, Time::Batch(100));
/// assert_eq!((Time::Epoch(3) + Time::Epoch(2))?, Time::Epoch(5));
/// assert_eq!((Time::Batch(250) / Time::Batch(1000))?, 0.25);
/// assert!(matches!(Time::Epoch(1) + Time::Batch(5), Err(CoreError::TimeUnitMismatch { .. })));
/// assert!((Time::Batch(5) - Time::Batch(6)).is_err());
/// # Ok::<(), CoreError>(())
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
    /// Wall-clock time.
    Wall(Duration),
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
            Time::Wall(_) => TimeUnit::Wall,
        }
    }

    /// The numeric value in its own unit (seconds for wall-clock time).
    pub fn value(&self) -> f64 {
        match *self {
            Time::Epoch(v) | Time::Batch(v) | Time::Sample(v) | Time::Token(v) => v as f64,
            Time::Duration(v) => v,
            Time::Wall(d) => d.as_secs_f64(),
        }
    }

    /// Builds a time from a unit and a value (seconds for wall-clock time), checking the
    /// value as a parser would.
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
        if unit == TimeUnit::Wall {
            return Duration::try_from_secs_f64(value)
                .map(Time::Wall)
                .map_err(|_| bad("the wall-clock time is too long"));
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
            // Invariant: both were returned above, before the count checks.
            TimeUnit::Duration | TimeUnit::Wall => unreachable!("handled above"),
        })
    }

    /// Multiplies a count by `ratio` (the scale-schedule ratio), rounding to the nearest whole
    /// count; a fraction of the run is left as it is, since the run itself is what gets scaled;
    /// a wall-clock time is scaled like a count.
    pub fn scaled(&self, ratio: f64) -> Time {
        let scale = |v: u64| ((v as f64) * ratio).round().max(0.0) as u64;
        match *self {
            Time::Epoch(v) => Time::Epoch(scale(v)),
            Time::Batch(v) => Time::Batch(scale(v)),
            Time::Sample(v) => Time::Sample(scale(v)),
            Time::Token(v) => Time::Token(scale(v)),
            Time::Duration(v) => Time::Duration(v),
            // Too long to represent: as good as no limit.
            Time::Wall(d) => Time::Wall(
                Duration::try_from_secs_f64(d.as_secs_f64() * ratio.max(0.0))
                    .unwrap_or(Duration::MAX),
            ),
        }
    }

    /// `self / other` for two times of one unit: how many `other`s fit in `self`.
    pub fn ratio(self, other: Time) -> Result<f64> {
        self.same_unit("/", other)?;
        if other.is_zero() {
            return Err(CoreError::InvalidTime {
                input: format!("{self} / {other}"),
                reason: "division by a zero time".into(),
            });
        }
        Ok(match (self, other) {
            (Time::Wall(a), Time::Wall(b)) => a.as_secs_f64() / b.as_secs_f64(),
            (a, b) => a.value() / b.value(),
        })
    }

    fn same_unit(self, op: &'static str, other: Time) -> Result<()> {
        if self.unit() == other.unit() {
            Ok(())
        } else {
            Err(CoreError::TimeUnitMismatch {
                op,
                left: self.to_string(),
                right: other.to_string(),
            })
        }
    }

    /// The time of this unit whose value is `value`, for the result of an operation written as
    /// `expression` (named in the error when the value is negative or not finite).
    fn result_of(self, expression: String, value: f64) -> Result<Time> {
        let value = if self.unit().is_count() {
            value.round()
        } else {
            value
        };
        Self::from_parts(&expression, self.unit(), value)
    }

    /// Whether this is zero in its unit.
    pub fn is_zero(&self) -> bool {
        match self {
            Time::Wall(d) => d.is_zero(),
            other => other.value() == 0.0,
        }
    }
}

impl std::ops::Add for Time {
    type Output = Result<Time>;

    /// The sum of two times of one unit.
    fn add(self, other: Time) -> Result<Time> {
        self.same_unit("+", other)?;
        match (self, other) {
            (Time::Wall(a), Time::Wall(b)) => {
                a.checked_add(b)
                    .map(Time::Wall)
                    .ok_or_else(|| CoreError::InvalidTime {
                        input: format!("{self} + {other}"),
                        reason: "the wall-clock time is too long".into(),
                    })
            }
            _ => self.result_of(format!("{self} + {other}"), self.value() + other.value()),
        }
    }
}

impl std::ops::Sub for Time {
    type Output = Result<Time>;

    /// The difference of two times of one unit; a negative difference is an error.
    fn sub(self, other: Time) -> Result<Time> {
        self.same_unit("-", other)?;
        match (self, other) {
            (Time::Wall(a), Time::Wall(b)) => {
                a.checked_sub(b)
                    .map(Time::Wall)
                    .ok_or_else(|| CoreError::InvalidTime {
                        input: format!("{self} - {other}"),
                        reason: "time cannot be negative".into(),
                    })
            }
            _ => self.result_of(format!("{self} - {other}"), self.value() - other.value()),
        }
    }
}

impl std::ops::Mul<f64> for Time {
    type Output = Result<Time>;

    /// The time `factor` times as long (counts rounded to the nearest whole count).
    fn mul(self, factor: f64) -> Result<Time> {
        self.result_of(format!("{self} * {factor}"), self.value() * factor)
    }
}

impl std::ops::Div<f64> for Time {
    type Output = Result<Time>;

    /// The time `divisor` times shorter (counts rounded to the nearest whole count).
    fn div(self, divisor: f64) -> Result<Time> {
        if divisor == 0.0 {
            return Err(CoreError::InvalidTime {
                input: format!("{self} / {divisor}"),
                reason: "division by zero".into(),
            });
        }
        self.result_of(format!("{self} / {divisor}"), self.value() / divisor)
    }
}

impl std::ops::Div for Time {
    type Output = Result<f64>;

    /// The ratio of two times of one unit (see [`Time::ratio`]).
    fn div(self, other: Time) -> Result<f64> {
        self.ratio(other)
    }
}

/// Removes `_` digit separators from the number part of a time string; a separator must sit
/// between two digits.
fn strip_separators(number: &str) -> std::result::Result<String, String> {
    let b = number.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        if c == b'_' {
            let digit = |j: Option<usize>| j.and_then(|j| b.get(j)).is_some_and(u8::is_ascii_digit);
            if !digit(i.checked_sub(1)) || !digit(Some(i + 1)) {
                return Err(format!("{number:?}: `_` may only separate two digits"));
            }
        }
    }
    Ok(number.replace('_', ""))
}

/// Parses a wall-clock time: one or more `<number><unit>` groups with units `h`, `m`, `s`, in
/// that order, each at most once (`1h30m`, `45m`, `90s`, `1.5h`). Whole seconds and their
/// decimals are kept exactly (to the nanosecond), so a formatted time parses back to itself.
///
/// A part that follows a larger one is below 60 (`1h59m`, not `1h60m`: Composer's `XhYmZs`
/// reads its parts as a clock does); a lone part may be any size (`90s`, `120m`, `36h`), which
/// Composer's strptime refuses although it is unambiguous.
fn parse_wall(input: &str) -> std::result::Result<Duration, String> {
    let mut rest = input;
    let mut total = Duration::ZERO;
    let mut last_rank = 0;
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .ok_or_else(|| format!("{rest:?} has no unit"))?;
        let (number, tail) = rest.split_at(end);
        let unit = tail.chars().next().unwrap_or(' ');
        let (rank, seconds) = match unit {
            'h' => (1, 3600u64),
            'm' => (2, 60),
            's' => (3, 1),
            other => return Err(format!("unknown unit {other:?}")),
        };
        if rank <= last_rank {
            return Err("wall-clock parts go h, m, s, each at most once".to_string());
        }
        let follows_larger = last_rank > 0;
        last_rank = rank;
        let number = strip_separators(number)?;
        if number.is_empty() {
            return Err(format!("no number before `{unit}`"));
        }
        if follows_larger {
            let v: f64 = number
                .parse()
                .map_err(|_| format!("{number:?} is not a number"))?;
            if v >= 60.0 {
                let (what, larger) = if unit == 'm' {
                    ("minutes", "hours")
                } else {
                    ("seconds", "a larger unit")
                };
                return Err(format!(
                    "`{number}{unit}` is out of range: {what} after {larger} go from 0 to 59 (carry the rest into the larger unit)"
                ));
            }
        }
        let part = match (unit, number.split_once('.')) {
            // Seconds keep their decimals exactly.
            ('s', Some((whole, frac))) if frac.len() <= 9 && !frac.is_empty() => {
                let whole: u64 = if whole.is_empty() {
                    0
                } else {
                    whole
                        .parse()
                        .map_err(|_| format!("{number:?} is not a number"))?
                };
                let nanos: u32 = format!("{frac:0<9}")
                    .parse()
                    .map_err(|_| format!("{number:?} is not a number"))?;
                Duration::new(whole, nanos)
            }
            (_, None) => {
                let whole: u64 = number
                    .parse()
                    .map_err(|_| format!("{number:?} is not a number"))?;
                whole
                    .checked_mul(seconds)
                    .map(Duration::from_secs)
                    .ok_or_else(|| "the wall-clock time is too long".to_string())?
            }
            _ => {
                let v: f64 = number
                    .parse()
                    .map_err(|_| format!("{number:?} is not a number"))?;
                Duration::try_from_secs_f64(v * seconds as f64)
                    .map_err(|_| format!("{number:?} is not a valid {unit} count"))?
            }
        };
        total = total
            .checked_add(part)
            .ok_or_else(|| "the wall-clock time is too long".to_string())?;
        rest = &tail[unit.len_utf8()..];
    }
    Ok(total)
}

impl FromStr for Time {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Time> {
        let input = s.trim().to_ascii_lowercase();
        let bad = |reason: String| CoreError::InvalidTime {
            input: s.to_string(),
            reason,
        };
        // Composer's wall-clock unit: a number of seconds (`3600sec`).
        if let Some(number) = input.strip_suffix("sec") {
            if number.is_empty()
                || !number
                    .chars()
                    .all(|c| c.is_ascii_digit() || c == '.' || c == '_')
            {
                return Err(bad(format!(
                    "{number:?} before `sec` is not a number of seconds (write 3600sec, or 1h)"
                )));
            }
            return parse_wall(&format!("{number}s"))
                .map(Time::Wall)
                .map_err(bad);
        }
        // The longest suffix is matched first so that "tok" is never read as a number ending in
        // "ok"; the number itself may contain an exponent ("1e6tok").
        let Some(unit) = TimeUnit::SUFFIXED
            .iter()
            .copied()
            .find(|u| input.ends_with(u.suffix()))
        else {
            let starts_wall = input.starts_with(|c: char| c.is_ascii_digit() || c == '.')
                && input.ends_with(['h', 'm', 's']);
            if !starts_wall {
                return Err(bad("no known unit at the end".to_string()));
            }
            return parse_wall(&input).map(Time::Wall).map_err(bad);
        };
        let number = input[..input.len() - unit.suffix().len()].trim();
        if number.is_empty() {
            return Err(bad("no number before the unit".to_string()));
        }
        let number = strip_separators(number).map_err(bad)?;
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
            Time::Wall(d) => {
                let secs = d.as_secs();
                let (h, m, s, nanos) = (secs / 3600, secs / 60 % 60, secs % 60, d.subsec_nanos());
                if h > 0 {
                    write!(f, "{h}h")?;
                }
                if m > 0 {
                    write!(f, "{m}m")?;
                }
                if nanos > 0 {
                    let frac = format!("{nanos:09}");
                    write!(f, "{s}.{}s", frac.trim_end_matches('0'))
                } else if s > 0 || (h == 0 && m == 0) {
                    write!(f, "{s}s")
                } else {
                    Ok(())
                }
            }
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
    /// Wall-clock time of the run: time inside `fit` since its `FIT_START`, summed over `fit`
    /// calls and over the runs a checkpoint resumed, including data loading and evaluation.
    /// Wall-clock durations (`max_duration = 1h30m`, stoppers) are measured against it; it is
    /// updated at every batch end.
    #[serde(default)]
    pub run_wall_time: Duration,
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
            TimeUnit::Duration | TimeUnit::Wall => None,
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
            TimeUnit::Wall => ts.run_wall_time.as_secs_f64(),
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
    /// Tokens and wall-clock time have no fixed rate and give `None` (so does a fraction of a
    /// run measured in either).
    pub fn to_batches(&self, t: Time) -> Option<f64> {
        let bpe = self.batches_per_epoch as f64;
        match t {
            Time::Epoch(v) => Some(v as f64 * bpe),
            Time::Batch(v) => Some(v as f64),
            Time::Sample(v) => Some(v as f64 * bpe / self.samples_per_epoch.max(1) as f64),
            Time::Token(_) | Time::Wall(_) => None,
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
    fn units_are_case_insensitive_and_digits_may_be_separated() {
        assert_eq!("10BA".parse::<Time>().unwrap(), Time::Batch(10));
        assert_eq!("3Ep".parse::<Time>().unwrap(), Time::Epoch(3));
        assert_eq!("4_000tok".parse::<Time>().unwrap(), Time::Token(4000));
        assert_eq!(
            "1_000_000SP".parse::<Time>().unwrap(),
            Time::Sample(1_000_000)
        );
        assert_eq!("0.5DUR".parse::<Time>().unwrap(), Time::Duration(0.5));
        for bad in ["_4ba", "4_ba", "4__0ba", "1_.5dur"] {
            let err = bad.parse::<Time>().unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn composer_spellings_parse_and_out_of_range_parts_are_refused() {
        let wall = |s: &str| s.parse::<Time>().unwrap();
        // Composer's wall-clock unit is `sec`.
        assert_eq!(wall("3600sec"), Time::Wall(Duration::from_secs(3600)));
        assert_eq!(wall("90SEC"), Time::Wall(Duration::from_secs(90)));
        assert_eq!(wall("1_800sec"), Time::Wall(Duration::from_secs(1800)));
        assert_eq!(wall("0.5sec"), Time::Wall(Duration::from_millis(500)));
        assert_eq!(wall("3600sec").to_string(), "1h");
        // Composer's `XhYmZs` reads parts as a clock: what follows a larger unit is below 60.
        assert_eq!(wall("1h59m59s"), Time::Wall(Duration::from_secs(7199)));
        assert_eq!(wall("120m"), Time::Wall(Duration::from_secs(7200)));
        assert_eq!(wall("36h"), Time::Wall(Duration::from_secs(36 * 3600)));
        for bad in [
            "1h60m", "1m60s", "2h0m75s", "1h90s", "1hsec", "sec", "1h30sec",
        ] {
            let err = bad.parse::<Time>().unwrap_err();
            assert!(matches!(err, CoreError::InvalidTime { .. }), "{bad}: {err}");
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        let err = "1h60m".parse::<Time>().unwrap_err().to_string();
        assert!(
            err.contains("`60m` is out of range") && err.contains("0 to 59"),
            "{err}"
        );
    }

    #[test]
    fn wall_clock_times_parse_format_and_measure_the_run() {
        let wall = |s: &str| s.parse::<Time>().unwrap();
        assert_eq!(wall("1h30m"), Time::Wall(Duration::from_secs(5400)));
        assert_eq!(wall("90s"), Time::Wall(Duration::from_secs(90)));
        assert_eq!(wall("45M"), Time::Wall(Duration::from_secs(2700)));
        assert_eq!(wall("1.5h"), Time::Wall(Duration::from_secs(5400)));
        assert_eq!(wall("2h0m5s"), Time::Wall(Duration::from_secs(7205)));
        assert_eq!(wall("0.25s"), Time::Wall(Duration::from_millis(250)));
        assert_eq!(wall("1_000s"), Time::Wall(Duration::from_secs(1000)));
        assert_eq!(wall("1h30m").to_string(), "1h30m");
        assert_eq!(wall("90s").to_string(), "1m30s");
        assert_eq!(wall("0s").to_string(), "0s");
        assert_eq!(wall("3600.5s").to_string(), "1h0.5s");
        assert_eq!(wall("90s").value(), 90.0);
        for bad in ["30m1h", "1h1h", "h", "5x", "1.5.5s", "m30"] {
            let err = bad.parse::<Time>().unwrap_err();
            assert!(matches!(err, CoreError::InvalidTime { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("1h30m"), "{err}");
        }
        // The run's wall time, not the sum of batch times, is what a wall-clock limit reads.
        let p = Progress {
            batches_per_epoch: 10,
            samples_per_epoch: 640,
            max_duration: wall("1m"),
        };
        let mut ts = Timestamp::default();
        ts.advance_batch(64, 0, Duration::from_secs(1));
        ts.run_wall_time = Duration::from_secs(30);
        assert_eq!(p.fraction(&ts), 0.5);
        assert!(!p.is_done(&ts));
        ts.run_wall_time = Duration::from_secs(61);
        assert!(p.is_done(&ts));
        // A fraction of a wall-clock run has no batch count.
        assert_eq!(p.to_batches(Time::Duration(0.5)), None);
        assert_eq!(Timestamp::default().count(TimeUnit::Wall), None);
    }

    #[test]
    fn arithmetic_follows_the_units() {
        assert_eq!((Time::Epoch(3) + Time::Epoch(2)).unwrap(), Time::Epoch(5));
        assert_eq!((Time::Batch(10) - Time::Batch(4)).unwrap(), Time::Batch(6));
        assert_eq!((Time::Batch(1000) * 0.1).unwrap(), Time::Batch(100));
        // Counts round to the nearest whole count, as `scaled` does.
        assert_eq!((Time::Epoch(3) * 0.5).unwrap(), Time::Epoch(2));
        assert_eq!((Time::Sample(10) / 4.0).unwrap(), Time::Sample(3));
        assert_eq!((Time::Duration(0.5) * 0.5).unwrap(), Time::Duration(0.25));
        let (h, m) = (
            Time::Wall(Duration::from_secs(3600)),
            Time::Wall(Duration::from_secs(60)),
        );
        assert_eq!((h + m).unwrap(), Time::Wall(Duration::from_secs(3660)));
        assert_eq!((h - m).unwrap(), Time::Wall(Duration::from_secs(3540)));
        assert_eq!((h / m).unwrap(), 60.0);
        assert_eq!((m * 1.5).unwrap(), Time::Wall(Duration::from_secs(90)));
        assert_eq!((Time::Batch(250) / Time::Batch(1000)).unwrap(), 0.25);
        assert_eq!(Time::Token(30).ratio(Time::Token(20)).unwrap(), 1.5);

        let err = (Time::Epoch(1) + Time::Batch(5)).unwrap_err();
        assert!(
            matches!(err, CoreError::TimeUnitMismatch { op: "+", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("1ep + 5ba"), "{err}");
        assert!(matches!(
            Time::Epoch(1) / Time::Duration(0.5),
            Err(CoreError::TimeUnitMismatch { op: "/", .. })
        ));
        assert!(matches!(
            h - Time::Batch(1),
            Err(CoreError::TimeUnitMismatch { .. })
        ));
        for err in [
            (Time::Batch(5) - Time::Batch(6)).unwrap_err(),
            (m - h).unwrap_err(),
            (Time::Batch(5) * -1.0).unwrap_err(),
            (Time::Batch(5) * f64::NAN).unwrap_err(),
            (Time::Batch(5) / 0.0).unwrap_err(),
            (Time::Batch(5) / Time::Batch(0)).unwrap_err(),
        ] {
            assert!(matches!(err, CoreError::InvalidTime { .. }), "{err}");
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
        fn wall_times_round_trip_through_strings(secs in 0u64..400_000, nanos in 0u32..1_000_000_000) {
            let t = Time::Wall(Duration::new(secs, nanos));
            let back: Time = t.to_string().parse().unwrap();
            prop_assert_eq!(back, t);
        }

        #[test]
        fn unknown_units_are_errors(v in 0u64..10_000, suffix in "[a-z]{1,4}") {
            prop_assume!(!TimeUnit::ALL.iter().any(|u| suffix.ends_with(u.suffix())));
            // A lone `h` or `m` is a wall-clock unit (`5h`, `5m`); a lone `s` is excluded above.
            prop_assume!(suffix != "h" && suffix != "m");
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
