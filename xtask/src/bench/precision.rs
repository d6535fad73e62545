//! The bench's precision section: the main job's CNN in each precision against float32.

use anyhow::Result;

use super::*;
use crate::backend::Backend;

/// Precision (`--precision`): the main job's CNN in each precision, interleaved repetitions
/// of the same short run (one training thread): samples/s and peak memory as ratios to
/// float32's in the same repetition (medians, min-max), and each precision's final test
/// accuracy (the same in every repetition: the runs are deterministic). Memory is the
/// device's reserved bytes at the end of training where the backend reports them (its pools
/// keep their peak), else the process's peak resident set (CPU backends, whose device is
/// the host). A precision the backend cannot compute is a row that says so.
pub(crate) fn precision_bench(b: Backend, quick: bool) -> Result<(serde_json::Value, String)> {
    let bin = build_mnist(b)?;
    // The quick run's epoch is 16 batches: shorter than the default 30-batch warmup, which the
    // example refuses, so it warms up over its first 4.
    // Three repetitions: the half types run 4-16x slower than float32 on the CPU backends,
    // and five made this the bench's longest section after the language model.
    let (reps, train_limit, warmup) = if quick {
        (1, "1024", "4ba")
    } else {
        (3, "2048", "30ba")
    };
    const PRECISIONS: [&str; 5] = ["fp32", "amp_bf16", "amp_fp16", "bf16", "fp16"];
    // Per precision: samples/s, memory, accuracy of each repetition, or why it cannot run.
    let mut sps: Vec<Vec<f64>> = vec![vec![]; PRECISIONS.len()];
    let mut mem: Vec<Vec<f64>> = vec![vec![]; PRECISIONS.len()];
    let mut accuracy = vec![f64::NAN; PRECISIONS.len()];
    let mut refused: Vec<Option<String>> = vec![None; PRECISIONS.len()];
    let mut memory_kind = "peak resident set of the process";
    for _ in 0..reps {
        for (i, p) in PRECISIONS.iter().enumerate() {
            if refused[i].is_some() {
                continue;
            }
            let args = strings(&[
                "--no-progress",
                "--precision",
                p,
                "--max-duration",
                "1ep",
                "--train-limit",
                train_limit,
                "--warmup",
                warmup,
            ]);
            match run_binary_on(b, &bin, &args, 1) {
                Ok(out) => {
                    let s = last_json(&out)?;
                    sps[i].push(s["samples_per_second"].as_f64().unwrap_or(f64::NAN));
                    let m = match s["device_reserved_bytes"].as_f64() {
                        Some(m) => {
                            memory_kind = "device memory reserved at the end of training";
                            m
                        }
                        None => s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN),
                    };
                    mem[i].push(m);
                    accuracy[i] = s["test_accuracy"].as_f64().unwrap_or(f64::NAN);
                }
                Err(e) if e.to_string().contains("does not support") => {
                    let why = e.to_string();
                    let line = why.lines().rev().find(|l| l.contains("does not support"));
                    refused[i] = Some(format!(
                        "no {} type: {}",
                        if p.contains("bf16") {
                            "bfloat16"
                        } else {
                            "float16"
                        },
                        line.unwrap_or("refused").trim()
                    ));
                }
                Err(e) => return Err(e),
            }
        }
    }
    let mut rows = Vec::new();
    let mut md = format!(
        "{reps} interleaved repetitions of one epoch on {train_limit} digits (batches of 64, one thread); ratios to fp32 in the same repetition, median (min-max); memory: {memory_kind}\n\n| precision | samples/s | throughput / fp32 | memory / fp32 | test accuracy |\n|---|---|---|---|---|\n"
    );
    for (i, p) in PRECISIONS.iter().enumerate() {
        if let Some(why) = &refused[i] {
            rows.push(serde_json::json!({"precision": p, "supported": false, "reason": why}));
            md.push_str(&format!("| {p} | {why} | | | |\n"));
            continue;
        }
        let mut thr: Vec<f64> = sps[i].iter().zip(&sps[0]).map(|(a, b)| a / b).collect();
        let mut mr: Vec<f64> = mem[i].iter().zip(&mem[0]).map(|(a, b)| a / b).collect();
        let (s_med, s_min, s_max) = median_range(&mut sps[i].clone());
        let (t_med, t_min, t_max) = median_range(&mut thr);
        let (m_med, m_min, m_max) = median_range(&mut mr);
        rows.push(serde_json::json!({
            "precision": p,
            "supported": true,
            "samples_per_second": {"median": s_med, "min": s_min, "max": s_max},
            "throughput_ratio": t_med,
            "throughput_ratio_range": [t_min, t_max],
            "memory_ratio": m_med,
            "memory_ratio_range": [m_min, m_max],
            "test_accuracy": accuracy[i],
        }));
        md.push_str(&format!(
            "| {p} | {s_med:.0} ({s_min:.0}-{s_max:.0}) | {t_med:.3} ({t_min:.3}-{t_max:.3}) | {m_med:.3} ({m_min:.3}-{m_max:.3}) | {:.4} |\n",
            accuracy[i]
        ));
    }
    let json = serde_json::json!({
        "reps": reps,
        "train_digits": train_limit.parse::<u64>().unwrap_or(0),
        "batch_size": 64,
        "memory": memory_kind,
        "rows": rows,
    });
    Ok((json, md))
}
