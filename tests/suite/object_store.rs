//! Checkpoints and logs in object storage, against a real S3-compatible server process
//! (`s3s-fs`, which verifies request signatures) on 127.0.0.1: remote saves rotate and resume
//! bit for bit on an empty disk, damaged and incomplete remote checkpoints are skipped by
//! autoresume and refused by `--load`, a stopped server delays uploads without stopping
//! training and a dead one is an error at the end, SIGKILLs during uploads resume from the
//! newest complete checkpoint, logs continue remotely, and bad settings are clear errors that
//! never show the secret.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::*;

/// The checkpoints under `prefix` of bucket `runs` that have a manifest, by batch.
fn complete(server: &S3Server, prefix: &str) -> Vec<(u64, String)> {
    let dir = server.object("runs", prefix);
    let mut out: Vec<(u64, String)> = std::fs::read_dir(&dir)
        .map(|e| e.flatten().collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.path().join("manifest.json").is_file())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let batch = name.rsplit_once("-ba")?.1.parse().ok()?;
            Some((batch, name))
        })
        .collect();
    out.sort();
    out
}

/// The remote `latest` of `prefix`, as its batch count (0 if none).
fn remote_latest(server: &S3Server, prefix: &str) -> u64 {
    std::fs::read_to_string(server.object("runs", &format!("{prefix}/latest")))
        .ok()
        .and_then(|n| {
            n.trim()
                .rsplit_once("-ba")
                .and_then(|(_, b)| b.parse().ok())
        })
        .unwrap_or(0)
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn contains_bytes(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn remote_saves_rotate_and_resume_on_an_empty_disk_bit_for_bit_with_their_logs() {
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let env = server.env();
    let straight = summary_of(&short_args(&["--max-duration", "3ep"]));
    let tmp = tempfile::tempdir().unwrap();
    let (cache_a, cache_b) = (tmp.path().join("machine-a"), tmp.path().join("machine-b"));
    let (logs_a, logs_b) = (tmp.path().join("logs-a"), tmp.path().join("logs-b"));
    let run = |cache: &Path, logs: &Path, extra: &[&str]| {
        let mut a = vec![
            "--save-folder",
            "s3://runs/mnist/ck",
            "--save-interval",
            "8ba",
            "--keep",
            "2",
            "--checkpoint-cache",
            cache.to_str().unwrap(),
            "--log-dir",
            logs.to_str().unwrap(),
            "--upload-logs",
            "s3://runs/mnist/logs",
        ];
        a.extend_from_slice(extra);
        run_example_env("mnist", &short_args(&a), &env)
    };
    // Stopped after two of its three epochs (the schedule is the three-epoch run's).
    let first = run(
        &cache_a,
        &logs_a,
        &["--max-duration", "3ep", "--stop-after", "32ba"],
    );
    assert!(first.status.success(), "{}", first.stderr);
    // Keep 2 applies to the store: the two newest, each complete, and `latest`.
    let kept = complete(&server, "mnist/ck");
    assert_eq!(
        kept.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        [24, 32],
        "{kept:?}"
    );
    assert_eq!(remote_latest(&server, "mnist/ck"), 32);
    let stray: Vec<PathBuf> = files_under(&server.object("runs", "mnist/ck"))
        .into_iter()
        .filter(|p| {
            !kept
                .iter()
                .any(|(_, n)| p.to_string_lossy().contains(&format!("/{n}/")))
        })
        .filter(|p| p.file_name().is_some_and(|n| n != "latest"))
        .collect();
    assert!(
        stray.is_empty(),
        "rotated checkpoints left objects: {stray:?}"
    );
    // A new machine: nothing local, the same command with --autoresume.
    let second = run(
        &cache_b,
        &logs_b,
        &["--max-duration", "3ep", "--autoresume"],
    );
    assert!(second.status.success(), "{}", second.stderr);
    assert!(
        second.stderr.contains("downloaded and verified"),
        "{}",
        second.stderr
    );
    let resumed = second.summary.expect("a summary");
    assert_eq!(outcome(&resumed), outcome(&straight));
    assert_eq!(remote_latest(&server, "mnist/ck"), 48);
    // The remote logs continue: the first run's lines, then the second's.
    let first_log = std::fs::read_to_string(logs_a.join("metrics.jsonl")).unwrap();
    let remote_log =
        std::fs::read_to_string(server.object("runs", "mnist/logs/metrics.jsonl")).unwrap();
    assert!(
        remote_log.starts_with(&first_log) && remote_log.len() > first_log.len(),
        "remote log: {} bytes, first run's: {}",
        remote_log.len(),
        first_log.len()
    );
    assert_eq!(
        remote_log,
        std::fs::read_to_string(logs_b.join("metrics.jsonl")).unwrap()
    );
    assert!(server.object("runs", "mnist/logs/training.png").is_file());
}

#[test]
fn damaged_and_incomplete_remote_checkpoints_are_skipped_by_autoresume_and_refused_by_load() {
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let env = server.env();
    let straight = summary_of(&short_args(&["--max-duration", "3ep"]));
    let tmp = tempfile::tempdir().unwrap();
    let cache = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let c1 = cache("c1");
    let base = ["--save-folder", "s3://runs/d", "--save-interval", "8ba"];
    let mut a = base.to_vec();
    a.extend([
        "--max-duration",
        "3ep",
        "--stop-after",
        "32ba",
        "--checkpoint-cache",
        &c1,
    ]);
    let out = run_example_env("mnist", &short_args(&a), &env);
    assert!(out.status.success(), "{}", out.stderr);
    let all = complete(&server, "d");
    assert_eq!(
        all.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        [8, 16, 24, 32]
    );
    let name = |b: u64| all.iter().find(|(x, _)| *x == b).unwrap().1.clone();
    let (n16, n24, n32) = (name(16), name(24), name(32));
    // The newest: one byte of the weights changed. The next: the optimizer state cut short.
    // The next: no manifest (an upload that never finished).
    let model = server.object("runs", &format!("d/{n32}/model.safetensors"));
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(&model, bytes).unwrap();
    let optimizer = server.object("runs", &format!("d/{n24}/optimizer.mpk"));
    let len = std::fs::metadata(&optimizer).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&optimizer)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    std::fs::remove_file(server.object("runs", &format!("d/{n16}/manifest.json"))).unwrap();

    // --load of a damaged or incomplete checkpoint is an error naming the object.
    for (n, needle) in [
        (&n32, format!("d/{n32}/model.safetensors")),
        (&n32, "SHA-256".to_string()),
        (&n24, format!("d/{n24}/optimizer.mpk")),
        (&n16, "no manifest".to_string()),
    ] {
        let uri = format!("s3://runs/d/{n}");
        let c = cache(&format!("load-{n}"));
        let out = run_example_env(
            "mnist",
            &short_args(&[
                "--load",
                &uri,
                "--checkpoint-cache",
                &c,
                "--max-duration",
                "3ep",
            ]),
            &env,
        );
        assert!(!out.status.success(), "--load {uri} succeeded");
        assert!(
            out.stderr.contains(&needle),
            "--load {uri}: no {needle:?} in:\n{}",
            out.stderr
        );
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
    // An intact one loads.
    let n8 = name(8);
    let c = cache("load-ok");
    let uri = format!("s3://runs/d/{n8}");
    let out = run_example_env(
        "mnist",
        &short_args(&["--load", &uri, "--weights-only", "--checkpoint-cache", &c]),
        &env,
    );
    assert!(out.status.success(), "{}", out.stderr);

    // Autoresume on an empty disk passes over all three, naming each, resumes from batch 8
    // and ends with the uninterrupted run's bits; the resumed run saves those names again.
    let c2 = cache("c2");
    let mut a = base.to_vec();
    a.extend([
        "--max-duration",
        "3ep",
        "--autoresume",
        "--checkpoint-cache",
        &c2,
    ]);
    let out = run_example_env("mnist", &short_args(&a), &env);
    assert!(out.status.success(), "{}", out.stderr);
    // Each is named in its skip warning, and the run resumed from batch 8.
    let warned = |kind: &str, n: &str| {
        out.stderr
            .lines()
            .any(|l| l.contains(kind) && l.contains(&format!("s3://runs/d/{n}")))
    };
    assert!(warned("skipping an incomplete", &n16), "{}", out.stderr);
    assert!(warned("skipping a damaged", &n24), "{}", out.stderr);
    assert!(warned("skipping a damaged", &n32), "{}", out.stderr);
    assert!(warned("downloaded and verified", &n8), "{}", out.stderr);
    assert_eq!(outcome(out.summary.as_ref().unwrap()), outcome(&straight));
    assert!(server
        .object("runs", &format!("d/{n32}/manifest.json.damaged"))
        .is_file());
    assert_eq!(
        complete(&server, "d")
            .iter()
            .map(|(b, _)| *b)
            .collect::<Vec<_>>(),
        [8, 16, 24, 32, 40, 48]
    );
}

#[test]
fn bad_settings_are_clear_errors_and_the_secret_never_leaks() {
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let fail = |folder: &str, env: &[(&str, String)], needles: &[&str]| {
        let out = run_example_env(
            "mnist",
            &short_args(&["--save-folder", folder, "--checkpoint-cache", cache]),
            env,
        );
        assert!(!out.status.success(), "{folder} succeeded");
        for n in needles {
            assert!(
                out.stderr.contains(n),
                "{folder}: no {n:?} in:\n{}",
                out.stderr
            );
        }
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
        out.stderr
    };
    let env = server.env();
    let mut wrong = env.clone();
    let wrong_secret = "wrong-secret-c0ffee1234";
    wrong.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    wrong.push(("AWS_SECRET_ACCESS_KEY", wrong_secret.into()));
    let text = fail("s3://runs/x", &wrong, &["credentials", "s3://runs/x"]);
    assert!(
        !text.contains(wrong_secret) && !text.contains(S3_SECRET_KEY),
        "{text}"
    );
    fail(
        "s3://no-such-bucket/x",
        &env,
        &["\"no-such-bucket\" does not exist"],
    );
    fail("s3://Runs/x", &env, &["\"Runs\"", "bucket"]);
    fail("s3://runs/a/../b", &env, &["\"..\""]);
    fail("ftp://runs/x", &env, &["\"ftp\"", "s3, gs or az"]);
    fail("s3://runs", &env, &["give a prefix"]);
    let text = fail(
        "s3://AKIAEXAMPLE:pasted-s3cret@runs/x",
        &env,
        &["without credentials"],
    );
    assert!(!text.contains("pasted-s3cret"), "{text}");
    let out = run_example_env(
        "mnist",
        &short_args(&[
            "--save-folder",
            "s3://runs/x",
            "--save-name",
            "ep {epoch}",
            "--checkpoint-cache",
            cache,
        ]),
        &env,
    );
    assert!(
        !out.status.success() && out.stderr.contains("name_template"),
        "{}",
        out.stderr
    );
    let logs_dir = tmp.path().join("l");
    let out = run_example_env(
        "mnist",
        &short_args(&[
            "--save-folder",
            "s3://runs/x",
            "--checkpoint-cache",
            cache,
            "--log-dir",
            logs_dir.to_str().unwrap(),
            "--upload-logs",
            "s3://runs/x/logs",
        ]),
        &env,
    );
    assert!(
        !out.status.success() && out.stderr.contains("overlap"),
        "{}",
        out.stderr
    );
    let no_keys: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| !k.contains("KEY"))
        .cloned()
        .collect();
    fail(
        "s3://runs/x",
        &no_keys,
        &["no credentials", "AWS_ACCESS_KEY_ID"],
    );
    let out = run_example_env(
        "mnist",
        &short_args(&["--load", "s3://runs", "--checkpoint-cache", cache]),
        &env,
    );
    assert!(
        !out.status.success() && out.stderr.contains("name a checkpoint"),
        "{}",
        out.stderr
    );

    // A full run with every output, logging at debug level: the secret is nowhere.
    let logs = tmp.path().join("logs");
    let out_dir = tmp.path().join("out");
    let ok = run_example_env(
        "mnist",
        &short_args(&[
            "--save-folder",
            "s3://runs/ok",
            "--checkpoint-cache",
            cache,
            "--save-interval",
            "8ba",
            "--log-dir",
            logs.to_str().unwrap(),
            "--tensorboard",
            "--upload-logs",
            "s3://runs/ok-logs",
            "--out",
            out_dir.to_str().unwrap(),
            "--max-duration",
            "2ep",
        ]),
        &[env.clone(), vec![("RUST_LOG", "debug".to_string())]].concat(),
    );
    assert!(ok.status.success(), "{}", ok.stderr);
    assert!(!ok.stderr.contains(S3_SECRET_KEY));
    for dir in [tmp.path(), server.root.path()] {
        for f in files_under(dir) {
            let bytes = std::fs::read(&f).unwrap();
            assert!(
                !contains_bytes(&bytes, S3_SECRET_KEY.as_bytes()),
                "{} holds the secret",
                f.display()
            );
        }
    }
}

#[test]
fn a_stopped_server_delays_uploads_and_a_dead_one_is_an_error_at_the_end() {
    let Some(mut server) = S3Server::start(&["runs"]) else {
        return;
    };
    let env = server.env();
    let tmp = tempfile::tempdir().unwrap();
    let run = |prefix: &str, cache: &Path| {
        let folder = format!("s3://runs/{prefix}");
        let args = short_args(&[
            "--save-folder",
            &folder,
            "--save-interval",
            "4ba",
            "--keep",
            "3",
            "--checkpoint-cache",
            cache.to_str().unwrap(),
            "--max-duration",
            "60ep",
        ]);
        example_command("mnist", &args, &env)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the example starts")
    };
    let wait_until = |what: &str, f: &mut dyn FnMut() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    // Down for a while mid-run: training goes on, the uploads catch up when it is back.
    let cache = tmp.path().join("c1");
    let local = cache.join("s3/runs/paused");
    let child = run("paused", &cache);
    wait_until("a first upload", &mut || {
        remote_latest(&server, "paused") > 0
    });
    server.stop();
    let stopped_at = latest_batch(&local);
    // Down for three seconds (longer than the store's own retries of one request), during
    // which training goes on.
    let down = Instant::now();
    wait_until("local saves while the server is down", &mut || {
        latest_batch(&local) >= stopped_at + 12 && down.elapsed() > Duration::from_secs(3)
    });
    server.restart();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("checkpoint upload failed"), "{stderr}");
    assert_eq!(remote_latest(&server, "paused"), 960, "{stderr}");
    let summary: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    // The wait for the last upload is part of the training time, and only a part of it.
    let (train, wait) = (
        summary["train_seconds"].as_f64().unwrap(),
        summary["fit_end_wait_seconds"].as_f64().unwrap(),
    );
    assert!(
        (0.0..train).contains(&wait),
        "FIT_END waited {wait} s of {train} s"
    );
    // What the store holds resumes to the same bits on a new disk (nothing left to train).
    let fresh = tmp.path().join("c2");
    let again = run_example_env(
        "mnist",
        &short_args(&[
            "--save-folder",
            "s3://runs/paused",
            "--checkpoint-cache",
            fresh.to_str().unwrap(),
            "--autoresume",
            "--max-duration",
            "60ep",
        ]),
        &env,
    );
    assert!(again.status.success(), "{}", again.stderr);
    assert_eq!(outcome(again.summary.as_ref().unwrap()), outcome(&summary));

    // Gone for good: training still finishes locally, and the run fails at the end naming
    // what was not uploaded, within a bounded time.
    let cache = tmp.path().join("c3");
    let local = cache.join("s3/runs/dead");
    let child = run("dead", &cache);
    wait_until("a first upload", &mut || remote_latest(&server, "dead") > 0);
    server.stop();
    let t = Instant::now();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("not uploaded to s3://runs/dead"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Each checkpoint is reported with its own cause (its own object's key), not with the
    // first failed one's repeated.
    let line = stderr
        .lines()
        .find(|l| l.contains("not uploaded to s3://runs/dead"))
        .unwrap();
    let listed = line
        .split_once("not uploaded to s3://runs/dead: ")
        .unwrap()
        .1;
    let names: std::collections::BTreeSet<&str> = listed
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("ep") && w.contains("-ba"))
        .collect();
    assert!(names.len() > 1, "{line}");
    for name in &names {
        assert!(
            listed.contains(&format!("{name} (")) && listed.contains(&format!("dead/{name}/")),
            "{name} has no cause of its own: {line}"
        );
    }
    assert_eq!(latest_batch(&local), 960, "training stopped early");
    assert!(t.elapsed() < Duration::from_secs(90), "{:?}", t.elapsed());
}

#[test]
fn sigkill_during_uploads_then_autoresume_on_a_new_disk_uses_the_newest_complete_checkpoint() {
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let env = server.env();
    let straight = summary_of(&short_args(&["--max-duration", "6ep"]));
    let tmp = tempfile::tempdir().unwrap();
    let args_for = |cache: &str| -> Vec<String> {
        short_args(&[
            "--save-folder",
            "s3://runs/k",
            "--save-interval",
            "1ba",
            "--keep",
            "3",
            "--autoresume",
            "--max-duration",
            "6ep",
            "--checkpoint-cache",
            cache,
        ])
        .into_iter()
        .map(String::from)
        .collect()
    };
    let mut kills = 0;
    let mut incomplete_seen = 0;
    for i in 0..6u64 {
        // Every try is a new machine: an empty local cache.
        let cache = tmp.path().join(format!("c{i}"));
        let args = args_for(cache.to_str().unwrap());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = example_command("mnist", &args, &env)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let from = remote_latest(&server, "k");
        let t = Instant::now();
        while remote_latest(&server, "k") < from + 3 + i
            && t.elapsed() < Duration::from_secs(60)
            && child.try_wait().unwrap().is_none()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(3 * i));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL, most often during an upload
            kills += 1;
        }
        child.wait().unwrap();
        let dir = server.object("runs", "k");
        incomplete_seen += std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir() && !e.path().join("manifest.json").is_file())
            .filter(|e| std::fs::read_dir(e.path()).is_ok_and(|mut d| d.next().is_some()))
            .count();
    }
    assert!(kills >= 4, "only {kills} kills landed");
    let last = tmp.path().join("final");
    let args = args_for(last.to_str().unwrap());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let done = run_example_env("mnist", &args, &env);
    assert!(done.status.success(), "{}", done.stderr);
    assert_eq!(
        outcome(done.summary.as_ref().unwrap()),
        outcome(&straight),
        "after {kills} kills ({incomplete_seen} incomplete remote checkpoints seen after them)"
    );
    eprintln!("{kills} kills; {incomplete_seen} incomplete remote checkpoints seen after them");
}

#[test]
fn the_store_round_trips_multipart_objects_and_keeps_to_its_prefix() {
    use flashover::checkpoint::remote::{RemoteSettings, RemoteStore, RemoteUri};
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let config: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let uri = RemoteUri::parse("s3://runs/p/q").unwrap();
    let store =
        RemoteStore::connect_with_config(&uri, &RemoteSettings::default(), config.clone()).unwrap();
    store.check().unwrap();
    // Larger than the single-PUT limit and not a multiple of the part size: three parts.
    let n = flashover::checkpoint::remote::store::MULTIPART_THRESHOLD + 3 * 1024 * 1024 + 7;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let big: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    store.put(&["ck", "big.bin"], big.clone()).unwrap();
    store.put(&["ck", "small.txt"], b"hello".to_vec()).unwrap();
    assert_eq!(
        std::fs::read(server.object("runs", "p/q/ck/big.bin")).unwrap(),
        big
    );
    assert_eq!(store.get(&["ck", "big.bin"]).unwrap().unwrap(), big);
    assert_eq!(store.get(&["ck", "missing"]).unwrap(), None);
    assert_eq!(store.list_dirs(&[]).unwrap(), ["ck"]);
    assert_eq!(
        store.list_files(&["ck"]).unwrap(),
        [
            ("big.bin".to_string(), n as u64),
            ("small.txt".to_string(), 5)
        ]
    );
    store.delete(&["ck", "big.bin"]).unwrap();
    store.delete(&["ck", "big.bin"]).unwrap(); // deleting what is gone is fine
    assert_eq!(store.get(&["ck", "big.bin"]).unwrap(), None);
    // Neighbours that share the prefix's text are not under it.
    for sibling in ["s3://runs/p/qx", "s3://runs/p/q2"] {
        let other = RemoteStore::connect_with_config(
            &RemoteUri::parse(sibling).unwrap(),
            &RemoteSettings::default(),
            config.clone(),
        )
        .unwrap();
        other.put(&["ck", "other.bin"], vec![7]).unwrap();
        other.put(&["elsewhere", "x"], vec![7]).unwrap();
    }
    assert_eq!(store.list_dirs(&[]).unwrap(), ["ck"]);
    assert_eq!(store.list_files(&["ck"]).unwrap().len(), 1);
    // Keys leave the prefix through no segment; a bad one is an error naming it.
    for bad in ["..", "", "a/b", "x y"] {
        let err = store.put(&[bad], vec![1]).unwrap_err().to_string();
        assert!(err.contains("s3://runs/p/q"), "{bad:?}: {err}");
    }
    // An unknown setting names the key, never its value; the Debug form is the URI only.
    let mut odd = config.clone();
    odd.push(("aws_secret_sauce".into(), "v4lue-n0t-shown".into()));
    let err = RemoteStore::connect_with_config(&uri, &RemoteSettings::default(), odd)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("aws_secret_sauce") && !err.contains("v4lue-n0t-shown"),
        "{err}"
    );
    assert_eq!(format!("{store:?}"), "RemoteStore(s3://runs/p/q)");
    // A wrong secret: refused by the server's signature check, the error says what to check
    // and shows neither secret.
    let mut wrong = config;
    wrong.retain(|(k, _)| k != "aws_secret_access_key");
    wrong.push(("aws_secret_access_key".into(), "not-the-secret-42".into()));
    let bad = RemoteStore::connect_with_config(&uri, &RemoteSettings::default(), wrong).unwrap();
    let err = bad.check().unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(text.contains("credentials"), "{text}");
    assert!(
        !text.contains("not-the-secret-42") && !text.contains(S3_SECRET_KEY),
        "{text}"
    );
}

/// The nice values of the threads of process `pid` whose name starts with `prefix`, or of its
/// main thread (the one whose id is `pid`) for `None` (Linux's `/proc/<pid>/task/<tid>/stat`,
/// field 19; names are cut to 15 bytes there).
#[cfg(target_os = "linux")]
fn thread_nice(pid: u32, prefix: Option<&str>) -> Vec<i64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // "tid (name) state ppid ...": the name may hold spaces, so split after its ')'.
            let (head, rest) = stat.rsplit_once(')')?;
            let (tid, name) = head.split_once(" (")?;
            let chosen = match prefix {
                Some(p) => name.starts_with(p),
                None => tid == pid.to_string(),
            };
            if !chosen {
                return None;
            }
            // After the name, field 3 (state) is the first: nice is field 19.
            rest.split_whitespace().nth(19 - 3)?.parse().ok()
        })
        .collect()
}

#[cfg(target_os = "linux")]
#[test]
fn the_upload_threads_run_below_the_training_threads_priority() {
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let env = server.env();
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let logs = tmp.path().join("logs");
    // Long enough to be looked at; killed once both threads are seen.
    let args = short_args(&[
        "--save-folder",
        "s3://runs/nice",
        "--save-interval",
        "1ba",
        "--checkpoint-cache",
        cache.to_str().unwrap(),
        "--log-dir",
        logs.to_str().unwrap(),
        "--upload-logs",
        "s3://runs/nice-logs",
        "--max-duration",
        "200ep",
    ]);
    let mut child = example_command("mnist", &args, &env)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let t = Instant::now();
    let (mut checkpoints, mut logs_seen, mut main) = (Vec::new(), Vec::new(), Vec::new());
    while t.elapsed() < Duration::from_secs(60) && child.try_wait().unwrap().is_none() {
        checkpoints = thread_nice(pid, Some("flashover-check"));
        logs_seen = thread_nice(pid, Some("flashover-log-u"));
        main = thread_nice(pid, None);
        let want = main.first().map(|&n| n.max(10));
        if want.is_some()
            && checkpoints.first() == want.as_ref()
            && logs_seen.first() == want.as_ref()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    child.wait().unwrap();
    // The training thread keeps the process's nice value (0 unless the tests run niced); the
    // upload threads are at 10 or, in a nicer process, at its value.
    assert_eq!(main.len(), 1, "the main thread: {main:?}");
    let want = main[0].max(10);
    assert_eq!(
        checkpoints,
        [want],
        "the checkpoint uploader's nice value (training's: {})",
        main[0]
    );
    assert_eq!(
        logs_seen,
        [want],
        "the log uploader's nice value (training's: {})",
        main[0]
    );
}
