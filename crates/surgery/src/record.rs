//! What a surgery algorithm did to a model, saved as its checkpoint state and compared on
//! restore: a checkpoint shaped by other surgery (or the same surgery with other settings) is
//! refused with both descriptions.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What one surgery algorithm did to a model: its settings and the layers it changed, in
/// module order. Saved as the algorithm's checkpoint state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SurgeryRecord {
    /// The algorithm's settings as it describes them (its CLI form, for example
    /// `blurpool:replace_convs=true:replace_maxpools=true:blur_first=true:min_channels=16`).
    pub settings: String,
    /// Paths of the layers changed.
    pub layers: Vec<String>,
}

impl SurgeryRecord {
    /// The record as checkpoint state.
    pub fn to_value(&self) -> Value {
        // Invariant: a struct of strings always serialises.
        serde_json::to_value(self).expect("a surgery record serialises")
    }

    /// `settings on [layer, layer]`, as errors show it.
    pub fn describe(&self) -> String {
        format!("{} on [{}]", self.settings, self.layers.join(", "))
    }
}

/// A checkpoint's surgery record that is not this run's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the checkpoint's model was changed by {algorithm} as `{saved}`, this run's as `{applied}`: build the run with the checkpoint's algorithms and settings (or load its weights into a model with the same architecture)")]
pub struct SurgeryMismatch {
    /// The surgery algorithm.
    pub algorithm: String,
    /// What the checkpoint records (settings and layers), or the state that is not a record.
    pub saved: String,
    /// What this run applied.
    pub applied: String,
}

/// Compares the surgery record a checkpoint saved (`saved`, the algorithm's state) with what
/// the algorithm did to this run's model (`applied`): an error naming both when they differ
/// (other settings, or other layers changed: another model), or when the saved state is not
/// a record at all.
pub fn check_surgery_record(
    name: &str,
    saved: Value,
    applied: &SurgeryRecord,
) -> Result<(), SurgeryMismatch> {
    let mismatch = |saved: String| SurgeryMismatch {
        algorithm: name.to_string(),
        saved,
        applied: applied.describe(),
    };
    let saved: SurgeryRecord = serde_json::from_value(saved.clone())
        .map_err(|e| mismatch(format!("{saved} (not a surgery record: {e})")))?;
    if &saved == applied {
        Ok(())
    } else {
        Err(mismatch(saved.describe()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(settings: &str, layers: &[&str]) -> SurgeryRecord {
        SurgeryRecord {
            settings: settings.into(),
            layers: layers.iter().map(|l| l.to_string()).collect(),
        }
    }

    #[test]
    fn a_record_matches_itself_and_names_both_sides_otherwise() {
        let applied = record("blurpool:min_channels=16", &["blocks.1.conv1"]);
        assert_eq!(
            check_surgery_record("blurpool", applied.to_value(), &applied),
            Ok(())
        );
        let other = record("blurpool:min_channels=16", &["stem"]);
        let e = check_surgery_record("blurpool", other.to_value(), &applied).unwrap_err();
        assert_eq!(e.saved, "blurpool:min_channels=16 on [stem]");
        assert_eq!(e.applied, "blurpool:min_channels=16 on [blocks.1.conv1]");
        let e = check_surgery_record("blurpool", Value::from(3), &applied).unwrap_err();
        assert!(
            e.saved.starts_with("3 (not a surgery record"),
            "{}",
            e.saved
        );
        assert!(e.to_string().contains("changed by blurpool"), "{e}");
    }
}
