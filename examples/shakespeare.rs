//! Trains a GPT (`flashover_models::Gpt`) on the bundled Shakespeare corpus, character by
//! character, through the Flashover trainer: 38 works for training, Macbeth and The Winter's
//! Tale for validation (whole plays the model never sees a line of). The last stdout line is
//! a JSON summary: `val_loss` (nats per token), `val_perplexity`, `val_bits_per_char`,
//! `val_accuracy` (next character), `tokens_per_second`, `wall_seconds`, `params_sha256`.
//!
//! ```text
//! cargo run --release --example shakespeare -- --help
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use burn::data::dataset::Dataset;
use burn::module::{AutodiffModule, Module};
use burn::optim::AdamWConfig;
use clap::Parser;
use flashover::backend::COMPILED;
use flashover::core::metric::{Accuracy, LossMetric};
use flashover::core::trainer::Evaluator;
use flashover::models::{GptConfig, Sampling, TrainBackend};
use flashover::prelude::*;
use flashover_examples::shakespeare::{
    bundled_shakespeare, read_text, window_loader, ShakespeareSplit, Windows,
};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Train a character-level GPT on the bundled Shakespeare plays with the Flashover trainer.
///
/// Times are written with a unit: ep (epochs), ba (batches), sp (samples: windows), tok
/// (tokens) or dur (fraction of the run), for example 2000ba, 0.1dur.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// How long to train (ep, ba, sp or tok); the default takes about 5 minutes on two
    /// cores.
    #[arg(long, default_value = "700ba")]
    max_duration: Time,
    /// Windows per batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Tokens per training window (at most --context).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Longest input the model takes (its position embeddings).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Attention heads (dividing --width).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// A separate output layer instead of logits through the token embeddings.
    #[arg(long)]
    untied: bool,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f32,
    /// Linear warmup before the cosine decay.
    #[arg(long, default_value = "100ba")]
    warmup: Time,
    /// Seed for weights, data order and every random draw.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Evaluate on the validation plays this often (and at the end).
    #[arg(long, default_value = "350ba")]
    eval_interval: Time,
    /// Evaluate on only the first N validation windows (default: all of them).
    #[arg(long)]
    val_windows: Option<usize>,
    /// Train on only the first N training windows.
    #[arg(long)]
    train_windows: Option<usize>,
    /// Backend to run on, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
    /// Log the training loss every N batches.
    #[arg(long, default_value_t = 50)]
    log_every: u64,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Save checkpoints into this folder.
    #[arg(long)]
    save_folder: Option<PathBuf>,
    /// How often to save; the state at the end of training is always saved too.
    #[arg(long, default_value = "500ba")]
    save_interval: Time,
    /// Resume from the newest intact checkpoint in --save-folder (start fresh if there is
    /// none).
    #[arg(long, requires = "save_folder")]
    autoresume: bool,
    /// Stop cleanly once training reaches this time (the state is saved if --save-folder is
    /// set), for example to resume later.
    #[arg(long)]
    stop_after: Option<Time>,
    /// After training (or, with --autoresume on a finished run, instead of it), continue this
    /// text with --tokens characters sampled from the model; printed before the summary and
    /// in it as `generated`.
    #[arg(long)]
    generate: Option<String>,
    /// Characters to generate.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Sampling temperature (0: always the most likely character).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among only the K most likely characters.
    #[arg(long)]
    top_k: Option<usize>,
    /// Also score this text (plain or gzipped) with the model, at every evaluation: its loss,
    /// perplexity and bits per character go into the summary as `text_*`. Its characters
    /// must be among the training text's.
    #[arg(long)]
    eval_text: Option<PathBuf>,
    /// The corpus (gzipped or plain text with the bundled corpus's layout).
    #[arg(long)]
    corpus: Option<PathBuf>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if let Err(e) = flashover_examples::with_backend!(args.backend.as_str(), run(&args)) {
        eprintln!("error: {}", flashover::core::error::report(e.as_ref()));
        std::process::exit(1);
    }
}

fn run<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    if args.seq_len == 0 || args.seq_len > args.context {
        anyhow::bail!(
            "--seq-len {} must be between 1 and --context {}",
            args.seq_len,
            args.context
        );
    }
    let sampling = Sampling {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    sampling.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let path = args.corpus.clone().unwrap_or_else(bundled_shakespeare);
    let split = ShakespeareSplit::load(&path)?;
    // The prompt is checked before training, not found untokenizable after it.
    let prompt = match &args.generate {
        Some(text) if text.is_empty() => {
            anyhow::bail!("--generate needs a prompt of at least one character")
        }
        Some(text) => Some(
            split
                .tokenizer
                .encode(text.as_bytes())
                .map_err(|e| anyhow::anyhow!("--generate {text:?}: {e}"))?,
        ),
        None => None,
    };
    let vocab = split.tokenizer.vocab.len();
    let config = GptConfig::new(vocab, args.context, args.layers, args.heads, args.width)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .with_tied_weights(!args.untied);
    let device = B::Device::default();
    let model = config.init::<B>(&device, args.seed);
    let train = window_loader::<B>(
        "shakespeare-train",
        Windows::over(split.train.clone(), args.seq_len, args.train_windows),
        args.batch_size,
        true,
        args.seed,
        &device,
    )?;
    let val_windows = Windows::over(split.validation.clone(), args.seq_len, args.val_windows);
    let val_tokens = val_windows.len() * args.seq_len;
    let val = window_loader::<B::InnerBackend>(
        "shakespeare-validation",
        val_windows,
        args.batch_size,
        false,
        args.seed,
        &device,
    )?;
    let evaluator = Evaluator::new(
        "val",
        val,
        vec![
            Box::new(LossMetric::default()),
            Box::new(Accuracy::default()),
        ],
    );
    // The extra text is read and tokenized before training, not found unreadable after it.
    let text_evaluator = match &args.eval_text {
        None => None,
        Some(path) => {
            let bytes = read_text(path)?;
            let tokens = split
                .tokenizer
                .encode(&bytes)
                .map_err(|e| anyhow::anyhow!("--eval-text {}: {e}", path.display()))?;
            let loader = window_loader::<B::InnerBackend>(
                &path.display().to_string(),
                Windows::over(std::sync::Arc::new(tokens), args.seq_len, None),
                args.batch_size,
                false,
                args.seed,
                &device,
            )
            .with_context(|| format!("--eval-text {}", path.display()))?;
            Some(Evaluator::new(
                "text",
                loader,
                vec![
                    Box::new(LossMetric::default()),
                    Box::new(Accuracy::default()),
                ],
            ))
        }
    };
    let optimizer = AdamWConfig::new()
        .with_weight_decay(args.weight_decay)
        .init::<B, _>();
    let mut scheduler = Scheduler::cosine(Time::Duration(1.0), 0.0);
    if !args.warmup.is_zero() {
        scheduler = scheduler.with_warmup(args.warmup);
    }
    let gen_device = device.clone();
    let mut builder = Trainer::builder(model, optimizer, train, args.max_duration, device)
        .lr(args.lr)
        .scheduler(scheduler)
        .seed(args.seed)
        .eval_interval(args.eval_interval)
        .evaluator(evaluator)
        .logger(ConsoleLogger::new(args.log_every))
        .hyperparameter("backend", args.backend.clone())
        .hyperparameter("model", format!("{config:?}"));
    if let Some(e) = text_evaluator {
        builder = builder.evaluator(e);
    }
    if !args.no_progress {
        builder = builder.logger(ProgressBar::new());
    }
    if let Some(at) = args.stop_after {
        builder = builder.callback(StopAt::new(at));
    }
    if let Some(folder) = &args.save_folder {
        builder = builder.callback(Saver::new(
            SaverConfig::new(folder),
            SaveInterval::Every(args.save_interval),
        )?);
        if args.autoresume {
            if let Some(restore) =
                flashover::checkpoint::autoresume_with(folder, AutoresumeOptions::default())?
            {
                builder = builder.restore(restore);
            }
        }
    }
    let mut trainer = builder.build()?;
    let report = if trainer.is_finished() {
        tracing::info!(at = %trainer.state().timestamp, "max_duration already reached; evaluating only");
        None
    } else {
        Some(trainer.fit()?)
    };
    let state = trainer.state();
    let metrics = if state.last_eval_batch == Some(state.timestamp.batch) {
        state.eval_metrics.clone()
    } else {
        trainer.eval()?
    };
    let val = metrics
        .get("val")
        .context("the validation evaluator returned no metrics")?;
    let loss = *val.get("loss").context("no validation loss")?;
    let generated = prompt.map(|p| {
        let model = trainer.model().valid();
        let new = model.generate(&p, &sampling, &gen_device);
        format!(
            "{}{}",
            split.tokenizer.decode(&p),
            split.tokenizer.decode(&new)
        )
    });
    let text_loss = metrics.get("text").and_then(|m| m.get("loss")).copied();
    let state = trainer.state();
    let ts = &state.timestamp;
    let train_seconds = report.as_ref().map_or(0.0, |r| r.wall.as_secs_f64());
    // Tokens trained on in this call (a resumed run counts from where it resumed).
    let tokens = report
        .as_ref()
        .map_or(0, |r| r.samples * args.seq_len as u64);
    let summary = json!({
        "val_loss": loss,
        "val_perplexity": loss.exp(),
        "val_bits_per_char": loss / std::f64::consts::LN_2,
        "val_accuracy": val.get("accuracy"),
        "val_tokens": val_tokens,
        "tokens_per_second": tokens as f64 / train_seconds.max(f64::MIN_POSITIVE),
        "train_seconds": train_seconds,
        "wall_seconds": started.elapsed().as_secs_f64(),
        "params_sha256": params_sha256::<B, _>(trainer.model()),
        "params": trainer.model().num_params(),
        "batches": ts.batch,
        // Batches trained by this process (fewer than `batches` when it resumed a run).
        "trained_batches": report.as_ref().map_or(0, |r| r.batches),
        "samples": ts.sample,
        "tokens": ts.token,
        "vocab": vocab,
        "train_works": split.works.0,
        "validation_works": split.works.1,
        "generated": generated,
        "text_loss": text_loss,
        "text_perplexity": text_loss.map(f64::exp),
        "text_bits_per_char": text_loss.map(|l| l / std::f64::consts::LN_2),
        "backend": args.backend,
        "seed": args.seed,
        "max_duration": state.max_duration.to_string(),
        "model": {
            "layers": args.layers, "heads": args.heads, "width": args.width,
            "context": args.context, "seq_len": args.seq_len, "tied": !args.untied,
        },
    });
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Some(text) = &generated {
        writeln!(stdout, "{text}").context("writing the generated text to stdout")?;
    }
    writeln!(stdout, "{summary}")
        .and_then(|_| stdout.flush())
        .context("writing the summary to stdout")?;
    Ok(())
}
