//! The bench's object-storage section: checkpoint uploads against a local `s3s-fs` server.

use std::process::Command;

use anyhow::{Context, Result};

use super::*;
use crate::backend::Backend;

/// Object storage against a local `s3s-fs` server: (1) the checkpoint upload (local
/// verification, manifest last, `latest`) against plain PUTs of the same bytes, from
/// `checkpoint_io --remote`; (2) the MNIST example's training time (six epochs, one training
/// thread) with checkpoints every 25 batches saved locally, and saved locally and uploaded in
/// the background, interleaved repetitions; the figure is the median of the per-repetition
/// ratios of the time up to the last batch end (the step time: `train_seconds` less
/// `fit_end_wait_seconds`), and beside it the same for the whole `fit`, whose end waits for
/// the last upload (a fixed cost of about one upload, 1-2% of these 3-second runs).
pub(crate) fn object_store_bench(
    b: Backend,
    quick: bool,
) -> Result<Option<(serde_json::Value, String)>> {
    let Some(server_bin) = s3s_fs() else {
        return Ok(None);
    };
    let mnist = build_mnist(b)?;
    let tmp = std::env::temp_dir().join(format!("flashover-s3-bench-{}", std::process::id()));
    let root = tmp.join("root");
    std::fs::create_dir_all(root.join("bench"))?;
    let (key, secret) = ("bench-access", "bench-secret-0f3e");
    let (mut server, port) = start_s3s_fs(&server_bin, &root, key, secret)?;
    let result = (|| -> Result<(serde_json::Value, String)> {
        let env = [
            ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ACCESS_KEY_ID", key.to_string()),
            ("AWS_SECRET_ACCESS_KEY", secret.to_string()),
            // Training on one pinned thread, as the other sections: the uploader (and here
            // the server too) run beside it, as on a machine whose cores are not all
            // training.
            ("RAYON_NUM_THREADS", "1".to_string()),
        ];
        // Seven repetitions of six epochs: in three-epoch runs one repetition's ratio ranged
        // 0.94-1.10 on a quiet machine (2026-12-03), wider than the 2% being measured.
        let (reps, epochs) = if quick { (1, 3) } else { (5, 6) };
        let io_bin = format!("{}/release/examples/checkpoint_io", b.target_dir());
        let out = Command::new(&io_bin)
            .args([
                "--reps",
                &reps.to_string(),
                "--remote",
                "s3://bench/io",
                "--backend",
                b.name(),
            ])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .with_context(|| format!("running {io_bin}"))?;
        anyhow::ensure!(
            out.status.success(),
            "checkpoint_io --remote: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let io_text = String::from_utf8_lossy(&out.stdout).into_owned();
        let io = last_json(&io_text)?;
        let train = |extra: &[String]| -> Result<(f64, f64)> {
            let out = Command::new(&mnist)
                .args([
                    "--max-duration",
                    &format!("{epochs}ep"),
                    "--save-interval",
                    "25ba",
                    "--no-progress",
                ])
                .args(["--backend", b.name()])
                .args(extra)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .output()
                .with_context(|| format!("running {mnist}"))?;
            anyhow::ensure!(
                out.status.success(),
                "mnist {extra:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let s = last_json(&String::from_utf8_lossy(&out.stdout))?;
            let train = s["train_seconds"]
                .as_f64()
                .context("the summary has train_seconds")?;
            let wait = s["fit_end_wait_seconds"]
                .as_f64()
                .context("the summary has fit_end_wait_seconds")?;
            // (stepping: up to the last batch end; the whole fit, with FIT_END's wait)
            Ok((train - wait, train))
        };
        let (mut local, mut remote, mut ratios, mut whole) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..reps {
            let dir = tmp.join(format!("local-{rep}"));
            let l = train(&["--save-folder".into(), dir.display().to_string()])?;
            let r = train(&[
                "--save-folder".into(),
                format!("s3://bench/run-{rep}"),
                "--checkpoint-cache".into(),
                tmp.join(format!("cache-{rep}")).display().to_string(),
            ])?;
            local.push(l.0);
            remote.push(r.0);
            ratios.push(r.0 / l.0);
            whole.push(r.1 / l.1);
        }
        let (l, lmin, lmax) = median_range(&mut local);
        let (r, rmin, rmax) = median_range(&mut remote);
        let (q, qmin, qmax) = median_range(&mut ratios);
        let (w, wmin, wmax) = median_range(&mut whole);
        let md = format!(
            "{}\n\n{epochs} MNIST epochs ({} batches) with a checkpoint every 25 batches ({reps} interleaved repetitions, one training thread), time up to the last batch end (training and the epoch-end evaluations): saved locally {l:.2} s ({lmin:.2}-{lmax:.2}), saved locally and uploaded in the background {r:.2} s ({rmin:.2}-{rmax:.2}); step-time ratio {q:.3} ({qmin:.3}-{qmax:.3}), goal <= 1.02. With the end of `fit` (which waits for the last checkpoint's write, and upload): ratio {w:.3} ({wmin:.3}-{wmax:.3}).\n",
            table(&io_text),
            125 * epochs
        );
        let json = serde_json::json!({
            "server": "s3s-fs on 127.0.0.1",
            "checkpoint_upload": io["remote"],
            "bytes": io["bytes"],
            "train_seconds_local": l,
            "train_seconds_local_min_max": [lmin, lmax],
            "train_seconds_uploading": r,
            "train_seconds_uploading_min_max": [rmin, rmax],
            "step_time_uploading_over_local": q,
            "step_time_ratio_min_max": [qmin, qmax],
            "fit_time_uploading_over_local": w,
            "fit_time_ratio_min_max": [wmin, wmax],
            "epochs": epochs,
            "reps": reps,
        });
        Ok((json, md))
    })();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(Some)
}
