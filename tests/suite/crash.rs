//! Crash safety: kill the example with SIGKILL at random points (many during a save, since it
//! saves after every batch; the points are drawn in batches of progress, so the test is the
//! same on a fast or a slow machine), resume each time with `--autoresume`, and still end
//! with the bits of the run that was never interrupted.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;
use flashover::checkpoint::find_resumable;
use flashover::core::rng::Rng;

#[test]
fn killed_at_random_points_and_resumed_gives_the_uninterrupted_result() {
    killed_and_resumed(&[], 20261130);
}

/// Every model surgery at once on the ResNet (the ones with per-batch draws, stochastic depth
/// and gyro dropout, and the ones that add or replace parameters, squeeze-and-excitation and
/// factorization), and a ResNet recipe (selective backprop on top of surgery and progressive
/// resizing): the same after SIGKILLs as uninterrupted.
#[test]
fn surgery_and_the_resnet_recipes_survive_kills_bit_for_bit() {
    killed_and_resumed(
        &[
            "--model",
            "resnet8",
            "--algorithms",
            "blurpool,weight_standardization:n_last_layers_ignore=2,squeeze_excite:min_channels=32:latent_channels=8,gyro_dropout:sigma=16:tau=4,factorize:min_channels=32:latent_channels=8,ghost_batchnorm:ghost_batch_size=8,stochastic_depth:stochastic_method=sample:drop_rate=0.3",
        ],
        20261202,
    );
    killed_and_resumed(
        &["--model", "resnet8", "--recipe", "resnet-medium"],
        20261203,
    );
}

/// Kills the example (with `extra` arguments) at random points and resumes it until it
/// finishes; the end must be the uninterrupted run's.
fn killed_and_resumed(extra: &[&str], seed: u64) {
    // 6 epochs of 16 batches, saving after every batch, keeping the newest three.
    let mut base = extra.to_vec();
    base.extend(["--max-duration", "6ep"]);
    let straight = summary_of(&short_args(&base));
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap().to_string();
    let mut with_saves = base.clone();
    with_saves.extend([
        "--save-folder",
        &folder,
        "--save-interval",
        "1ba",
        "--keep",
        "3",
        "--autoresume",
    ]);
    let args = short_args(&with_saves);
    let mut rng = Rng::new(seed);
    let mut progress = Vec::new();
    let mut kills = 0;
    for _ in 0..12 {
        let mut child = Command::new(example_bin("mnist"))
            .args(&args)
            .args(["--no-progress", "--backend", BACKEND])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the example starts");
        // A kill 1 to 5 saved batches into this try, a random 0-20 ms after the last save
        // seen: inside a step or a save, wherever the machine's speed puts it (a kill at a
        // fixed time let fast machines finish the run before the twelfth try).
        let from = latest_batch(dir.path());
        let batches = 1 + rng.below(5);
        let extra = Duration::from_millis(rng.below(20));
        if wait_for_progress(
            &mut child,
            dir.path(),
            from,
            batches,
            extra,
            Duration::from_secs(60),
        ) {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().unwrap();
        let (found, _) = find_resumable(dir.path()).unwrap();
        progress.push(found.map(|p| p.file_name().unwrap().to_string_lossy().into_owned()));
    }
    assert!(
        kills >= 10,
        "only {kills} runs were killed before finishing; progress {progress:?}"
    );
    let done = summary_of(&args);
    assert_eq!(
        outcome(&done),
        outcome(&straight),
        "{extra:?} after {kills} kills (checkpoints seen: {progress:?})"
    );
    // Rotation kept three checkpoints and no scratch survived the last run.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names.len(),
        5,
        "three checkpoints, `latest` and the folder's lock: {names:?}"
    );
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with('.') || n == flashover::checkpoint::LOCK_FILE),
        "{names:?}"
    );
}
