//! What the surgery algorithms share: what a surgery needs of the model ([`Needs`]: at least
//! one layer of the kinds it changes, else an error at `INIT` naming them), and the record
//! each keeps of what it changed, logged, saved as its checkpoint state and compared on
//! restore ([`Applied`]).
//!
//! Each surgery is one typed algorithm ([`BlurPool`], [`GhostBatchNorm`], ...) for every model
//! that implements [`Surgical`]; the by-name builder (`--algorithms blurpool`) builds the same
//! algorithm, so a run configured in code resumes a run configured on the command line and
//! the other way round.
//!
//! [`BlurPool`]: crate::blurpool::BlurPool
//! [`GhostBatchNorm`]: crate::ghost_batchnorm::GhostBatchNorm

use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{check_surgery_record, LayerKind, SurgeryRecord, Surgical, SurgicalExt};
use serde_json::Value;

use crate::error::{AlgorithmError, Result};

/// What a surgery algorithm needs of the model: at least one layer of one of `kinds`,
/// described as `describe` in the error where the model shows none.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Needs {
    /// The algorithm.
    pub(crate) algorithm: &'static str,
    /// The kinds of layer it changes.
    pub(crate) kinds: &'static [LayerKind],
    /// Them, for the error (`surgery-ready batch norms`).
    pub(crate) describe: &'static str,
}

impl Needs {
    /// An error naming what is missing, unless `model` shows a layer of one of the kinds.
    pub(crate) fn check<M: Surgical + ?Sized>(&self, model: &mut M) -> Result<()> {
        if self.kinds.iter().any(|&k| model.has(k)) {
            Ok(())
        } else {
            Err(AlgorithmError::ModelLacks {
                algorithm: self.algorithm,
                needs: self.describe,
            })
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
        check_surgery_record(name, saved, &applied).map_err(|e| {
            flashover_core::CoreError::External {
                component: name.to_string(),
                source: Box::new(e),
            }
        })
    }

    /// Checks that the state's model has what `needs` names, runs `surgery` on it and keeps
    /// what it changed: the `INIT` step every surgery algorithm shares.
    pub(crate) fn run<S: Setup>(
        &mut self,
        needs: Needs,
        state: &mut State<S>,
        surgery: impl FnOnce(&mut S::Model) -> flashover_core::Result<SurgeryRecord>,
    ) -> flashover_core::Result<()>
    where
        S::Model: Surgical,
    {
        let mut out = None;
        state.map_model(|mut model| {
            out = Some(match needs.check(&mut model) {
                Ok(()) => surgery(&mut model),
                Err(e) => Err(e.into()),
            });
            model
        });
        // Invariant: `map_model` ran the closure.
        self.keep(needs.algorithm, out.expect("the surgery ran")?);
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
