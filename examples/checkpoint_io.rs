//! Measures checkpoint save and load of the MNIST model's full training state (weights,
//! AdamW moments, trainer state) against writing and reading the same number of bytes raw,
//! with the same durability (fsync). Interleaved repetitions, medians with min-max.
//!
//! With `--remote s3://bucket/prefix` (credentials and endpoint from the environment), also
//! the upload of each checkpoint as the saver's uploader does it (local verification, manifest
//! last, `latest`) against plain PUTs of the same files' bytes to the same server.
//!
//! ```text
//! cargo run --release --example checkpoint_io -- --reps 5 [--remote s3://bench/io]
//! ```

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use clap::Parser;
use flashover::backend::COMPILED;
use flashover::core::callback::Callback;
use flashover::core::logger::Logger;
use flashover::core::restore::Restore;
use flashover::core::setup::SetupOf;
use flashover::models::TrainBackend;
use flashover::prelude::*;
use flashover_examples::{median_min_max, MnistData, MnistRun};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Time checkpoint save/load against raw file I/O of the same size.
#[derive(Debug, Parser)]
struct Args {
    /// Repetitions (interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Backend, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
    /// Folder for the files (default: a new folder under the system temp dir).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Also measure uploads to this object-store prefix.
    #[arg(long)]
    remote: Option<flashover::checkpoint::remote::RemoteUri>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

fn dir_bytes(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for e in fs::read_dir(dir)? {
        total += e?.metadata()?.len();
    }
    Ok(total)
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let device = B::Device::default();
    let scratch = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("flashover-ckpt-bench-{}", std::process::id())),
    };
    fs::create_dir_all(&scratch)?;
    // A trainer a few steps in, so the optimizer has moments to save.
    let mut run = MnistRun::default();
    run.data = MnistData {
        train_limit: Some(256),
        test_limit: Some(10),
        ..run.data
    };
    run.max_duration = Time::Batch(4);
    // Four batches at a constant rate: the default warmup (30 batches) is longer than this
    // run, which the trainer refuses.
    run.scheduler = flashover::core::schedule::Scheduler::constant();
    let mut trainer = run
        .builder::<B, _>(MnistRun::adamw::<B>(), &device)?
        .build()?;
    trainer.fit()?;
    let mut logger = Logger::default();
    let (mut save, mut write, mut load, mut read) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut upload, mut put) = (Vec::new(), Vec::new());
    let store = match &args.remote {
        Some(uri) => {
            let s = flashover::checkpoint::remote::RemoteStore::connect(uri)?;
            s.check()?;
            Some(s)
        }
        None => None,
    };
    let mut bytes = 0;
    for rep in 0..=args.reps {
        let folder = scratch.join(format!("rep{rep}"));
        let mut saver = Saver::new(
            SaverConfig::new(&folder),
            SaveInterval::Every(Time::Epoch(1)),
        )?;
        let t = Instant::now();
        Callback::<SetupOf<B, _, _>>::fit_end(
            &mut saver,
            trainer.state(),
            &mut Control::new(&mut logger),
        )?;
        let save_s = t.elapsed().as_secs_f64();
        let ck = saver
            .saved()
            .last()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("the saver wrote nothing"))?;
        bytes = dir_bytes(&ck)?;

        let blob = vec![0x5Au8; bytes as usize];
        let raw = scratch.join(format!("raw{rep}.bin"));
        let t = Instant::now();
        let mut f = fs::File::create(&raw)?;
        f.write_all(&blob)?;
        f.sync_all()?;
        let write_s = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let restore = Box::new(CheckpointRestore::new(&ck, LoadOptions::default()));
        Restore::<SetupOf<B, _, _>>::restore(restore, &mut trainer.restoring())?;
        let load_s = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut n = 0;
        for e in fs::read_dir(&ck)? {
            n += fs::read(e?.path())?.len();
        }
        let read_s = t.elapsed().as_secs_f64();
        assert_eq!(n as u64, bytes);
        if let Some(store) = &store {
            let name = ck
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // Each repetition uploads under its own prefix, as a trainer uploads each
            // checkpoint under a new name: replacing a checkpoint first downloads the old
            // manifest, which s3s-fs answers in two TCP writes that Nagle's algorithm and
            // delayed ACKs stall for 40 ms on loopback (seen with strace).
            let rep_store = flashover::checkpoint::remote::RemoteStore::connect(
                &args
                    .remote
                    .as_ref()
                    .expect("a store needs --remote")
                    .join(&format!("rep{rep}"))?,
            )?;
            let t = Instant::now();
            flashover::checkpoint::remote::upload_checkpoint(&rep_store, &folder, &name, false)?;
            let upload_s = t.elapsed().as_secs_f64();
            let files: Vec<(String, Vec<u8>)> = fs::read_dir(&ck)?
                .map(|e| {
                    let e = e?;
                    Ok((
                        e.file_name().to_string_lossy().into_owned(),
                        fs::read(e.path())?,
                    ))
                })
                .collect::<std::io::Result<_>>()?;
            let raw_dir = format!("raw{rep}");
            let t = Instant::now();
            for (file, data) in files {
                store.put(&[raw_dir.as_str(), file.as_str()], data)?;
            }
            let put_s = t.elapsed().as_secs_f64();
            if rep > 0 {
                upload.push(upload_s);
                put.push(put_s);
            }
        }
        // Repetition 0 warms the page cache and allocators and is not counted.
        if rep > 0 {
            save.push(save_s);
            write.push(write_s);
            load.push(load_s);
            read.push(read_s);
        }
    }
    let _ = fs::remove_dir_all(&scratch);
    let (s, smin, smax) = median_min_max(&save);
    let (w, wmin, wmax) = median_min_max(&write);
    let (l, lmin, lmax) = median_min_max(&load);
    let (r, rmin, rmax) = median_min_max(&read);
    println!("| operation ({bytes} bytes) | median ms | min-max ms | ratio to raw |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| checkpoint save | {:.2} | {:.2}-{:.2} | {:.2} |",
        s * 1e3,
        smin * 1e3,
        smax * 1e3,
        s / w
    );
    println!(
        "| raw write + fsync | {:.2} | {:.2}-{:.2} | 1.00 |",
        w * 1e3,
        wmin * 1e3,
        wmax * 1e3
    );
    println!(
        "| checkpoint load (verify + decode) | {:.2} | {:.2}-{:.2} | {:.2} |",
        l * 1e3,
        lmin * 1e3,
        lmax * 1e3,
        l / r
    );
    println!(
        "| raw read | {:.2} | {:.2}-{:.2} | 1.00 |",
        r * 1e3,
        rmin * 1e3,
        rmax * 1e3
    );
    let remote = (!upload.is_empty()).then(|| {
        let (u, umin, umax) = median_min_max(&upload);
        let (p, pmin, pmax) = median_min_max(&put);
        println!(
            "| checkpoint upload (verify, manifest last, latest) | {:.2} | {:.2}-{:.2} | {:.2} |",
            u * 1e3,
            umin * 1e3,
            umax * 1e3,
            u / p
        );
        println!(
            "| raw PUTs of the same files | {:.2} | {:.2}-{:.2} | 1.00 |",
            p * 1e3,
            pmin * 1e3,
            pmax * 1e3
        );
        json!({
            "upload_median_s": u,
            "raw_put_median_s": p,
            "upload_mb_per_s": bytes as f64 / u / 1e6,
            "raw_put_mb_per_s": bytes as f64 / p / 1e6,
            "upload_throughput_over_raw_put": p / u,
        })
    });
    println!(
        "{}",
        json!({
            "remote": remote,
            "backend": args.backend,
            "bytes": bytes,
            "reps": args.reps,
            "save_median_s": s,
            "raw_write_median_s": w,
            "save_over_raw_write": s / w,
            "load_median_s": l,
            "raw_read_median_s": r,
            "load_over_raw_read": l / r,
        })
    );
    Ok(())
}
