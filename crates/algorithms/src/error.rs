//! The one error type of `flashover-algorithms`: bad hyperparameters, unknown names in an
//! algorithm list, and saved states that do not fit the model. Each names the value and what
//! would be accepted.

use flashover_core::CoreError;

/// Everything that can go wrong in `flashover-algorithms`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AlgorithmError {
    /// A hyperparameter is out of range.
    #[error("{algorithm}: invalid value {value} for `{name}`: expected {expected}")]
    InvalidParameter {
        /// The algorithm.
        algorithm: &'static str,
        /// The hyperparameter.
        name: &'static str,
        /// The value as given.
        value: String,
        /// What would be accepted.
        expected: String,
    },

    /// A surgery algorithm chosen by name was given a model without the layers it changes.
    #[error("{algorithm} needs a model with {needs}, and this model has none: use a model built from flashover-models' layers (for example the ResNets) or implement the surgery traits of flashover_core::surgery for it")]
    ModelLacks {
        /// The algorithm.
        algorithm: &'static str,
        /// What it needs.
        needs: &'static str,
    },

    /// An algorithm list names an algorithm that does not exist.
    #[error("unknown algorithm {name:?}; valid names: {valid}")]
    UnknownAlgorithm {
        /// The name as given.
        name: String,
        /// The valid names, comma-separated.
        valid: String,
    },

    /// An algorithm list gives a parameter the algorithm does not have.
    #[error("unknown parameter {name:?} for {algorithm}; valid parameters: {valid}")]
    UnknownParameter {
        /// The algorithm.
        algorithm: String,
        /// The parameter as given.
        name: String,
        /// Its valid parameters, comma-separated (or "none").
        valid: String,
    },

    /// An algorithm list could not be parsed, or a value in it has the wrong type.
    #[error("cannot parse algorithm list {input:?}: {reason}")]
    Parse {
        /// The offending part of the list.
        input: String,
        /// What is wrong and what is expected.
        reason: String,
    },

    /// An unknown recipe name.
    #[error("unknown recipe {name:?}; valid recipes: {valid}")]
    UnknownRecipe {
        /// The name as given.
        name: String,
        /// The valid names.
        valid: String,
    },

    /// An algorithm set soft targets (class distributions) that the model's loss never read:
    /// the loss scores the class indices, so the algorithm would silently do nothing.
    #[error("{algorithm} set soft targets (class distributions) that the model's loss did not read, so it would train as if {algorithm} were off: compute the loss with `flashover::core::loss::classification_loss(logits, batch)` (or `per_sample_classification_loss`, or read `batch.soft_targets()`), not `cross_entropy` on the class indices; or remove {algorithm}")]
    SoftTargetsIgnored {
        /// The algorithm.
        algorithm: &'static str,
    },

    /// A saved algorithm state does not fit this run (a checkpoint from another model).
    #[error("{algorithm}: cannot restore saved state: {reason}")]
    BadState {
        /// The algorithm.
        algorithm: &'static str,
        /// What does not fit.
        reason: String,
    },

    /// The batch does not have the shape the algorithm needs.
    #[error("{algorithm}: {reason}")]
    BadBatch {
        /// The algorithm.
        algorithm: &'static str,
        /// What is wrong with the batch.
        reason: String,
    },
}

/// Shorthand for results in this crate.
pub type Result<T, E = AlgorithmError> = std::result::Result<T, E>;

impl AlgorithmError {
    /// Builds an [`AlgorithmError::InvalidParameter`].
    pub fn param(
        algorithm: &'static str,
        name: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        AlgorithmError::InvalidParameter {
            algorithm,
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}

impl From<AlgorithmError> for CoreError {
    fn from(e: AlgorithmError) -> Self {
        let component = match &e {
            AlgorithmError::InvalidParameter { algorithm, .. }
            | AlgorithmError::ModelLacks { algorithm, .. }
            | AlgorithmError::BadState { algorithm, .. }
            | AlgorithmError::BadBatch { algorithm, .. } => algorithm.to_string(),
            _ => "algorithms".to_string(),
        };
        CoreError::External {
            component,
            source: Box::new(e),
        }
    }
}

/// Checks that `value` is finite and within `[low, high]`.
pub(crate) fn check_range(
    algorithm: &'static str,
    name: &'static str,
    value: f64,
    low: f64,
    high: f64,
) -> Result<()> {
    if value.is_finite() && value >= low && value <= high {
        Ok(())
    } else {
        Err(AlgorithmError::param(
            algorithm,
            name,
            value,
            format!("a number from {low} to {high}"),
        ))
    }
}
