//! The training plot: loss, accuracy and learning rate against batches, drawn into one PNG at
//! `FIT_END` (or by the caller, after its own results are written); a plot that cannot be
//! drawn is a warning, never a lost run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use derive_new::new;

use flashover_core::callback::{Callback, Control};
use flashover_core::collective::Ranks;
use flashover_core::error::Result;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::error::CallbackError;
use crate::files::check_writable_dir;
use crate::plot::{write_panels, LineChart, PlotError, Series};

/// Draws, at `FIT_END`, a PNG of three panels against batches: the training loss (each
/// batch's, and its moving average over 20 batches) with every evaluator's loss; every
/// evaluator's accuracy; and the learning rate. Panels without data (no evaluator measures
/// accuracy) are left out.
///
/// A plot is never worth a run: its folder is checked at `INIT` (an unwritable path fails
/// before the first batch), but a chart that cannot be drawn at the end (no font installed,
/// a full disk) is a warning, and training, checkpoints and logs carry on. A program that
/// writes its own results after `fit` can draw the plot after them instead:
/// [`drawn_by_caller`](Self::drawn_by_caller), then [`draw_or_warn`](Self::draw_or_warn) on a
/// clone (clones share the recorded points).
///
/// ```no_run
/// use flashover_callbacks::TrainingPlot;
/// let plot = TrainingPlot::new("runs/mnist/training.png"); // .callback(plot)
/// # let _ = plot;
/// ```
///
/// `TrainingPlot::new(path)` draws 900x900 pixels.
#[derive(Clone, new)]
pub struct TrainingPlot {
    #[new(into)]
    path: PathBuf,
    #[new(value = "(900, 900)")]
    size: (u32, u32),
    #[new(value = "false")]
    deferred: bool,
    #[new(default)]
    points: Arc<Mutex<Points>>,
}

/// What the plot has recorded.
#[derive(Default)]
struct Points {
    loss: Vec<(f64, f64)>,
    lr: Vec<(f64, f64)>,
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

    /// Records during training but does not draw at `FIT_END`: the caller draws with
    /// [`draw_or_warn`](Self::draw_or_warn) (or [`draw`](Self::draw)) when its own results
    /// are safe.
    pub fn drawn_by_caller(mut self) -> Self {
        self.deferred = true;
        self
    }

    fn points(&self) -> std::sync::MutexGuard<'_, Points> {
        // The points are plain vectors, consistent after every push: a panic elsewhere while
        // the lock was held leaves nothing half-written to recover from.
        self.points.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Draws the chart now (nothing when nothing was recorded).
    pub fn draw(&self) -> std::result::Result<(), PlotError> {
        let charts = self.charts();
        if charts.is_empty() {
            return Ok(());
        }
        // Drawing is third-party code over a font read from disk: a panic there is caught
        // and reported like any other failure to draw.
        let path = self.path.clone();
        let size = self.size;
        std::panic::catch_unwind(move || write_panels(&charts, size, &path)).unwrap_or_else(|_| {
            Err(PlotError::Draw {
                path: self.path.clone(),
                reason: "the chart library panicked".into(),
            })
        })
    }

    /// The file the chart is drawn into.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Draws the chart, and if it cannot be drawn logs a warning naming the reason and returns
    /// `false`; the run's other results are never lost to a plot.
    pub fn draw_or_warn(&self) -> bool {
        match self.draw() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "training plot not drawn; the run's other results are unaffected");
                false
            }
        }
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
        let p = self.points();
        let mut charts = Vec::new();
        let mut losses = Vec::new();
        if !p.loss.is_empty() {
            losses.push(Series {
                name: "train (per batch)".into(),
                points: p.loss.clone(),
            });
            losses.push(Series {
                name: "train (mean of 20)".into(),
                points: moving_average(&p.loss, 20),
            });
        }
        let eval_with = |word: &str| -> Vec<Series> {
            p.eval
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
        if !p.lr.is_empty() {
            charts.push(chart(
                "learning rate",
                "lr",
                vec![Series {
                    name: "lr".into(),
                    points: p.lr.clone(),
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

    /// The folder is created and checked before the first batch.
    fn init(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            check_writable_dir(dir).map_err(|e| CallbackError::io("training_plot", dir, e))?;
        }
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        let x = state.timestamp().batch as f64;
        let mut p = self.points();
        if let Some(l) = state.loss_value() {
            p.loss.push((x, l));
        }
        p.lr.push((x, state.lr()));
        Ok(())
    }

    fn eval_after_all(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        let x = state.timestamp().batch as f64;
        let mut p = self.points();
        for label in state.evaluated() {
            if let Some(metrics) = state.eval_metrics().get(label) {
                for (name, v) in metrics {
                    p.eval
                        .entry(format!("{label}/{name}"))
                        .or_default()
                        .push((x, *v));
                }
            }
        }
        Ok(())
    }

    /// Draws (unless the caller draws), warning instead of failing when it cannot.
    fn fit_end(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if !self.deferred {
            self.draw_or_warn();
        }
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
