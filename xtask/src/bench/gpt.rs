//! The bench's GPT section: the language model's throughput and quality against PyTorch's
//! figures, and its chart.

use std::process::Command;

use anyhow::{Context, Result};

use super::*;
use crate::backend::Backend;

/// The language-model section, on two threads: (1) the GPT recipes against the plain GPT
/// (2 blocks of width 128, 160 batches of 32 windows of 128 characters, evaluated every 20
/// batches on 128 validation windows; 3 interleaved repetitions): seconds of training until
/// the validation loss first reaches the plain GPT's final loss (the median over its
/// repetitions); (2) ALiBi's extrapolation: the same GPT with ALiBi trained on windows of 64
/// evaluated on windows of 64 and of 128 (the same weights: training does not depend on the
/// evaluation), and the plain GPT asked for 128; (3) the default run against the count-based
/// bigram model.
pub(crate) fn gpt_bench(b: Backend) -> Result<(serde_json::Value, String)> {
    let mut args = strings(&[
        "build",
        "--release",
        "--example",
        "shakespeare",
        "--example",
        "plot",
    ]);
    args.extend(b.cargo_args(bench_selection(), &[]));
    cargo(&args)?;
    let bin = format!("{}/release/examples/shakespeare", b.target_dir());
    let plot_bin = format!("{}/release/examples/plot", b.target_dir());
    let run = |extra: &[&str]| -> Result<std::result::Result<serde_json::Value, String>> {
        eprintln!("$ {bin} {}", extra.join(" "));
        let out = Command::new(&bin)
            .args(extra)
            .args(["--no-progress", "--backend", b.name()])
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Ok(Err(err.lines().last().unwrap_or("").to_string()));
        }
        Ok(Ok(last_json(&String::from_utf8_lossy(&out.stdout))?))
    };
    let small = [
        "--layers",
        "2",
        "--width",
        "128",
        "--heads",
        "4",
        "--max-duration",
        "160ba",
        "--warmup",
        "20ba",
        "--eval-interval",
        "20ba",
        "--val-windows",
        "128",
    ];
    let names = ["baseline", "gpt-mild", "gpt-medium", "gpt-hot"];
    let mut runs: Vec<Vec<serde_json::Value>> = vec![Vec::new(); names.len()];
    for _rep in 0..3 {
        for (i, name) in names.iter().enumerate() {
            let mut a: Vec<&str> = small.to_vec();
            if *name != "baseline" {
                a.extend(["--recipe", name]);
            }
            runs[i].push(run(&a)?.map_err(|e| anyhow::anyhow!("{name}: {e}"))?);
        }
    }
    let loss = |s: &serde_json::Value| s["val_loss"].as_f64().unwrap_or(f64::NAN);
    let mut base_losses: Vec<f64> = runs[0].iter().map(loss).collect();
    let (target, _, _) = median_range(&mut base_losses);
    let seconds_to = |s: &serde_json::Value| {
        s["val_curve"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["value"].as_f64().unwrap_or(f64::INFINITY) <= target)
            .and_then(|p| p["train_seconds"].as_f64())
    };
    let mut base_secs: Vec<f64> = runs[0].iter().filter_map(seconds_to).collect();
    let (base_med, _, _) = median_range(&mut base_secs);
    let mut recipes = serde_json::Map::new();
    let mut md = format!(
        "Target: the plain GPT's final validation loss, {target:.4} nats per character (median of 3).\n\n| run | s to target (median, min-max) | speed-up | final loss |\n|---|---|---|---|\n"
    );
    for (i, name) in names.iter().enumerate() {
        let mut secs: Vec<f64> = runs[i].iter().filter_map(seconds_to).collect();
        let reached = secs.len() == runs[i].len();
        let mut finals: Vec<f64> = runs[i].iter().map(loss).collect();
        let (final_med, _, _) = median_range(&mut finals);
        let (med, lo, hi) = median_range(&mut secs);
        let speedup = reached.then(|| base_med / med);
        md.push_str(&format!(
            "| {name} | {} | {} | {final_med:.4} |\n",
            if reached {
                format!("{med:.1} ({lo:.1}-{hi:.1})")
            } else {
                "not reached in every repetition".into()
            },
            speedup.map_or("-".into(), |s| format!("{s:.2}x")),
        ));
        recipes.insert(
            name.to_string(),
            serde_json::json!({
                "speedup_to_baseline_loss": speedup,
                "final_val_loss": final_med,
                "seconds_to_baseline_loss": reached.then_some(med),
                "seconds_min_max": reached.then_some([lo, hi]),
            }),
        );
    }
    // The chart: each run's validation loss against training time in the first repetition,
    // and the target.
    let mut series: Vec<serde_json::Value> = names
        .iter()
        .zip(&runs)
        .map(|(name, reps)| {
            let points: Vec<[f64; 2]> = reps[0]["val_curve"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some([p["train_seconds"].as_f64()?, p["value"].as_f64()?]))
                .collect();
            serde_json::json!({"name": name, "points": points})
        })
        .collect();
    let end = runs
        .iter()
        .flat_map(|reps| reps[0]["val_curve"].as_array().into_iter().flatten())
        .filter_map(|p| p["train_seconds"].as_f64())
        .fold(0.0, f64::max);
    series.push(serde_json::json!({
        "name": format!("target {target:.4}"),
        "points": [[0.0, target], [end, target]],
    }));
    let chart_spec = format!("target/bench/{}-gpt-time-to-loss.json", b.name());
    let chart = format!("target/bench/{}-gpt-time-to-loss.png", b.name());
    std::fs::write(
        &chart_spec,
        serde_json::to_string_pretty(&serde_json::json!({
            "title": format!("Shakespeare validation loss against training time (2-block GPT, {})", b.name()),
            "x_label": "training seconds (evaluation excluded)",
            "y_label": "validation loss (nats per character)",
            "series": series,
        }))?,
    )?;
    let status = Command::new(&plot_bin)
        .args([&chart_spec, &chart])
        .status()
        .with_context(|| format!("running {plot_bin}"))?;
    anyhow::ensure!(status.success(), "{plot_bin} {chart_spec} {chart} failed");
    md.push_str(&format!("\nCurves: `{chart}`\n"));
    // ALiBi at twice its training length, and learned positions asked for the same. 480
    // batches: after 160 the model was still too undertrained to gain from the longer
    // context (2026-12-03: loss ratio 1.0005 at 160 batches, 0.994 at 480).
    // One training: the run saves its final state, and a second invocation autoresumes
    // from it (nothing left to train) and only evaluates, on windows of 128.
    let ck_dir = std::env::temp_dir().join(format!("flashover-alibi-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ck_dir);
    let ck = ck_dir.display().to_string();
    let long = |eval: &'static str, alibi: bool, save: bool| {
        let mut a: Vec<&str> = [
            "--layers",
            "2",
            "--width",
            "128",
            "--heads",
            "4",
            "--max-duration",
            "480ba",
            "--warmup",
            "20ba",
            "--eval-interval",
            "480ba",
            "--seq-len",
            "64",
            "--context",
            "64",
            "--eval-seq-len",
        ]
        .to_vec();
        a.push(eval);
        if alibi {
            a.extend(["--algorithms", "alibi:train_sequence_length_scaling=1"]);
        }
        if save {
            a.extend(["--save-folder", ck.as_str(), "--autoresume"]);
        }
        run(&a)
    };
    let at_1x = long("64", true, true)?.map_err(|e| anyhow::anyhow!("alibi at 1x: {e}"))?;
    let at_2x = long("128", true, true)?.map_err(|e| anyhow::anyhow!("alibi at 2x: {e}"))?;
    let _ = std::fs::remove_dir_all(&ck_dir);
    anyhow::ensure!(
        at_1x["params_sha256"] == at_2x["params_sha256"],
        "the 2x evaluation did not use the trained weights"
    );
    let learned_2x = match long("128", false, false)? {
        Ok(s) => format!("ran: loss {}", loss(&s)),
        Err(e) => format!("refused: {e}"),
    };
    let ratio = loss(&at_2x) / loss(&at_1x);
    md.push_str(&format!(
        "\nALiBi trained on 64 characters: validation loss {:.4} on windows of 64, {:.4} on windows of 128 (ratio {ratio:.4}). Learned positions at 128: {learned_2x}\n",
        loss(&at_1x),
        loss(&at_2x)
    ));
    // The default run against the bigram model.
    let default = run(&[])?.map_err(|e| anyhow::anyhow!("default run: {e}"))?;
    let bigram = default["bigram_val_loss"].as_f64().unwrap_or(f64::NAN);
    let below = 1.0 - loss(&default) / bigram;
    md.push_str(&format!(
        "\nDefault run: {:.0} s wall, validation loss {:.4} nats per character; the count-based bigram model {bigram:.4}: {:.0}% lower.\n",
        default["wall_seconds"].as_f64().unwrap_or(f64::NAN),
        loss(&default),
        100.0 * below
    ));
    let json = serde_json::json!({
        "gpt_recipes": recipes,
        "gpt": {
            "target_val_loss": target,
            "time_to_loss_chart": chart,
            "val_loss_at_2x_context_over_1x": ratio,
            "alibi_val_loss_1x": loss(&at_1x),
            "alibi_val_loss_2x": loss(&at_2x),
            "learned_positions_at_2x": learned_2x,
            "default_run": {
                "wall_seconds": default["wall_seconds"],
                "val_loss": default["val_loss"],
                "bigram_val_loss": bigram,
                "fraction_below_bigram": below,
                "tokens_per_second": default["tokens_per_second"],
            },
        },
    });
    Ok((json, md))
}
