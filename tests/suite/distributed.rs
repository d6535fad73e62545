//! Data parallelism with real processes: the MNIST example under `mpirun` (OpenMPI), as a
//! user launches it. Two processes train like one process on the whole batch; every rank
//! holds the same bits; a run repeats bit-exactly; SIGKILLed runs resume to the bits of the
//! uninterrupted one; a checkpoint of two ranks resumes on one and on three, seeing every
//! sample of the interrupted epoch exactly once; a stopped rank is named and the job ends;
//! one rank's error ends every rank with that error; bad launches are clear errors; and two
//! ranks in two network namespaces train across a veth pair. Sharded (`--sharding
//! shard_grad_op`): the data-parallel bits on two and three processes, a sharded checkpoint
//! resumed on one, two and three, a damaged or missing shard named, SIGKILLs during sharded
//! saves, and every rank's shard uploaded to an object store and resumed from it.
//!
//! Every run has a deadline: a hang fails the test (and the job is killed), never the suite.
//!
//! Where `mpirun` is missing each test records a skip (see `support/skip.rs`); where it is
//! there, the first test builds the example with MPI (`support/mpi.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use flashover::checkpoint::find_resumable;
use flashover::core::rng::Rng;

/// 480 digits (divisible by 1, 2, 3 and 6: no padding at any world size tested) in global
/// batches of 48: 10 batches per epoch. 200 test digits.
const DDP: &[&str] = &[
    "--train-limit",
    "480",
    "--test-limit",
    "200",
    "--batch-size",
    "48",
    "--warmup",
    "4ba",
    "--prefetch",
    "0",
];

/// SGD at a constant rate: weights move by `lr * gradient`, so two runs whose gradients
/// differ only in summation order (a few ulp) end within a tolerance that can be justified.
const SGD: &[&str] = &[
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--schedule",
    "constant",
];

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `mpirun -n <n>` of the example, as `cargo xtask launch` runs it.
fn mpirun_command(n: usize, args: &[&str]) -> Command {
    let mut c = mpirun_bare(n);
    c.args(["--processes", &n.to_string()]);
    c.args(args);
    c
}

/// `mpirun -n <n>` of the example without `--processes`.
fn mpirun_bare(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-n", &n.to_string()]);
    if is_root() {
        c.arg("--allow-run-as-root");
    }
    // Three ranks on two cores; and never bind to cores (several tests run at once).
    c.args(["--oversubscribe", "--bind-to", "none"]);
    c.args(["-x", "RAYON_NUM_THREADS=1", "-x", "RUST_LOG=info"]);
    c.arg(mpi::mnist().expect("every test here starts with `mpi::mnist()`"));
    c.args(["--backend", BACKEND, "--no-progress"]);
    c
}

/// Waits for `child` at most `limit`; kills it (and its process group) past that.
fn wait_with_deadline(mut child: Child, limit: Duration, what: &str) -> Output {
    let started = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{what} did not finish within {limit:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_mpi(n: usize, args: &[&str]) -> Output {
    let child = mpirun_command(n, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts (OpenMPI is installed: see README)");
    wait_with_deadline(
        child,
        Duration::from_secs(240),
        &format!("mpirun -n {n} {args:?}"),
    )
}

/// Runs on `n` ranks and returns rank 0's summary; fails with the job's stderr otherwise.
fn mpi_summary(n: usize, args: &[&str]) -> serde_json::Value {
    let out = run_mpi(n, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun -n {n} {args:?} failed:\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary from mpirun -n {n} {args:?}:\n{stdout}\n{stderr}"));
    // Only rank 0 prints one.
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with('{')).count(),
        1,
        "{stdout}"
    );
    assert_eq!(summary["world_size"], n, "{summary}");
    let by_rank: Vec<&str> = summary["params_sha256_by_rank"]
        .as_array()
        .expect("per-rank digests")
        .iter()
        .map(|d| d.as_str().unwrap_or_default())
        .collect();
    assert_eq!(by_rank.len(), n);
    assert!(
        by_rank.iter().all(|d| *d == summary["params_sha256"]),
        "every rank must hold the same weights: {by_rank:?}"
    );
    summary
}

fn args_with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// The weights a run wrote with `--out`, as one flat vector.
fn weights(out_dir: &Path) -> Vec<f32> {
    let model = flashover_examples::MnistCnn::<TB>::new(&device(), 0);
    let model =
        flashover::checkpoint::load_weights::<TB, _>(model, &out_dir.join("model.safetensors"))
            .expect("the run wrote its weights");
    flashover::core::params::flatten_params::<TB, _>(&model)
        .expect("the CNN has parameters")
        .into_data()
        .iter::<f32>()
        .collect()
}

#[test]
fn two_processes_train_like_one_process_on_the_whole_batch_and_repeat_bit_exactly() {
    if mpi::mnist().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    let two = dir.path().join("two");
    let steps = ["--max-duration", "6ba"];
    let single = summary_of(&args_with(
        &args_with(DDP, SGD),
        &[&steps[..], &["--out", one.to_str().unwrap()]].concat(),
    ));
    let a = mpi_summary(
        2,
        &args_with(
            &args_with(DDP, SGD),
            &[&steps[..], &["--out", two.to_str().unwrap()]].concat(),
        ),
    );
    // The repeat runs with automatic microbatching: every step the ranks also agree on
    // whether any ran out of memory (none does on the CPU), which changes nothing else.
    let b = mpi_summary(
        2,
        &args_with(
            &args_with(DDP, SGD),
            &[&steps[..], &["--microbatch-size", "auto"]].concat(),
        ),
    );
    assert_eq!(
        a["params_sha256"], b["params_sha256"],
        "same world size and seed: same bits"
    );
    assert_eq!(a["batches"], 6);
    assert_eq!(
        a["samples"],
        6 * 48,
        "the timestamp counts both ranks' samples"
    );
    assert_eq!(single["samples"], 6 * 48);
    // Rank r's gradient is the mean over its 24 digits; the two are averaged (weighted by
    // 24 each), where one process averages 48 at once: the sums differ in order only, a few
    // ulp of each gradient (~1e-7 relative). Six SGD steps of rate 0.05 on gradients below
    // 10 in size keep the weights within 6 * 0.05 * 10 * 1e-6 = 3e-6 of each other; 1e-5
    // leaves room and still catches a wrong average (a missed rank halves a step: ~1e-2).
    let diff = max_abs_diff(&weights(&one), &weights(&two));
    assert!(diff < 1e-5, "weights differ by {diff}");
    assert!(diff > 0.0 || single["params_sha256"] == a["params_sha256"]);
}

#[test]
fn two_devices_of_one_process_match_two_processes_bit_for_bit() {
    if mpi::mnist().is_none() {
        return;
    }
    // `--devices 2`: two training threads through burn-collective's local mode. With two
    // ranks both reductions compute a + b per element, so the bits must agree with MPI's.
    let args = args_with(DDP, &["--max-duration", "6ba"]);
    let local = summary_of(&args_with(&args, &["--devices", "2"]));
    let mpi = mpi_summary(2, &args);
    assert_eq!(local["world_size"], 2);
    let by_rank = local["params_sha256_by_rank"].as_array().unwrap();
    assert!(
        by_rank.iter().all(|d| *d == local["params_sha256"]),
        "{local}"
    );
    assert_eq!(local["params_sha256"], mpi["params_sha256"]);
    assert_eq!(local["test_accuracy"], mpi["test_accuracy"]);
}

#[test]
fn a_full_run_on_two_processes_reaches_the_accuracy_of_one() {
    if mpi::mnist().is_none() {
        return;
    }
    // The main job as it ships (6 epochs of the 8,000 digits, global batch 64), on one
    // process and on two. The runs differ in summation order only, which AdamW amplifies
    // into different trajectories; the final test accuracy must agree within 0.3 points
    // (6 of the 2,000 test digits).
    let one = summary_of(&[]);
    let two = mpi_summary(2, &[]);
    let (a, b) = (
        one["test_accuracy"].as_f64().unwrap(),
        two["test_accuracy"].as_f64().unwrap(),
    );
    assert!((a - b).abs() <= 0.003 + 1e-9, "one process {a}, two {b}");
    assert!(
        b >= 0.97,
        "two processes reach the main job's accuracy: {b}"
    );
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_one_and_on_three_seeing_each_sample_once() {
    if mpi::mnist().is_none() {
        return;
    }
    elastic_two_to_one_and_three(&args_with(DDP, SGD));
}

/// The same from MDS shards (`--data`): the streamed order, cache and download-ahead keep the
/// promise too, with the shards' `id` column recorded.
#[test]
fn a_streamed_checkpoint_of_two_ranks_resumes_on_one_and_on_three_seeing_each_sample_once() {
    if mpi::mnist().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    write_example_shards(&[
        "mnist",
        shards.to_str().unwrap(),
        "--size-limit",
        "40KB",
        "--compression",
        "zstd:3",
        "--train-limit",
        "480",
        "--test-limit",
        "200",
    ]);
    let cache = dir.path().join("cache");
    let streamed = [
        "--data",
        shards.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
        "--cache-limit",
        "200KB",
        "--shuffle-block-size",
        "100",
    ];
    elastic_two_to_one_and_three(&args_with(&args_with(&DDP[4..], SGD), &streamed));
}

/// A run of 480 digits in global batches of 48 (`base`), on two ranks stopped and saved
/// after 4 of the epoch's 10 batches, resumed on one and on three ranks: every digit is read
/// once in the epoch and the weights are the straight run's within summation-order noise.
fn elastic_two_to_one_and_three(base: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("ck");
    let record = dir.path().join("first");
    // Two ranks, stopped (and saved) after 4 of the epoch's 10 batches.
    mpi_summary(
        2,
        &args_with(
            base,
            &[
                "--max-duration",
                "1ep",
                "--stop-after",
                "4ba",
                "--save-folder",
                folder.to_str().unwrap(),
                "--save-interval",
                "1ep",
                "--record-indices",
                record.to_str().unwrap(),
            ],
        ),
    );
    let read = |prefix: &Path, ranks: usize| -> Vec<usize> {
        (0..ranks)
            .flat_map(|r| {
                let p = PathBuf::from(format!("{}.{r}", prefix.display()));
                std::fs::read_to_string(&p)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                    .lines()
                    .map(|l| l.parse::<usize>().unwrap())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let first = read(&record, 2);
    assert_eq!(first.len(), 4 * 48, "4 global batches of 48");
    let straight_dir = dir.path().join("straight");
    mpi_summary(
        2,
        &args_with(
            base,
            &[
                "--max-duration",
                "1ep",
                "--out",
                straight_dir.to_str().unwrap(),
            ],
        ),
    );
    for world in [1usize, 3] {
        let copy = dir.path().join(format!("ck{world}"));
        copy_dir(&folder, &copy);
        let rest = dir.path().join(format!("rest{world}"));
        let out = dir.path().join(format!("out{world}"));
        let extra = [
            "--max-duration",
            "1ep",
            "--save-folder",
            copy.to_str().unwrap(),
            "--autoresume",
            "--record-indices",
            rest.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let args = args_with(base, &extra);
        let s = if world == 1 {
            summary_of(&args)
        } else {
            mpi_summary(world, &args)
        };
        assert_eq!(s["batches"], 10, "world {world}: {s}");
        assert_eq!(s["samples"], 480, "world {world}: {s}");
        let mut seen = first.clone();
        let rest = read(&rest, world);
        assert_eq!(rest.len(), 6 * 48, "world {world}: the 6 batches left");
        seen.extend(rest);
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..480).collect::<Vec<_>>(),
            "world {world}: every digit once"
        );
        // The same samples in the same global batches; only the summation order differs
        // (see the equivalence test for the bound).
        let diff = max_abs_diff(&weights(&out), &weights(&straight_dir));
        assert!(
            diff < 1e-5,
            "world {world}: weights differ by {diff} from the run on 2"
        );
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else if e.file_type().unwrap().is_symlink() {
            let link = std::fs::read_link(e.path()).unwrap();
            std::os::unix::fs::symlink(link, target).unwrap();
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// The pids of mpirun's direct children: the ranks.
fn ranks_of(mpirun: u32) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", &mpirun.to_string()])
        .output()
        .expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
}

#[test]
fn two_processes_killed_at_random_points_resume_to_the_uninterrupted_bits() {
    if mpi::mnist().is_none() {
        return;
    }
    // 960 digits: 20 batches of 48 per epoch, 120 in all (a few seconds on two ranks).
    kill_and_resume(&["--max-duration", "6ep"], 4, 19, 3, 20261201);
}

/// The example on 960 digits in batches of 48 (20 an epoch) with `extra` flags, run to the
/// end once; then `tries` times with a save after every batch and autoresume, a random rank
/// SIGKILLed 2 to `2 + spread - 1` saved batches into each try (a random 0-30 ms after the
/// last save seen: progress, not time, so that a fast machine does not finish first); at
/// least `min_kills` tries must have been killed, and the resumed run must end with the
/// uninterrupted run's outcome.
fn kill_and_resume(extra: &[&str], tries: usize, spread: u64, min_kills: usize, seed: u64) {
    let mut base: Vec<&str> = DDP
        .iter()
        .map(|&a| if a == "480" { "960" } else { a })
        .collect();
    base.extend(extra);
    let straight = mpi_summary(2, &base);
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap().to_string();
    let args = args_with(
        &base,
        &[
            "--save-folder",
            &folder,
            "--save-interval",
            "1ba",
            "--keep",
            "2",
            "--autoresume",
        ],
    );
    let mut rng = Rng::new(seed);
    let mut kills = 0;
    let mut progress = Vec::new();
    for _ in 0..tries {
        let mut child = mpirun_command(2, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mpirun starts");
        let from = latest_batch(dir.path());
        let batches = 2 + rng.below(spread);
        let extra = Duration::from_millis(rng.below(30));
        if wait_for_progress(
            &mut child,
            dir.path(),
            from,
            batches,
            extra,
            Duration::from_secs(60),
        ) {
            let ranks = ranks_of(child.id());
            if let Some(&victim) = ranks.get(rng.below(ranks.len().max(1) as u64) as usize) {
                signal(victim, "-KILL");
                kills += 1;
            }
        }
        // mpirun ends the job once a rank dies (about a second); never wait forever.
        let _ = wait_with_deadline(child, Duration::from_secs(60), "mpirun after a kill");
        let (found, _) = find_resumable(dir.path()).unwrap();
        progress.push(found.map(|p| p.file_name().unwrap().to_string_lossy().into_owned()));
    }
    assert!(
        kills >= min_kills,
        "only {kills} runs were killed; progress {progress:?}"
    );
    let done = mpi_summary(2, &args);
    assert_eq!(
        outcome(&done),
        outcome(&straight),
        "after {kills} kills (checkpoints seen: {progress:?})"
    );
}

#[test]
fn a_stopped_rank_is_named_and_the_job_ends_with_the_last_checkpoint_intact() {
    if mpi::mnist().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("ck");
    let mut child = mpirun_command(
        2,
        &args_with(
            DDP,
            &[
                "--max-duration",
                "50ep",
                "--save-folder",
                folder.to_str().unwrap(),
                "--save-interval",
                "2ba",
                "--peer-timeout",
                "3s",
            ],
        ),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("mpirun starts");
    // Once a checkpoint exists, freeze rank 1.
    let started = Instant::now();
    while find_resumable(&folder)
        .map(|(f, _)| f.is_none())
        .unwrap_or(true)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no checkpoint after 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ranks = ranks_of(child.id());
    assert_eq!(ranks.len(), 2, "two ranks under mpirun: {ranks:?}");
    // pgrep lists children in pid order; which one is rank 1 does not matter to the test
    // beyond the name in the message, read from the process itself.
    let victim = ranks[1];
    let victim_rank = rank_of(victim);
    signal(victim, "-STOP");
    let stopped = Instant::now();
    let stderr_pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        use std::io::Read;
        let mut p = stderr_pipe;
        let _ = p.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if stopped.elapsed() > Duration::from_secs(40) {
            signal(victim, "-CONT");
            let _ = child.kill();
            panic!("the job did not end within 40 s of a rank being stopped");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let ended = stopped.elapsed();
    signal(victim, "-CONT");
    let stderr = reader.join().unwrap();
    assert!(!status.success(), "{stderr}");
    // The timeout (3 s) plus the answer grace (at most the timeout) plus the abort.
    assert!(ended < Duration::from_secs(20), "ended after {ended:?}");
    assert!(
        stderr.contains(&format!("lost rank {victim_rank} (pid {victim}")),
        "the error names the stopped rank {victim_rank} (pid {victim}):\n{stderr}"
    );
    // The newest checkpoint verifies.
    let (found, skipped) = find_resumable(&folder).unwrap();
    assert!(found.is_some() && skipped.is_empty(), "{skipped:?}");
    // No rank outlives the job.
    assert!(
        !Path::new(&format!("/proc/{victim}")).exists()
            || std::fs::read_to_string(format!("/proc/{victim}/stat"))
                .map(|s| s.contains(") Z"))
                .unwrap_or(true),
        "rank {victim_rank} still runs"
    );
}

/// The rank of a process started by mpirun, from its environment.
fn rank_of(pid: u32) -> usize {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    env.split(|&b| b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix("OMPI_COMM_WORLD_RANK="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("process {pid} has no OMPI_COMM_WORLD_RANK"))
}

#[test]
fn one_ranks_error_ends_every_rank_with_that_error() {
    if mpi::mnist().is_none() {
        return;
    }
    // --out under a regular file: only rank 0 checks (and writes) it, so rank 0 fails alone
    // while rank 1 goes on to meet it.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let out = file.join("out");
    let started = Instant::now();
    let run = run_mpi(
        2,
        &args_with(
            DDP,
            &["--max-duration", "2ep", "--out", out.to_str().unwrap()],
        ),
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60));
    assert!(
        stderr.contains("error (rank 0 of 2): checking --out"),
        "rank 0 says its error:\n{stderr}"
    );
    assert!(
        stderr.contains("rank 0 (pid") && stderr.contains("failed: checking --out"),
        "rank 1 says rank 0's error:\n{stderr}"
    );
}

#[test]
fn bad_launches_are_clear_errors() {
    if mpi::mnist().is_none() {
        return;
    }
    // Several processes asked for, none started by a launcher.
    let out = run_mnist(&args_with(DDP, &["--processes", "2"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--processes 2") && out.stderr.contains("cargo xtask launch -n 2"),
        "{}",
        out.stderr
    );
    // A launcher that started another number.
    let child = mpirun_bare(2)
        .args(args_with(DDP, &["--processes", "3"]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let run = wait_with_deadline(child, Duration::from_secs(60), "mpirun --processes 3");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("the launcher started 2"), "{stderr}");
    // A global batch that does not divide over the ranks.
    let odd: Vec<&str> = DDP
        .iter()
        .map(|&a| if a == "48" { "64" } else { a })
        .collect();
    let run = run_mpi(3, &odd);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("invalid value 64 for `batch_size`") && stderr.contains("multiple of 3"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Devices and processes at once.
    let run = run_mpi(2, &args_with(DDP, &["--devices", "2"]));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("--devices 2") && stderr.contains("use one or the other"),
        "{stderr}"
    );
    // Zero devices.
    let out = run_mnist(&args_with(DDP, &["--devices", "0"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("devices") && out.stderr.contains("between 1 and 1024"),
        "{}",
        out.stderr
    );
}

/// The veth pair's addresses: a private subnet that exists only inside the namespaces the
/// test creates.
const ADDRS: [&str; 2] = ["10.231.77.1", "10.231.77.2"];
const SUBNET: &str = "10.231.77.0/24";

/// Two network namespaces joined by a veth pair, removed on drop.
struct Namespaces {
    names: [String; 2],
}

impl Namespaces {
    fn create() -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let names = [format!("fo{tag}a"), format!("fo{tag}b")];
        let (va, vb) = (format!("v{tag}a"), format!("v{tag}b"));
        let ns = Namespaces {
            names: names.clone(),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), names[0].clone()],
            vec!["netns".into(), "add".into(), names[1].clone()],
            vec![
                "link".into(),
                "add".into(),
                va.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                vb.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                va.clone(),
                "netns".into(),
                names[0].clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                vb.clone(),
                "netns".into(),
                names[1].clone(),
            ],
        ];
        for s in steps {
            ip(&s)?;
        }
        let cidr = |a: &str| format!("{a}/24");
        for (n, v, addr) in [
            (&names[0], &va, cidr(ADDRS[0])),
            (&names[1], &vb, cidr(ADDRS[1])),
        ] {
            for s in [
                vec!["-n", n, "addr", "add", &addr, "dev", v],
                vec!["-n", n, "link", "set", v, "up"],
                vec!["-n", n, "link", "set", "lo", "up"],
            ] {
                ip(&s.iter().map(|x| x.to_string()).collect::<Vec<_>>())?;
            }
        }
        Ok(ns)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns".into(), "del".into(), n.clone()]);
        }
    }
}

fn ip(args: &[String]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[test]
fn two_ranks_in_two_network_namespaces_train_across_a_veth_pair() {
    if mpi::mnist().is_none() {
        return;
    }
    let ns = match Namespaces::create() {
        Ok(ns) => ns,
        Err(e) => {
            skip::skipped(
                skip::Need::NetNs,
                &format!("cannot create network namespaces here: {e}"),
            );
            return;
        }
    };
    // Two "machines": mpirun runs in the first namespace and reaches the second as a remote
    // host, through a launch agent that stands in for ssh (it runs OpenMPI's daemon inside
    // that namespace). TCP only, on the veth subnet only, for the ranks' data and for
    // mpirun's own traffic: every byte between the ranks crosses the veth pair.
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("ns-rsh");
    std::fs::write(
        &agent,
        format!(
            "#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n  {a}) ns={na};;\n  {b}) ns={nb};;\n  *) echo \"unknown host $host\" >&2; exit 1;;\nesac\nexec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n",
            a = ADDRS[0],
            b = ADDRS[1],
            na = ns.names[0],
            nb = ns.names[1]
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        format!("{} slots=1\n{} slots=1\n", ADDRS[0], ADDRS[1]),
    )
    .unwrap();
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &ns.names[0], "mpirun", "-n", "2"]);
    if is_root() {
        c.arg("--allow-run-as-root");
    }
    c.arg("--hostfile").arg(&hosts);
    c.arg("--mca").arg("plm_rsh_agent").arg(&agent);
    c.args([
        "--mca",
        "btl",
        "tcp,self",
        "--mca",
        "btl_tcp_if_include",
        SUBNET,
        "--mca",
        "oob_tcp_if_include",
        SUBNET,
        "-x",
        "RAYON_NUM_THREADS=1",
    ]);
    c.arg(mpi::mnist().expect("the test starts with `mpi::mnist()`"));
    c.args(args_with(
        DDP,
        &[
            "--max-duration",
            "6ba",
            "--processes",
            "2",
            "--backend",
            BACKEND,
            "--no-progress",
        ],
    ));
    let counters = |n: &str| -> u64 {
        let out = Command::new("ip")
            .args(["-n", n, "-s", "-j", "link", "show"])
            .output()
            .expect("ip runs");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["ifname"] != "lo")
            .map(|l| l["stats64"]["tx"]["bytes"].as_u64().unwrap_or(0))
            .sum()
    };
    let before = counters(&ns.names[1]);
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let out = wait_with_deadline(child, Duration::from_secs(180), "mpirun across namespaces");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let s: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary:\n{stdout}\n{stderr}"));
    // The rank in the second namespace sent its half of six all-reduces of the CNN's
    // ~200k gradients (0.8 MB each): several MB left through its veth end.
    let sent = counters(&ns.names[1]) - before;
    assert!(
        sent > 2_000_000,
        "only {sent} bytes left namespace {}",
        ns.names[1]
    );
    let local = mpi_summary(2, &args_with(DDP, &["--max-duration", "6ba"]));
    assert_eq!(
        s["params_sha256"], local["params_sha256"],
        "the network changes no bits"
    );
}

/// `--sharding shard_grad_op`.
const SHARDED: &[&str] = &["--sharding", "shard_grad_op"];

#[test]
fn sharded_processes_hold_the_data_parallel_weights_bit_for_bit() {
    if mpi::mnist().is_none() {
        return;
    }
    // Two ranks, 300 AdamW steps (the example's optimizer) of 8 digits: 5 epochs of 480.
    let long: Vec<&str> = DDP
        .iter()
        .map(|&a| if a == "48" { "8" } else { a })
        .chain(["--max-duration", "300ba"])
        .collect();
    let dp = mpi_summary(2, &long);
    let sharded = mpi_summary(2, &args_with(&long, SHARDED));
    assert_eq!(sharded["sharding"], "shard_grad_op", "{sharded}");
    assert_eq!(dp["sharding"], "no_shard");
    assert_eq!(dp["params_sha256"], sharded["params_sha256"]);
    assert_eq!(dp["test_loss"], sharded["test_loss"]);
    // Each rank keeps its share of the optimizer state; together about the whole.
    let bytes = |s: &serde_json::Value| -> Vec<u64> {
        s["optimizer_state_bytes_by_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect()
    };
    let (whole, parts) = (bytes(&dp), bytes(&sharded));
    assert!(
        parts.iter().all(|&p| p < whole[0]),
        "{parts:?} vs {whole:?}"
    );
    let sum: u64 = parts.iter().sum();
    assert!(
        sum.abs_diff(whole[0]) < whole[0] / 100,
        "{parts:?} vs {whole:?}"
    );
    // Three ranks, Adam, with norm clipping (a norm over every rank's parameters), SAM (the
    // whole gradient, gathered) and EMA: the transport's reduce-scatter hands every element
    // the all-reduce's summation order, which on three ranks depends on it.
    let with = args_with(
        DDP,
        &[
            "--max-duration",
            "12ba",
            "--optimizer",
            "adam",
            "--algorithms",
            "gradient_clipping:clipping_threshold=0.5,sam,ema",
        ],
    );
    let dp = mpi_summary(3, &with);
    let sharded = mpi_summary(3, &args_with(&with, SHARDED));
    assert_eq!(dp["params_sha256"], sharded["params_sha256"]);
}

#[test]
fn a_sharded_checkpoint_resumes_on_one_two_and_three_as_an_unsharded_one_would() {
    if mpi::mnist().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = args_with(DDP, &["--max-duration", "14ba"]);
    let saved = |name: &str, extra: &[&str]| -> PathBuf {
        let folder = dir.path().join(name);
        let args = args_with(
            &args_with(&base, extra),
            &[
                "--stop-after",
                "6ba",
                "--save-folder",
                folder.to_str().unwrap(),
            ],
        );
        mpi_summary(2, &args);
        folder
    };
    let sharded = saved("sharded", SHARDED);
    let whole = saved("whole", &[]);
    let ck = sharded.join("ep0-ba6");
    let manifest = flashover::checkpoint::format::verify(&ck).unwrap();
    let names: Vec<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
    assert!(
        names.contains(&"optimizer-rank0-of2.mpk") && names.contains(&"optimizer-rank1-of2.mpk"),
        "{names:?}"
    );
    assert!(!names.contains(&"optimizer.mpk"), "{names:?}");
    let straight = mpi_summary(2, &base);
    for world in [1usize, 2, 3] {
        let resume = |from: &Path, extra: &[&str]| {
            let copy = dir.path().join(format!(
                "{}-{world}-{}",
                from.file_name().unwrap().to_string_lossy(),
                extra.len()
            ));
            copy_dir(from, &copy);
            let args = args_with(
                &args_with(&base, extra),
                &["--save-folder", copy.to_str().unwrap(), "--autoresume"],
            );
            if world == 1 {
                summary_of(&args)
            } else {
                mpi_summary(world, &args)
            }
        };
        let from_whole = resume(&whole, &[]);
        assert_eq!(from_whole["batches"], 14);
        // Resharded to `world` ranks (one: the whole state in one process).
        let resharded = resume(&sharded, SHARDED);
        assert_eq!(
            resharded["params_sha256"], from_whole["params_sha256"],
            "world {world}: {resharded}"
        );
        // And resumed without sharding.
        let unsharded = resume(&sharded, &[]);
        assert_eq!(unsharded["params_sha256"], from_whole["params_sha256"]);
        if world == 2 {
            assert_eq!(resharded["params_sha256"], straight["params_sha256"]);
        }
    }
}

#[test]
fn a_damaged_or_missing_shard_is_named_and_autoresume_resumes_from_the_one_before() {
    if mpi::mnist().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("ck");
    let base = args_with(&args_with(DDP, SHARDED), &["--max-duration", "8ba"]);
    mpi_summary(
        2,
        &args_with(
            &base,
            &[
                "--stop-after",
                "6ba",
                "--save-folder",
                folder.to_str().unwrap(),
                "--save-interval",
                "3ba",
            ],
        ),
    );
    let newest = folder.join("ep0-ba6");
    let shard = newest.join("optimizer-rank1-of2.mpk");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    // Loaded by name: an error naming the rank and the file; nothing trains.
    let out = run_mpi(2, &args_with(&base, &["--load", newest.to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("optimizer-rank1-of2.mpk") && stderr.contains("rank 1 of 2"),
        "{stderr}"
    );
    // A missing shard likewise.
    let copy = dir.path().join("missing");
    copy_dir(&newest, &copy);
    std::fs::remove_file(copy.join("optimizer-rank0-of2.mpk")).unwrap();
    let out = run_mpi(2, &args_with(&base, &["--load", copy.to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("optimizer-rank0-of2.mpk"), "{stderr}");
    // Autoresume moves the damaged checkpoint aside and resumes from batch 3, to the bits of
    // a run that was never interrupted.
    let resumed = mpi_summary(
        2,
        &args_with(
            &base,
            &["--save-folder", folder.to_str().unwrap(), "--autoresume"],
        ),
    );
    assert!(folder.join("ep0-ba6.damaged").exists());
    let straight = mpi_summary(2, &base);
    assert_eq!(outcome(&resumed), outcome(&straight));
}

#[test]
fn sharded_ranks_killed_during_saves_resume_to_the_uninterrupted_bits() {
    if mpi::mnist().is_none() {
        return;
    }
    // 60 batches in all, a save after every one, so most kills land in a sharded save (each
    // rank writing its shard, rank 0 the rest).
    let extra = [&["--max-duration", "3ep"][..], SHARDED].concat();
    kill_and_resume(&extra, 3, 12, 2, 20261206);
}

#[test]
fn a_sharded_save_to_an_object_store_uploads_every_ranks_shard_and_resumes_from_the_bucket() {
    if mpi::mnist().is_none() {
        return;
    }
    let Some(server) = S3Server::start(&["runs"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let base = args_with(&args_with(DDP, SHARDED), &["--max-duration", "10ba"]);
    let remote = |cache: &Path, extra: &[&str]| -> (serde_json::Value, String) {
        let mut args = args_with(
            &base,
            &[
                "--save-folder",
                "s3://runs/sharded/ck",
                "--checkpoint-cache",
                cache.to_str().unwrap(),
            ],
        );
        args.extend_from_slice(extra);
        let mut c = mpirun_command(2, &args);
        // (mpirun's local ranks inherit its environment.)
        for (k, v) in server.env() {
            c.env(k, &v);
        }
        let child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun starts");
        let out = wait_with_deadline(child, Duration::from_secs(240), "a sharded remote save");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let summary = stdout
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no summary:\n{stdout}\n{stderr}"));
        (summary, stderr.into_owned())
    };
    // Stopped at batch 4 of 10; its checkpoint is in the bucket with both shards.
    remote(&dir.path().join("machine-a"), &["--stop-after", "4ba"]);
    for file in [
        "manifest.json",
        "optimizer-rank0-of2.mpk",
        "optimizer-rank1-of2.mpk",
    ] {
        let key = format!("sharded/ck/ep0-ba4/{file}");
        assert!(
            server.object("runs", &key).is_file(),
            "{key} was not uploaded"
        );
    }
    // A new machine (an empty cache) resumes from the bucket to the uninterrupted bits.
    let (resumed, log) = remote(&dir.path().join("machine-b"), &["--autoresume"]);
    assert!(
        log.contains("downloaded and verified")
            && log.contains("loading a sharded optimizer state"),
        "{log}"
    );
    let straight = mpi_summary(2, &base);
    assert_eq!(outcome(&resumed), outcome(&straight));
}
