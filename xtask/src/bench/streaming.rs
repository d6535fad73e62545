//! The bench's streaming section: the main job fed from MDS shards (local, and in a local
//! `s3s-fs` server) against the same digits in memory, and reading an epoch's samples from
//! shards against reading them from memory.

use std::process::Command;

use anyhow::{Context, Result};

use super::*;
use crate::backend::Backend;

/// `streaming.data_wait_fraction.{memory,local,s3}`: the share of the main job's training
/// time spent waiting for its next batch (one epoch, one training thread, 2 MB cache for the
/// 6.4 MB of shards, blocks of 2,000 samples), median and range of interleaved repetitions
/// (goal: at most 0.02, as in memory). `streaming.samples_per_second_read`: an epoch of
/// training digits read in training order and decoded, from local shards with a cold cache
/// and from memory, and their ratio. `streaming.peak_rss`: the peak memory of reading an
/// epoch through a 4 MB cache from the digits' shards and from a dataset 20 times larger.
/// S3 rows are absent where s3s-fs is not installed.
pub(crate) fn streaming_bench(b: Backend, quick: bool) -> Result<(serde_json::Value, String)> {
    let mut build = strings(&[
        "build",
        "--release",
        "--example",
        "shards",
        "--example",
        "mnist",
    ]);
    build.extend(b.cargo_args(bench_selection(), &[]));
    cargo(&build)?;
    let dir = std::path::PathBuf::from("target/bench/streaming");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let shards = dir.join("mnist");
    let shards_bin = format!("{}/release/examples/shards", b.target_dir());
    let run = |bin: &str, args: &[&str], env: &[(&str, String)]| -> Result<serde_json::Value> {
        let out = Command::new(bin)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .with_context(|| format!("running {bin}"))?;
        anyhow::ensure!(
            out.status.success(),
            "{bin} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        last_json(&String::from_utf8_lossy(&out.stdout))
    };
    let s = shards.to_str().context("a UTF-8 path")?.to_string();
    run(
        &shards_bin,
        &[
            "mnist",
            &s,
            "--size-limit",
            "256KB",
            "--compression",
            "zstd:3",
        ],
        &[],
    )?;
    // The same shards in a local S3 server, when there is one.
    let server = S3Bench::start(&dir.join("s3root"), &shards)?;
    let mnist = format!("{}/release/examples/mnist", b.target_dir());
    let duration = if quick { "60ba" } else { "3ep" };
    let reps = if quick { 1 } else { 5 };
    let mut waits: Vec<(&str, Vec<f64>)> = vec![("memory", vec![]), ("local", vec![])];
    if server.is_some() {
        waits.push(("s3", vec![]));
    }
    for rep in 0..reps {
        for (source, v) in waits.iter_mut() {
            let cache = dir.join(format!("cache-{source}-{rep}"));
            let c = cache.to_str().context("a UTF-8 path")?.to_string();
            let mut args = vec![
                "--max-duration",
                duration,
                "--no-progress",
                "--backend",
                b.name(),
            ];
            let data;
            let mut env = Vec::new();
            match *source {
                "local" => data = s.clone(),
                "s3" => {
                    data = "s3://bench/mnist".to_string();
                    env = server.as_ref().map(|x| x.env()).unwrap_or_default();
                }
                _ => data = String::new(),
            }
            let flags = stream_flags(&data, &c);
            if !data.is_empty() {
                args.extend(flags.iter().map(String::as_str));
            }
            let summary = run(&mnist, &args, &env)?;
            v.push(summary["data_wait_fraction"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let mut read_rows: Vec<(&str, Vec<f64>)> = vec![("memory", vec![]), ("local", vec![])];
    for rep in 0..5 {
        for (source, v) in read_rows.iter_mut() {
            let cache = dir.join(format!("read-cache-{rep}"));
            let c = cache.to_str().context("a UTF-8 path")?.to_string();
            let mut args = vec!["read".to_string()];
            if *source == "local" {
                args.extend(stream_flags(&s, &c));
            }
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let r = run(&shards_bin, &refs, &[])?;
            v.push(r["samples_per_second"].as_f64().unwrap_or(f64::NAN));
        }
    }
    drop(server);
    // Peak memory of reading a whole epoch, from the digits' shards and from a dataset 20
    // times larger (the training digits written 20 times over, 128 MB raw), through a cache
    // of 4 MB: the second must not need more memory.
    let s20 = dir
        .join("mnist20")
        .to_str()
        .context("a UTF-8 path")?
        .to_string();
    run(
        &shards_bin,
        &[
            "mnist",
            &s20,
            "--size-limit",
            "256KB",
            "--compression",
            "zstd:3",
            "--repeat",
            "20",
        ],
        &[],
    )?;
    let raw_bytes = |location: &str| -> Result<u64> {
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(format!("{location}/train/index.json"))?)?;
        Ok(index["shards"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["raw_data"]["bytes"].as_u64())
                    .sum()
            })
            .unwrap_or(0))
    };
    let mut rss = Vec::new();
    for (label, location) in [("1x", &s), ("20x", &s20)] {
        let cache = dir.join(format!("rss-cache-{label}"));
        let c = cache.to_str().context("a UTF-8 path")?.to_string();
        let r = run(
            &shards_bin,
            &[
                "read",
                "--data",
                location,
                "--cache-dir",
                &c,
                "--cache-limit",
                "4MB",
                "--shuffle-block-size",
                "1000",
            ],
            &[],
        )?;
        rss.push((
            label,
            r["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN),
            r["samples"].clone(),
            raw_bytes(location)?,
        ));
    }
    let mut json = serde_json::json!({
        "shards": "the 8,000 bundled training digits as MDS, zstd:3, 256 KB shards",
        "cache_limit_bytes": 2_000_000,
        "shuffle_block_size": 1000,
        "max_duration": duration,
    });
    let mut md = String::from("| source | data wait fraction, median (min-max) |\n|---|---|\n");
    for (source, v) in waits.iter_mut() {
        let (m, lo, hi) = median_range(v);
        json["data_wait_fraction"][*source] = serde_json::json!(m);
        json["data_wait_fraction_range"][*source] = serde_json::json!([lo, hi]);
        md.push_str(&format!("| {source} | {m:.4} ({lo:.4}-{hi:.4}) |\n"));
    }
    let mut read: Vec<f64> = Vec::new();
    md.push_str("\n| read an epoch | samples/s, median (min-max) |\n|---|---|\n");
    for (source, v) in read_rows.iter_mut() {
        let (m, lo, hi) = median_range(v);
        read.push(m);
        json["samples_per_second_read"][*source] = serde_json::json!(m);
        json["samples_per_second_read_range"][*source] = serde_json::json!([lo, hi]);
        md.push_str(&format!("| {source} | {m:.0} ({lo:.0}-{hi:.0}) |\n"));
    }
    json["samples_per_second_read"]["local_over_memory"] = serde_json::json!(read[1] / read[0]);
    md.push_str("\n| read an epoch through a 4 MB cache | samples | raw bytes | peak RSS |\n|---|---|---|---|\n");
    for (label, bytes, samples, raw) in &rss {
        json["peak_rss"][*label] =
            serde_json::json!({"peak_rss_bytes": bytes, "samples": samples, "raw_bytes": raw});
        md.push_str(&format!(
            "| dataset {label} | {samples} | {raw} | {:.1} MB |\n",
            bytes / 1e6
        ));
    }
    json["peak_rss"]["ratio_20x_over_1x"] = serde_json::json!(rss[1].1 / rss[0].1);
    json["peak_rss"]["cache_limit_bytes"] = serde_json::json!(4_000_000);
    Ok((json, md))
}

/// The flags of the measured streaming runs: the 2 MB cache in `cache`, blocks of 1,000.
fn stream_flags(data: &str, cache: &str) -> Vec<String> {
    strings(&[
        "--data",
        data,
        "--cache-dir",
        cache,
        "--cache-limit",
        "2MB",
        "--shuffle-block-size",
        "1000",
    ])
}

/// A local s3s-fs serving a copy of the shards as `s3://bench/mnist`.
struct S3Bench {
    child: std::process::Child,
    port: u16,
}

const KEY: &str = "bench-access";
const SECRET: &str = "bench-secret-0f3e";

impl S3Bench {
    fn start(root: &std::path::Path, shards: &std::path::Path) -> Result<Option<S3Bench>> {
        let Some(bin) = s3s_fs() else {
            return Ok(None);
        };
        copy_tree(shards, &root.join("bench").join("mnist"))?;
        let (child, port) = start_s3s_fs(&bin, root, KEY, SECRET)?;
        Ok(Some(S3Bench { child, port }))
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "AWS_ENDPOINT_URL",
                format!("http://127.0.0.1:{}", self.port),
            ),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ACCESS_KEY_ID", KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.to_string()),
        ]
    }
}

impl Drop for S3Bench {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let target = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &target)?;
        } else {
            std::fs::copy(e.path(), target)?;
        }
    }
    Ok(())
}
