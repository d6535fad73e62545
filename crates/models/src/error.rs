//! `ModelError`, the crate's one error enum: a shape or setting no model or layer can be
//! built or run with. Every constructor that takes sizes checks them and returns it, so no
//! configuration reaches a panic.

/// A model, layer or generation setting that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A setting out of its range.
    #[error("invalid value {value} for `{name}` of {what}: expected {expected}")]
    Config {
        /// What the setting belongs to ("a GPT", "a CIFAR ResNet", "generation").
        what: &'static str,
        /// The setting.
        name: &'static str,
        /// The value given.
        value: String,
        /// What would be accepted.
        expected: String,
    },
}

impl ModelError {
    pub(crate) fn config(
        what: &'static str,
        name: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        ModelError::Config {
            what,
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}
