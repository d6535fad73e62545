//! Layer freezing (Brock et al., 2017, "FreezeOut"; Composer's method card): progressively
//! stop training the earliest layers, whose features settle first, so backward does less
//! work. Frozen parameters become constants: no gradient is computed for them and the
//! optimizer leaves them (and their state) alone.
//!
//! Schedule (Composer's): at fraction `f` of training, the share of layers frozen is 0 until
//! `freeze_start`, then `freeze_level * (f - freeze_start) / (1 - freeze_start)`; the number
//! frozen is that share of the model's layers (in the model's order, rounded down), and at
//! least the last layer always trains. The share is evaluated at the start of each epoch.
//!
//! Hyperparameters: `freeze_start` 0.5, `freeze_level` 1.0. A layer is a module that owns
//! parameters directly (`conv1` for `conv1.weight`).
//!
//! Hooks: `FIT_START` and `EPOCH_START`. The frozen set is a pure function of the epoch, so a
//! resumed run freezes exactly what the uninterrupted one did.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::error::{check_range, Result};
use crate::params::{freeze_layers, layers};

/// Share of layers frozen at fraction `f` of training.
pub fn freeze_share(f: f64, freeze_start: f64, freeze_level: f64) -> f64 {
    if f <= freeze_start || freeze_start >= 1.0 {
        return 0.0;
    }
    freeze_level * (f - freeze_start) / (1.0 - freeze_start)
}

/// Layers frozen out of `n` at share `share` (at most `n - 1`).
pub fn frozen_count(share: f64, n: usize) -> usize {
    ((share * n as f64).floor() as usize).min(n.saturating_sub(1))
}

/// The layer-freezing algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct LayerFreezing {
    freeze_start: f64,
    freeze_level: f64,
    frozen: usize,
}

impl LayerFreezing {
    /// Freezing from `freeze_start` up to `freeze_level` of the layers (both in `[0, 1]`).
    pub fn new(freeze_start: f64, freeze_level: f64) -> Result<Self> {
        check_range("layer_freezing", "freeze_start", freeze_start, 0.0, 1.0)?;
        check_range("layer_freezing", "freeze_level", freeze_level, 0.0, 1.0)?;
        Ok(LayerFreezing {
            freeze_start,
            freeze_level,
            frozen: 0,
        })
    }

    /// Layers frozen now.
    pub fn frozen(&self) -> usize {
        self.frozen
    }
}

impl<S: Setup> Algorithm<S> for LayerFreezing {
    fn name(&self) -> &str {
        "layer_freezing"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        matches!(event, Event::FitStart | Event::EpochStart)
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        // The fraction at the start of the current epoch, also when resuming mid-epoch.
        let mut ts = state.timestamp().clone();
        ts.batch -= ts.batch_in_epoch;
        ts.sample -= ts.sample_in_epoch;
        ts.token -= ts.token_in_epoch;
        ts.batch_in_epoch = 0;
        ts.sample_in_epoch = 0;
        ts.token_in_epoch = 0;
        let f = state.progress().fraction(&ts);
        let all = layers(state.model());
        let k = frozen_count(
            freeze_share(f, self.freeze_start, self.freeze_level),
            all.len(),
        );
        if k != self.frozen || k > 0 {
            let chosen = all[..k].to_vec();
            state.map_model(|m| freeze_layers(m, &chosen));
            if k != self.frozen {
                tracing::info!(frozen = ?chosen, "layer_freezing: frozen layers changed");
            }
            self.frozen = k;
        }
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "layer_freezing", params: ["freeze_start", "freeze_level"]}
crate::spec::by_name! {general |p| LayerFreezing::new(
    p.f64("freeze_start", 0.5)?,
    p.f64("freeze_level", 1.0)?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, proptest};

    #[test]
    fn schedule_matches_composer() {
        assert_eq!(freeze_share(0.4, 0.5, 1.0), 0.0);
        assert_eq!(freeze_share(0.5, 0.5, 1.0), 0.0);
        assert!((freeze_share(0.75, 0.5, 1.0) - 0.5).abs() < 1e-12);
        assert!((freeze_share(1.0, 0.5, 0.5) - 0.5).abs() < 1e-12);
        // Four layers at share 0.5: two frozen; at share 1: all but the last.
        assert_eq!(frozen_count(0.5, 4), 2);
        assert_eq!(frozen_count(1.0, 4), 3);
        assert_eq!(frozen_count(0.2, 4), 0);
    }

    proptest! {
        #[test]
        fn freezing_only_grows_and_never_takes_every_layer(a in 0.0f64..1.0, b in 0.0f64..1.0, s in 0.0f64..1.0, l in 0.0f64..1.0, n in 1usize..20) {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let k1 = frozen_count(freeze_share(lo, s, l), n);
            let k2 = frozen_count(freeze_share(hi, s, l), n);
            prop_assert!(k1 <= k2);
            prop_assert!(k2 < n);
        }
    }
}
