//! The language-model main job (`examples/shakespeare.rs`): a small GPT trains on the split
//! Shakespeare corpus and reports the language metrics consistently, resumes bit for bit in a
//! new process, generates the same text from the same seed, and refuses shapes and prompts it
//! cannot take with an error naming them.

use flashover_tests::*;

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
    assert!(out.stderr.contains("not -1"), "{}", out.stderr);
    let out = tiny(&["--heads", "3"]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("3 heads must divide its width 32"),
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
