//! What a new user hits with bad inputs, damaged files, a missing font and two processes at
//! once, through the real example program: a run never reports success for work it did not
//! do, never loops on a damaged checkpoint, never throws away finished work, and checks every
//! output location and every time unit before the first batch.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use flashover::checkpoint::format::{sha256_hex, verify, MANIFEST, MODEL, TRAINER_STATE};
use flashover::checkpoint::LOCK_FILE;

use crate::damage::two_checkpoints;

/// Runs the example and expects it to fail; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = run_mnist(args);
    assert!(
        !out.status.success(),
        "mnist {args:?} should have failed:\n{}",
        out.stderr
    );
    assert!(out.summary.is_none(), "a failed run printed a summary");
    assert!(
        !out.stderr.contains("panicked"),
        "mnist {args:?} panicked:\n{}",
        out.stderr
    );
    out.stderr
}

/// The `error: ...` line of a failed run.
fn error_line(stderr: &str) -> String {
    stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"))
        .to_string()
}

/// Fails if the error line says something twice: no `: `-separated part repeats, and no
/// part holds another whole.
fn said_once(line: &str) {
    let parts: Vec<&str> = line
        .trim_start_matches("error: ")
        .split(": ")
        .filter(|p| p.len() >= 12)
        .collect();
    for (i, a) in parts.iter().enumerate() {
        for b in &parts[i + 1..] {
            assert!(
                !a.contains(b) && !b.contains(a),
                "the error repeats {b:?}:\n{line}"
            );
        }
    }
}

fn flip_byte(path: &Path) {
    let mut b = fs::read(path).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x40;
    fs::write(path, b).unwrap();
}

fn tree_hashes(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if e.file_name() == LOCK_FILE {
            continue; // the lock's holder record, rewritten by every run
        }
        if p.is_dir() {
            out.extend(tree_hashes(&p));
        } else {
            out.push((p.clone(), sha256_hex(&fs::read(&p).unwrap())));
        }
    }
    out.sort();
    out
}

#[test]
fn a_run_that_would_train_nothing_says_so() {
    // The warmup (SHORT's 20ba) at least as long as the run: an error naming both, where the
    // learning rate used to be 0 at every batch and the run exited 0 with its initial weights.
    for max in ["20ba", "12ba", "1ep"] {
        let line = error_line(&fails(&short_args(&["--max-duration", max])));
        assert!(
            line.contains("`warmup`") && line.contains("20ba") && line.contains(max),
            "{line}"
        );
    }
    // One batch more than the warmup trains.
    let s = summary_of(&short_args(&["--max-duration", "21ba"]));
    assert_eq!(s["batches"], 21);
    // A ratio that scales the run to nothing.
    let line = error_line(&fails(&short_args(&[
        "--max-duration",
        "3ep",
        "--scale-schedule-ratio",
        "0.1",
    ])));
    assert!(
        line.contains("scale_schedule_ratio") && line.contains("0.1") && line.contains("0ep"),
        "{line}"
    );
    // Asked for explicitly, a zero-length run evaluates the initial weights, and says that it
    // trained nothing.
    let out = run_mnist(&short_args(&["--max-duration", "0ba"]));
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(out.summary.as_ref().unwrap()["batches"], 0);
    assert!(out.stderr.contains("trains nothing"), "{}", out.stderr);
}

#[test]
fn autoresume_moves_a_damaged_checkpoint_aside_and_the_run_completes() {
    let (dir, _, damaged) = two_checkpoints();
    let folder = dir.path().to_str().unwrap();
    let save = ["--save-folder", folder, "--save-interval", "4ba"];
    flip_byte(&damaged.join(MODEL));
    let damaged_bytes = fs::read(damaged.join(MODEL)).unwrap();
    // Resumes from ep0-ba4, passes batch 8 (saving ep0-ba8 afresh) and goes on. Before, the
    // save at batch 8 stopped the run with "exists", at every restart.
    let again: Vec<&str> = save
        .iter()
        .copied()
        .chain(["--autoresume", "--stop-after", "12ba"])
        .collect();
    let out = run_mnist(&short_args(&again));
    assert!(out.status.success(), "{}", out.stderr);
    let aside = dir.path().join("ep0-ba8.damaged");
    assert!(
        out.stderr.contains("moved aside") && out.stderr.contains("ep0-ba8.damaged"),
        "the move must be reported:\n{}",
        out.stderr
    );
    assert_eq!(
        fs::read(aside.join(MODEL)).unwrap(),
        damaged_bytes,
        "kept as it was"
    );
    verify(&damaged).expect("a good ep0-ba8 was saved in its place");
    verify(&dir.path().join("ep0-ba12")).unwrap();
    assert_eq!(
        fs::read_to_string(dir.path().join("latest")).unwrap(),
        "ep0-ba12"
    );
    // And it ends where a run that was never damaged ends.
    let clean = tempfile::tempdir().unwrap();
    let straight = summary_of(&short_args(&[
        "--save-folder",
        clean.path().to_str().unwrap(),
        "--stop-after",
        "12ba",
    ]));
    assert_eq!(outcome(out.summary.as_ref().unwrap()), outcome(&straight));
    // A third start finds everything in order and nothing more to move.
    let third = run_mnist(&short_args(&again));
    assert!(
        third.status.success() && !third.stderr.contains("moved aside"),
        "{}",
        third.stderr
    );
}

#[test]
fn when_no_checkpoint_verifies_autoresume_changes_nothing_unless_asked() {
    let (dir, _, _) = two_checkpoints();
    let folder = dir.path().to_str().unwrap();
    flip_byte(&dir.path().join("ep0-ba4").join(MODEL));
    flip_byte(&dir.path().join("ep0-ba8").join(MODEL));
    let before = tree_hashes(dir.path());
    // With --overwrite and --keep 1 a fresh start would replace or rotate them: refused, and
    // nothing is touched.
    let stderr = fails(&short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--overwrite",
        "--keep",
        "1",
        "--autoresume",
    ]));
    let line = error_line(&stderr);
    assert!(
        line.contains("can be resumed from")
            && line.contains("ep0-ba4")
            && line.contains("ep0-ba8")
            && line.contains("--fresh-start"),
        "{line}"
    );
    said_once(&line);
    assert_eq!(tree_hashes(dir.path()), before, "nothing may change");
    // Asked for, the fresh start keeps both aside and trains from the beginning.
    let s = summary_of(&short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--overwrite",
        "--keep",
        "1",
        "--autoresume",
        "--fresh-start",
        "--stop-after",
        "4ba",
    ]));
    assert_eq!(s["batches"], 4);
    for name in ["ep0-ba4.damaged", "ep0-ba8.damaged"] {
        assert!(dir.path().join(name).join(MODEL).is_file(), "{name} kept");
    }
    verify(&dir.path().join("ep0-ba4")).unwrap();
}

#[test]
fn an_unreadable_checkpoint_is_an_error_not_damage() {
    let (dir, _, _) = two_checkpoints();
    let folder = dir.path().to_str().unwrap();
    // A manifest the OS cannot read as a file (EISDIR): an I/O error, which says nothing
    // about the checkpoint's contents. Autoresume must not pass over it to an older one.
    let manifest = dir.path().join("ep0-ba8").join("manifest.json");
    fs::remove_file(&manifest).unwrap();
    fs::create_dir(&manifest).unwrap();
    let err = flashover::checkpoint::find_resumable(dir.path()).unwrap_err();
    assert!(
        matches!(err, flashover::checkpoint::CheckpointError::Io { .. }),
        "{err}"
    );
    let line = error_line(&fails(&short_args(&[
        "--save-folder",
        folder,
        "--autoresume",
    ])));
    assert!(
        line.contains("manifest.json") && line.contains("cannot read"),
        "{line}"
    );
    assert!(!dir.path().join("ep0-ba8.damaged").exists());
}

fn spawn_mnist(args: &[&str]) -> std::process::Child {
    Command::new(example_bin("mnist"))
        .args(args)
        .args(["--no-progress", "--backend", BACKEND])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example starts")
}

/// Waits until `folder/.lock` names process `pid`.
fn wait_for_lock(folder: &Path, pid: u32) {
    let started = Instant::now();
    loop {
        let text = fs::read_to_string(folder.join(LOCK_FILE)).unwrap_or_default();
        if text.contains(&format!("process {pid} ")) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "process {pid} never locked {}",
            folder.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_processes_cannot_write_one_save_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let run = short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--overwrite",
        "--max-duration",
        "8ep",
    ]);
    let first = spawn_mnist(&run);
    wait_for_lock(dir.path(), first.id());
    // The second fails at once, naming the first; before, both ran (and with --overwrite
    // both exited 0, the folder ending with whichever wrote last).
    let started = Instant::now();
    let line = error_line(&fails(&run));
    assert!(
        line.contains(&format!("in use by process {}", first.id())) && line.contains(folder),
        "{line}"
    );
    let refused_in = started.elapsed();
    let done = first.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "the first run was disturbed:\n{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(
        refused_in < Duration::from_secs(30),
        "refused only after {refused_in:?}"
    );
    let latest = fs::read_to_string(dir.path().join("latest")).unwrap();
    assert_eq!(latest, "ep7-ba128");
    verify(&dir.path().join(latest)).unwrap();
    // A SIGKILLed holder leaves the folder free: the OS releases the lock with the process.
    let resume = short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--autoresume",
        "--max-duration",
        "12ep",
    ]);
    let mut killed = spawn_mnist(&resume);
    wait_for_lock(dir.path(), killed.id());
    killed.kill().unwrap();
    killed.wait().unwrap();
    let s = summary_of(&short_args(&[
        "--save-folder",
        folder,
        "--autoresume",
        "--max-duration",
        "12ep",
    ]));
    assert_eq!(s["epochs"], 12);
}

#[test]
fn every_output_location_is_checked_before_the_first_batch() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    fs::write(&file, b"not a folder").unwrap();
    let logs = dir.path().join("logs");
    let logs_s = logs.to_str().unwrap();
    let under_file = file.join("out");
    let under = under_file.to_str().unwrap();
    for flag in ["--out", "--save-folder"] {
        let stderr = fails(&short_args(&[
            flag,
            under,
            "--log-dir",
            logs_s,
            "--log-every",
            "1",
        ]));
        let line = error_line(&stderr);
        assert!(line.contains(under), "{flag}: {line}");
        said_once(&line);
        // Nothing trained: the log has no training loss.
        let jsonl = fs::read_to_string(logs.join("metrics.jsonl")).unwrap_or_default();
        assert!(
            !jsonl.contains("train/loss"),
            "{flag}: training ran before the error:\n{jsonl}"
        );
    }
}

#[test]
fn a_missing_font_costs_the_plot_not_the_run() {
    // A mount namespace with an empty /usr/share/fonts: the slim container of the report.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let logs = dir.path().join("logs");
    let mut args: Vec<String> = vec![example_bin("mnist").to_string_lossy().into_owned()];
    args.extend(
        short_args(&[
            "--out",
            out.to_str().unwrap(),
            "--log-dir",
            logs.to_str().unwrap(),
            "--max-duration",
            "2ep",
            "--no-progress",
            "--backend",
            BACKEND,
        ])
        .iter()
        .map(|s| s.to_string()),
    );
    let run = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg("mount -t tmpfs fontless /usr/share/fonts && exec \"$@\"")
        .arg("sh")
        .args(&args)
        .output()
        .expect("unshare (util-linux) runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        !stderr.contains("mount:") && !stderr.contains("unshare:"),
        "this test needs root to hide the fonts in a mount namespace:\n{stderr}"
    );
    assert!(run.status.success(), "the run was lost:\n{stderr}");
    let summary: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&run.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(summary["batches"], 32);
    assert!(out.join("model.safetensors").is_file() && out.join("summary.json").is_file());
    assert!(logs.join("metrics.jsonl").is_file() && logs.join("metrics.csv").is_file());
    assert!(
        stderr.contains("training plot not drawn") && stderr.contains("no TrueType font"),
        "the missing plot must be reported:\n{stderr}"
    );
    assert!(!out.join("training.png").exists());
}

#[test]
fn times_in_tokens_on_a_dataset_without_tokens_are_errors() {
    for extra in [
        &["--max-duration", "100tok"][..],
        &["--save-folder", "unused", "--save-interval", "100tok"],
        &["--eval-interval", "500tok"],
        &["--stop-after", "100tok"],
        &["--early-stop", "test/accuracy:patience=100tok"],
        &["--algorithms", "ema:half_life=100tok"],
    ] {
        let line = error_line(&fails(&short_args(extra)));
        assert!(
            line.contains("100tok") || line.contains("500tok"),
            "{extra:?}: {line}"
        );
        assert!(line.contains("do not count tokens"), "{extra:?}: {line}");
        said_once(&line);
    }
    assert!(!Path::new("unused").exists());
}

/// Writes an IDX pair of `n` images of `rows x cols` (raw) into `dir` for both splits.
fn write_digits(dir: &Path, n: u32, rows: u32, cols: u32) {
    for split in ["train", "t10k"] {
        let mut img = Vec::new();
        for w in [0x0803u32, n, rows, cols] {
            img.extend(w.to_be_bytes());
        }
        img.extend((0..n * rows * cols).map(|i| (i % 251) as u8));
        fs::write(dir.join(format!("{split}-images-idx3-ubyte")), img).unwrap();
        let mut lab = Vec::new();
        for w in [0x0801u32, n] {
            lab.extend(w.to_be_bytes());
        }
        lab.extend((0..n).map(|i| (i % 10) as u8));
        fs::write(dir.join(format!("{split}-labels-idx1-ubyte")), lab).unwrap();
    }
}

#[test]
fn images_of_another_size_than_the_models_are_refused() {
    for (rows, cols) in [(1, 1), (27, 27), (28, 14)] {
        let dir = tempfile::tempdir().unwrap();
        write_digits(dir.path(), 64, rows, cols);
        let line = error_line(&fails(&[
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--max-duration",
            "1ep",
            "--warmup",
            "0ba",
        ]));
        assert!(
            line.contains(&format!("{rows}x{cols}")) && line.contains("28x28"),
            "{line}"
        );
    }
    // 28x28 from the same writer trains.
    let dir = tempfile::tempdir().unwrap();
    write_digits(dir.path(), 64, 28, 28);
    let s = summary_of(&[
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--max-duration",
        "1ep",
        "--warmup",
        "0ba",
    ]);
    assert_eq!(s["batches"], 1);
}

#[test]
fn a_closed_stdout_is_an_error_not_a_panic() {
    let mut child = spawn_mnist(&short_args(&["--max-duration", "2ep"]));
    drop(child.stdout.take()); // nobody reads the summary
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("writing the summary to stdout") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

#[test]
fn unbounded_settings_are_bounded_and_errors_are_said_once() {
    for (args, expect) in [
        (&["--prefetch", "1000000000"][..], "prefetch"),
        (
            &["--algorithms", "cutout:num_holes=1000000000"],
            "num_holes",
        ),
        (&["--algorithms", "randaugment:depth=1000000000"], "depth"),
        (&["--algorithms", "augmix:width=1000000"], "width"),
        (&["--algorithms", "cutout:num_holes=x"], "num_holes"),
        (&["--algorithms", "mixup:alpha=-1"], "alpha"),
        (&["--algorithms", "sam:rho=0"], "rho"),
        (&["--algorithms", "nosuch"], "nosuch"),
        (&["--recipe", "scorching"], "scorching"),
        (&["--max-duration", "3parsecs"], "3parsecs"),
        (&["--early-stop", "test/accuracy:patience=0ep"], "patience"),
    ] {
        let started = Instant::now();
        let line = error_line(&fails(&short_args(args)));
        assert!(line.contains(expect), "{args:?}: {line}");
        said_once(&line);
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{args:?} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn a_checkpoint_name_that_exists_is_said_once() {
    // A template without a changing field names every checkpoint of the run alike: the
    // second save finds the first.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let run = short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--save-name",
        "ck",
        "--stop-after",
        "8ba",
    ]);
    let line = error_line(&fails(&run));
    assert_eq!(line.matches("exists").count(), 1, "{line}");
    said_once(&line);
}

#[test]
fn a_background_save_is_said_saved_only_once_it_is() {
    // The second save of `ck` fails on the writer thread (the name exists): the first is
    // said saved, the second only failed.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let stderr = fails(&short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--save-name",
        "ck",
        "--save-async",
        "--stop-after",
        "8ba",
    ]));
    let saved: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("checkpoint saved"))
        .collect();
    assert_eq!(saved.len(), 1, "{stderr}");
    assert!(saved[0].contains("batch=4"), "{}", saved[0]);
    let e = error_line(&stderr);
    assert!(e.contains("background save") && e.contains("exists"), "{e}");
    said_once(&e);
}

#[test]
fn a_new_run_into_a_folder_with_another_runs_checkpoints_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let first = short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--stop-after",
        "8ba",
    ]);
    assert!(run_mnist(&first).status.success());
    let before = tree_hashes(dir.path());
    // A new run (another seed, so surely another run) into the same folder.
    let second = short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--seed",
        "7",
    ]);
    let stderr = fails(&second);
    let e = error_line(&stderr);
    for part in [
        "ep0-ba4 (batch 4)",
        "ep0-ba8 (batch 8)",
        "--autoresume",
        "--overwrite",
        "new folder",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    said_once(&e);
    assert!(
        !stderr.contains("checkpoint saved"),
        "it trained before refusing:\n{stderr}"
    );
    assert_eq!(tree_hashes(dir.path()), before, "the folder changed");
    // A run resumed from an earlier checkpoint of the folder would be mixed with the later
    // one: refused too, naming only the later one.
    let ck4 = dir.path().join("ep0-ba4");
    let mut earlier = first.clone();
    earlier.retain(|s| *s != "--stop-after" && *s != "8ba");
    earlier.extend(["--load", ck4.to_str().unwrap()]);
    let e = error_line(&fails(&earlier));
    assert!(
        e.contains("ep0-ba8 (batch 8)") && !e.contains("ep0-ba4 (") && e.contains("batch 4"),
        "{e}"
    );
    // Resuming the run, or replacing it, is accepted.
    let mut resume = first.clone();
    resume.retain(|s| *s != "--stop-after" && *s != "8ba");
    resume.push("--autoresume");
    assert!(run_mnist(&resume).status.success());
    let mut replace = second.clone();
    replace.push("--overwrite");
    let out = run_mnist(&replace);
    assert!(out.status.success(), "{}", out.stderr);
}

/// A short run's arguments at batch size `batch` and seed `seed` (SHORT's data and warmup).
fn sized(batch: &str, seed: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--train-limit",
        "512",
        "--test-limit",
        "200",
        "--warmup",
        "4ba",
        "--max-duration",
        "2ep",
        "--batch-size",
        batch,
        "--seed",
        seed,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn a_resume_inside_an_epoch_keeps_its_global_batch_and_its_seed() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let save = ["--save-folder", folder, "--save-interval", "4ba"];
    // Batch 5 of the first epoch (16 batches of 32).
    let first = sized("32", "42", &[&save[..], &["--stop-after", "5ba"]].concat());
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    assert!(run_mnist(&first).status.success());
    let resume = |batch: &str, seed: &str| {
        let a = sized(batch, seed, &[&save[..], &["--autoresume"]].concat());
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        error_line(&fails(&a))
    };
    // Another global batch would restart the epoch at another sample: 5 x 32 = 160 samples
    // read, and at batch 16 the rest of the epoch would start at sample 80.
    let e = resume("16", "42");
    assert!(
        e.contains("`batch_size`") && e.contains("\"16") && e.contains("--batch-size 32"),
        "{e}"
    );
    assert!(e.contains("replay or skip"), "{e}");
    said_once(&e);
    // Another seed would build the sampler from it while the warning claimed the saved one.
    let e = resume("32", "7");
    assert!(
        e.contains("`seed`") && e.contains("\"7\"") && e.contains("seed 42"),
        "{e}"
    );
    said_once(&e);
    // The same settings resume, and end where an uninterrupted run ends.
    let whole_dir = tempfile::tempdir().unwrap();
    let whole = sized(
        "32",
        "42",
        &["--save-folder", whole_dir.path().to_str().unwrap()],
    );
    let whole: Vec<&str> = whole.iter().map(String::as_str).collect();
    let again = sized("32", "42", &[&save[..], &["--autoresume"]].concat());
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    assert_eq!(
        summary_of(&again)["params_sha256"],
        summary_of(&whole)["params_sha256"]
    );
}

/// SHORT's data at batch 32, one batch without warmup, from the checkpoint at `load`.
fn one_batch_loading(load: &str) -> Vec<&str> {
    vec![
        "--train-limit",
        "512",
        "--test-limit",
        "200",
        "--batch-size",
        "32",
        "--warmup",
        "0ba",
        "--max-duration",
        "1ba",
        "--load",
        load,
    ]
}

#[test]
fn load_follows_the_latest_pointer_and_takes_a_save_folder_for_its_latest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let first = sized(
        "32",
        "42",
        &["--save-folder", folder, "--stop-after", "8ba"],
    );
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    assert!(run_mnist(&first).status.success());
    assert_eq!(
        fs::read_to_string(dir.path().join("latest")).unwrap(),
        "ep0-ba8"
    );
    // One batch from the loaded weights: the same bits whichever way the checkpoint is named.
    let from = |load: &str| {
        let mut args = one_batch_loading(load);
        args.push("--weights-only");
        summary_of(&args)["params_sha256"].clone()
    };
    let named = from(dir.path().join("ep0-ba8").to_str().unwrap());
    assert_eq!(from(dir.path().join("latest").to_str().unwrap()), named);
    assert_eq!(from(folder), named);
}

#[test]
fn a_uri_where_a_local_folder_is_meant_is_refused_without_repeating_it() {
    let secret = "hunter2-7f3a";
    let uri = format!("s3://AKIAEXAMPLE:{secret}@bucket/run");
    for (flag, extra) in [
        ("--out", vec![]),
        ("--log-dir", vec![]),
        // Only read with a remote save folder, and checked whatever the save folder.
        ("--checkpoint-cache", vec!["--save-folder", "ck"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec![
            "--max-duration",
            "1ba",
            "--warmup",
            "0ba",
            flag,
            uri.as_str(),
        ];
        args.extend(extra);
        let out = example_command("mnist", &args, &[])
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: accepted a URI:\n{stderr}");
        let e = error_line(&stderr);
        assert!(
            e.contains(flag) && e.contains("s3://") && e.contains("local folder"),
            "{e}"
        );
        assert!(
            !stderr.contains(secret),
            "{flag}: the secret was printed:\n{stderr}"
        );
        assert!(
            !dir.path().join("s3:").exists(),
            "{flag}: a folder named s3: was made"
        );
    }
}

#[test]
fn messages_name_the_real_problem() {
    // A zero batch is not a divisibility problem.
    let e = error_line(&fails(&["--batch-size", "0"]));
    assert!(
        e.contains("`batch_size`") && e.contains(">= 1") && !e.contains("multiple of"),
        "{e}"
    );
    // A wall-clock run with the default schedule (cosine over the whole run) is not about
    // tokens: the error says what would work.
    let e = error_line(&fails(&["--max-duration", "4s"]));
    assert!(
        e.contains("wall-clock") && e.contains("--schedule constant") && !e.contains("token"),
        "{e}"
    );
    // A checkpoint file that does not match its manifest was never verified by this run:
    // the error says it is damaged, not that it changed after a verification.
    let (_dir, _, newer) = two_checkpoints();
    flip_byte(&newer.join(MODEL));
    let e = error_line(&fails(&one_batch_loading(newer.to_str().unwrap())));
    assert!(
        e.contains(MODEL)
            && e.contains("does not match the manifest")
            && !e.contains("after it was verified"),
        "{e}"
    );
}

/// Rewrites `trainer_state.json` of `ck` through `edit`, and the manifest through
/// `edit_manifest`, with the file's size and hash redone as a forger would.
fn forge(
    ck: &Path,
    edit: impl Fn(&mut serde_json::Value),
    edit_manifest: impl Fn(&mut serde_json::Value),
) {
    let path = ck.join(TRAINER_STATE);
    let mut state: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut state);
    let bytes = serde_json::to_vec_pretty(&state).unwrap();
    fs::write(&path, &bytes).unwrap();
    let mpath = ck.join(MANIFEST);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(&mpath).unwrap()).unwrap();
    for f in manifest["files"].as_array_mut().unwrap() {
        if f["name"] == TRAINER_STATE {
            f["bytes"] = bytes.len().into();
            f["sha256"] = sha256_hex(&bytes).into();
        }
    }
    edit_manifest(&mut manifest);
    fs::write(&mpath, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    verify(ck).unwrap();
}

#[test]
fn a_forged_or_finished_position_is_refused() {
    let (_dir, _, newer) = two_checkpoints();
    let ck = newer.to_str().unwrap();
    // The checkpoint is at batch 8 (256 samples): a 1-batch run would train nothing.
    let e = error_line(&fails(&one_batch_loading(ck)));
    assert!(
        e.contains("`max_duration` 1ba") && e.contains("batch 8") && e.contains("train nothing"),
        "{e}"
    );
    said_once(&e);
    // The case: the batch count set to 2^64 - 1, the manifest's hash redone. The
    // manifest still says batch 8.
    let resume = short_args(&["--load", ck]);
    forge(
        &newer,
        |s| s["timestamp"]["batch"] = u64::MAX.into(),
        |_| {},
    );
    let e = error_line(&fails(&resume));
    assert!(
        e.contains(TRAINER_STATE) && e.contains("not the manifest's") && e.contains("batch 8"),
        "{e}"
    );
    // The manifest forged too: the counts contradict each other.
    forge(&newer, |_| {}, |m| m["batch"] = u64::MAX.into());
    let e = error_line(&fails(&resume));
    assert!(
        e.contains("restored position")
            && e.contains(&u64::MAX.to_string())
            && e.contains("only 256 samples"),
        "{e}"
    );
    said_once(&e);
}
