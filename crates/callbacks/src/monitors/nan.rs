//! The NaN/Inf watch.

use burn::tensor::ElementConversion;
use flashover_core::callback::{Callback, Control};
use flashover_core::collective::Ranks;
use flashover_core::error::Result;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use super::norms::{ParamStats, Stat};
use crate::error::CallbackError;

/// Stops the run with [`CallbackError::NonFinite`] as soon as a loss or a gradient holds a NaN
/// or an infinity, naming the epoch and batch (and the microbatch, or the parameters whose
/// gradients are affected), before the optimizer step can write the bad values into the
/// weights.
///
/// Losses are checked at `AFTER_LOSS` of every microbatch (one scalar read each); gradients at
/// `AFTER_TRAIN_BATCH` every `grad_every` batches (default 1: every step; one pass over the
/// gradients and one read back). Takes precedence over the trainer's `skip_nonfinite_loss`.
///
/// ```
/// use flashover_callbacks::monitors::NanMonitor;
/// let watch = NanMonitor::new(); // trainer builder: .callback(NanMonitor::new())
/// # let _ = watch;
/// ```
#[derive(Debug)]
pub struct NanMonitor {
    grad_every: u64,
    microbatch: u64,
}

impl Default for NanMonitor {
    fn default() -> Self {
        NanMonitor {
            grad_every: 1,
            microbatch: 0,
        }
    }
}

impl NanMonitor {
    /// Checks every loss and every step's gradients.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks gradients every `every` optimizer steps (at least 1).
    pub fn grad_every(mut self, every: u64) -> crate::error::Result<Self> {
        if every == 0 {
            return Err(CallbackError::param(
                "nan_monitor",
                "grad_every",
                every,
                "an integer number of batches >= 1",
            ));
        }
        self.grad_every = every;
        Ok(self)
    }
}

impl<S: Setup> Callback<S> for NanMonitor {
    fn name(&self) -> &str {
        "nan_monitor"
    }

    /// In a sharded run every rank checks the gradients of the parameters it owns (rank 0
    /// holds only its own); otherwise rank 0 checks.
    fn ranks(&self) -> Ranks {
        Ranks::Shards
    }

    fn batch_start(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.microbatch = 0;
        Ok(())
    }

    fn after_loss(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        let micro = self.microbatch;
        self.microbatch += 1;
        let Some(loss) = state.loss() else {
            return Ok(());
        };
        let value: f64 = loss.clone().into_scalar().elem();
        if value.is_finite() {
            return Ok(());
        }
        let ts = state.timestamp();
        Err(CallbackError::NonFinite {
            what: "loss",
            value,
            epoch: ts.epoch,
            batch: ts.batch,
            batch_in_epoch: ts.batch_in_epoch,
            detail: format!("; microbatch {micro}"),
        }
        .into())
    }

    fn after_train_batch(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if !(state.timestamp().batch + 1).is_multiple_of(self.grad_every) {
            return Ok(());
        }
        let Some(grads) = state.grads() else {
            return Ok(());
        };
        let counts = ParamStats::<S::Backend>::of(state.model(), Some(grads), Stat::NonFinite);
        let bad: Vec<&(String, Vec<f64>)> = counts
            .iter()
            .filter(|(_, c)| c[0] > 0.0 || c[1] > 0.0)
            .collect();
        if bad.is_empty() {
            return Ok(());
        }
        let any_nan = bad.iter().any(|(_, c)| c[0] > 0.0);
        let listed: Vec<String> = bad
            .iter()
            .take(5)
            .map(|(name, c)| format!("{name} ({} NaN, {} inf)", c[0] as u64, c[1] as u64))
            .collect();
        let more = if bad.len() > 5 {
            format!(" and {} more", bad.len() - 5)
        } else {
            String::new()
        };
        let ts = state.timestamp();
        Err(CallbackError::NonFinite {
            what: "gradient",
            value: if any_nan { f64::NAN } else { f64::INFINITY },
            epoch: ts.epoch,
            batch: ts.batch,
            batch_in_epoch: ts.batch_in_epoch,
            detail: format!("; in {}{more}", listed.join(", ")),
        }
        .into())
    }
}
