//! The bench's memory section: sharded optimizer state against data parallelism on two
//! processes (the GPT example under `mpirun`), and activation checkpointing against the
//! plain backward pass (the default GPT at a long context, one process).

use anyhow::{bail, Result};

use super::*;
use crate::backend::Backend;

/// The GPT whose weights, gradients and Adam state dominate its memory (about 12.7 million
/// parameters: 4 blocks of width 512, a short context), trained 2 processes x 4 windows.
pub(crate) const SHARDING_GPT: &[&str] = &[
    "--layers",
    "4",
    "--width",
    "512",
    "--heads",
    "8",
    "--context",
    "64",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--optimizer",
    "adam",
    "--warmup",
    "1ba",
    "--val-windows",
    "8",
    "--eval-interval",
    "1000ba",
];

/// The default GPT at a context where the activations dominate (1024 positions, 8 windows).
pub(crate) const LONG_CONTEXT_GPT: &[&str] = &[
    "--context",
    "1024",
    "--seq-len",
    "1024",
    "--batch-size",
    "8",
    "--warmup",
    "1ba",
    "--val-windows",
    "4",
    "--eval-interval",
    "1000ba",
];

/// The largest of a summary's per-rank numbers under `key`.
fn max_of(s: &serde_json::Value, key: &str) -> f64 {
    s[key]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_f64())
        .fold(f64::NAN, f64::max)
}

/// Seconds a training batch took in a summary.
fn per_batch(s: &serde_json::Value) -> f64 {
    let batches = s["trained_batches"].as_f64().unwrap_or(f64::NAN);
    s["train_seconds"].as_f64().unwrap_or(f64::NAN) / batches
}

fn stat(v: &mut [f64]) -> serde_json::Value {
    let (med, min, max) = median_range(v);
    serde_json::json!({"median": med, "min": min, "max": max})
}

/// Sharding (two processes, `--sharding shard_grad_op` against `no_shard`, interleaved) and
/// activation checkpointing (one process, with and without, interleaved): the ratios of
/// per-rank optimizer state, peak resident memory and step time. The sharding rows need
/// `mpirun` (`None` in their place without it). Returns the JSON section and a Markdown
/// table.
pub(crate) fn memory_bench(b: Backend, quick: bool) -> Result<(serde_json::Value, String)> {
    let reps = if quick { 2 } else { 5 };
    let mut json = serde_json::Map::new();
    let mut md = String::new();
    if have_mpirun() {
        let bin = build_mpi_example(b, "shakespeare")?;
        let steps = if quick { "3ba" } else { "8ba" };
        let run = |extra: &[&str]| -> Result<serde_json::Value> {
            let mut m = mpirun_args(2, None, &bin);
            m.extend(strings(&[
                "--processes",
                "2",
                "--backend",
                b.name(),
                "--no-progress",
            ]));
            m.extend(strings(SHARDING_GPT));
            m.extend(strings(&[
                "--max-duration",
                steps,
                "--report-optimizer-state",
            ]));
            m.extend(strings(extra));
            mpirun_summary(&m)
        };
        let (mut state, mut rss, mut time) = (vec![], vec![], vec![]);
        let (mut dp_state, mut dp_rss) = (vec![], vec![]);
        for _ in 0..reps {
            let dp = run(&[])?;
            let sh = run(&["--sharding", "shard_grad_op"])?;
            if dp["params_sha256"] != sh["params_sha256"] {
                bail!("sharded and data-parallel runs ended with other weights: {dp} {sh}");
            }
            let key = "optimizer_state_bytes_by_rank";
            state.push(max_of(&sh, key) / max_of(&dp, key));
            dp_state.push(max_of(&dp, key));
            let key = "peak_rss_bytes_by_rank";
            rss.push(max_of(&sh, key) / max_of(&dp, key));
            dp_rss.push(max_of(&dp, key));
            time.push(per_batch(&sh) / per_batch(&dp));
        }
        let (s_med, s_min, s_max) = median_range(&mut state.clone());
        let (r_med, r_min, r_max) = median_range(&mut rss.clone());
        let (t_med, t_min, t_max) = median_range(&mut time.clone());
        json.insert(
            "sharding".into(),
            serde_json::json!({
                "model": SHARDING_GPT.join(" "),
                "optimizer_state_bytes_ratio": stat(&mut state),
                "peak_rss_ratio": stat(&mut rss),
                "step_time_ratio": stat(&mut time),
                "no_shard_optimizer_state_bytes_per_rank": stat(&mut dp_state),
                "no_shard_peak_rss_bytes_per_rank": stat(&mut dp_rss),
                "goals": {"optimizer_state_bytes_ratio": 0.55, "step_time_ratio": 1.10},
            }),
        );
        md.push_str(&format!(
            "Sharding: 2 processes, `--sharding shard_grad_op` over `no_shard` (the GPT `{}`, Adam, {steps}; the largest rank of each; same weights checked), {reps} interleaved repetitions, median (min-max)\n\n| ratio | sharded / data parallel | goal |\n|---|---|---|\n| optimizer state bytes per rank | {s_med:.3} ({s_min:.3}-{s_max:.3}) | <= 0.55 |\n| peak resident memory per rank | {r_med:.3} ({r_min:.3}-{r_max:.3}) | - |\n| step time | {t_med:.3} ({t_min:.3}-{t_max:.3}) | <= 1.10 |\n\n",
            SHARDING_GPT.join(" ")
        ));
    } else {
        eprintln!("mpirun not found: the sharding rows are skipped (install OpenMPI)");
        json.insert("sharding".into(), serde_json::Value::Null);
        md.push_str("Sharding: not measured: mpirun not found (install OpenMPI)\n\n");
    }
    // Activation checkpointing: one process, two threads, the default GPT at context 1024.
    let steps = if quick { "2ba" } else { "4ba" };
    let bin = format!("{}/release/examples/shakespeare", b.target_dir());
    let run = |extra: &[&str]| -> Result<serde_json::Value> {
        // (`run_binary_on` adds `--backend`.)
        let mut a = strings(&["--no-progress"]);
        a.extend(strings(LONG_CONTEXT_GPT));
        a.extend(strings(&["--max-duration", steps]));
        a.extend(strings(extra));
        last_json(&run_binary_on(b, &bin, &a, 2)?)
    };
    let (mut rss, mut time) = (vec![], vec![]);
    for _ in 0..reps {
        let plain = run(&[])?;
        let ck = run(&["--activation-checkpointing"])?;
        if plain["params_sha256"] != ck["params_sha256"] {
            bail!("activation checkpointing changed the weights: {plain} {ck}");
        }
        rss.push(
            ck["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN)
                / plain["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN),
        );
        time.push(per_batch(&ck) / per_batch(&plain));
    }
    let (r_med, r_min, r_max) = median_range(&mut rss.clone());
    let (t_med, t_min, t_max) = median_range(&mut time.clone());
    json.insert(
        "activation_checkpointing".into(),
        serde_json::json!({
            "model": LONG_CONTEXT_GPT.join(" "),
            "peak_rss_ratio": stat(&mut rss),
            "step_time_ratio": stat(&mut time),
            "goals": {"peak_rss_ratio": 0.7, "step_time_ratio": 1.4},
        }),
    );
    md.push_str(&format!(
        "Activation checkpointing: one process (two threads), `--activation-checkpointing` over the plain backward pass (the default GPT with `{}`, {steps}; same weights checked), {reps} interleaved repetitions, median (min-max)\n\n| ratio | checkpointed / plain | goal |\n|---|---|---|\n| peak resident memory | {r_med:.3} ({r_min:.3}-{r_max:.3}) | <= 0.7 |\n| step time | {t_med:.3} ({t_min:.3}-{t_max:.3}) | <= 1.4 |\n",
        LONG_CONTEXT_GPT.join(" ")
    ));
    Ok((serde_json::Value::Object(json), md))
}
