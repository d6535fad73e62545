//! Learning-rate schedules as pure functions of training time.
//!
//! A schedule returns a *factor* that the trainer multiplies into the base learning rate at
//! each `BATCH_START`. Because the factor depends only on the timestamp (never on how many
//! times it was called), a resumed run gets exactly the learning rates of an uninterrupted
//! one. Milestones are [`Time`]s in any convertible unit and are multiplied by the
//! scale-schedule ratio; fractions of the run (`dur`) follow `max_duration`, which the ratio
//! already scales. Warmup is not scaled (as in Composer's default).

use std::f64::consts::PI;

use crate::error::{CoreError, Result};
use crate::time::{Progress, Time, TimeUnit};

/// What a schedule sees: elapsed batches and the shape of the run.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleContext {
    /// Batches completed so far.
    pub batch: f64,
    /// The run's length and epoch shape.
    pub progress: Progress,
    /// Scale-schedule ratio applied to milestones.
    pub scale_schedule_ratio: f64,
}

impl ScheduleContext {
    /// A milestone in batches, after the scale-schedule ratio. Tokens have no batch
    /// equivalent; [`LrSchedule::validate`] rejects them before training starts.
    pub fn milestone(&self, t: Time) -> f64 {
        let batches = self.progress.to_batches(t).unwrap_or(f64::INFINITY);
        match t {
            Time::Duration(_) => batches,
            _ => batches * self.scale_schedule_ratio,
        }
    }

    /// A time in batches without the scale-schedule ratio (used for warmup).
    pub fn unscaled(&self, t: Time) -> f64 {
        self.progress.to_batches(t).unwrap_or(f64::INFINITY)
    }
}

/// A learning-rate schedule: the factor applied to the base learning rate.
///
/// ```
/// use flashover_core::schedule::{LrSchedule, ScheduleContext, Scheduler};
/// use flashover_core::time::{Progress, Time};
/// let s = Scheduler::cosine(Time::Duration(1.0), 0.0).with_warmup(Time::Batch(10));
/// let ctx = |batch| ScheduleContext {
///     batch,
///     progress: Progress { batches_per_epoch: 100, samples_per_epoch: 6400, max_duration: Time::Epoch(1) },
///     scale_schedule_ratio: 1.0,
/// };
/// assert_eq!(s.factor(&ctx(5.0)), 0.5);          // half-way through warmup
/// assert_eq!(s.factor(&ctx(10.0)), 1.0);         // warmup done, cosine starts at 1
/// assert!(s.factor(&ctx(100.0)).abs() < 1e-12);  // and ends at alpha_f = 0
/// ```
pub trait LrSchedule: Send + Sync {
    /// The factor for the batch described by `ctx`.
    fn factor(&self, ctx: &ScheduleContext) -> f64;

    /// Checks, before training, that every milestone can be placed on the run's time axis.
    fn validate(&self, progress: &Progress) -> Result<()> {
        let _ = progress;
        Ok(())
    }

    /// A short description for logs.
    fn describe(&self) -> String;
}

/// The shape of a built-in schedule (before warmup).
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    /// `alpha` until `t_max`, then 1.
    Constant {
        /// Factor before `t_max`.
        alpha: f64,
        /// End of the constant phase.
        t_max: Time,
    },
    /// `gamma ^ floor(t / step_size)`.
    Step {
        /// Length of one step.
        step_size: Time,
        /// Decay per step.
        gamma: f64,
    },
    /// `gamma ^ (number of milestones passed)`.
    MultiStep {
        /// Times at which the factor is multiplied by `gamma`.
        milestones: Vec<Time>,
        /// Decay per milestone.
        gamma: f64,
    },
    /// Linear from `alpha_i` to `alpha_f` over `t_max`, then `alpha_f`.
    Linear {
        /// Start factor.
        alpha_i: f64,
        /// End factor.
        alpha_f: f64,
        /// Length of the ramp.
        t_max: Time,
    },
    /// `gamma ^ (t / period)`, continuous.
    Exponential {
        /// Decay per period.
        gamma: f64,
        /// The period.
        period: Time,
    },
    /// Half a cosine from 1 down to `alpha_f` over `t_max`.
    Cosine {
        /// Length of the decay.
        t_max: Time,
        /// Final factor.
        alpha_f: f64,
    },
    /// Cosine decay restarted after `t_0`, then cycles growing by `t_mult` (SGDR).
    CosineWarmRestarts {
        /// Length of the first cycle.
        t_0: Time,
        /// Growth of each next cycle (at least 1).
        t_mult: f64,
        /// Factor at the end of each cycle.
        alpha_f: f64,
    },
    /// `alpha_f + (1 - alpha_f) * (1 - t / t_max) ^ power`.
    Polynomial {
        /// Exponent.
        power: f64,
        /// Length of the decay.
        t_max: Time,
        /// Final factor.
        alpha_f: f64,
    },
}

/// A built-in schedule with optional linear warmup from 0.
///
/// During warmup the factor rises linearly from 0 to the schedule's value at the end of
/// warmup. Schedules with a horizon (linear, cosine, polynomial) then run over what is left
/// of their horizon, `t_max - warmup`; step-like schedules keep their absolute milestones.
#[derive(Debug, Clone, PartialEq)]
pub struct Scheduler {
    /// The schedule's shape.
    pub shape: Shape,
    /// Optional warmup length.
    pub warmup: Option<Time>,
}

impl Scheduler {
    fn of(shape: Shape) -> Self {
        Scheduler {
            shape,
            warmup: None,
        }
    }
    /// A constant factor of 1 for the whole run.
    pub fn constant() -> Self {
        Self::of(Shape::Constant {
            alpha: 1.0,
            t_max: Time::Duration(1.0),
        })
    }
    /// See [`Shape::Step`].
    pub fn step(step_size: Time, gamma: f64) -> Self {
        Self::of(Shape::Step { step_size, gamma })
    }
    /// See [`Shape::MultiStep`].
    pub fn multistep(milestones: Vec<Time>, gamma: f64) -> Self {
        Self::of(Shape::MultiStep { milestones, gamma })
    }
    /// See [`Shape::Linear`].
    pub fn linear(alpha_i: f64, alpha_f: f64, t_max: Time) -> Self {
        Self::of(Shape::Linear {
            alpha_i,
            alpha_f,
            t_max,
        })
    }
    /// See [`Shape::Exponential`].
    pub fn exponential(gamma: f64, period: Time) -> Self {
        Self::of(Shape::Exponential { gamma, period })
    }
    /// See [`Shape::Cosine`].
    pub fn cosine(t_max: Time, alpha_f: f64) -> Self {
        Self::of(Shape::Cosine { t_max, alpha_f })
    }
    /// See [`Shape::CosineWarmRestarts`].
    pub fn cosine_warm_restarts(t_0: Time, t_mult: f64, alpha_f: f64) -> Self {
        Self::of(Shape::CosineWarmRestarts {
            t_0,
            t_mult,
            alpha_f,
        })
    }
    /// See [`Shape::Polynomial`].
    pub fn polynomial(power: f64, t_max: Time, alpha_f: f64) -> Self {
        Self::of(Shape::Polynomial {
            power,
            t_max,
            alpha_f,
        })
    }
    /// Adds linear warmup of length `warmup`.
    pub fn with_warmup(mut self, warmup: Time) -> Self {
        self.warmup = Some(warmup);
        self
    }

    fn times(&self) -> Vec<Time> {
        let mut out: Vec<Time> = self.warmup.into_iter().collect();
        match &self.shape {
            Shape::Constant { t_max, .. }
            | Shape::Linear { t_max, .. }
            | Shape::Cosine { t_max, .. }
            | Shape::Polynomial { t_max, .. } => out.push(*t_max),
            Shape::Step { step_size, .. } => out.push(*step_size),
            Shape::MultiStep { milestones, .. } => out.extend(milestones.iter().copied()),
            Shape::Exponential { period, .. } => out.push(*period),
            Shape::CosineWarmRestarts { t_0, .. } => out.push(*t_0),
        }
        out
    }

    /// The shape's factor at `t` batches, where `start` is where the shape's horizon begins
    /// (the end of warmup) for schedules that have one.
    fn shape_factor(&self, ctx: &ScheduleContext, t: f64, start: f64) -> f64 {
        let horizon = |t_max: Time| {
            let end = ctx.milestone(t_max);
            if end <= start {
                1.0
            } else {
                ((t - start) / (end - start)).clamp(0.0, 1.0)
            }
        };
        match &self.shape {
            Shape::Constant { alpha, t_max } => {
                if t < ctx.milestone(*t_max) {
                    *alpha
                } else {
                    1.0
                }
            }
            Shape::Step { step_size, gamma } => {
                let s = ctx.milestone(*step_size);
                gamma.powf((t / s).floor())
            }
            Shape::MultiStep { milestones, gamma } => {
                let passed = milestones
                    .iter()
                    .filter(|m| t >= ctx.milestone(**m))
                    .count();
                gamma.powi(passed as i32)
            }
            Shape::Linear {
                alpha_i,
                alpha_f,
                t_max,
            } => alpha_i + (alpha_f - alpha_i) * horizon(*t_max),
            Shape::Exponential { gamma, period } => gamma.powf(t / ctx.milestone(*period)),
            Shape::Cosine { t_max, alpha_f } => {
                alpha_f + (1.0 - alpha_f) * 0.5 * (1.0 + (PI * horizon(*t_max)).cos())
            }
            Shape::CosineWarmRestarts {
                t_0,
                t_mult,
                alpha_f,
            } => {
                let mut cycle = ctx.milestone(*t_0);
                let mut pos = (t - start).max(0.0);
                while pos >= cycle {
                    pos -= cycle;
                    cycle *= t_mult;
                }
                alpha_f + (1.0 - alpha_f) * 0.5 * (1.0 + (PI * pos / cycle).cos())
            }
            Shape::Polynomial {
                power,
                t_max,
                alpha_f,
            } => alpha_f + (1.0 - alpha_f) * (1.0 - horizon(*t_max)).powf(*power),
        }
    }
}

impl LrSchedule for Scheduler {
    fn factor(&self, ctx: &ScheduleContext) -> f64 {
        let t = ctx.batch;
        let warmup = self.warmup.map(|w| ctx.unscaled(w)).unwrap_or(0.0);
        if warmup > 0.0 && t < warmup {
            return (t / warmup) * self.shape_factor(ctx, warmup, warmup);
        }
        self.shape_factor(ctx, t, warmup)
    }

    fn validate(&self, progress: &Progress) -> Result<()> {
        // A constant factor of 1 without warmup never reads the clock, so it fits any run,
        // including one measured in tokens (the default schedule of a language model).
        let flat = matches!(self.shape, Shape::Constant { alpha, .. } if alpha == 1.0)
            && self.warmup.is_none();
        // A warmup at least as long as the run never ends: the peak rate is never reached, and
        // the schedules with a horizon would be over before they start (a factor of 0 at every
        // batch, so the run would train nothing). Refused rather than silently clipped.
        if let Some(w) = self.warmup {
            let run = progress.to_batches(progress.max_duration);
            if let (Some(warm), Some(run)) = (progress.to_batches(w), run) {
                if run > 0.0 && warm >= run {
                    return Err(CoreError::config(
                        "warmup",
                        w,
                        format!(
                            "a warmup shorter than the run (max_duration {} = {run} batches): a \
                             warmup of {warm} batches never ends, so the learning rate never \
                             reaches its peak; shorten the warmup (0ba for none) or lengthen the run",
                            progress.max_duration
                        ),
                    ));
                }
            }
        }
        for t in self.times().into_iter().filter(|_| !flat) {
            if progress.to_batches(t).is_none() {
                let why = match (t.unit(), progress.max_duration.unit()) {
                    (TimeUnit::Duration, TimeUnit::Wall) => format!(
                        "a fraction of the run needs a run measured in ep, ba or sp, and this one is limited by wall-clock time ({}): use a constant schedule (--schedule constant), or give the run's length in ep, ba or sp and stop on time with --stop-after",
                        progress.max_duration
                    ),
                    (TimeUnit::Duration, TimeUnit::Token) => format!(
                        "a fraction of the run needs a run measured in ep, ba or sp, and this one is counted in tokens ({}): give the run's length in ep, ba or sp, or use a constant schedule",
                        progress.max_duration
                    ),
                    _ => format!(
                        "a time convertible to batches (ep, ba, sp, or dur when max_duration is {}): tokens and wall-clock times have no fixed rate in batches",
                        progress.max_duration
                    ),
                };
                return Err(CoreError::config("scheduler", t, why));
            }
        }
        let positive = |name: &'static str, t: Time| {
            if t.is_zero() {
                Err(CoreError::config(name, t, "a length greater than zero"))
            } else {
                Ok(())
            }
        };
        match &self.shape {
            Shape::Step { step_size, gamma } => {
                positive("step_size", *step_size)?;
                check_gamma(*gamma)
            }
            Shape::MultiStep { gamma, .. } => check_gamma(*gamma),
            Shape::Exponential { gamma, period } => {
                positive("period", *period)?;
                check_gamma(*gamma)
            }
            Shape::CosineWarmRestarts { t_0, t_mult, .. } => {
                positive("t_0", *t_0)?;
                if !(t_mult.is_finite() && *t_mult >= 1.0) {
                    return Err(CoreError::config("t_mult", t_mult, "a finite number >= 1"));
                }
                Ok(())
            }
            Shape::Polynomial { power, .. } if !(power.is_finite() && *power > 0.0) => {
                Err(CoreError::config("power", power, "a finite number > 0"))
            }
            _ => Ok(()),
        }
    }

    fn describe(&self) -> String {
        match self.warmup {
            Some(w) => format!("{:?} with {w} warmup", self.shape),
            None => format!("{:?}", self.shape),
        }
    }
}

fn check_gamma(gamma: f64) -> Result<()> {
    if gamma.is_finite() && gamma > 0.0 {
        Ok(())
    } else {
        Err(CoreError::config("gamma", gamma, "a finite number > 0"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx(batch: f64) -> ScheduleContext {
        ScheduleContext {
            batch,
            progress: Progress {
                batches_per_epoch: 100,
                samples_per_epoch: 3200,
                max_duration: Time::Epoch(10),
            },
            scale_schedule_ratio: 1.0,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn reference_values_from_the_formulas() {
        // Step: gamma^floor(t / 1ep), at 250 batches two steps have passed.
        assert!(close(
            Scheduler::step(Time::Epoch(1), 0.1).factor(&ctx(250.0)),
            0.01
        ));
        // Multistep: milestones at 2ep and 5ep, at 6ep both passed.
        let ms = Scheduler::multistep(vec![Time::Epoch(2), Time::Epoch(5)], 0.5);
        assert!(close(ms.factor(&ctx(199.0)), 1.0));
        assert!(close(ms.factor(&ctx(200.0)), 0.5));
        assert!(close(ms.factor(&ctx(600.0)), 0.25));
        // Linear from 1 to 0.1 over the run: at 40% of 1000 batches, 1 - 0.9 * 0.4.
        assert!(close(
            Scheduler::linear(1.0, 0.1, Time::Duration(1.0)).factor(&ctx(400.0)),
            0.64
        ));
        // Exponential with period 1ep: 0.9^(150/100).
        assert!(close(
            Scheduler::exponential(0.9, Time::Epoch(1)).factor(&ctx(150.0)),
            0.9f64.powf(1.5)
        ));
        // Cosine over the run: at a quarter, 0.5 * (1 + cos(pi/4)).
        let c = Scheduler::cosine(Time::Duration(1.0), 0.0);
        assert!(close(c.factor(&ctx(250.0)), 0.5 * (1.0 + (PI / 4.0).cos())));
        // Cosine with warm restarts, t_0 = 100 batches, t_mult = 2: cycles [0,100), [100,300).
        let r = Scheduler::cosine_warm_restarts(Time::Batch(100), 2.0, 0.0);
        assert!(close(r.factor(&ctx(100.0)), 1.0));
        assert!(close(r.factor(&ctx(200.0)), 0.5));
        assert!(close(r.factor(&ctx(50.0)), 0.5));
        // Polynomial, power 2, at half the run: 0.25.
        assert!(close(
            Scheduler::polynomial(2.0, Time::Duration(1.0), 0.0).factor(&ctx(500.0)),
            0.25
        ));
        // Constant 0.5 for the first epoch.
        let k = Scheduler::of(Shape::Constant {
            alpha: 0.5,
            t_max: Time::Epoch(1),
        });
        assert!(close(k.factor(&ctx(99.0)), 0.5));
        assert!(close(k.factor(&ctx(100.0)), 1.0));
    }

    #[test]
    fn warmup_then_shifted_horizon() {
        let s = Scheduler::linear(1.0, 0.0, Time::Batch(300)).with_warmup(Time::Batch(100));
        assert!(close(s.factor(&ctx(0.0)), 0.0));
        assert!(close(s.factor(&ctx(50.0)), 0.5));
        assert!(close(s.factor(&ctx(100.0)), 1.0));
        assert!(close(s.factor(&ctx(200.0)), 0.5));
        assert!(close(s.factor(&ctx(300.0)), 0.0));
        // A step schedule keeps its absolute milestones.
        let st = Scheduler::step(Time::Batch(150), 0.1).with_warmup(Time::Batch(100));
        assert!(close(st.factor(&ctx(120.0)), 1.0));
        assert!(close(st.factor(&ctx(150.0)), 0.1));
    }

    #[test]
    fn scale_schedule_ratio_moves_milestones_but_not_fractions() {
        let mut c = ctx(100.0);
        c.scale_schedule_ratio = 0.5;
        let st = Scheduler::step(Time::Epoch(2), 0.1);
        // 2ep scaled by 0.5 is 100 batches: one step has passed.
        assert!(close(st.factor(&c), 0.1));
        let cos = Scheduler::cosine(Time::Duration(1.0), 0.0);
        assert!(close(cos.factor(&c), cos.factor(&ctx(100.0))));
    }

    #[test]
    fn a_warmup_as_long_as_the_run_is_refused() {
        let p = |max| Progress {
            batches_per_epoch: 10,
            samples_per_epoch: 640,
            max_duration: max,
        };
        let s = Scheduler::cosine(Time::Duration(1.0), 0.0).with_warmup(Time::Batch(30));
        for max in [
            Time::Batch(20),
            Time::Batch(30),
            Time::Epoch(3),
            Time::Sample(1920),
        ] {
            let e = s.validate(&p(max)).unwrap_err().to_string();
            assert!(
                e.contains("`warmup`") && e.contains("30ba") && e.contains(&max.to_string()),
                "{e}"
            );
        }
        for ok in [Time::Batch(31), Time::Epoch(4), Time::Batch(0)] {
            s.validate(&p(ok)).unwrap();
        }
        // A warmup given as a fraction of the run is refused at the whole run or more.
        let frac = Scheduler::constant().with_warmup(Time::Duration(1.0));
        assert!(frac.validate(&p(Time::Batch(20))).is_err());
        Scheduler::constant()
            .with_warmup(Time::Duration(0.5))
            .validate(&p(Time::Batch(20)))
            .unwrap();
    }

    #[test]
    fn validation_names_the_bad_value() {
        let p = ctx(0.0).progress;
        let err = Scheduler::cosine(Time::Token(1000), 0.0)
            .validate(&p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("1000tok"), "{err}");
        let err = Scheduler::step(Time::Epoch(1), -1.0)
            .validate(&p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("-1") && err.contains("gamma"), "{err}");
        assert!(Scheduler::step(Time::Batch(0), 0.5).validate(&p).is_err());
        assert!(Scheduler::cosine_warm_restarts(Time::Batch(10), 0.5, 0.0)
            .validate(&p)
            .is_err());
    }

    #[test]
    fn the_default_schedule_fits_a_run_counted_in_tokens() {
        let p = Progress {
            max_duration: Time::Token(20_000),
            ..ctx(0.0).progress
        };
        assert!(Scheduler::constant().validate(&p).is_ok());
        let c = ScheduleContext {
            progress: p,
            ..ctx(37.0)
        };
        assert_eq!(Scheduler::constant().factor(&c), 1.0);
        // Anything that reads the clock still needs a batch conversion.
        assert!(Scheduler::constant()
            .with_warmup(Time::Duration(0.1))
            .validate(&p)
            .is_err());
        assert!(Scheduler::cosine(Time::Duration(1.0), 0.0)
            .validate(&p)
            .is_err());
    }

    fn all_decaying(alpha_f: f64, warm: u64) -> Vec<Scheduler> {
        let w = Time::Batch(warm);
        vec![
            Scheduler::linear(1.0, alpha_f, Time::Duration(1.0)).with_warmup(w),
            Scheduler::cosine(Time::Duration(1.0), alpha_f).with_warmup(w),
            Scheduler::polynomial(1.5, Time::Duration(1.0), alpha_f).with_warmup(w),
        ]
    }

    proptest! {
        #[test]
        fn decaying_schedules_are_bounded_monotone_with_exact_endpoints(alpha_f in 0.0f64..1.0, warm in 1u64..300) {
            for s in all_decaying(alpha_f, warm) {
                let mut last = f64::INFINITY;
                for b in (warm..=1000).step_by(7) {
                    let f = s.factor(&ctx(b as f64));
                    prop_assert!(f <= 1.0 + 1e-12 && f >= alpha_f - 1e-12, "{} at {b}: {f}", s.describe());
                    prop_assert!(f <= last + 1e-12);
                    last = f;
                }
                prop_assert!(close(s.factor(&ctx(warm as f64)), 1.0));
                prop_assert!(close(s.factor(&ctx(1000.0)), alpha_f));
                prop_assert!(close(s.factor(&ctx(5000.0)), alpha_f));
                // Warmup is a straight line from 0.
                prop_assert!(close(s.factor(&ctx(0.0)), 0.0));
                let half = warm as f64 / 2.0;
                prop_assert!(close(s.factor(&ctx(half)), 0.5));
            }
        }

        #[test]
        fn step_schedules_only_decrease(gamma in 0.01f64..1.0, step in 1u64..500) {
            let s = Scheduler::step(Time::Batch(step), gamma);
            let mut last = f64::INFINITY;
            for b in 0..1000 {
                let f = s.factor(&ctx(b as f64));
                // gamma^k underflows to exactly 0 for large k (0.01^999), so 0 is in range.
                prop_assert!(f <= last && (0.0..=1.0).contains(&f));
                last = f;
            }
        }

        #[test]
        fn warm_restarts_stay_in_bounds_and_restart_at_one(t0 in 1u64..200, mult in 1.0f64..3.0, alpha_f in 0.0f64..1.0) {
            let s = Scheduler::cosine_warm_restarts(Time::Batch(t0), mult, alpha_f);
            for b in 0..1000 {
                let f = s.factor(&ctx(b as f64));
                prop_assert!(f <= 1.0 + 1e-12 && f >= alpha_f - 1e-12);
            }
            prop_assert!(close(s.factor(&ctx(t0 as f64)), 1.0));
        }
    }
}
