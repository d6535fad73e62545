//! Line charts as PNG files (plotters, drawn in memory, no system libraries). Text is drawn
//! with a TrueType font read at run time from the usual system locations (Debian's
//! `fonts-dejavu-core` provides one); without a font the chart is an error that says so,
//! rather than an image without labels.
//!
//! This module writes the one file it is asked to write and nothing else.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// Where fonts are looked for, in order.
pub const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// What can go wrong when drawing a chart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// No usable font was found.
    #[error("no TrueType font for chart text; looked for {tried}; install one (Debian: apt-get install fonts-dejavu-core)")]
    NoFont {
        /// The paths tried, comma-separated.
        tried: String,
    },
    /// The chart has nothing to draw.
    #[error("chart {path} has no points to draw")]
    Empty {
        /// The file that was asked for.
        path: PathBuf,
    },
    /// Drawing or writing failed.
    #[error("cannot draw chart {path}: {reason}")]
    Draw {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
}

/// One named line.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// `(x, y)` points, drawn in order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart: title, axis labels, lines, size in pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    /// Title above the plot.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Width and height in pixels.
    pub size: (u32, u32),
    /// Fixed y range; the data's range (with a margin) when `None`.
    pub y_range: Option<(f64, f64)>,
}

static FONT: OnceLock<Result<(), String>> = OnceLock::new();

fn ensure_font() -> Result<(), PlotError> {
    let r = FONT.get_or_init(|| {
        for p in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps registered fonts for the life of the process; leaking the one
                // font read here is what it asks for (`&'static [u8]`).
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(FONT_PATHS.join(", "))
    });
    r.clone().map_err(|tried| PlotError::NoFont { tried })
}

fn range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return None;
    }
    let pad = if hi > lo {
        (hi - lo) * 0.05
    } else {
        lo.abs().max(1.0) * 0.05
    };
    Some((lo - pad, hi + pad))
}

impl LineChart {
    /// Draws the chart into a PNG file at `path`.
    pub fn write_png(&self, path: &Path) -> Result<(), PlotError> {
        write_panels(std::slice::from_ref(self), self.size, path)
    }

    fn draw_on(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
        path: &Path,
    ) -> Result<(), PlotError> {
        let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let empty = || PlotError::Empty {
            path: path.to_path_buf(),
        };
        let (x0, x1) = range(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0)),
        )
        .ok_or_else(empty)?;
        let (y0, y1) = match self.y_range {
            Some(r) => r,
            None => range(
                self.series
                    .iter()
                    .flat_map(|s| s.points.iter().map(|p| p.1)),
            )
            .ok_or_else(empty)?,
        };
        // The legend goes to the right-hand corner the lines end farther from.
        let ends: Vec<f64> = self
            .series
            .iter()
            .filter_map(|s| s.points.last().map(|p| p.1))
            .collect();
        let mid = (y0 + y1) / 2.0;
        let legend_position = if ends.iter().filter(|&&y| y > mid).count() * 2 >= ends.len() {
            SeriesLabelPosition::LowerRight
        } else {
            SeriesLabelPosition::UpperRight
        };
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| draw_err(&e))?;
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .draw()
            .map_err(|e| draw_err(&e))?;
        for (i, s) in self.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied().filter(|p| p.1.is_finite()),
                    color.stroke_width(2),
                ))
                .map_err(|e| draw_err(&e))?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(legend_position)
            .draw()
            .map_err(|e| draw_err(&e))?;
        Ok(())
    }
}

/// Draws `charts` stacked top to bottom in one PNG of `size` pixels at `path` (each chart's
/// own `size` is ignored). Charts without points are an error, like a single empty chart.
pub fn write_panels(charts: &[LineChart], size: (u32, u32), path: &Path) -> Result<(), PlotError> {
    ensure_font()?;
    if charts.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
        });
    }
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| PlotError::Draw {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let areas = root.split_evenly((charts.len(), 1));
    for (chart, area) in charts.iter().zip(&areas) {
        chart.draw_on(area, path)?;
    }
    root.present().map_err(|e| PlotError::Draw {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_of_the_requested_size() {
        let dir = std::env::temp_dir().join(format!("flashover-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.png");
        let chart = LineChart {
            title: "accuracy".into(),
            x_label: "seconds".into(),
            y_label: "accuracy".into(),
            series: vec![
                Series {
                    name: "a".into(),
                    points: vec![(0.0, 0.5), (1.0, 0.9), (2.0, 0.95)],
                },
                Series {
                    name: "b".into(),
                    points: vec![(0.0, 0.4), (2.0, 0.97)],
                },
            ],
            size: (640, 400),
            y_range: None,
        };
        match chart.write_png(&path) {
            Ok(()) => {
                let bytes = std::fs::read(&path).unwrap();
                assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
                // IHDR: width and height, big-endian, at bytes 16..24.
                let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
                let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
                assert_eq!((w, h), (640, 400));
            }
            Err(PlotError::NoFont { .. }) if FONT_PATHS.iter().all(|p| !Path::new(p).exists()) => {
                // Honest about the missing font rather than drawing without labels.
            }
            Err(e) => panic!("{e}"),
        }
        let empty = LineChart {
            series: vec![],
            ..chart
        };
        assert!(matches!(
            empty.write_png(&dir.join("e.png")),
            Err(PlotError::Empty { .. }) | Err(PlotError::NoFont { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
