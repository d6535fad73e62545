//! The bench's memory section: sharded optimizer state against data parallelism on two
//! processes (the GPT example under `mpirun`), and activation checkpointing against the
//! plain backward pass (the default GPT at a long context, one process).

use std::process::Command;

use anyhow::{bail, Context, Result};

use super::*;
use crate::backend::Backend;

/// The GPT whose weights, gradients and Adam state dominate its memory: 4 blocks of width
/// 1024 (50.5 million parameters, 202 MB a copy in float32), one window of 32 tokens per
/// process, so that activations are a few megabytes. The sharding rows and the memory-limit
/// demonstration both train it.
pub(crate) const SHARDING_GPT: &[&str] = &[
    "--layers",
    "4",
    "--width",
    "1024",
    "--heads",
    "8",
    "--context",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--optimizer",
    "adam",
    "--warmup",
    "1ba",
    "--val-windows",
    "2",
    "--eval-interval",
    "1000ba",
];

/// The per-process data limit (`prlimit --data`, bytes) of the memory-limit demonstration:
/// between what a sharded rank of [`SHARDING_GPT`] needs (it trains at 900 MB) and what one
/// process needs (it fails at 1000 MB and below).
pub(crate) const DATA_LIMIT: u64 = 950_000_000;

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
    let reps = if quick { 1 } else { 3 };
    let mut json = serde_json::Map::new();
    let mut md = String::new();
    if have_mpirun() {
        let bin = build_mpi_example(b, "shakespeare")?;
        let steps = if quick { "2ba" } else { "4ba" };
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
        let (limit_json, limit_md) = memory_limit(b, &bin)?;
        json.insert("memory_limit".into(), limit_json);
        md.push_str(&limit_md);
        md.push_str(&format!(
            "Sharding: 2 processes, `--sharding shard_grad_op` over `no_shard` (the GPT `{}`, Adam, {steps}; the largest rank of each; same weights checked), {reps} interleaved repetitions, median (min-max)\n\n| ratio | sharded / data parallel | goal |\n|---|---|---|\n| optimizer state bytes per rank | {s_med:.3} ({s_min:.3}-{s_max:.3}) | <= 0.55 |\n| peak resident memory per rank | {r_med:.3} ({r_min:.3}-{r_max:.3}) | - |\n| step time | {t_med:.3} ({t_min:.3}-{t_max:.3}) | <= 1.10 |\n\n",
            SHARDING_GPT.join(" ")
        ));
    } else {
        eprintln!("mpirun not found: the sharding rows are skipped (install OpenMPI)");
        json.insert("sharding".into(), serde_json::Value::Null);
        json.insert("memory_limit".into(), serde_json::Value::Null);
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

/// How one run under the data limit ended.
fn outcome(out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = stderr
        .lines()
        .chain(stdout.lines())
        .find(|l| l.starts_with("error: out of memory"));
    match (out.status.success(), report) {
        (true, _) => {
            let summary = last_json(&stdout).unwrap_or(serde_json::Value::Null);
            serde_json::json!({
                "outcome": "completed",
                "batches": summary["trained_batches"],
                "params_sha256": summary["params_sha256"],
                "peak_rss_bytes_by_rank": summary["peak_rss_bytes_by_rank"],
            })
        }
        (false, Some(line)) => serde_json::json!({"outcome": "out_of_memory", "error": line}),
        (false, None) => serde_json::json!({
            "outcome": "failed",
            "error": stderr.lines().rev().find(|l| l.contains("error")).unwrap_or(""),
        }),
    }
}

/// Item 4 of the sharding work, shown: [`SHARDING_GPT`] under a per-process data limit of
/// [`DATA_LIMIT`] bytes, trained by one process, by two data-parallel processes and by two
/// sharded processes. One process and data parallelism must run out of memory (with the
/// programs' plain-words report) and the sharded pair must finish. `MIMALLOC_ARENA_EAGER_COMMIT=0`
/// makes the allocator commit memory as it is used, so that the limit counts what a process
/// holds rather than address space reserved ahead.
fn memory_limit(b: Backend, bin: &str) -> Result<(serde_json::Value, String)> {
    let limit = format!("--data={DATA_LIMIT}");
    let common = |cmd: &mut Command| {
        cmd.env("MIMALLOC_ARENA_EAGER_COMMIT", "0")
            .env("RAYON_NUM_THREADS", "1");
    };
    let mut args = strings(&["--no-progress", "--backend", b.name()]);
    args.extend(strings(SHARDING_GPT));
    args.extend(strings(&["--max-duration", "3ba"]));
    let mut one = Command::new("prlimit");
    one.arg(&limit).arg(bin).args(&args);
    common(&mut one);
    eprintln!("$ prlimit {limit} {bin} {}", args.join(" "));
    let one = outcome(&one.output().context("running prlimit")?);
    let pair = |sharding: &str| -> Result<serde_json::Value> {
        let mut m = mpirun_args(2, None, "prlimit");
        // (mpirun's own options before the program it starts.)
        let program = m.pop().unwrap_or_default();
        m.extend(strings(&["-x", "MIMALLOC_ARENA_EAGER_COMMIT", &program]));
        m.push(limit.clone());
        m.push(bin.into());
        m.extend(args.iter().cloned());
        m.extend(strings(&["--processes", "2", "--sharding", sharding]));
        eprintln!("$ mpirun {}", m.join(" "));
        let mut cmd = Command::new("mpirun");
        cmd.args(&m);
        common(&mut cmd);
        Ok(outcome(&cmd.output().context("running mpirun")?))
    };
    let dp = pair("no_shard")?;
    let sharded = pair("shard_grad_op")?;
    let shown = one["outcome"] == "out_of_memory"
        && dp["outcome"] == "out_of_memory"
        && sharded["outcome"] == "completed";
    if !shown {
        eprintln!(
            "warning: the memory-limit demonstration did not show what it should (one process and data parallelism out of memory, sharding completed): {one} {dp} {sharded}"
        );
    }
    let name = |v: &serde_json::Value| v["outcome"].as_str().unwrap_or("?").replace('_', " ");
    let md = format!(
        "Memory limit: the GPT `{}` (Adam, 3 batches) with `prlimit --data={DATA_LIMIT}` on each process: one process: {}; 2 data-parallel processes: {}; 2 sharded processes (`--sharding shard_grad_op`): {}{}\n\n",
        SHARDING_GPT.join(" "),
        name(&one),
        name(&dp),
        name(&sharded),
        if shown { "" } else { " (NOT AS EXPECTED)" },
    );
    Ok((
        serde_json::json!({
            "model": SHARDING_GPT.join(" "),
            "data_limit_bytes": DATA_LIMIT,
            "one_process": one,
            "data_parallel_2": dp,
            "sharded_2": sharded,
            "shown": shown,
        }),
        md,
    ))
}
