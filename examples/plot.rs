//! Draws a line chart from a JSON description, for programs that hold their curves as data
//! but should not link the plotting stack themselves (`cargo xtask bench` draws the language
//! model's time-to-loss chart with it).
//!
//! ```text
//! cargo run --release --example plot -- chart.json chart.png
//! ```
//!
//! The JSON: `{"title": "...", "x_label": "...", "y_label": "...", "size": [960, 600],
//! "y_range": [lo, hi] (optional), "series": [{"name": "...", "points": [[x, y], ...]}, ...]}`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use flashover::callbacks::plot::{LineChart, Series};
use serde::Deserialize;

/// Draw a line chart described by a JSON file into a PNG file.
#[derive(Parser, Debug)]
struct Args {
    /// The chart's description (see the module documentation for its form).
    spec: PathBuf,
    /// Where to write the PNG.
    out: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    title: String,
    x_label: String,
    y_label: String,
    #[serde(default = "default_size")]
    size: (u32, u32),
    #[serde(default)]
    y_range: Option<(f64, f64)>,
    series: Vec<SeriesSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeriesSpec {
    name: String,
    points: Vec<(f64, f64)>,
}

fn default_size() -> (u32, u32) {
    (960, 600)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.spec)
        .with_context(|| format!("reading {}", args.spec.display()))?;
    let spec: Spec = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a chart description", args.spec.display()))?;
    if spec.series.is_empty() {
        anyhow::bail!("{}: the chart has no series", args.spec.display());
    }
    let chart = LineChart {
        title: spec.title,
        x_label: spec.x_label,
        y_label: spec.y_label,
        size: spec.size,
        y_range: spec.y_range,
        series: spec
            .series
            .into_iter()
            .map(|s| Series {
                name: s.name,
                points: s.points,
            })
            .collect(),
    };
    chart
        .write_png(&args.out)
        .with_context(|| format!("drawing {}", args.out.display()))?;
    Ok(())
}
