//! Time to accuracy: trains the baseline (the example's default run) and each recipe on the
//! bundled MNIST data, evaluating on the 2,000 test digits every `--eval-every` batches, and
//! reports for each recipe the training seconds to first reach the baseline's final test
//! accuracy against the baseline's own seconds to reach it (the same rule for both), its
//! final accuracy, and every run's accuracy at the shortest run's training time (accuracy at
//! equal wall time). Runs are interleaved (baseline, mild, medium, hot, baseline, ...);
//! times to the target are medians over `--reps`: the first repetition trains every run to its
//! end (the target, final accuracies and curves are its), the later ones stop each run at the
//! evaluation that reaches the target. Training seconds exclude evaluation. With `--model
//! resnet8` (or another ResNet) the baseline is that ResNet and the recipes are the ResNet
//! recipes (`resnet-mild`, `resnet-medium`, `resnet-hot`). With `--stack ALGORITHMS@RATIO`
//! (repeatable) your own stacks replace the recipes: the algorithms in the `--algorithms`
//! syntax, trained with that scale-schedule ratio.
//!
//! ```text
//! cargo run --release --example time_to_accuracy -- --reps 3
//! cargo run --release --example time_to_accuracy -- --reps 3 --model resnet8 --max-duration 3ep
//! cargo run --release --example time_to_accuracy -- --reps 1 --model resnet8 --max-duration 3ep \
//!     --stack 'blurpool,label_smoothing:smoothing=0.1@0.5'
//! ```

use anyhow::Context;
use clap::Parser;
use flashover::algorithms::recipes::{RECIPES, RESNET_RECIPES};
use flashover::algorithms::spec::parse_list;
use flashover::backend::COMPILED;
use flashover::callbacks::plot::{LineChart, Series};
use flashover::callbacks::MetricStopper;
use flashover::core::time::Time;
use flashover::models::TrainBackend;
use flashover_examples::{
    median_min_max, CurvePoint, MetricCurve, MnistCnn, MnistModel, MnistRun, ModelKind,
};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Seconds to the baseline's accuracy, per recipe, on the bundled MNIST data.
#[derive(Debug, Parser)]
struct Args {
    /// Repetitions of each run (interleaved).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Evaluate every this many batches.
    #[arg(long, default_value_t = 25)]
    eval_every: u64,
    /// Backend, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
    /// Also write the curves as JSON here.
    #[arg(long)]
    curves: Option<std::path::PathBuf>,
    /// Also draw the curves (first repetition of each run) as a PNG here.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// The model: cnn (the main job's, with the CNN recipes) or a ResNet (resnet8, resnet20,
    /// ..., with the ResNet recipes).
    #[arg(long, default_value = "cnn")]
    model: ModelKind,
    /// The baseline's length (default: the main job's); recipes scale it by their ratio.
    #[arg(long)]
    max_duration: Option<Time>,
    /// Train on only the first this many digits (quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// A ResNet's first-stage width (default: the model's, 16); the later stages keep their
    /// ratios to it.
    #[arg(long)]
    width: Option<usize>,
    /// Compare this stack instead of the recipes: `ALGORITHMS@RATIO`, the algorithms in the
    /// `--algorithms` syntax and a scale-schedule ratio in (0, 1] (repeatable; named stack-1,
    /// stack-2, ...).
    #[arg(long = "stack")]
    stacks: Vec<String>,
    /// The runs' seed (weights, data order and algorithms' draws); the default is the main
    /// job's.
    #[arg(long, default_value_t = flashover_examples::defaults::SEED)]
    seed: u64,
}

/// One compared run: the baseline, a recipe or a `--stack`.
#[derive(Debug, Clone)]
struct Entry {
    label: String,
    /// In the `--algorithms` syntax; empty for the baseline.
    algorithms: String,
    scale_schedule_ratio: f64,
}

impl Entry {
    fn describe(&self) -> String {
        if self.algorithms.is_empty() {
            "(none)".to_string()
        } else {
            format!("{} (ssr {})", self.algorithms, self.scale_schedule_ratio)
        }
    }
}

impl Args {
    /// The baseline, then the recipes (or the `--stack`s) compared with it.
    fn entries(&self) -> anyhow::Result<Vec<Entry>> {
        let mut entries = vec![Entry {
            label: "baseline".into(),
            algorithms: String::new(),
            scale_schedule_ratio: 1.0,
        }];
        for (i, stack) in self.stacks.iter().enumerate() {
            let (algorithms, ratio) = stack.rsplit_once('@').with_context(|| {
                format!("--stack {stack:?}: expected ALGORITHMS@RATIO, e.g. 'mixup@0.5'")
            })?;
            let ratio: f64 = ratio
                .parse()
                .ok()
                .filter(|r: &f64| *r > 0.0 && *r <= 1.0)
                .with_context(|| {
                    format!("--stack {stack:?}: the ratio {ratio:?} is not a number in (0, 1]")
                })?;
            parse_list(algorithms).with_context(|| format!("--stack {stack:?}"))?;
            entries.push(Entry {
                label: format!("stack-{}", i + 1),
                algorithms: algorithms.to_string(),
                scale_schedule_ratio: ratio,
            });
        }
        if self.stacks.is_empty() {
            let recipes = if self.model.resnet().is_some() {
                RESNET_RECIPES
            } else {
                RECIPES
            };
            entries.extend(recipes.iter().map(|r| Entry {
                label: r.name.to_string(),
                algorithms: r.algorithms.to_string(),
                scale_schedule_ratio: r.scale_schedule_ratio,
            }));
        }
        Ok(entries)
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.width == Some(0) {
        anyhow::bail!("--width must be at least 1");
    }
    if args.reps == 0 || args.eval_every == 0 {
        anyhow::bail!(
            "--reps ({}) and --eval-every ({}) must be at least 1",
            args.reps,
            args.eval_every
        );
    }
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

/// One training run of `entry`; returns its accuracy curve. With `stop_at`, the run stops at
/// the first evaluation whose accuracy reaches it (a repetition that only measures the time to
/// the target).
fn one<B: TrainBackend>(
    args: &Args,
    entry: &Entry,
    stop_at: Option<f64>,
) -> anyhow::Result<Vec<CurvePoint>> {
    let mut run = MnistRun {
        eval_interval: Time::Batch(args.eval_every),
        seed: args.seed,
        ..MnistRun::default()
    };
    if let Some(d) = args.max_duration {
        run.max_duration = d;
    }
    run.data.train_limit = args.train_limit;
    run.algorithms = parse_list(&entry.algorithms)?;
    run.scale_schedule_ratio = entry.scale_schedule_ratio;
    let device = Default::default();
    match args.model.resnet() {
        None => train(
            &run,
            MnistCnn::<B>::new(&device, run.seed),
            &device,
            stop_at,
        ),
        Some(mut shape) => {
            if let Some(w) = args.width {
                let base = shape.widths()[0];
                let widths = shape.widths().iter().map(|x| x * w / base).collect();
                shape = shape
                    .with_widths(widths)
                    .map_err(|e| anyhow::anyhow!("--width {w}: {e}"))?;
            }
            train(&run, shape.init::<B>(&device, run.seed), &device, stop_at)
        }
    }
}

/// Trains `model` as `run` says (AdamW with the main job's settings) and returns the curve,
/// stopping once the test accuracy reaches `stop_at` if given.
fn train<B: TrainBackend, M: MnistModel<B>>(
    run: &MnistRun,
    model: M,
    device: &B::Device,
    stop_at: Option<f64>,
) -> anyhow::Result<Vec<CurvePoint>> {
    let optimizer = burn::optim::AdamWConfig::new()
        .with_weight_decay(flashover_examples::defaults::WEIGHT_DECAY)
        .init::<B, M>();
    let curve = MetricCurve::default();
    let mut builder = run
        .builder_with::<B, M, _>(model, optimizer, device)?
        .callback(curve.clone());
    if let Some(target) = stop_at {
        // `{target}` prints the shortest text that parses back to the same f64.
        builder = builder.callback(MetricStopper::parse_threshold(&format!(
            "test/accuracy={target}:mode=max"
        ))?);
    }
    let mut t = builder.build()?;
    t.fit()?;
    // The final weights are evaluated unless the last interval already did (a run stopped
    // at the target ends on the evaluation that reached it).
    if stop_at.is_none() && t.state().last_eval_batch() != Some(t.state().timestamp().batch) {
        t.eval()?;
    }
    Ok(curve.points())
}

fn accuracy_at(curve: &[CurvePoint], seconds: f64) -> f64 {
    curve
        .iter()
        .take_while(|p| p.train_seconds <= seconds + 1e-9)
        .last()
        .map_or(f64::NAN, |p| p.value)
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let entries = args.entries()?;
    let mut curves: Vec<Vec<Vec<CurvePoint>>> = vec![Vec::new(); entries.len()];
    let final_acc = |c: &Vec<CurvePoint>| c.last().map_or(f64::NAN, |p| p.value);
    let total = |c: &Vec<CurvePoint>| c.last().map_or(f64::NAN, |p| p.train_seconds);
    // The first repetition trains every run to its end: the target is its baseline's final
    // accuracy, and the final accuracies, run lengths and curves are its runs'. Later
    // repetitions measure only the time to the target: each stops at the evaluation that
    // reaches it (the same point of the same curve: the runs are deterministic on the CPU
    // backends), which keeps a long baseline's repetitions affordable.
    let mut target = f64::NAN;
    for rep in 0..args.reps {
        for (i, entry) in entries.iter().enumerate() {
            eprintln!("rep {}/{}: {}", rep + 1, args.reps, entry.label);
            let stop_at = (rep > 0).then_some(target);
            curves[i].push(one::<B>(args, entry, stop_at)?);
            if rep == 0 && i == 0 {
                target = final_acc(&curves[0][0]);
            }
        }
    }
    let budget = curves
        .iter()
        .map(|runs| total(&runs[0]))
        .fold(f64::INFINITY, f64::min);
    let mut rows = Vec::new();
    let mut recipes = serde_json::Map::new();
    let mut base_seconds = f64::NAN;
    for (i, entry) in entries.iter().enumerate() {
        let label = entry.label.as_str();
        let runs = &curves[i];
        let to: Vec<Option<f64>> = runs
            .iter()
            .map(|c| {
                c.iter()
                    .find(|p| p.value >= target)
                    .map(|p| p.train_seconds)
            })
            .collect();
        let reached: Vec<f64> = to.iter().flatten().copied().collect();
        // A recipe counts as reaching the target only if every repetition reached it.
        let secs = (reached.len() == runs.len()).then(|| median_min_max(&reached));
        if i == 0 {
            base_seconds = secs.map_or(f64::NAN, |s| s.0);
        }
        // Whole runs: the first repetition's.
        let fin = final_acc(&runs[0]);
        let tot = total(&runs[0]);
        let atb = accuracy_at(&runs[0], budget);
        let speedup = secs.map(|s| base_seconds / s.0);
        let batches = runs[0].last().map_or(0, |p| p.batch);
        let algorithms = entry.describe();
        rows.push(format!(
            "| {label} | {} | {} | {} | {fin:.4} | {tot:.1} | {atb:.4} | {batches} |",
            secs.map_or("not reached".to_string(), |s| format!(
                "{:.1} ({:.1}-{:.1})",
                s.0, s.1, s.2
            )),
            speedup.map_or("-".to_string(), |s| format!("{s:.2}x")),
            algorithms,
        ));
        let mut entry = json!({
            "baseline_final_accuracy": target,
            "final_accuracy": fin,
            "train_seconds": tot,
            "accuracy_at_equal_time": atb,
            "batches": batches,
        });
        if let Some(s) = secs {
            entry["seconds_to_baseline_accuracy"] = json!(s.0);
        }
        if let Some(s) = speedup.filter(|_| i > 0) {
            entry["speedup_to_baseline_accuracy"] = json!(s);
        }
        recipes.insert(label.to_string(), entry);
    }
    println!(
        "Target: the baseline's final test accuracy {target:.4}; equal-time budget {budget:.1} s; {} rep(s), evaluation every {} batches (repetitions after the first stop at the target; final accuracy, train s and the accuracy at the budget are the first repetition's).\n",
        args.reps, args.eval_every
    );
    println!("| run | s to target | speed-up | algorithms | final acc | train s | acc at {budget:.1} s | batches |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    if let Some(path) = &args.plot {
        let mut series: Vec<Series> = entries
            .iter()
            .zip(&curves)
            .map(|(e, c)| Series {
                name: e.label.clone(),
                points: c[0].iter().map(|p| (p.train_seconds, p.value)).collect(),
            })
            .collect();
        let end = curves.iter().flatten().map(total).fold(0.0, f64::max);
        series.push(Series {
            name: format!("target {target:.4}"),
            points: vec![(0.0, target), (end, target)],
        });
        let chart = LineChart {
            title: format!(
                "MNIST test accuracy against training time ({}, {})",
                args.model, args.backend
            ),
            x_label: "training seconds (evaluation excluded)".into(),
            y_label: "test accuracy".into(),
            series,
            size: (960, 600),
            y_range: Some(if args.model.resnet().is_some() {
                (0.90, 0.995)
            } else {
                (0.95, 0.99)
            }),
        };
        chart
            .write_png(path)
            .with_context(|| format!("drawing {}", path.display()))?;
    }
    if let Some(path) = &args.curves {
        let all: serde_json::Map<String, serde_json::Value> = entries
            .iter()
            .zip(&curves)
            .map(|(e, c)| (e.label.clone(), json!(c)))
            .collect();
        std::fs::write(path, serde_json::to_string(&all)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "{}",
        json!({
            "target_accuracy": target,
            "equal_time_budget_seconds": budget,
            "reps": args.reps,
            "model": args.model.name(),
            "width": args.model.resnet().map(|s| args.width.unwrap_or(s.widths()[0])),
            "eval_every_batches": args.eval_every,
            "seed": args.seed,
            "baseline_seconds_to_target": base_seconds,
            "recipes": recipes,
        })
    );
    Ok(())
}
