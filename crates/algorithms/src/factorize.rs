//! Factorize (Composer's `Factorize`; low-rank factorization of layers as in Jaderberg, Vedaldi
//! and Zisserman, "Speeding up Convolutional Neural Networks with Low Rank Expansions", 2014,
//! and Zhang et al., "Accelerating Very Deep Convolutional Networks for Classification and
//! Detection", 2016): a convolution `in -> out` with a `k x k` kernel becomes a `k x k`
//! convolution `in -> r` followed by a `1 x 1` convolution `r -> out`, and a dense layer
//! `in -> out` becomes `in -> r -> out`, with no non-linearity between: fewer multiply-adds
//! and parameters where `r` is small enough, for a rank-`r` constraint on the layer.
//!
//! - `factorize_convs`, `factorize_linears` (both on): which layers.
//! - `min_channels` (256), `min_features` (256): a layer is factored only if it has at least
//!   this many input and output channels (features).
//! - `latent_channels` (0.25), `latent_features` (128): `r`, as a count (an integer >= 1) or,
//!   below 1, as a fraction of `min(in, out)` (rounded down, at least 1).
//! - A layer is factored only where that saves multiply-adds (Composer's rule): `r <=
//!   ceil(f * out / (f + out) - 1)` with `f = in * k * k` its fan-in; never a grouped
//!   convolution.
//!
//! The factors are initialised from the truncated SVD of the layer's current weights (the
//! best rank-`r` approximation, its singular values split evenly between the two; see
//! `flashover_models::lowrank`), so a factored layer starts as close to the original as rank
//! `r` allows; the bias moves to the second factor. Composer re-draws the factors at random
//! at `INIT` instead (its SVD solution, `factorize_matrix`, is only used when a rank is
//! lowered later, with activations); and its second factor always has a bias, where here it
//! has one only if the layer had (a convolution before a batch norm has none).
//!
//! At `INIT` it logs each layer's rank and the model's parameter and multiply-add reduction
//! (`flops_reduction`: before over after). When it helps: wide layers
//! (Composer's defaults reach only layers 256 wide or more) where compute, not memory
//! traffic, bounds a step; on small models the two smaller operations often cost more time
//! than the one they replace.
//!
//! Surgery at `INIT` on the convolutions and dense layers the model shows ([`Surgical`]): the layer's weight parameter
//! keeps its name and id but becomes empty (no values, never trained), and the factors are
//! new parameters (`<layer>.factors.first`, `<layer>.factors.second`). The layers factored
//! are the checkpoint state; a checkpoint of another surgery is refused.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::TrainModel;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{ConvInfo, LayerKind, LinearInfo, SurgeryRecord, Surgical, SurgicalExt};

use crate::error::Result;
use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "factorize",
    kinds: &[LayerKind::Conv, LayerKind::Linear],
    describe: "convolutions or dense layers that can be factored",
};
use crate::util::check_latent;

/// Factorize's settings (Composer's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FactorizeOptions {
    /// Factor convolutions.
    pub factorize_convs: bool,
    /// Factor dense layers.
    pub factorize_linears: bool,
    /// Least input and output channels of a convolution to factor.
    pub min_channels: usize,
    /// A factored convolution's rank: a count, or below 1 a fraction of `min(in, out)`.
    pub latent_channels: f64,
    /// Least input and output features of a dense layer to factor.
    pub min_features: usize,
    /// A factored dense layer's rank: a count, or below 1 a fraction of `min(in, out)`.
    pub latent_features: f64,
}

impl Default for FactorizeOptions {
    fn default() -> Self {
        Self {
            factorize_convs: true,
            factorize_linears: true,
            min_channels: 256,
            latent_channels: 0.25,
            min_features: 256,
            latent_features: 128.0,
        }
    }
}

/// A rank `spec` (a count, or below 1 a fraction of `min(a, b)`, at least 1) for a layer
/// `a -> b`.
fn latent_size(spec: f64, a: usize, b: usize) -> usize {
    if spec >= 1.0 {
        spec as usize
    } else {
        ((spec * a.min(b) as f64) as usize).max(1)
    }
}

/// The largest rank at which two factors of a layer with fan-in `fan_in` and `out` outputs
/// cost fewer multiply-adds than the layer: below `fan_in * out / (fan_in + out)`.
pub fn max_rank_with_speedup(fan_in: usize, out: usize) -> usize {
    let breakeven = (fan_in * out) as f64 / (fan_in + out) as f64;
    (breakeven - 1.0).ceil().max(0.0) as usize
}

impl FactorizeOptions {
    /// The settings, checked (ranks a fraction in `(0, 1)` or a whole count).
    pub fn check(self) -> Result<Self> {
        check_latent("factorize", "latent_channels", self.latent_channels)?;
        check_latent("factorize", "latent_features", self.latent_features)?;
        Ok(self)
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "factorize:factorize_convs={}:factorize_linears={}:min_channels={}:latent_channels={}:min_features={}:latent_features={}",
            self.factorize_convs,
            self.factorize_linears,
            self.min_channels,
            self.latent_channels,
            self.min_features,
            self.latent_features
        )
    }

    /// The rank `conv` gets, or `None` where it stays whole.
    pub fn conv_rank(&self, conv: &ConvInfo) -> Option<usize> {
        let (i, o) = (conv.in_channels, conv.out_channels);
        if !self.factorize_convs || conv.groups != 1 || i.min(o) < self.min_channels {
            return None;
        }
        let r = latent_size(self.latent_channels, i, o);
        (r <= max_rank_with_speedup(i * conv.kernel[0] * conv.kernel[1], o)).then_some(r)
    }

    /// The rank `linear` gets, or `None` where it stays whole.
    pub fn linear_rank(&self, linear: &LinearInfo) -> Option<usize> {
        let (i, o) = (linear.in_features, linear.out_features);
        if !self.factorize_linears || i.min(o) < self.min_features {
            return None;
        }
        let r = latent_size(self.latent_features, i, o);
        (r <= max_rank_with_speedup(i, o)).then_some(r)
    }
}

/// What factoring changed, layer by layer: `(path, rank, weights before, weights after)`
/// (weights: multiply-adds per output position, the same count).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FactorReport {
    /// The layers factored.
    pub layers: Vec<(String, usize, usize, usize)>,
}

/// Factors the layers of `model` that `options` selects (the functional form; call it
/// before building the optimizer) and returns what it changed with the per-layer figures.
pub fn apply_factorize<M: Surgical + ?Sized>(
    model: &mut M,
    options: &FactorizeOptions,
) -> (SurgeryRecord, FactorReport) {
    let mut report = FactorReport::default();
    let mut conv = |c: &ConvInfo| {
        let r = options.conv_rank(c)?;
        let f = c.in_channels * c.kernel[0] * c.kernel[1];
        let o = c.out_channels;
        report
            .layers
            .push((c.path.clone(), r, f * o, r * f + o * r));
        Some(r)
    };
    let mut linears = Vec::new();
    let mut linear = |l: &LinearInfo| {
        let r = options.linear_rank(l)?;
        let (i, o) = (l.in_features, l.out_features);
        linears.push((l.path.clone(), r, i * o, r * i + o * r));
        Some(r)
    };
    let layers = model.factorize(&mut conv, &mut linear);
    report.layers.extend(linears);
    (
        SurgeryRecord {
            settings: options.describe(),
            layers,
        },
        report,
    )
}

/// The Factorize algorithm: [`apply_factorize`] at `INIT`.
#[derive(Debug, Clone, Default)]
pub struct Factorize {
    options: FactorizeOptions,
    applied: Applied,
}

impl Factorize {
    /// The algorithm with `options`, checked.
    pub fn new(options: FactorizeOptions) -> Result<Self> {
        Ok(Self {
            options: options.check()?,
            applied: Applied::default(),
        })
    }
}

/// Logs a factorization: each layer's rank and weights before and after.
pub(crate) fn log_report(report: &FactorReport) {
    for (path, rank, before, after) in &report.layers {
        tracing::info!(layer = %path, rank, weights_before = before, weights_after = after, "factorize");
    }
}

/// Logs the model's multiply-add reduction (before over after), where the model counts them.
pub(crate) fn log_flops(before: Option<f64>, after: Option<f64>) {
    if let (Some(b), Some(a)) = (before, after) {
        tracing::info!(
            flops_before = b,
            flops_after = a,
            flops_reduction = b / a,
            "factorize: the model's floating-point operations per sample, before over after"
        );
    }
}

impl<S: Setup> Algorithm<S> for Factorize
where
    S::Model: Surgical,
{
    surgery_at_init!("factorize", |this| this.options.describe());

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let before = state.model().flops_per_sample();
        let mut report = None;
        self.applied.run(NEEDS, state, |model| {
            let (record, layers) = apply_factorize(model, &self.options);
            report = Some(layers);
            Ok(record)
        })?;
        // Invariant: `run` ran the surgery.
        log_report(&report.expect("the surgery ran"));
        log_flops(before, state.model().flops_per_sample());
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "factorize",
    params: [
        "factorize_convs",
        "factorize_linears",
        "min_channels",
        "latent_channels",
        "min_features",
        "latent_features",
    ],
}
crate::spec::by_name! {image |p, _norm| Factorize::new(options_by_name(p)?)?}
crate::spec::by_name! {language |p| Factorize::new(options_by_name(p)?)?}

/// Factorize's settings from its `--algorithms` parameters, checked.
fn options_by_name(p: &crate::spec::Params<'_>) -> Result<FactorizeOptions> {
    let d = FactorizeOptions::default();
    FactorizeOptions {
        factorize_convs: p.bool("factorize_convs", d.factorize_convs)?,
        factorize_linears: p.bool("factorize_linears", d.factorize_linears)?,
        min_channels: p.usize("min_channels", d.min_channels)?,
        latent_channels: p.f64("latent_channels", d.latent_channels)?,
        min_features: p.usize("min_features", d.min_features)?,
        latent_features: p.f64("latent_features", d.latent_features)?,
    }
    .check()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(i: usize, o: usize, k: usize, groups: usize) -> ConvInfo {
        ConvInfo {
            path: "c".into(),
            in_channels: i,
            out_channels: o,
            kernel: [k, k],
            stride: [1, 1],
            groups,
        }
    }

    #[test]
    fn ranks_follow_composers_rules() {
        let d = FactorizeOptions::default();
        // 256 -> 256, 3x3: a quarter of 256 is 64, well under the break-even 230.
        assert_eq!(d.conv_rank(&conv(256, 256, 3, 1)), Some(64));
        assert_eq!(d.conv_rank(&conv(128, 256, 3, 1)), None, "too narrow");
        assert_eq!(d.conv_rank(&conv(256, 256, 3, 4)), None, "grouped");
        // 1x1, 256 -> 256: break-even 128, so rank 127 at most.
        assert_eq!(max_rank_with_speedup(256, 256), 127);
        let half = FactorizeOptions {
            latent_channels: 128.0,
            ..d
        };
        assert_eq!(
            half.conv_rank(&conv(256, 256, 1, 1)),
            None,
            "no saving at 128"
        );
        let lin = |i, o| LinearInfo {
            path: "l".into(),
            in_features: i,
            out_features: o,
        };
        assert_eq!(d.linear_rank(&lin(512, 256)), Some(128));
        assert_eq!(d.linear_rank(&lin(256, 256)), None, "128 = break-even");
        let off = FactorizeOptions {
            factorize_linears: false,
            ..d
        };
        assert_eq!(off.linear_rank(&lin(512, 256)), None);
        // 10 -> 20 at 3x3 with rank 0.25: floor(2.5) = 2.
        let small = FactorizeOptions {
            min_channels: 1,
            ..d
        };
        assert_eq!(small.conv_rank(&conv(10, 20, 3, 1)), Some(2));
    }

    #[test]
    fn bad_ranks_are_named() {
        let bad = FactorizeOptions {
            latent_features: 1.5,
            ..Default::default()
        };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains("latent_features") && e.contains("1.5"), "{e}");
    }
}
