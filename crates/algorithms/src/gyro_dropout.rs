//! Gyro dropout (Park, Lee and Seo, "Gyro Dropout: Maximizing Ensemble Effect in Neural
//! Network Training", MLSys 2022; Composer's `GyroDropout`): instead of a fresh random
//! sub-network at every step, dropout trains a fixed set of `sigma` sub-networks chosen at
//! the start, `tau` of them at a time, each long enough to learn something; the trained model
//! then behaves as a better ensemble of them.
//!
//! At each dropout site (in Flashover's models the classifier's input: the ResNet's pooled
//! features, the CNN's hidden layer) `sigma` masks of the site's features are drawn once,
//! each feature kept with probability `1 - p`. Every `period` training batches, `tau` of them
//! are picked at random (with repetition, as Composer does), the batch is cut into `tau`
//! consecutive parts and part `j` uses mask `j`; kept features are scaled by `1 / (1 - p)`;
//! evaluation drops nothing. `period = floor(batches / sigma) * tau` for a run of `batches`
//! training batches (Composer's `int(iters_per_epoch * max_epoch / sigma) * tau`: each
//! sub-network sees as many samples as it would if trained alone for `1 / sigma` of the run),
//! at least 1 (Composer divides by zero when the run has fewer batches than `sigma`).
//!
//! Defaults are Composer's: `p = 0.5`, `sigma = 256`, `tau = 16`. Where Flashover differs:
//! - a batch whose size is not a multiple of `tau` is cut into parts that differ by one
//!   sample (sample `i` of `n` uses mask `i * tau / n`); Composer's shapes fail to broadcast;
//! - the period counts optimizer steps (batches), not forward passes, so microbatches of one
//!   step share its masks;
//! - the masks come from the run's seed (the same sigma on every rank) and the picks from
//!   `(seed, rank, site, period index)`: the picks differ between ranks as their samples do,
//!   and a resumed run picks what the uninterrupted one picked, with nothing saved (Composer
//!   marks its resumption as unsupported).
//!
//! When it helps: networks whose classifier already uses dropout (VGG, the paper's fully
//! connected heads); the paper reports +1-2% over plain dropout on CIFAR. On a model without
//! dropout it adds regularisation that may or may not pay.
//!
//! Surgery at `INIT` on the dropout sites the model shows ([`Surgical`]); no parameter is added or changed.
//! The sites changed are the checkpoint state; a checkpoint of another surgery is refused.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::rng::{derive_seed, hash_str, Rng};
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{GyroMasks, LayerKind, SurgeryRecord, Surgical, SurgicalExt};
use serde_json::Value;

use crate::error::{AlgorithmError, Result};
use crate::surgery::{Applied, Needs};

/// GyroDropout's settings (Composer's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GyroDropoutOptions {
    /// Drop probability of a feature in a mask.
    pub p: f64,
    /// Sub-networks (masks) drawn at the start.
    pub sigma: usize,
    /// Sub-networks trained at once (parts of a batch).
    pub tau: usize,
}

impl Default for GyroDropoutOptions {
    fn default() -> Self {
        Self {
            p: 0.5,
            sigma: 256,
            tau: 16,
        }
    }
}

impl GyroDropoutOptions {
    /// The settings, checked: `p` in `[0, 1)`, `sigma >= 1`, `1 <= tau`.
    pub fn new(p: f64, sigma: usize, tau: usize) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(AlgorithmError::param(
                "gyro_dropout",
                "p",
                p,
                "a probability in [0, 1)",
            ));
        }
        if sigma == 0 {
            return Err(AlgorithmError::param(
                "gyro_dropout",
                "sigma",
                sigma,
                "an integer >= 1",
            ));
        }
        if tau == 0 {
            return Err(AlgorithmError::param(
                "gyro_dropout",
                "tau",
                tau,
                "an integer >= 1",
            ));
        }
        Ok(Self { p, sigma, tau })
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "gyro_dropout:p={}:sigma={}:tau={}",
            self.p, self.sigma, self.tau
        )
    }

    /// Batches between two picks in a run of `batches` training batches.
    pub fn period(&self, batches: u64) -> u64 {
        (batches / self.sigma as u64 * self.tau as u64).max(1)
    }
}

/// One site's `sigma` masks, drawn at `INIT`.
#[derive(Debug, Clone, PartialEq)]
struct Site {
    features: usize,
    /// `sigma` rows of `features` keep flags.
    masks: Vec<bool>,
}

/// Gyro dropout on a model: its masks and its schedule, shared by the typed and the by-name
/// algorithm.
#[derive(Debug, Clone, PartialEq)]
pub struct Gyro {
    options: GyroDropoutOptions,
    seed: u64,
    period: u64,
    sites: Vec<Site>,
}

impl Gyro {
    /// Puts gyro dropout on every dropout site of `model` for a run of `batches` training
    /// batches and draws each site's masks from `seed` (the functional form; then call
    /// [`Gyro::before_forward`] before each training forward pass and [`Gyro::clear`]
    /// after the step). Returns it and what it changed.
    pub fn apply<M: Surgical + ?Sized>(
        model: &mut M,
        options: GyroDropoutOptions,
        seed: u64,
        batches: u64,
    ) -> (Self, SurgeryRecord) {
        let mut sites = Vec::new();
        let mut layers = Vec::new();
        model.for_each_dropout(&mut |info, variant| {
            let index = sites.len() as u64;
            let mut rng = Rng::new(derive_seed(&[seed, hash_str("gyro_dropout"), index]));
            let masks = (0..options.sigma * info.features)
                .map(|_| rng.next_f64() >= options.p)
                .collect();
            sites.push(Site {
                features: info.features,
                masks,
            });
            layers.push(info.path.clone());
            variant.gyro = Some(GyroMasks {
                p: options.p,
                keep: None,
            });
        });
        let gyro = Self {
            options,
            seed,
            period: options.period(batches),
            sites,
        };
        let record = SurgeryRecord {
            settings: options.describe(),
            layers,
        };
        (gyro, record)
    }

    /// Batches between two picks.
    pub fn period(&self) -> u64 {
        self.period
    }

    /// The sub-networks (indices among the `sigma`) that site `site` trains at training
    /// batch `batch` (counted from 0 over the run) on rank `rank`.
    pub fn picks(&self, site: usize, batch: u64, rank: usize) -> Vec<usize> {
        let k = batch / self.period;
        let mut rng = Rng::new(derive_seed(&[
            self.seed,
            rank as u64,
            hash_str("gyro_dropout/picks"),
            site as u64,
            k,
        ]));
        (0..self.options.tau)
            .map(|_| rng.below(self.options.sigma as u64) as usize)
            .collect()
    }

    /// Sets every site's masks for training batch `batch` on rank `rank`.
    pub fn before_forward<M: Surgical + ?Sized>(&self, model: &mut M, batch: u64, rank: usize) {
        let mut index = 0;
        model.for_each_dropout(&mut |_, variant| {
            let i = index;
            index += 1;
            let (Some(site), Some(g)) = (self.sites.get(i), variant.gyro.as_mut()) else {
                return;
            };
            let f = site.features;
            let keep = self
                .picks(i, batch, rank)
                .into_iter()
                .flat_map(|j| site.masks[j * f..(j + 1) * f].iter().copied())
                .collect();
            g.keep = Some((self.options.tau, keep));
        });
    }

    /// Forgets the masks (after each step and a restore), so that no forward pass outside a
    /// training step uses a stale pick.
    pub fn clear<M: Surgical + ?Sized>(model: &mut M) {
        model.for_each_dropout(&mut |_, variant| {
            if let Some(g) = &mut variant.gyro {
                g.keep = None;
            }
        });
    }
}

/// Training batches in the run, or an error where its length is not in batches, samples or
/// epochs.
fn run_batches<S: Setup>(state: &State<S>) -> Result<u64> {
    let batches = state.progress().to_batches(state.max_duration());
    batches.map(|b| b.ceil() as u64).ok_or_else(|| {
        AlgorithmError::param(
            "gyro_dropout",
            "max_duration",
            state.max_duration(),
            "a run length in epochs, batches or samples (its schedule counts batches)",
        )
    })
}

/// The GyroDropout algorithm: surgery at `INIT`, this step's masks before every forward
/// pass, cleared at the end of the batch.
#[derive(Debug, Clone)]
pub struct GyroDropout {
    options: GyroDropoutOptions,
    gyro: Option<Gyro>,
    applied: Applied,
}

impl Default for GyroDropout {
    fn default() -> Self {
        Self::new(GyroDropoutOptions::default())
    }
}

impl GyroDropout {
    /// The algorithm with `options` (see [`GyroDropoutOptions::new`] for the checks).
    pub fn new(options: GyroDropoutOptions) -> Self {
        Self {
            options,
            gyro: None,
            applied: Applied::default(),
        }
    }
}

/// What GyroDropout needs of the model.
const NEEDS: Needs = Needs {
    algorithm: "gyro_dropout",
    kinds: &[LayerKind::DropoutSite],
    describe: "surgery-ready dropout sites",
};

impl<S: Setup> Algorithm<S> for GyroDropout
where
    S::Model: Surgical,
{
    fn name(&self) -> &str {
        "gyro_dropout"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        matches!(
            event,
            Event::Init | Event::BeforeForward | Event::BatchEnd | Event::AfterLoad
        )
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        match event {
            Event::Init => {
                let (options, batches, seed) = (self.options, run_batches(state)?, state.seed());
                let mut out = None;
                state.map_model(|mut model| {
                    out = Some(
                        NEEDS
                            .check(&mut model)
                            .map(|()| Gyro::apply(&mut model, options, seed, batches)),
                    );
                    model
                });
                // Invariant: `map_model` ran the closure.
                let (gyro, record) = out.expect("the surgery ran")?;
                self.gyro = Some(gyro);
                self.applied.keep("gyro_dropout", record);
            }
            Event::BeforeForward => {
                if let Some(g) = self.gyro.as_ref() {
                    let (batch, rank) = (state.timestamp().batch, state.world().rank);
                    state.map_model(|mut model| {
                        g.before_forward(&mut model, batch, rank);
                        model
                    });
                }
            }
            _ => state.map_model(|mut model| {
                Gyro::clear(&mut model);
                model
            }),
        }
        Ok(())
    }

    fn state_dict(&self) -> Value {
        self.applied.state_dict()
    }

    fn required_on_load(&self) -> bool {
        true
    }

    fn load_state_dict(&mut self, state: Value) -> flashover_core::Result<()> {
        self.applied
            .check("gyro_dropout", self.options.describe(), state)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "gyro_dropout", params: ["p", "sigma", "tau"]}
crate::spec::by_name! {image |p, _norm| {
    let d = GyroDropoutOptions::default();
    GyroDropout::new(GyroDropoutOptions::new(
        p.f64("p", d.p)?,
        p.usize("sigma", d.sigma)?,
        p.usize("tau", d.tau)?,
    )?)
}}

#[cfg(test)]
mod tests {
    use super::*;
    use flashover_surgery::{DropoutSite, DropoutVariant, Layers};

    /// Dropout sites of `.1` features each.
    struct Sites(Vec<DropoutVariant>, usize);

    struct Site<'a>(&'a mut DropoutVariant, usize);

    impl DropoutSite for Site<'_> {
        fn features(&self) -> usize {
            self.1
        }

        fn dropout(&mut self) -> &mut DropoutVariant {
            self.0
        }
    }

    impl Surgical for Sites {
        fn visit_layers(&mut self, layers: &mut Layers<'_>) {
            let features = self.1;
            for (i, v) in self.0.iter_mut().enumerate() {
                layers.dropout_site(&format!("site{i}"), &mut Site(v, features));
            }
        }
    }

    #[test]
    fn period_is_composers_formula_at_least_one() {
        let d = GyroDropoutOptions::default();
        assert_eq!((d.p, d.sigma, d.tau), (0.5, 256, 16));
        // 196 batches an epoch for 100 epochs (Composer's README example): 76 * 16.
        assert_eq!(d.period(196 * 100), 1216);
        assert_eq!(d.period(100), 1, "fewer batches than sigma");
    }

    #[test]
    fn masks_keep_one_minus_p_and_repeat_with_the_seed() {
        let options = GyroDropoutOptions::new(0.3, 64, 4).unwrap();
        let mut m = Sites(vec![DropoutVariant::default(); 2], 100);
        let (g, record) = Gyro::apply(&mut m, options, 7, 10_000);
        assert_eq!(record.layers, ["site0", "site1"]);
        assert_eq!(g.period(), 10_000 / 64 * 4);
        let kept = g.sites[0].masks.iter().filter(|&&k| k).count() as f64;
        let frac = kept / (64.0 * 100.0);
        // 6400 Bernoulli(0.7) draws: standard deviation 0.0057.
        assert!((frac - 0.7).abs() < 0.03, "{frac}");
        assert_ne!(
            g.sites[0].masks, g.sites[1].masks,
            "each site its own masks"
        );
        let (again, _) = Gyro::apply(&mut m, options, 7, 10_000);
        assert_eq!(again, g);
        let (other, _) = Gyro::apply(&mut m, options, 8, 10_000);
        assert_ne!(other.sites, g.sites);
    }

    #[test]
    fn picks_change_once_per_period_and_differ_by_rank() {
        let options = GyroDropoutOptions::new(0.5, 32, 4).unwrap();
        let mut m = Sites(vec![DropoutVariant::default()], 8);
        let (g, _) = Gyro::apply(&mut m, options, 1, 32 * 10);
        assert_eq!(g.period(), 40);
        let first = g.picks(0, 0, 0);
        assert_eq!(first.len(), 4);
        assert!(first.iter().all(|&j| j < 32));
        assert_eq!(g.picks(0, 39, 0), first, "same period, same picks");
        assert_ne!(g.picks(0, 40, 0), first, "next period, new picks");
        assert_ne!(g.picks(0, 0, 1), first, "another rank picks for itself");
        g.before_forward(&mut m, 5, 0);
        let masks = m.0[0].gyro.clone().unwrap();
        let (rows, keep) = masks.keep.unwrap();
        assert_eq!(rows, 4);
        let expected: Vec<bool> = first
            .iter()
            .flat_map(|&j| g.sites[0].masks[j * 8..(j + 1) * 8].to_vec())
            .collect();
        assert_eq!(keep, expected);
        Gyro::clear(&mut m);
        assert_eq!(m.0[0].gyro.as_ref().unwrap().keep, None);
    }

    #[test]
    fn bad_settings_are_named() {
        for (p, sigma, tau, name) in [
            (1.0, 8, 2, "`p`"),
            (-0.1, 8, 2, "`p`"),
            (0.5, 0, 2, "`sigma`"),
            (0.5, 8, 0, "`tau`"),
        ] {
            let e = GyroDropoutOptions::new(p, sigma, tau)
                .unwrap_err()
                .to_string();
            assert!(e.contains(name), "{e}");
        }
    }
}
