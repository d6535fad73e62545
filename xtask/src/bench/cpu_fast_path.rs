//! The bench's CPU fast-path sections: the CNN (`cpu_fast_path`) and the GPT
//! (`gpt_fast_path`) on Flashover's kernels against Burn's own.

use std::process::Command;

use anyhow::{bail, Context, Result};

use super::*;
use crate::backend::Backend;

/// Runs `bin args` with `threads` compute threads (`RAYON_NUM_THREADS`), pinned to the first
/// `threads` CPUs with `taskset` if `pin`, and returns its JSON summary line; its stderr in
/// the error when it fails.
fn run_on_threads(
    bin: &str,
    args: &[String],
    threads: usize,
    pin: bool,
) -> Result<serde_json::Value> {
    let cpus = (0..threads)
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut cmd = if pin {
        eprintln!(
            "$ RAYON_NUM_THREADS={threads} taskset -c {cpus} {bin} {}",
            args.join(" ")
        );
        let mut c = Command::new("taskset");
        c.args(["-c", &cpus, bin]);
        c
    } else {
        eprintln!("$ RAYON_NUM_THREADS={threads} {bin} {}", args.join(" "));
        Command::new(bin)
    };
    let out = cmd
        .args(args)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .with_context(|| format!("running {bin}"))?;
    if !out.status.success() {
        bail!("{bin} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    last_json(&String::from_utf8_lossy(&out.stdout))
}

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
        let s = run_on_threads(&bin, &args, threads, false)?;
        let sps = s["samples_per_second"].as_f64().unwrap_or(f64::NAN);
        let rss = s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        Ok((sps, rss))
    };
    let reps = if quick { 1 } else { 5 };
    let mut runs = FourWay::default();
    for _ in 0..reps {
        // Burn 1 thread, fast 1 thread, Burn 2 threads, fast 2 threads.
        let mut r = [(0.0, 0.0); 4];
        for (i, (format, threads)) in [
            ("channels-first", 1),
            ("channels-last", 1),
            ("channels-first", 2),
            ("channels-last", 2),
        ]
        .into_iter()
        .enumerate()
        {
            r[i] = run(format, threads)?;
        }
        runs.push(r);
    }
    let (mut json, cells, line) = runs.report("samples_per_second");
    json.insert("reps".into(), reps.into());
    json.insert("batches".into(), 100.into());
    json.insert("batch_size".into(), 64.into());
    let md = format!(
        "{reps} interleaved repetitions of 100 batches of 64 (the main job); median (min-max)\n\n| kernels | samples/s, 1 thread | samples/s, 2 threads |\n|---|---|---|\n| Burn's (channels-first) | {} | {} |\n| Flashover's (channels-last) | {} | {} |\n\n{line}\n",
        cells[0], cells[2], cells[1], cells[3],
    );
    Ok(Some((serde_json::Value::Object(json), md)))
}

/// The shakespeare example's default GPT (4 blocks, width 128, 4 heads, batches of 32
/// windows of 128 characters, AdamW) on Burn's tensor ops (`--kernels burn`) against the
/// fast path (`--kernels fast`: fused dense layers with GELU, fused layer norms, the attention
/// kernel), each at 1 and 2 threads (`RAYON_NUM_THREADS`, pinned with `taskset` where it is
/// installed), repetitions interleaved: tokens per second over 20 batches without evaluation
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
    // 20 batches: Burn's ops take 1.4 to 2 s a batch (by CPU) on one or two threads, so each
    // batch of the five repetitions costs 15 to 20 s of the bench (30 batches took 7.7
    // minutes on 2026-12-07, 20 took 8.2 on a slower CPU); at 15 the fast path's two-thread
    // range doubled.
    let batches = if quick { 10 } else { 20 };
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
        let s = run_on_threads(&bin, &args, threads, pin)?;
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
    let mut runs = FourWay::default();
    let mut losses = (f64::NAN, f64::NAN);
    for _ in 0..reps {
        // Burn 1 thread, fast 1 thread, Burn 2 threads, fast 2 threads.
        let mut r = [(0.0, 0.0); 4];
        let mut loss = [0.0; 4];
        for (i, (kernels, threads)) in [("burn", 1), ("fast", 1), ("burn", 2), ("fast", 2)]
            .into_iter()
            .enumerate()
        {
            let (v, m, l) = run(kernels, threads)?;
            r[i] = (v, m);
            loss[i] = l;
        }
        // The same model, data and steps: the validation losses agree to float32 rounding
        // (4 digits), whatever the kernels and threads.
        if loss.iter().any(|l| (l - loss[0]).abs() > 5e-4) {
            bail!("the kernels changed the validation loss: {loss:?}");
        }
        losses = (loss[0], loss[1]);
        runs.push(r);
    }
    let (mut json, cells, line) = runs.report("tokens_per_second");
    json.insert("reps".into(), reps.into());
    json.insert("batches".into(), batches.into());
    json.insert(
        "model".into(),
        "the shakespeare example's default GPT (4 blocks, width 128, 4 heads, 32 x 128 tokens per batch, AdamW)".into(),
    );
    json.insert("pinned".into(), pin.into());
    json.insert(
        "val_loss".into(),
        serde_json::json!({"burn": losses.0, "fast": losses.1}),
    );
    let md = format!(
        "{reps} interleaved repetitions of {batches} batches of 32 x 128 tokens (the shakespeare example's default GPT); median (min-max)\n\n| kernels | tokens/s, 1 thread | tokens/s, 2 threads |\n|---|---|---|\n| Burn's tensor ops (`--kernels burn`) | {} | {} |\n| Flashover's fast path (`--kernels fast`) | {} | {} |\n\n{line}; validation loss after the run {:.5} (Burn's ops) and {:.5} (fast path)\n",
        cells[0], cells[2], cells[1], cells[3], losses.0, losses.1,
    );
    Ok(Some((serde_json::Value::Object(json), md)))
}

/// The four interleaved runs of a fast-path comparison, repetition by repetition: Burn's
/// kernels and the fast path, at 1 and 2 threads, each's throughput and peak RSS.
#[derive(Default)]
struct FourWay {
    rates: [Vec<f64>; 4],
    speedup_1thread: Vec<f64>,
    speedup_2threads: Vec<f64>,
    thread_scaling: Vec<f64>,
    peak_rss_ratio: Vec<f64>,
}

impl FourWay {
    /// One repetition: `(throughput, peak RSS)` of Burn at 1 thread, fast at 1, Burn at 2,
    /// fast at 2.
    fn push(&mut self, r: [(f64, f64); 4]) {
        for (rates, (v, _)) in self.rates.iter_mut().zip(r) {
            rates.push(v);
        }
        self.speedup_1thread.push(r[1].0 / r[0].0);
        self.speedup_2threads.push(r[3].0 / r[2].0);
        self.thread_scaling.push(r[3].0 / r[1].0);
        self.peak_rss_ratio.push(r[1].1 / r[0].1);
    }

    /// The JSON fields (the four rates under `rate_key`, each ratio's median and range),
    /// the four rates as table cells (`median (min-max)`, in push order) and the speed-up
    /// sentence.
    fn report(
        mut self,
        rate_key: &str,
    ) -> (
        serde_json::Map<String, serde_json::Value>,
        [String; 4],
        String,
    ) {
        let ranges = self.rates.each_mut().map(|v| median_range(v));
        let row = |r: &(f64, f64, f64)| serde_json::json!({"median": r.0, "min": r.1, "max": r.2});
        let mut json = serde_json::Map::new();
        json.insert(
            rate_key.into(),
            serde_json::json!({
                "burn_1thread": row(&ranges[0]),
                "fast_1thread": row(&ranges[1]),
                "burn_2threads": row(&ranges[2]),
                "fast_2threads": row(&ranges[3]),
            }),
        );
        let mut ratio = |name: &str, v: &mut Vec<f64>| {
            let (med, min, max) = median_range(v);
            json.insert(name.into(), med.into());
            json.insert(format!("{name}_range"), serde_json::json!([min, max]));
            (med, min, max)
        };
        let (a, a0, a1) = ratio("speedup_1thread", &mut self.speedup_1thread);
        let (b, b0, b1) = ratio("speedup_2threads", &mut self.speedup_2threads);
        let (c, c0, c1) = ratio("thread_scaling", &mut self.thread_scaling);
        let (d, d0, d1) = ratio("peak_rss_ratio", &mut self.peak_rss_ratio);
        let cells = ranges.map(|r| format!("{:.0} ({:.0}-{:.0})", r.0, r.1, r.2));
        let line = format!(
            "Speed-up: {a:.2}x ({a0:.2}-{a1:.2}) at 1 thread, {b:.2}x ({b0:.2}-{b1:.2}) at 2 threads; fast path 2 threads over 1: {c:.2}x ({c0:.2}-{c1:.2}); peak RSS fast over Burn (1 thread): {d:.3} ({d0:.3}-{d1:.3})"
        );
        (json, cells, line)
    }
}
