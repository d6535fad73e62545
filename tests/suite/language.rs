//! The language-model main job (`examples/shakespeare.rs`): a small GPT trains on the split
//! Shakespeare corpus and reports the language metrics consistently, resumes bit for bit in a
//! new process, generates the same text from the same seed, and refuses shapes and prompts it
//! cannot take with an error naming them.

use crate::support::*;

/// A GPT small enough for a test: 2 blocks of width 32, windows of 32 characters, 16 per
/// batch, 300 batches (over the first 2,000 training windows), 64 validation windows.
const TINY: &[&str] = &[
    "--layers",
    "2",
    "--heads",
    "2",
    "--width",
    "32",
    "--context",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "16",
    "--train-windows",
    "2000",
    "--val-windows",
    "64",
    "--warmup",
    "5ba",
    "--eval-interval",
    "100ba",
    "--save-interval",
    "50ba",
    "--max-duration",
    "300ba",
];

/// The example on [`TINY`], with `extra` flags (replacing TINY's value of any it repeats).
fn tiny(extra: &[&str]) -> RunOutput {
    let mut args: Vec<&str> = Vec::new();
    for pair in TINY.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend(pair);
        }
    }
    args.extend(extra);
    run_example("shakespeare", &args)
}

fn summary(out: RunOutput) -> serde_json::Value {
    assert!(out.status.success(), "{}", out.stderr);
    out.summary.expect("a JSON summary line")
}

#[test]
fn a_small_gpt_learns_shakespeare_and_reports_consistent_metrics() {
    let generate = ["--generate", "ROMEO:", "--tokens", "50"];
    let s = summary(tiny(&generate));
    let loss = s["val_loss"].as_f64().unwrap();
    // The corpus's character frequencies alone (a model that ignores context) give 3.33
    // nats per character (its unigram entropy); the GPT must use the context to beat that.
    assert!(loss < 3.2, "validation loss {loss}");
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.abs().max(1.0);
    assert!(close(s["val_perplexity"].as_f64().unwrap(), loss.exp()));
    assert!(close(
        s["val_bits_per_char"].as_f64().unwrap(),
        loss / std::f64::consts::LN_2
    ));
    assert_eq!(s["tokens"], 300 * 16 * 32);
    assert_eq!(s["val_tokens"], 64 * 32);
    assert_eq!(s["vocab"], 84);
    assert_eq!(
        (s["train_works"].as_u64(), s["validation_works"].as_u64()),
        (Some(38), Some(2))
    );
    assert!(s["tokens_per_second"].as_f64().unwrap() > 0.0);
    let text = s["generated"].as_str().unwrap();
    assert!(text.starts_with("ROMEO:"), "{text:?}");
    assert_eq!(text.len(), 6 + 50, "{text:?}");
    // Same seed, same bits, same text.
    let again = summary(tiny(&generate));
    assert_eq!(s["params_sha256"], again["params_sha256"]);
    assert_eq!(s["val_loss"], again["val_loss"]);
    assert_eq!(s["generated"], again["generated"]);
}

#[test]
fn the_gpt_resumes_bit_for_bit_in_a_new_process() {
    let straight = summary(tiny(&[]));
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let partial = summary(tiny(&["--save-folder", folder, "--stop-after", "130ba"]));
    assert_eq!(partial["batches"], 130);
    let resumed = summary(tiny(&["--save-folder", folder, "--autoresume"]));
    assert_eq!(resumed["batches"], 300);
    assert_eq!(
        resumed["trained_batches"], 170,
        "the second process resumed at batch 130"
    );
    assert_eq!(resumed["params_sha256"], straight["params_sha256"]);
    assert_eq!(resumed["val_loss"], straight["val_loss"]);
    // The `latest` pointer the saver wrote loads, and the tokenizer beside its folder is
    // found and checked.
    let latest = dir.path().join("latest");
    let out = tiny(&[
        "--load",
        latest.to_str().unwrap(),
        "--weights-only",
        "--max-duration",
        "1ba",
        "--warmup",
        "0ba",
    ]);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(!out.stderr.contains("no tokenizer.json"), "{}", out.stderr);
}

#[test]
fn shapes_and_prompts_the_gpt_cannot_take_are_errors_naming_them() {
    // Checked before training: a character the corpus never uses, a negative temperature.
    let out = tiny(&["--generate", "caf\u{e9}"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("byte 0xc3") && out.stderr.contains("offset 3"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("evaluation"),
        "refused before training: {}",
        out.stderr
    );
    // A corpus without the bundled one's validation plays: named, not split some other way.
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("other.txt");
    std::fs::write(&corpus, "A PLAY\n\nby William Shakespeare\n\nEnter one.\n").unwrap();
    let out = tiny(&["--corpus", corpus.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("other.txt")
            && out.stderr.contains("1 works found")
            && out.stderr.contains("MACBETH"),
        "{}",
        out.stderr
    );
    let out = tiny(&["--generate", "A", "--temperature=-1"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--temperature -1")
            && out.stderr.contains("a number >= 0")
            && !out.stderr.contains("panicked"),
        "{}",
        out.stderr
    );
    // Zero windows is a bad flag, not a malformed data file.
    for flag in ["--val-windows", "--train-windows"] {
        let out = tiny(&[flag, "0"]);
        assert!(!out.status.success());
        assert!(
            out.stderr.contains(&format!("invalid value 0 for {flag}"))
                && !out.stderr.contains("malformed"),
            "{}",
            out.stderr
        );
    }
    // A generation that would run for days is refused before training, naming the bound.
    let out = tiny(&["--generate", "A", "--tokens", "1000000000"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--tokens")
            && out.stderr.contains("1000000000")
            && out.stderr.contains("at most 100000")
            && !out.stderr.contains("evaluation"),
        "{}",
        out.stderr
    );
    // A shape whose parameters alone cannot fit is refused before anything is allocated
    // (it used to abort on "memory allocation of 16000000000 bytes failed").
    let out = tiny(&["--width", "4000000000", "--heads", "4"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--width 4000000000")
            && out.stderr.contains("need at least")
            && out.stderr.contains("smaller --width")
            && !out.stderr.contains("memory allocation of")
            && !out.stderr.contains("panicked"),
        "{}",
        out.stderr
    );
    let out = tiny(&["--heads", "3"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--heads 3")
            && out
                .stderr
                .contains("a number of heads that divides its width 32"),
        "{}",
        out.stderr
    );
    let out = tiny(&["--seq-len", "64"]);
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("--seq-len 64 must be between 1 and --context 32"),
        "{}",
        out.stderr
    );
}

#[test]
fn eval_text_scores_a_file_like_the_validation_text() {
    use flashover_examples::shakespeare::{bundled_shakespeare, ShakespeareSplit};
    let split = ShakespeareSplit::load(&bundled_shakespeare()).unwrap();
    // Exactly the text of TINY's 64 validation windows of 32 characters (and the last
    // target): scored as a file, it must give the validation loss.
    let text = split.tokenizer.decode(&split.validation[..64 * 32 + 1]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("macbeth-opening.txt");
    std::fs::write(&file, &text).unwrap();
    let s = summary(tiny(&["--eval-text", file.to_str().unwrap()]));
    let (text_loss, val_loss) = (
        s["text_loss"].as_f64().unwrap(),
        s["val_loss"].as_f64().unwrap(),
    );
    assert!(
        (text_loss - val_loss).abs() < 1e-6,
        "{text_loss} against {val_loss}"
    );
    assert!(
        (s["text_bits_per_char"].as_f64().unwrap() - text_loss / std::f64::consts::LN_2).abs()
            < 1e-9
    );
    // A character the training text never uses, and a text too short for one window: errors
    // naming the file, before training.
    std::fs::write(&file, "Fair is foul \u{2014} and foul is fair").unwrap();
    let out = tiny(&["--eval-text", file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("macbeth-opening.txt") && out.stderr.contains("offset 13"),
        "{}",
        out.stderr
    );
    std::fs::write(&file, "Fair is foul").unwrap();
    let out = tiny(&["--eval-text", file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("macbeth-opening.txt") && out.stderr.contains("no window of 33 tokens"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("evaluation"),
        "refused before training: {}",
        out.stderr
    );
}

/// Every algorithm for language models resumes bit for bit in a new process, and each one
/// changes the run (it is not silently ignored): its weights differ from the plain run's.
#[test]
fn every_language_algorithm_resumes_bit_for_bit_and_changes_the_run() {
    let short = ["--max-duration", "60ba", "--eval-interval", "60ba"];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = short.to_vec();
        a.extend(extra);
        summary(tiny(&a))
    };
    let plain = with(&[]);
    for algorithm in [
        "alibi:train_sequence_length_scaling=0.5",
        "gated_linear_units:activation=silu",
        "seq_length_warmup:min_seq_length=8:max_seq_length=32:step_size=8:duration=0.6",
        "seq_length_warmup:min_seq_length=8:max_seq_length=32:truncate=false",
        "label_smoothing:smoothing=0.1",
        "selective_backprop:start=0:end=1:keep=0.5",
        "factorize:min_features=32:latent_features=8",
        "gradient_clipping:clipping_threshold=0.1,ema:half_life=10ba",
    ] {
        let straight = with(&["--algorithms", algorithm]);
        assert_ne!(
            straight["params_sha256"], plain["params_sha256"],
            "{algorithm} changed nothing"
        );
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().to_str().unwrap();
        let flags = ["--algorithms", algorithm, "--save-folder", folder];
        let mut first = flags.to_vec();
        first.extend(["--stop-after", "30ba"]);
        assert_eq!(with(&first)["batches"], 30, "{algorithm}");
        let mut second = flags.to_vec();
        second.push("--autoresume");
        let resumed = with(&second);
        assert_eq!(resumed["trained_batches"], 30, "{algorithm}");
        assert_eq!(
            resumed["params_sha256"], straight["params_sha256"],
            "{algorithm} resumed differently"
        );
        assert_eq!(resumed["val_loss"], straight["val_loss"], "{algorithm}");
    }
}

/// ALiBi removes the position embeddings, so the model reads validation windows twice as long
/// as it trained on; with learned positions that is refused before training, naming the
/// lengths and the way out.
#[test]
fn alibi_reads_windows_longer_than_its_training_and_learned_positions_refuse_them() {
    let base = [
        "--max-duration",
        "60ba",
        "--eval-interval",
        "60ba",
        "--eval-seq-len",
        "64",
    ];
    let out = tiny(&base);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("--eval-seq-len 64")
            && out.stderr.contains("--context 32")
            && out.stderr.contains("alibi"),
        "{}",
        out.stderr
    );
    let mut with_alibi = base.to_vec();
    with_alibi.extend(["--algorithms", "alibi:train_sequence_length_scaling=1"]);
    let s = summary(tiny(&with_alibi));
    assert_eq!(s["eval_seq_len"], 64);
    assert_eq!(s["val_tokens"], 64 * 64);
    // The tiny model's 32 x 32 position embeddings are gone.
    let plain = summary(tiny(&["--max-duration", "60ba", "--eval-interval", "60ba"]));
    assert_eq!(
        plain["params"].as_u64().unwrap() - s["params"].as_u64().unwrap(),
        32 * 32
    );
    assert!(s["val_loss"].as_f64().unwrap().is_finite());
}

/// Algorithms that change image models are refused for the GPT by name, and low-precision
/// layer norm is refused on the CPU backend, which has no fast half type.
#[test]
fn algorithms_that_do_not_fit_the_gpt_are_refused_by_name() {
    for (algorithm, says) in [
        ("mixup", "image models"),
        ("blurpool", "image models"),
        ("low_precision_layernorm", "float32"),
        ("alibi:train_sequence_length_scaling=0.3", "32 tokens"),
        ("gated_linear_units:activation=tanh", "tanh"),
    ] {
        let out = tiny(&["--max-duration", "10ba", "--algorithms", algorithm]);
        assert!(!out.status.success(), "{algorithm} was accepted");
        let name = algorithm.split(':').next().unwrap();
        assert!(
            out.stderr.contains(name) && out.stderr.contains(says),
            "{algorithm}: {}",
            out.stderr
        );
    }
}

/// The Generate callback continues its prompts during training and logs the text to the
/// JSONL log and TensorBoard at the batches it is due, and the same seed gives the same text
/// in a run resumed from a checkpoint.
#[test]
fn generated_samples_are_logged_during_training_and_repeat_after_resumption() {
    let dir = tempfile::tempdir().unwrap();
    let run = |logs: &str, extra: &[&str]| {
        let mut a = vec![
            "--max-duration",
            "60ba",
            "--eval-interval",
            "60ba",
            "--generate-every",
            "20ba",
            "--generate-prompt",
            "KING:",
            "--generate-prompt",
            "Enter",
            "--tokens",
            "24",
            "--log-dir",
            logs,
            "--tensorboard",
        ];
        a.extend(extra);
        summary(tiny(&a))
    };
    let texts = |logs: &std::path::Path| -> Vec<(u64, String, String)> {
        std::fs::read_to_string(logs.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| {
                let text = v.get("text")?.as_object()?.clone();
                let batch = v["batch"].as_u64()?;
                Some(
                    text.into_iter()
                        .map(move |(tag, t)| (batch, tag, t.as_str().unwrap().to_string())),
                )
            })
            .flatten()
            .collect()
    };
    let straight_logs = dir.path().join("straight");
    run(straight_logs.to_str().unwrap(), &[]);
    let straight = texts(&straight_logs);
    let steps: Vec<(u64, &str)> = straight.iter().map(|(b, t, _)| (*b, t.as_str())).collect();
    assert_eq!(
        steps,
        [
            (20, "generate/0"),
            (20, "generate/1"),
            (40, "generate/0"),
            (40, "generate/1"),
            (60, "generate/0"),
            (60, "generate/1"),
        ]
    );
    for (_, tag, text) in &straight {
        let prompt = if tag == "generate/0" {
            "KING:"
        } else {
            "Enter"
        };
        assert!(text.starts_with(prompt), "{tag}: {text:?}");
        assert_eq!(text.chars().count(), prompt.len() + 24, "{text:?}");
    }
    // Resumed at batch 30: the samples after it are the uninterrupted run's.
    let folder = dir.path().join("ck");
    let folder = folder.to_str().unwrap();
    let resumed_logs = dir.path().join("resumed");
    let logs = resumed_logs.to_str().unwrap();
    run(logs, &["--save-folder", folder, "--stop-after", "30ba"]);
    run(logs, &["--save-folder", folder, "--autoresume"]);
    let mut resumed = texts(&resumed_logs);
    // The first process also generated at its end, batch 30.
    let at_stop: Vec<_> = resumed
        .iter()
        .filter(|(b, _, _)| *b == 30)
        .cloned()
        .collect();
    assert_eq!(at_stop.len(), 2, "{resumed:?}");
    resumed.retain(|(b, _, _)| *b != 30);
    assert_eq!(resumed, straight);
    // TensorBoard's reader sees each sample under its tag at its batch.
    if let Some(tb) = read_tensorboard(&straight_logs.join("tensorboard")) {
        let seen = tb["texts"]["generate/1"].as_array().unwrap();
        let want: Vec<serde_json::Value> = straight
            .iter()
            .filter(|(_, t, _)| t == "generate/1")
            .map(|(b, _, text)| serde_json::json!([b, text]))
            .collect();
        assert_eq!(seen, &want);
    }
}

/// The BPE option: the GPT trains on byte-pair tokens learned from the training plays, reports
/// bits per byte of text (comparable with the character model's bits per character), keeps
/// its tokenizer beside the checkpoints, resumes with it, and a run with another tokenizer is
/// refused that folder.
#[test]
fn bpe_tokens_train_resume_and_guard_their_checkpoints() {
    let short = [
        "--max-duration",
        "40ba",
        "--eval-interval",
        "40ba",
        "--tokenizer",
        "bpe",
        "--bpe-vocab",
        "384",
    ];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = short.to_vec();
        a.extend(extra);
        tiny(&a)
    };
    let straight = summary(with(&["--generate", "ROMEO:", "--tokens", "10"]));
    assert_eq!(straight["vocab"], 384);
    assert_eq!(straight["tokenizer"], "bpe (384 tokens)");
    assert!(straight["val_bits_per_char"].is_null());
    let loss = straight["val_loss"].as_f64().unwrap();
    let per_token = straight["val_bytes_per_token"].as_f64().unwrap();
    assert!(per_token > 1.3, "{per_token} bytes per token");
    let bpb = straight["val_bits_per_byte"].as_f64().unwrap();
    assert!((bpb - loss / std::f64::consts::LN_2 / per_token).abs() < 1e-9);
    assert!(straight["generated"]
        .as_str()
        .unwrap()
        .starts_with("ROMEO:"));

    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let partial = summary(with(&["--save-folder", folder, "--stop-after", "20ba"]));
    assert_eq!(partial["batches"], 20);
    let saved = std::fs::read_to_string(dir.path().join("tokenizer.json")).unwrap();
    assert!(saved.contains("\"bpe\""), "{saved}");
    let resumed = summary(with(&["--save-folder", folder, "--autoresume"]));
    assert_eq!(resumed["params_sha256"], straight["params_sha256"]);
    // Another vocabulary size is another tokenizer: refused, naming both.
    let out = tiny(&[
        "--max-duration",
        "40ba",
        "--tokenizer",
        "bpe",
        "--bpe-vocab",
        "300",
        "--save-folder",
        folder,
        "--autoresume",
    ]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("bpe (384 tokens)") && out.stderr.contains("bpe (300 tokens)"),
        "{}",
        out.stderr
    );
    // The character model reports the same quantity per byte (one byte per token).
    let chars = summary(tiny(&["--max-duration", "40ba", "--eval-interval", "40ba"]));
    assert_eq!(chars["val_bytes_per_token"], 1.0);
    assert_eq!(chars["val_bits_per_byte"], chars["val_bits_per_char"]);
}

/// The GPT recipes train with their algorithms and scale-schedule ratio; an image recipe is
/// refused for the GPT by its algorithms' names.
#[test]
fn gpt_recipes_run_at_their_ratio() {
    let full = 40 * 16 * 32;
    for (name, stack) in [("gpt-mild", 1), ("gpt-medium", 2), ("gpt-hot", 3)] {
        let s = summary(tiny(&[
            "--max-duration",
            "40ba",
            "--eval-interval",
            "40ba",
            "--recipe",
            name,
        ]));
        // Every GPT recipe trains the whole run (see `GPT_RECIPES`: a shorter schedule
        // cost this model more than it saved).
        assert_eq!(s["batches"], 40, "{name}");
        assert_eq!(s["scale_schedule_ratio"], 1.0, "{name}");
        let algorithms = s["algorithms"].as_array().unwrap();
        assert_eq!(algorithms.len(), stack, "{name}: {algorithms:?}");
        assert_eq!(algorithms[0], "alibi:train_sequence_length_scaling=1");
        let tokens = s["tokens"].as_u64().unwrap();
        if stack == 1 {
            // ALiBi on the full window: every token of every window.
            assert_eq!(tokens, full, "{name}");
        } else {
            // Sequence-length warmup truncates the first 30% of the batches' windows, from 8
            // tokens up: fewer tokens are trained on, and most of them still are.
            assert_eq!(
                algorithms[1], "seq_length_warmup:max_seq_length=128",
                "{name}"
            );
            assert!(tokens < full && tokens > full / 2, "{name}: {tokens}");
        }
    }
    let out = tiny(&["--max-duration", "40ba", "--recipe", "resnet-mild"]);
    assert!(!out.status.success());
    assert!(out.stderr.contains("blurpool"), "{}", out.stderr);
}

/// Low-precision layer norm joins a mixed-precision run in the run's half type (where a
/// float32 run on the CPU refuses it, above): the checkpoint's surgery record names the type.
#[test]
fn low_precision_layernorm_computes_in_the_runs_half_type() {
    use burn::tensor::backend::Backend;
    use flashover::core::precision::Precision;
    let Some(p) = [Precision::AmpBf16, Precision::AmpFp16]
        .into_iter()
        .find(|p| {
            let d = p.compute_dtype().unwrap();
            <TB as Backend>::supports_dtype(&device(), burn::tensor::DType::from(d))
        })
    else {
        eprintln!("skipped on {BACKEND}: no half type");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let s = summary(tiny(&[
        "--max-duration",
        "20ba",
        "--save-interval",
        "20ba",
        "--precision",
        p.name(),
        "--algorithms",
        "low_precision_layernorm",
        "--save-folder",
        folder,
    ]));
    assert!(s["val_loss"].as_f64().unwrap().is_finite());
    let name = flashover::checkpoint::format::read_latest(dir.path()).unwrap();
    let state = std::fs::read_to_string(dir.path().join(name).join("trainer_state.json")).unwrap();
    let half = match p {
        Precision::AmpBf16 => "low_precision_layernorm:bf16",
        _ => "low_precision_layernorm:f16",
    };
    assert!(state.contains(half), "{state}");
}

#[test]
fn activation_checkpointing_trains_the_same_bits_and_resumes_across_it() {
    // Checkpointing keeps fewer activations and computes them again in the backward pass:
    // the gradients, so the weights, are the same bits (ALiBi's slopes too).
    let short = ["--max-duration", "40ba", "--algorithms", "alibi"];
    let plain = summary(tiny(&short));
    let ck = summary(tiny(
        &[&short[..], &["--activation-checkpointing"]].concat(),
    ));
    assert_eq!(ck["activation_checkpointing"], true);
    assert_eq!(plain["params_sha256"], ck["params_sha256"]);
    assert_eq!(plain["val_loss"], ck["val_loss"]);
    // A run saved without it resumes with it, to the same bits.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    summary(tiny(
        &[
            &short[..],
            &["--save-folder", folder, "--stop-after", "15ba"],
        ]
        .concat(),
    ));
    let resumed = summary(tiny(
        &[
            &short[..],
            &[
                "--save-folder",
                folder,
                "--autoresume",
                "--activation-checkpointing",
            ],
        ]
        .concat(),
    ));
    assert_eq!(resumed["params_sha256"], plain["params_sha256"]);
}

/// The corpus read from MDS shards (`cargo xtask shards shakespeare`, one sample per work,
/// zstd) splits into the same works and trains the same bits as the bundled file.
#[test]
fn the_corpus_from_shards_trains_the_same_bits_as_the_bundled_file() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("plays");
    write_example_shards(&[
        "shakespeare",
        shards.to_str().unwrap(),
        "--size-limit",
        "1MB",
        "--compression",
        "zstd:3",
    ]);
    let short = ["--max-duration", "20ba", "--eval-interval", "20ba"];
    let bundled = summary(tiny(&short));
    let mut from_shards = short.to_vec();
    from_shards.extend(["--data", shards.to_str().unwrap()]);
    let streamed = summary(tiny(&from_shards));
    assert_eq!(streamed["params_sha256"], bundled["params_sha256"]);
    assert_eq!(streamed["val_loss"], bundled["val_loss"]);
}
