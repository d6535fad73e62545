//! The bench's CPU fast-path sections: the CNN (`cpu_fast_path`) and the GPT
//! (`gpt_fast_path`) on Flashover's kernels against Burn's own.

use std::process::Command;

use anyhow::{bail, Context, Result};

use super::*;
use crate::backend::Backend;

/// The main job's training throughput and peak memory with Burn's convolution and pooling
/// kernels (`--memory-format channels-first`) against Flashover's channels-last fast path
/// (`channels-last`), each at 1 and 2 threads (`RAYON_NUM_THREADS`), repetitions interleaved:
/// 100 batches of 64, no evaluation inside the timed fit. CPU backends only (`None` on GPU).
pub(crate) fn cpu_fast_path_bench(
    b: Backend,
    quick: bool,
) -> Result<Option<(serde_json::Value, String)>> {
    if !matches!(b, Backend::Flex | Backend::Ndarray) {
        return Ok(None);
    }
    let bin = build_mnist(b)?;
    let run = |format: &str, threads: usize| -> Result<(f64, f64)> {
        let args = strings(&[
            "--no-progress",
            "--max-duration",
            "100ba",
            "--memory-format",
            format,
            "--backend",
            b.name(),
        ]);
        eprintln!("$ RAYON_NUM_THREADS={threads} {bin} {}", args.join(" "));
        let out = Command::new(&bin)
            .args(&args)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!("{bin} failed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        let s = last_json(&String::from_utf8_lossy(&out.stdout))?;
        let sps = s["samples_per_second"].as_f64().unwrap_or(f64::NAN);
        let rss = s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        Ok((sps, rss))
    };
    let reps = if quick { 3 } else { 5 };
    let mut sps = vec![vec![]; 4];
    let (mut s1, mut s2, mut scaling, mut rss) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        // Burn 1 thread, fast 1 thread, Burn 2 threads, fast 2 threads.
        let mut r = vec![];
        for (i, (format, threads)) in [
            ("channels-first", 1),
            ("channels-last", 1),
            ("channels-first", 2),
            ("channels-last", 2),
        ]
        .into_iter()
        .enumerate()
        {
            let (v, m) = run(format, threads)?;
            sps[i].push(v);
            r.push((v, m));
        }
        s1.push(r[1].0 / r[0].0);
        s2.push(r[3].0 / r[2].0);
        scaling.push(r[3].0 / r[1].0);
        rss.push(r[1].1 / r[0].1);
    }
    let ranges: Vec<(f64, f64, f64)> = sps.iter_mut().map(|v| median_range(v)).collect();
    let (a_med, a_min, a_max) = median_range(&mut s1);
    let (b_med, b_min, b_max) = median_range(&mut s2);
    let (c_med, c_min, c_max) = median_range(&mut scaling);
    let (d_med, d_min, d_max) = median_range(&mut rss);
    let row = |r: &(f64, f64, f64)| serde_json::json!({"median": r.0, "min": r.1, "max": r.2});
    let json = serde_json::json!({
        "reps": reps,
        "batches": 100,
        "batch_size": 64,
        "samples_per_second": {
            "burn_1thread": row(&ranges[0]),
            "fast_1thread": row(&ranges[1]),
            "burn_2threads": row(&ranges[2]),
            "fast_2threads": row(&ranges[3]),
        },
        "speedup_1thread": a_med,
        "speedup_1thread_range": [a_min, a_max],
        "speedup_2threads": b_med,
        "speedup_2threads_range": [b_min, b_max],
        "thread_scaling": c_med,
        "thread_scaling_range": [c_min, c_max],
        "peak_rss_ratio": d_med,
        "peak_rss_ratio_range": [d_min, d_max],
    });
    let f = |r: &(f64, f64, f64)| format!("{:.0} ({:.0}-{:.0})", r.0, r.1, r.2);
    let md = format!(
        "{reps} interleaved repetitions of 100 batches of 64 (the main job); median (min-max)\n\n| kernels | samples/s, 1 thread | samples/s, 2 threads |\n|---|---|---|\n| Burn's (channels-first) | {} | {} |\n| Flashover's (channels-last) | {} | {} |\n\nSpeed-up: {a_med:.2}x ({a_min:.2}-{a_max:.2}) at 1 thread, {b_med:.2}x ({b_min:.2}-{b_max:.2}) at 2 threads; fast path 2 threads over 1: {c_med:.2}x ({c_min:.2}-{c_max:.2}); peak RSS fast over Burn (1 thread): {d_med:.3} ({d_min:.3}-{d_max:.3})\n",
        f(&ranges[0]),
        f(&ranges[2]),
        f(&ranges[1]),
        f(&ranges[3]),
    );
    Ok(Some((json, md)))
}

/// The shakespeare example's default GPT (4 blocks, width 128, 4 heads, batches of 32
/// windows of 128 characters, AdamW) on Burn's tensor ops (`--kernels burn`) against the
/// fast path (`--kernels fast`: fused dense layers with GELU, fused layer norms, the attention
/// kernel), each at 1 and 2 threads (`RAYON_NUM_THREADS`, pinned with `taskset` where it is
/// installed), repetitions interleaved: tokens per second over 30 batches without evaluation
/// inside the timed fit, the same validation loss checked (quick mode: one repetition of 10
/// batches, a smoke run). CPU backends only (`None` on GPU).
pub(crate) fn gpt_fast_path_bench(
    b: Backend,
    quick: bool,
) -> Result<Option<(serde_json::Value, String)>> {
    if !matches!(b, Backend::Flex | Backend::Ndarray) {
        return Ok(None);
    }
    let bin = format!("{}/release/examples/shakespeare", b.target_dir());
    let batches = if quick { 10 } else { 30 };
    let pin = Command::new("taskset").arg("--version").output().is_ok();
    let run = |kernels: &str, threads: usize| -> Result<(f64, f64, f64)> {
        let args = strings(&[
            "--no-progress",
            "--max-duration",
            &format!("{batches}ba"),
            "--val-windows",
            "16",
            "--eval-interval",
            "100000ba",
            "--warmup",
            "5ba",
            "--kernels",
            kernels,
            "--backend",
            b.name(),
        ]);
        let cpus = if threads == 1 { "0" } else { "0,1" };
        eprintln!(
            "$ RAYON_NUM_THREADS={threads} taskset -c {cpus} {bin} {}",
            args.join(" ")
        );
        let mut cmd = if pin {
            let mut c = Command::new("taskset");
            c.args(["-c", cpus, &bin]);
            c
        } else {
            Command::new(&bin)
        };
        let out = cmd
            .args(&args)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!("{bin} failed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        let s = last_json(&String::from_utf8_lossy(&out.stdout))?;
        if s["kernels"] != kernels {
            bail!(
                "asked for --kernels {kernels}, the run used {}",
                s["kernels"]
            );
        }
        let tps = s["tokens_per_second"].as_f64().unwrap_or(f64::NAN);
        let rss = s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        let loss = s["val_loss"].as_f64().unwrap_or(f64::NAN);
        Ok((tps, rss, loss))
    };
    let reps = if quick { 1 } else { 5 };
    let mut tps = vec![vec![]; 4];
    let (mut s1, mut s2, mut scaling, mut rss) = (vec![], vec![], vec![], vec![]);
    let mut losses = (f64::NAN, f64::NAN);
    for _ in 0..reps {
        // Burn 1 thread, fast 1 thread, Burn 2 threads, fast 2 threads.
        let mut r = vec![];
        for (i, (kernels, threads)) in [("burn", 1), ("fast", 1), ("burn", 2), ("fast", 2)]
            .into_iter()
            .enumerate()
        {
            let (v, m, loss) = run(kernels, threads)?;
            tps[i].push(v);
            r.push((v, m, loss));
        }
        // The same model, data and steps: the validation losses agree to float32 rounding
        // (4 digits), whatever the kernels and threads.
        let (burn_loss, fast_loss) = (r[0].2, r[1].2);
        if r.iter().any(|x| (x.2 - burn_loss).abs() > 5e-4) {
            bail!(
                "the kernels changed the validation loss: {:?}",
                r.iter().map(|x| x.2).collect::<Vec<_>>()
            );
        }
        losses = (burn_loss, fast_loss);
        s1.push(r[1].0 / r[0].0);
        s2.push(r[3].0 / r[2].0);
        scaling.push(r[3].0 / r[1].0);
        rss.push(r[1].1 / r[0].1);
    }
    let ranges: Vec<(f64, f64, f64)> = tps.iter_mut().map(|v| median_range(v)).collect();
    let (a_med, a_min, a_max) = median_range(&mut s1);
    let (b_med, b_min, b_max) = median_range(&mut s2);
    let (c_med, c_min, c_max) = median_range(&mut scaling);
    let (d_med, d_min, d_max) = median_range(&mut rss);
    let row = |r: &(f64, f64, f64)| serde_json::json!({"median": r.0, "min": r.1, "max": r.2});
    let json = serde_json::json!({
        "reps": reps,
        "batches": batches,
        "model": "the shakespeare example's default GPT (4 blocks, width 128, 4 heads, 32 x 128 tokens per batch, AdamW)",
        "pinned": pin,
        "tokens_per_second": {
            "burn_1thread": row(&ranges[0]),
            "fast_1thread": row(&ranges[1]),
            "burn_2threads": row(&ranges[2]),
            "fast_2threads": row(&ranges[3]),
        },
        "val_loss": {"burn": losses.0, "fast": losses.1},
        "speedup_1thread": a_med,
        "speedup_1thread_range": [a_min, a_max],
        "speedup_2threads": b_med,
        "speedup_2threads_range": [b_min, b_max],
        "thread_scaling": c_med,
        "thread_scaling_range": [c_min, c_max],
        "peak_rss_ratio": d_med,
        "peak_rss_ratio_range": [d_min, d_max],
    });
    let f = |r: &(f64, f64, f64)| format!("{:.0} ({:.0}-{:.0})", r.0, r.1, r.2);
    let md = format!(
        "{reps} interleaved repetitions of {batches} batches of 32 x 128 tokens (the shakespeare example's default GPT); median (min-max)\n\n| kernels | tokens/s, 1 thread | tokens/s, 2 threads |\n|---|---|---|\n| Burn's tensor ops (`--kernels burn`) | {} | {} |\n| Flashover's fast path (`--kernels fast`) | {} | {} |\n\nSpeed-up: {a_med:.2}x ({a_min:.2}-{a_max:.2}) at 1 thread, {b_med:.2}x ({b_min:.2}-{b_max:.2}) at 2 threads; fast path 2 threads over 1: {c_med:.2}x ({c_min:.2}-{c_max:.2}); peak RSS fast over Burn (1 thread): {d_med:.3} ({d_min:.3}-{d_max:.3}); validation loss after the run {:.5} (Burn's ops) and {:.5} (fast path)\n",
        f(&ranges[0]),
        f(&ranges[2]),
        f(&ranges[1]),
        f(&ranges[3]),
        losses.0,
        losses.1,
    );
    Ok(Some((json, md)))
}
