//! The prepared GPU check (`cargo xtask bench --backend cuda --only gpu`): one command, under
//! 10 minutes on one GPU, that prints the throughput of the three model families in the
//! three precisions a GPU user picks between, and runs automatic microbatching into a real
//! out-of-memory and back out of it.
//!
//! Throughput is read from the speed monitor's window (`throughput/samples_per_sec` and
//! `throughput/tokens_per_sec` in the run's `metrics.jsonl`: the last 100 batches, evaluation
//! left out), not from the whole run, so that a GPU's kernel compilation and autotuning in
//! the first batches do not count. Each run has a wall-clock limit (`timeout`), so one that
//! hangs costs its limit, not the check.
//!
//! On a machine without cargo (a device machine that only received the built programs),
//! `--no-build` runs the programs already in the backend's target directory.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use super::*;
use crate::backend::Backend;

/// The precisions measured, float32 first (the others are given as ratios to it).
const PRECISIONS: [&str; 3] = ["fp32", "amp_bf16", "amp_fp16"];

/// Seconds one measured run may take before it is stopped (a first run compiles kernels).
const RUN_LIMIT_S: u64 = 150;

/// One model family's run: the program, its arguments, and whether it counts tokens.
struct Family {
    name: &'static str,
    program: &'static str,
    args: &'static [&'static str],
    tokens: bool,
}

/// The three families. The CNN and ResNet-8 in batches of 256 (the GPU's batch, not the
/// CPU's 64) for 300 batches; the default GPT (4 blocks of width 128, 32 windows of 128
/// characters) for 250 batches, evaluated only at the end. The speed monitor's 100-batch
/// window then covers the last 100 batches, long after the first ones' compilation.
const FAMILIES: [Family; 3] = [
    Family {
        name: "cnn",
        program: "mnist",
        args: &[
            "--batch-size",
            "256",
            "--max-duration",
            "300ba",
            "--warmup",
            "10ba",
        ],
        tokens: false,
    },
    Family {
        name: "resnet8",
        program: "mnist",
        args: &[
            "--model",
            "resnet8",
            "--batch-size",
            "256",
            "--max-duration",
            "300ba",
            "--warmup",
            "10ba",
        ],
        tokens: false,
    },
    Family {
        name: "gpt",
        program: "shakespeare",
        args: &[
            "--max-duration",
            "250ba",
            "--warmup",
            "10ba",
            "--eval-interval",
            "1000ba",
            "--val-windows",
            "32",
        ],
        tokens: true,
    },
];

/// The out-of-memory run: the default GPT on windows of 2,048 characters in batches of 1,024
/// with `--microbatch-size auto`. Its attention probabilities alone take 64 GiB per block for
/// the whole batch (1,024 x 4 heads x 2,048^2 float32 values), 256 GiB for the four blocks
/// that backward keeps, more than any one GPU holds; the trainer halves the microbatch until
/// a step fits (about 128 windows on an 80 GiB card) and trains two batches.
const OOM_ARGS: &[&str] = &[
    "--context",
    "2048",
    "--seq-len",
    "2048",
    "--batch-size",
    "1024",
    "--microbatch-size",
    "auto",
    "--max-duration",
    "2ba",
    "--warmup",
    "1ba",
    "--eval-interval",
    "1000ba",
    "--val-windows",
    "2",
];

/// The result of one run: its summary line, or why it gave none.
enum Outcome {
    Ran(serde_json::Value),
    Refused(String),
    Failed(String),
}

/// Runs `bin` with `args`, `--backend` and `--log-dir dir`, under the wall-clock limit.
fn run_limited(b: Backend, bin: &str, args: &[&str], dir: &Path) -> Result<Outcome> {
    let _ = std::fs::remove_dir_all(dir);
    eprintln!("$ timeout {RUN_LIMIT_S} {bin} {}", args.join(" "));
    let out = Command::new("timeout")
        .arg(RUN_LIMIT_S.to_string())
        .arg(bin)
        .args(args)
        .args(["--no-progress", "--backend", b.name(), "--log-dir"])
        .arg(dir)
        .output()
        .with_context(|| format!("running timeout {bin}"))?;
    if out.status.success() {
        return Ok(Outcome::Ran(last_json(&String::from_utf8_lossy(
            &out.stdout,
        ))?));
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(124) {
        return Ok(Outcome::Failed(format!("stopped after {RUN_LIMIT_S} s")));
    }
    let why = failure_line(&err);
    if err.contains("does not support") {
        return Ok(Outcome::Refused(why));
    }
    Ok(Outcome::Failed(format!(
        "exit {:?}: {why}",
        out.status.code()
    )))
}

/// The line of a failed run's stderr that says why, cut to 160 characters for the table: a
/// panic's message (the line after "panicked at"), else the last line that starts with
/// `error`, else the last line.
fn failure_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).collect();
    let line = match lines.iter().position(|l| l.contains("panicked at")) {
        Some(i) => format!("panicked: {}", lines.get(i + 1).copied().unwrap_or("")),
        None => lines
            .iter()
            .rev()
            .find(|l| l.starts_with("error"))
            .or_else(|| lines.iter().rev().find(|l| !l.is_empty()))
            .unwrap_or(&"")
            .to_string(),
    };
    match line.char_indices().nth(160) {
        Some((at, _)) => format!("{}...", &line[..at]),
        None => line,
    }
}

/// Every logged value of metric `key` in `dir/metrics.jsonl`, in order, and every logged
/// text line (`tag: text`).
fn from_log(dir: &Path, key: &str) -> (Vec<f64>, Vec<String>) {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    let (mut values, mut texts) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(x) = v["metrics"][key].as_f64() {
            values.push(x);
        }
        if let Some(t) = v["text"].as_object() {
            texts.extend(
                t.iter()
                    .map(|(k, v)| format!("{k}: {}", v.as_str().unwrap_or(""))),
            );
        }
    }
    (values, texts)
}

/// The GPU check; `build`: build the programs first (false on a machine without cargo).
pub(crate) fn gpu_bench(b: Backend, build: bool) -> Result<(serde_json::Value, String)> {
    if build {
        let mut args = strings(&[
            "build",
            "--release",
            "--example",
            "mnist",
            "--example",
            "shakespeare",
        ]);
        // No MPI: the device machine need not have OpenMPI's libraries.
        args.extend(b.cargo_args_mpi(bench_selection(), &[], false));
        cargo(&args)?;
    }
    let started = std::time::Instant::now();
    let logs = std::env::temp_dir().join(format!("flashover-gpu-check-{}", std::process::id()));
    let mut rows = Vec::new();
    let mut md = format!(
        "Throughput over the last 100 batches of each run (the speed monitor's window: compilation and evaluation left out), backend {}; ratios to fp32.\n\n| model | precision | samples/s | tokens/s | throughput / fp32 | note |\n|---|---|---|---|---|---|\n",
        b.name()
    );
    for family in &FAMILIES {
        let bin = format!("{}/release/examples/{}", b.target_dir(), family.program);
        anyhow::ensure!(
            Path::new(&bin).exists(),
            "{bin} is not built (run without --no-build, or build it with `cargo xtask build --backend {}`)",
            b.name()
        );
        let mut fp32 = None;
        for p in PRECISIONS {
            let dir = logs.join(format!("{}-{p}", family.name));
            let mut args = family.args.to_vec();
            args.extend(["--precision", p]);
            let (sps, tps, whole, note) = match run_limited(b, &bin, &args, &dir)? {
                Outcome::Ran(summary) => {
                    // The last window's rate: the run's steady state.
                    let sps = from_log(&dir, "throughput/samples_per_sec")
                        .0
                        .last()
                        .copied();
                    let tps = from_log(&dir, "throughput/tokens_per_sec")
                        .0
                        .last()
                        .copied();
                    // The whole run's rate (compilation included), for comparison.
                    let whole = match family.tokens {
                        true => summary["tokens_per_second"].as_f64(),
                        false => summary["samples_per_second"].as_f64(),
                    };
                    (sps, tps.filter(|_| family.tokens), whole, String::new())
                }
                Outcome::Refused(why) => (None, None, None, format!("refused: {why}")),
                Outcome::Failed(why) => (None, None, None, format!("failed: {why}")),
            };
            if p == "fp32" {
                fp32 = sps;
            }
            let ratio = sps.zip(fp32).map(|(s, f)| s / f);
            md.push_str(&format!(
                "| {} | {p} | {} | {} | {} | {note} |\n",
                family.name,
                sps.map_or("-".into(), |v| format!("{v:.0}")),
                tps.map_or("-".into(), |v| format!("{v:.0}")),
                ratio.map_or("-".into(), |v| format!("{v:.2}x")),
            ));
            rows.push(serde_json::json!({
                "model": family.name,
                "precision": p,
                "samples_per_second": sps,
                "tokens_per_second": tps,
                "throughput_over_fp32": ratio,
                "whole_run_rate": whole,
                "whole_run_unit": if family.tokens { "tokens/s" } else { "samples/s" },
                "note": note,
            }));
        }
    }
    // Automatic microbatching into a real out-of-memory: on the CubeCL backends only (the
    // CPU backends' device is the host, which never reports one).
    let oom = if matches!(b, Backend::Cuda | Backend::Wgpu) {
        let bin = format!("{}/release/examples/shakespeare", b.target_dir());
        let dir = logs.join("oom");
        let outcome = run_limited(b, &bin, OOM_ARGS, &dir)?;
        let (sizes, texts) = from_log(&dir, "train/microbatch_size");
        let changes: Vec<String> = texts
            .into_iter()
            .filter(|t| t.starts_with("auto_microbatching"))
            .collect();
        let settled = sizes.last().copied();
        let (ok, line) = match &outcome {
            Outcome::Ran(_) if settled.is_some_and(|s| s < 1024.0) => (
                true,
                format!(
                    "ran out of memory at 1,024 windows of 2,048 characters, retried, and trained both batches in microbatches of {}",
                    settled.unwrap_or(f64::NAN)
                ),
            ),
            Outcome::Ran(_) => (
                false,
                "trained without running out of memory: the forced out-of-memory did not happen (a device with more than 256 GiB?)".into(),
            ),
            Outcome::Refused(why) | Outcome::Failed(why) => (false, format!("failed: {why}")),
        };
        md.push_str(&format!(
            "\nAutomatic microbatching (`shakespeare {}`): {line}.{}\n",
            OOM_ARGS.join(" "),
            if changes.is_empty() {
                String::new()
            } else {
                format!(" Logged: {}", changes.join(" / "))
            }
        ));
        serde_json::json!({
            "args": OOM_ARGS,
            "recovered": ok,
            "settled_microbatch_size": settled,
            "logged": changes,
            "outcome": line,
        })
    } else {
        md.push_str(
            "\nAutomatic microbatching: not run (a CPU backend never runs out of device memory).\n",
        );
        serde_json::Value::Null
    };
    let _ = std::fs::remove_dir_all(&logs);
    let seconds = started.elapsed().as_secs_f64();
    md.push_str(&format!(
        "\nThe check took {:.1} minutes.\n",
        seconds / 60.0
    ));
    let json = serde_json::json!({
        "backend": b.name(),
        "throughput": rows,
        "out_of_memory_retry": oom,
        "seconds": seconds,
    });
    Ok((json, md))
}
