//! Damaged, hostile and half-written checkpoints: each is a typed error naming the file (or
//! autoresume passes over it to an older intact one), never a panic, a hang or a huge
//! allocation. And a save that fails midway leaves the previous checkpoint and `latest` as
//! they were.

use std::fs;
use std::path::{Path, PathBuf};

use crate::support::*;
use flashover::checkpoint::format::{
    sha256_hex, verify, Manifest, MANIFEST, MODEL, OPTIMIZER, TRAINER_STATE,
};
use flashover::checkpoint::{find_resumable, CheckpointRestore, LoadOptions};
use flashover_examples::MnistRun;

/// A save folder with two real checkpoints, after 4 and 8 batches.
pub(crate) fn two_checkpoints() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    summary_of(&short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--stop-after",
        "8ba",
    ]));
    let older = dir.path().join("ep0-ba4");
    let newer = dir.path().join("ep0-ba8");
    verify(&older).unwrap();
    verify(&newer).unwrap();
    (dir, older, newer)
}

/// Restoring a trainer from `ck` must fail; returns the message.
fn restore_error(ck: &Path) -> String {
    let mut run = short_run(512, 32, 200, "3ep");
    run.data.batch_size = 32;
    // The example's seed, which the checkpoint was trained with (another is refused).
    run.seed = MnistRun::default().seed;
    let b = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap();
    match b
        .restore(CheckpointRestore::new(ck, LoadOptions::default()))
        .build()
    {
        Ok(_) => panic!("restoring from damaged {} succeeded", ck.display()),
        Err(e) => format!(
            "{e}: {}",
            std::error::Error::source(&e)
                .map(|s| s.to_string())
                .unwrap_or_default()
        ),
    }
}

fn rewrite_manifest(ck: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = ck.join(MANIFEST);
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Re-lists `name` in the manifest with its current size and hash (a hostile checkpoint whose
/// author made the hashes agree).
fn rehash(ck: &Path, name: &str) {
    let bytes = fs::read(ck.join(name)).unwrap();
    rewrite_manifest(ck, |v| {
        for f in v["files"].as_array_mut().unwrap() {
            if f["name"] == name {
                f["bytes"] = bytes.len().into();
                f["sha256"] = sha256_hex(&bytes).into();
            }
        }
    });
}

#[test]
fn each_kind_of_damage_names_the_file_and_autoresume_falls_back() {
    type Damage = (&'static str, &'static str, fn(&Path));
    let damages: Vec<Damage> = vec![
        ("truncated weights", MODEL, |ck| {
            let p = ck.join(MODEL);
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..b.len() / 2]).unwrap();
        }),
        ("flipped byte", OPTIMIZER, |ck| {
            let p = ck.join(OPTIMIZER);
            let mut b = fs::read(&p).unwrap();
            let i = b.len() / 3;
            b[i] ^= 0x40;
            fs::write(&p, b).unwrap();
        }),
        ("missing manifest", MANIFEST, |ck| {
            fs::remove_file(ck.join(MANIFEST)).unwrap()
        }),
        ("wrong version", MANIFEST, |ck| {
            rewrite_manifest(ck, |v| v["version"] = 99.into())
        }),
        ("manifest points outside", MANIFEST, |ck| {
            rewrite_manifest(ck, |v| {
                v["files"][0]["name"] = "../ep0-ba4/model.safetensors".into()
            })
        }),
        ("absurd tensor size", MODEL, |ck| {
            // Rewrite the safetensors header so a tensor claims 2^40 x 2^40 elements, then
            // make the manifest agree, so only decoding can catch it.
            let p = ck.join(MODEL);
            let b = fs::read(&p).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
            let hostile =
                header.replacen("\"shape\":[", "\"shape\":[1099511627776,1099511627776,", 1);
            let mut out = (hostile.len() as u64).to_le_bytes().to_vec();
            out.extend(hostile.as_bytes());
            out.extend(&b[8 + n..]);
            fs::write(&p, out).unwrap();
            rehash(ck, MODEL);
        }),
        ("hostile trainer state", TRAINER_STATE, |ck| {
            // A position far past the end of the epoch, with agreeing hashes.
            let p = ck.join(TRAINER_STATE);
            let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
            v["timestamp"]["batch_in_epoch"] = 1_000_000_000u64.into();
            v["sampler"]["batch_in_epoch"] = 1_000_000_000u64.into();
            fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
            rehash(ck, TRAINER_STATE);
        }),
        ("empty folder", MANIFEST, |ck| {
            fs::remove_dir_all(ck).unwrap();
            fs::create_dir(ck).unwrap();
        }),
    ];
    for (what, file, damage) in damages {
        let (dir, older, newer) = two_checkpoints();
        damage(&newer);
        let msg = restore_error(&newer);
        let named = if what == "hostile trainer state" {
            "batch 1000000000".to_string()
        } else {
            file.to_string()
        };
        assert!(
            msg.contains(&named),
            "{what}: the error must name {named}: {msg}"
        );
        if what == "wrong version" {
            // Not damage: a checkpoint another build may read. Autoresume stops rather than
            // pass over it to an older one (whose resumed run would overwrite it).
            let err = find_resumable(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains("version 99") && err.contains("ep0-ba8"),
                "{err}"
            );
        } else if what != "hostile trainer state" && what != "absurd tensor size" {
            // Verification alone catches these; autoresume passes over them to the older one.
            let (found, skipped) = find_resumable(dir.path()).unwrap();
            assert_eq!(found.as_deref(), Some(older.as_path()), "{what}");
            assert_eq!(skipped.len(), 1, "{what}: {skipped:?}");
            assert!(
                skipped[0].to_string().contains("ep0-ba8"),
                "{what}: {}",
                skipped[0]
            );
        }
    }
}

#[test]
fn an_empty_or_missing_save_folder_means_a_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(find_resumable(dir.path()).unwrap().0, None);
    assert_eq!(find_resumable(&dir.path().join("absent")).unwrap().0, None);
    let s = summary_of(&short_args(&[
        "--save-folder",
        dir.path().to_str().unwrap(),
        "--autoresume",
        "--stop-after",
        "4ba",
    ]));
    assert_eq!(s["batches"], 4);
}

#[test]
fn a_save_that_fails_midway_keeps_the_previous_checkpoint_and_latest() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    summary_of(&short_args(&[
        "--save-folder",
        folder,
        "--save-interval",
        "4ba",
        "--stop-after",
        "4ba",
    ]));
    let latest_before = fs::read_to_string(dir.path().join("latest")).unwrap();
    assert_eq!(latest_before, "ep0-ba4");
    // Resume under a file-size limit smaller than the weights file: the next save fails with
    // EFBIG (SIGXFSZ is ignored, and stays ignored across exec). Running as root, permission
    // bits cannot make a folder read-only, so a size limit stands in for a full disk.
    let model_bytes = fs::metadata(dir.path().join("ep0-ba4").join(MODEL))
        .unwrap()
        .len();
    let limit_kib = model_bytes / 1024 / 2;
    let mut cmd = vec![example_bin("mnist").to_string_lossy().into_owned()];
    cmd.extend(
        short_args(&[
            "--save-folder",
            folder,
            "--save-interval",
            "4ba",
            "--autoresume",
            "--no-progress",
            "--backend",
            BACKEND,
        ])
        .iter()
        .map(|s| s.to_string()),
    );
    let script = format!("trap '' XFSZ; ulimit -f {limit_kib}; exec \"$@\"");
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(script)
        .arg("bash")
        .args(&cmd)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the save should have failed:\n{stderr}"
    );
    assert!(
        stderr.contains(MODEL) && !stderr.contains("panicked"),
        "the error must name the file:\n{stderr}"
    );
    assert_eq!(
        fs::read_to_string(dir.path().join("latest")).unwrap(),
        latest_before
    );
    let m: Manifest = verify(&dir.path().join("ep0-ba4")).unwrap();
    assert_eq!(m.batch, 4);
    let entries: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !entries.iter().any(|n| n.starts_with(".tmp-")),
        "no half-written checkpoint is left: {entries:?}"
    );
    assert!(!entries.iter().any(|n| n == "ep0-ba8"), "{entries:?}");
}
