//! The training plot: loss, accuracy and learning rate against batches, drawn into one PNG at
//! `FIT_END`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use derive_new::new;

use flashover_core::callback::Callback;
use flashover_core::collective::Ranks;
use flashover_core::error::Result;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::error::CallbackError;
use crate::plot::{write_panels, LineChart, Series};

/// Draws, at `FIT_END`, a PNG of three panels against batches: the training loss (each
/// batch's, and its moving average over 20 batches) with every evaluator's loss; every
/// evaluator's accuracy; and the learning rate. Panels without data (no evaluator measures
/// accuracy) are left out.
///
/// ```no_run
/// use flashover_callbacks::TrainingPlot;
/// let plot = TrainingPlot::new("runs/mnist/training.png"); // .callback(plot)
/// # let _ = plot;
/// ```
///
/// `TrainingPlot::new(path)` draws 900x900 pixels.
#[derive(new)]
pub struct TrainingPlot {
    #[new(into)]
    path: PathBuf,
    #[new(value = "(900, 900)")]
    size: (u32, u32),
    #[new(default)]
    loss: Vec<(f64, f64)>,
    #[new(default)]
    lr: Vec<(f64, f64)>,
    #[new(default)]
    eval: BTreeMap<String, Vec<(f64, f64)>>,
}

impl TrainingPlot {
    /// Sets the image's size in pixels (each at least 200).
    pub fn with_size(mut self, width: u32, height: u32) -> crate::error::Result<Self> {
        if width < 200 || height < 200 {
            return Err(CallbackError::param(
                "training_plot",
                "size",
                format!("{width}x{height}"),
                "at least 200x200 pixels",
            ));
        }
        self.size = (width, height);
        Ok(self)
    }

    /// The panels as they stand.
    pub fn charts(&self) -> Vec<LineChart> {
        let chart = |title: &str, y: &str, series: Vec<Series>| LineChart {
            title: title.into(),
            x_label: "batches".into(),
            y_label: y.into(),
            series,
            size: self.size,
            y_range: None,
        };
        let mut charts = Vec::new();
        let mut losses = Vec::new();
        if !self.loss.is_empty() {
            losses.push(Series {
                name: "train (per batch)".into(),
                points: self.loss.clone(),
            });
            losses.push(Series {
                name: "train (mean of 20)".into(),
                points: moving_average(&self.loss, 20),
            });
        }
        let eval_with = |word: &str| -> Vec<Series> {
            self.eval
                .iter()
                .filter(|(k, _)| k.rsplit('/').next().is_some_and(|m| m.contains(word)))
                .map(|(k, v)| Series {
                    name: k.clone(),
                    points: v.clone(),
                })
                .collect()
        };
        losses.extend(eval_with("loss"));
        if !losses.is_empty() {
            charts.push(chart("loss", "loss", losses));
        }
        let accuracy = eval_with("accuracy");
        if !accuracy.is_empty() {
            charts.push(chart("accuracy", "accuracy", accuracy));
        }
        if !self.lr.is_empty() {
            charts.push(chart(
                "learning rate",
                "lr",
                vec![Series {
                    name: "lr".into(),
                    points: self.lr.clone(),
                }],
            ));
        }
        charts
    }
}

/// The mean of each point and the `window - 1` before it.
fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len());
    let mut sum = 0.0;
    for (i, &(x, y)) in points.iter().enumerate() {
        sum += y;
        if i >= window {
            sum -= points[i - window].1;
        }
        out.push((x, sum / (i + 1).min(window) as f64));
    }
    out
}

impl<S: Setup> Callback<S> for TrainingPlot {
    /// Only rank 0 of a data-parallel run writes (wrap in `OnEveryRank` to change that).
    fn ranks(&self) -> Ranks {
        Ranks::Main
    }

    fn name(&self) -> &str {
        "training_plot"
    }

    fn batch_end(&mut self, state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        let x = state.timestamp.batch as f64;
        if let Some(l) = state.loss_value {
            self.loss.push((x, l));
        }
        self.lr.push((x, state.lr));
        Ok(())
    }

    fn eval_after_all(&mut self, state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        let x = state.timestamp.batch as f64;
        for label in &state.evaluated {
            if let Some(metrics) = state.eval_metrics.get(label) {
                for (name, v) in metrics {
                    self.eval
                        .entry(format!("{label}/{name}"))
                        .or_default()
                        .push((x, *v));
                }
            }
        }
        Ok(())
    }

    fn fit_end(&mut self, _state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        let charts = self.charts();
        if charts.is_empty() {
            return Ok(());
        }
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| CallbackError::io("training_plot", dir, e))?;
        }
        write_panels(&charts, self.size, &self.path).map_err(CallbackError::from)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_average_by_hand() {
        let p = [(1.0, 2.0), (2.0, 4.0), (3.0, 6.0), (4.0, 10.0)];
        assert_eq!(
            moving_average(&p, 2),
            [(1.0, 2.0), (2.0, 3.0), (3.0, 5.0), (4.0, 8.0)]
        );
    }
}
