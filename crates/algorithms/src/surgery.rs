//! Surgery algorithms chosen by name (`--algorithms blurpool,ghost_batchnorm`), for programs
//! that also choose the model at run time: [`SurgeryByName`] asks the model for each
//! capability through [`SurgeryModel`] at `INIT` and fails with an error naming what is
//! missing. It does what the typed algorithm of the same name does ([`BlurPool`],
//! [`GhostBatchNorm`]), under the same name and with the same checkpoint state, so a run
//! configured in code resumes a run configured on the command line and the other way round.
//!
//! [`BlurPool`]: crate::blurpool::BlurPool
//! [`GhostBatchNorm`]: crate::ghost_batchnorm::GhostBatchNorm

use burn::tensor::backend::Backend;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::TrainModel;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::surgery::{
    check_surgery_record, DropoutSurgery, HalfType, SurgeryModel, SurgeryRecord,
};
use flashover_core::time::Time;
use serde_json::Value;

use crate::blurpool::{blur_convs, blur_pools, BlurPoolOptions};
use crate::error::{AlgorithmError, Result};
use crate::factorize::{apply_factorize, log_flops, log_report, FactorizeOptions};
use crate::ghost_batchnorm::{apply_ghost_batchnorm, check_size, describe};
use crate::gyro_dropout::{gyro_event, gyro_matches, run_batches, Gyro, GyroDropoutOptions};
use crate::low_precision_groupnorm::{
    apply_low_precision_groupnorm, describe as lp_describe, norm_half, unsupported,
};
use crate::squeeze_excite::{apply_squeeze_excite, SqueezeExciteOptions};
use crate::stochastic_depth::{
    apply_stochastic_depth, settle, DrawInputs, Draws, StochasticDepthOptions,
};
use crate::weight_standardization::{apply_weight_standardization, describe as ws_describe};

/// A surgery and its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NamedSurgery {
    /// BlurPool.
    BlurPool(BlurPoolOptions),
    /// GhostBatchNorm with this ghost batch size.
    GhostBatchNorm(usize),
    /// StochasticDepth.
    StochasticDepth(StochasticDepthOptions),
    /// WeightStandardization, leaving this many last convolutions alone.
    WeightStandardization(usize),
    /// SqueezeExcite.
    SqueezeExcite(SqueezeExciteOptions),
    /// GyroDropout.
    GyroDropout(GyroDropoutOptions),
    /// Factorize.
    Factorize(FactorizeOptions),
    /// LowPrecisionGroupNorm (in the backend's accelerated half type).
    LowPrecisionGroupNorm,
}

/// What a surgery reads of the run at `INIT`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunAt {
    /// Fraction of training done.
    pub fraction: f64,
    /// The run's seed.
    pub seed: u64,
    /// Training batches in the run, where its length converts to batches.
    pub batches: Option<u64>,
    /// The run's length as configured.
    pub max_duration: Time,
    /// The half type the backend runs accelerated on the run's device, if any.
    pub half: Option<HalfType>,
    /// The backend's name on the run's device.
    pub backend: String,
}

impl RunAt {
    /// What `state` says.
    pub fn of<S: Setup>(state: &State<S>) -> Self {
        Self {
            fraction: crate::util::fraction(state),
            seed: state.seed,
            batches: state
                .progress()
                .to_batches(state.max_duration)
                .map(|b| b.ceil() as u64),
            max_duration: state.max_duration,
            half: norm_half::<S::Backend>(state.precision, &state.device),
            backend: <S::Backend as Backend>::name(&state.device),
        }
    }
}

impl NamedSurgery {
    /// The algorithm's name.
    pub fn name(&self) -> &'static str {
        match self {
            NamedSurgery::BlurPool(_) => "blurpool",
            NamedSurgery::GhostBatchNorm(_) => "ghost_batchnorm",
            NamedSurgery::StochasticDepth(_) => "stochastic_depth",
            NamedSurgery::WeightStandardization(_) => "weight_standardization",
            NamedSurgery::SqueezeExcite(_) => "squeeze_excite",
            NamedSurgery::GyroDropout(_) => "gyro_dropout",
            NamedSurgery::Factorize(_) => "factorize",
            NamedSurgery::LowPrecisionGroupNorm => "low_precision_groupnorm",
        }
    }

    fn settings(&self, half: Option<HalfType>) -> String {
        match self {
            NamedSurgery::BlurPool(o) => o.describe(),
            NamedSurgery::GhostBatchNorm(g) => describe(*g),
            NamedSurgery::StochasticDepth(o) => o.describe(),
            NamedSurgery::WeightStandardization(n) => ws_describe(*n),
            NamedSurgery::SqueezeExcite(o) => o.describe(),
            NamedSurgery::GyroDropout(o) => o.describe(),
            NamedSurgery::Factorize(o) => o.describe(),
            NamedSurgery::LowPrecisionGroupNorm => lp_describe(half),
        }
    }

    /// Applies the surgery to `model` in the run `run` describes, or says which capability
    /// it lacks. GyroDropout also returns its masks and schedule, for the training steps.
    pub fn apply_to(
        &self,
        model: &mut dyn SurgeryModel,
        run: &RunAt,
    ) -> Result<(SurgeryRecord, Option<Gyro>)> {
        if let NamedSurgery::GyroDropout(options) = self {
            let batches = run_batches(run)?;
            let sites = model.dropout_surgery().ok_or(AlgorithmError::ModelLacks {
                algorithm: "gyro_dropout",
                needs: "surgery-ready dropout sites",
            })?;
            let (gyro, record) = Gyro::apply(sites, *options, run.seed, batches);
            return Ok((record, Some(gyro)));
        }
        self.apply_stateless(model, run).map(|r| (r, None))
    }

    fn apply_stateless(&self, model: &mut dyn SurgeryModel, run: &RunAt) -> Result<SurgeryRecord> {
        let fraction = run.fraction;
        let lacks = |needs: &'static str| AlgorithmError::ModelLacks {
            algorithm: self.name(),
            needs,
        };
        match self {
            NamedSurgery::BlurPool(options) => {
                let mut layers = Vec::new();
                let mut any = false;
                if let Some(convs) = model.conv_surgery() {
                    any = true;
                    blur_convs(convs, options, &mut layers);
                }
                if let Some(pools) = model.pool_surgery() {
                    any = true;
                    blur_pools(pools, options, &mut layers);
                }
                if !any {
                    return Err(lacks("surgery-ready convolutions or max pools"));
                }
                Ok(SurgeryRecord {
                    settings: options.describe(),
                    layers,
                })
            }
            NamedSurgery::GhostBatchNorm(size) => {
                check_size(*size)?;
                let norms = model
                    .norm_surgery()
                    .ok_or_else(|| lacks("surgery-ready batch norms"))?;
                apply_ghost_batchnorm(norms, *size)
            }
            NamedSurgery::StochasticDepth(options) => {
                let blocks = model
                    .residual_surgery()
                    .ok_or_else(|| lacks("surgery-ready residual blocks"))?;
                apply_stochastic_depth(blocks, options, fraction)
            }
            NamedSurgery::WeightStandardization(n) => {
                let convs = model
                    .conv_surgery()
                    .ok_or_else(|| lacks("surgery-ready convolutions"))?;
                Ok(apply_weight_standardization(convs, *n))
            }
            NamedSurgery::SqueezeExcite(options) => {
                let convs = model
                    .excite_surgery()
                    .ok_or_else(|| lacks("convolutions that take squeeze-and-excitation blocks"))?;
                Ok(apply_squeeze_excite(convs, options, run.seed))
            }
            NamedSurgery::Factorize(options) => {
                let layers = model
                    .factor_surgery()
                    .ok_or_else(|| lacks("convolutions or dense layers that can be factored"))?;
                let (record, report) = apply_factorize(layers, options);
                log_report(&report);
                Ok(record)
            }
            NamedSurgery::LowPrecisionGroupNorm => {
                let half = run.half.ok_or_else(|| unsupported(run.backend.clone()))?;
                let norms = model
                    .group_norm_surgery()
                    .ok_or_else(|| lacks("surgery-ready group norms"))?;
                Ok(apply_low_precision_groupnorm(norms, half))
            }
            NamedSurgery::GyroDropout(_) => unreachable!("apply_to handles gyro dropout"),
        }
    }
}

/// What a surgery algorithm changed, shared by every surgery algorithm: logged once at
/// `INIT`, saved as its checkpoint state, and compared with a checkpoint's on restore.
#[derive(Debug, Clone, Default)]
pub(crate) struct Applied(Option<SurgeryRecord>);

impl Applied {
    /// Keeps `record` and logs it (a warning when the model had no layer to change).
    pub(crate) fn keep(&mut self, name: &str, record: SurgeryRecord) {
        if record.layers.is_empty() {
            tracing::warn!(settings = %record.settings, "{name} changed no layer: the model has none of the layers it changes");
        } else {
            tracing::info!(layers = ?record.layers, settings = %record.settings, "{name} applied");
        }
        self.0 = Some(record);
    }

    /// The checkpoint state: the record (`null` before `INIT`).
    pub(crate) fn state_dict(&self) -> Value {
        self.0.as_ref().map_or(Value::Null, SurgeryRecord::to_value)
    }

    /// Compares a checkpoint's state with what this run applied (before `INIT`: nothing, with
    /// `settings`).
    pub(crate) fn check(
        &self,
        name: &str,
        settings: String,
        saved: Value,
    ) -> flashover_core::Result<()> {
        let applied = self.0.clone().unwrap_or(SurgeryRecord {
            settings,
            layers: Vec::new(),
        });
        check_surgery_record(name, saved, &applied)
    }

    /// Runs `surgery` on the state's model and keeps what it changed: the `INIT` step every
    /// typed surgery algorithm shares.
    pub(crate) fn run<S: Setup>(
        &mut self,
        name: &str,
        state: &mut State<S>,
        surgery: impl FnOnce(&mut S::Model) -> flashover_core::Result<SurgeryRecord>,
    ) -> flashover_core::Result<()> {
        let mut out = None;
        state.map_model(|mut model| {
            out = Some(surgery(&mut model));
            model
        });
        // Invariant: `map_model` ran the closure.
        self.keep(name, out.expect("the surgery ran")?);
        Ok(())
    }
}

/// The parts of a typed surgery algorithm's `Algorithm` impl that do not depend on the
/// surgery: its name, running at `INIT` only, and its checkpoint state (the [`Applied`] record
/// in its `applied` field, required on load and compared there with `settings`, an expression
/// over `this`, the algorithm).
macro_rules! surgery_at_init {
    ($name:expr, |$this:ident| $settings:expr) => {
        fn name(&self) -> &str {
            $name
        }

        fn matches(
            &self,
            event: flashover_core::event::Event,
            _state: &flashover_core::state::State<S>,
        ) -> bool {
            event == flashover_core::event::Event::Init
        }

        fn state_dict(&self) -> serde_json::Value {
            self.applied.state_dict()
        }

        fn required_on_load(&self) -> bool {
            true
        }

        fn load_state_dict(&mut self, state: serde_json::Value) -> flashover_core::Result<()> {
            let $this = &*self;
            let settings = $settings;
            self.applied.check($name, settings, state)
        }
    };
}
pub(crate) use surgery_at_init;

/// A [`NamedSurgery`] as an algorithm for any model that answers [`SurgeryModel`].
#[derive(Debug, Clone)]
pub struct SurgeryByName {
    surgery: NamedSurgery,
    draws: Draws,
    gyro: Option<Gyro>,
    /// The half type LowPrecisionGroupNorm chose at `INIT`.
    half: Option<HalfType>,
    applied: Applied,
}

impl SurgeryByName {
    /// The algorithm for `surgery`.
    pub fn new(surgery: NamedSurgery) -> Self {
        Self {
            surgery,
            draws: Draws::default(),
            gyro: None,
            half: None,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for SurgeryByName
where
    S::Model: SurgeryModel,
{
    fn name(&self) -> &str {
        self.surgery.name()
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        match self.surgery {
            NamedSurgery::StochasticDepth(_) => {
                matches!(
                    event,
                    Event::Init | Event::AfterLoad | Event::BeforeForward | Event::BatchEnd
                )
            }
            NamedSurgery::GyroDropout(_) => gyro_matches(event),
            _ => event == Event::Init,
        }
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        if let NamedSurgery::StochasticDepth(options) = self.surgery {
            // Residual blocks are there: INIT checked it (an error there ends the build).
            match event {
                Event::AfterLoad | Event::BatchEnd => {
                    let fraction = crate::util::fraction(state);
                    state.map_model(|mut model| {
                        if let Some(blocks) = model.residual_surgery() {
                            settle(blocks, &options, fraction);
                        }
                        model
                    });
                    return Ok(());
                }
                Event::BeforeForward => {
                    let inputs = DrawInputs::of(state);
                    let draws = &mut self.draws;
                    state.map_model(|mut model| {
                        if let Some(blocks) = model.residual_surgery() {
                            draws.before_forward(blocks, &options, &inputs);
                        }
                        model
                    });
                    return Ok(());
                }
                _ => {}
            }
        }
        if let (NamedSurgery::GyroDropout(options), false) = (self.surgery, event == Event::Init) {
            let sites: fn(&mut S::Model) -> Option<&mut dyn DropoutSurgery> =
                |m| m.dropout_surgery();
            gyro_event(options, &mut self.gyro, event, state, sites)?;
            return Ok(());
        }
        let run = RunAt::of(state);
        self.half = run.half;
        let flops_before = state.model().flops_per_sample();
        let mut result = None;
        state.map_model(|mut model| {
            result = Some(self.surgery.apply_to(&mut model, &run));
            model
        });
        // Invariant: `map_model` ran the closure.
        let (record, gyro) = result.expect("the surgery ran")?;
        if let NamedSurgery::Factorize(_) = self.surgery {
            log_flops(flops_before, state.model().flops_per_sample());
        }
        self.gyro = gyro;
        self.applied.keep(self.surgery.name(), record);
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
            .check(self.surgery.name(), self.surgery.settings(self.half), state)
    }
}
