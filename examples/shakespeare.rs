//! Trains a GPT (`flashover_models::Gpt`) on the bundled Shakespeare corpus, character by
//! character, through the Flashover trainer: 38 works for training, Macbeth and The Winter's
//! Tale for validation (whole plays the model never sees a line of). The last stdout line is
//! a JSON summary: `val_loss` (nats per token), `val_perplexity`, `val_bits_per_char`,
//! `val_accuracy` (next character), `tokens_per_second`, `wall_seconds`, `params_sha256`.
//!
//! ```text
//! cargo run --release --example shakespeare -- --help
//! ```

// The summary is one `json!` literal with more fields than the macro's default recursion.
#![recursion_limit = "256"]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn::data::dataset::Dataset;
use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use clap::Parser;
use flashover::algorithms::recipes::recipe;
use flashover::algorithms::spec::{build_language_model, parse_list, AlgorithmSpec};
use flashover::callbacks::Generate;
use flashover::checkpoint::remote::Location;
use flashover::core::metric::{Accuracy, LossMetric, Perplexity};
use flashover::core::trainer::Evaluator;
use flashover::distributed::Distributed;
use flashover::models::{Gpt, GptConfig, Sampling, TrainBackend};
use flashover::prelude::*;
use flashover_examples::cli::{self, OptimizerKind, WithOptimizer};
use flashover_examples::shakespeare::{
    bigram_loss, bundled_shakespeare, rank_window_loader, read_text, ShakespeareSplit,
    TokenizerChoice, Windows,
};
use flashover_examples::tokenizer::{Tokenizer, TOKENIZER_FILE};
use flashover_examples::{session, MetricCurve};
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
    #[command(flatten)]
    run: cli::RunArgs<GptDefaults>,
    /// Tokens per training window (at most --context, or ALiBi's max_sequence_length).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Tokens per validation window (default: --seq-len). Longer than --context only with
    /// ALiBi: learned position embeddings stop at the context.
    #[arg(long)]
    eval_seq_len: Option<usize>,
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
    /// Activation checkpointing: the backward pass computes again what is cheap to compute
    /// (element-wise operations and the attention probabilities, through Burn's
    /// `BalancedCheckpointing`) instead of keeping it from the forward pass: less memory, a
    /// little more time, the same gradients bit for bit.
    #[arg(long)]
    activation_checkpointing: bool,
    /// The training step's kernels on the CPU backend: fast (the fast path's fused dense
    /// layers with GELU or the residual, layer norms, attention, cross-entropy and AdamW
    /// step) or burn (Burn's tensor ops and Burn's AdamW alone, for comparison; the same
    /// model and results to float32 rounding). Other backends always run Burn's.
    #[arg(long, value_enum, default_value_t = Kernels::Fast)]
    kernels: Kernels,
    #[command(flatten)]
    processes: cli::ProcessArgs,
    /// Report each rank's optimizer state in bytes (`optimizer_state_bytes_by_rank`), by
    /// serialising it as a checkpoint would, after the peak memory is read (the bench).
    #[arg(long, hide = true)]
    report_optimizer_state: bool,
    /// Evaluate on only the first N validation windows (default: all of them).
    #[arg(long)]
    val_windows: Option<usize>,
    /// Train on only the first N training windows.
    #[arg(long)]
    train_windows: Option<usize>,
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
    /// During training, continue the --generate-prompt texts this often (and at the end),
    /// logging them to the console, the JSONL log and TensorBoard (Composer's Generate
    /// callback), with --tokens, --temperature, --top-k and the run's seed.
    #[arg(long)]
    generate_every: Option<Time>,
    /// A prompt for --generate-every (repeatable; default: the --generate prompt, else
    /// "ROMEO:").
    #[arg(long)]
    generate_prompt: Vec<String>,
    /// Also score this text (plain or gzipped) with the model, at every evaluation: its loss,
    /// perplexity and bits per character go into the summary as `text_*`. Its characters
    /// must be among the training text's.
    #[arg(long)]
    eval_text: Option<PathBuf>,
    /// The corpus (gzipped or plain text with the bundled corpus's layout).
    #[arg(long, conflicts_with = "data")]
    corpus: Option<PathBuf>,
    /// The corpus from shards instead: a folder or `s3://bucket/prefix` holding an MDS or
    /// Parquet dataset of works with a `text` column, read in index order
    /// (`cargo xtask shards shakespeare <folder>` writes the bundled plays so).
    #[arg(long)]
    data: Option<String>,
    /// Tokens: char (one per distinct byte of the training text) or bpe (byte-level BPE
    /// learned from the training text, --bpe-vocab tokens). Saved as tokenizer.json beside
    /// the checkpoints of --save-folder; a folder whose tokenizer differs is refused.
    #[arg(long, value_enum, default_value_t = TokenizerKind::Char)]
    tokenizer: TokenizerKind,
    /// Vocabulary size of the BPE tokenizer (the 256 bytes and the merges learned).
    #[arg(long, default_value_t = 512)]
    bpe_vocab: usize,
}

/// The language job's defaults for the flags it shares with the other main jobs.
#[derive(Debug, Clone)]
struct GptDefaults;

impl cli::RunDefaults for GptDefaults {
    const MAX_DURATION: &'static str = "700ba";
    const MAX_DURATION_HELP: &'static str =
        "How long to train (ep, ba, sp or tok); the default takes about 5 minutes on two cores";
    const BATCH_SIZE: usize = 32;
    const BATCH_SIZE_HELP: &'static str = "Windows per batch (per optimizer step)";
    const MICROBATCH_HELP: &'static str = "Split each batch into microbatches of this many windows (gradient accumulation), or `auto` (see the mnist example)";
    const LR: f64 = 3e-3;
    const WEIGHT_DECAY: f32 = 0.01;
    const WARMUP: &'static str = "100ba";
    const SEED: u64 = 42;
    const EVAL_INTERVAL: &'static str = "350ba";
    const EVAL_INTERVAL_HELP: &'static str =
        "Evaluate on the validation plays this often (and at the end)";
    const LOG_EVERY: u64 = 50;
    const RECIPE_HELP: &'static str =
        "A preset stack of speed-up algorithms with its scale-schedule ratio: gpt-mild, gpt-medium or gpt-hot";
    const IMAGE: bool = false;
}

/// The kernels a CPU run uses (`--kernels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Kernels {
    /// The fast path's (flex only; other backends run Burn's).
    Fast,
    /// Burn's tensor ops.
    Burn,
}

/// The tokenizers offered.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TokenizerKind {
    /// One token per distinct byte.
    Char,
    /// Byte-level BPE.
    Bpe,
}

fn main() {
    // Log lines on stderr, coloured only on a terminal (never ANSI codes in a log file).
    flashover::init_logging();
    let args = Args::parse();
    let dist = match args.processes.join() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {}", flashover::core::error::report(e.as_ref()));
            std::process::exit(1);
        }
    };
    match flashover_examples::with_backend!(
        args.run.backend.as_str(),
        checkpointing = args.activation_checkpointing,
        run(&args, &dist)
    ) {
        // Waits for every process, then MPI shuts down as `dist` is dropped.
        Ok(()) => dist.finish(None),
        Err(e) => cli::exit_with_error(&dist, &e),
    }
}

/// What the run uses besides the model and the optimizer, prepared before either is built.
struct Prepared {
    split: ShakespeareSplit,
    config: GptConfig,
    algorithms: Vec<AlgorithmSpec>,
    scale_schedule_ratio: f64,
    prompt: Option<Vec<u16>>,
    sampling: Sampling,
    eval_seq_len: usize,
    text: Option<(PathBuf, Vec<u16>)>,
    started: Instant,
}

/// The longest input the model takes once the algorithms have run: ALiBi's
/// `max_sequence_length` (8192 by default) when it is among them, else the context.
fn longest_input(algorithms: &[AlgorithmSpec], context: usize) -> anyhow::Result<usize> {
    let Some(alibi) = algorithms.iter().find(|a| a.name == "alibi") else {
        return Ok(context);
    };
    match alibi
        .params
        .iter()
        .rev()
        .find(|(k, _)| k == "max_sequence_length")
    {
        None => Ok(flashover::algorithms::alibi::AlibiOptions::default().max_sequence_length),
        Some((_, v)) => v
            .parse()
            .with_context(|| format!("alibi:max_sequence_length={v}: expected an integer")),
    }
}

fn run<B: TrainBackend>(args: &Args, dist: &Distributed) -> anyhow::Result<()> {
    let started = Instant::now();
    args.run.logs.check()?;
    for (flag, value) in [
        ("--val-windows", args.val_windows),
        ("--train-windows", args.train_windows),
    ] {
        if value == Some(0) {
            anyhow::bail!(
                "invalid value 0 for {flag}: expected at least 1 window (leave the flag out for all of them)"
            );
        }
    }
    let mut algorithms = Vec::new();
    let mut scale_schedule_ratio = 1.0;
    if let Some(name) = &args.run.recipe {
        let r = recipe(name)?;
        algorithms = r.specs();
        scale_schedule_ratio = r.scale_schedule_ratio;
    }
    algorithms.extend(parse_list(&args.run.algorithms)?);
    if let Some(ssr) = args.run.scale_schedule_ratio {
        scale_schedule_ratio = ssr;
    }
    let longest = longest_input(&algorithms, args.context)?;
    let eval_seq_len = args.eval_seq_len.unwrap_or(args.seq_len);
    for (flag, len) in [
        ("--seq-len", args.seq_len),
        ("--eval-seq-len", eval_seq_len),
    ] {
        if len == 0 || len > longest {
            if longest == args.context {
                anyhow::bail!(
                    "{flag} {len} must be between 1 and --context {}: the model's learned position embeddings stop there (with --algorithms alibi it reads longer inputs)",
                    args.context
                );
            }
            anyhow::bail!(
                "{flag} {len} must be between 1 and ALiBi's max_sequence_length {longest}"
            );
        }
    }
    let sampling = Sampling {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.run.seed,
    };
    sampling.check().map_err(|e| {
        named_flag(
            e,
            &[
                ("tokens", "--tokens"),
                ("temperature", "--temperature"),
                ("top_k", "--top-k"),
            ],
        )
    })?;
    let path = args.corpus.clone().unwrap_or_else(bundled_shakespeare);
    let choice = match args.tokenizer {
        TokenizerKind::Char => TokenizerChoice::Char,
        TokenizerKind::Bpe => TokenizerChoice::Bpe(args.bpe_vocab),
    };
    let split = match &args.data {
        Some(location) => ShakespeareSplit::load_shards_with(location, choice)?,
        None => ShakespeareSplit::load_with(&path, choice)?,
    };
    // The checkpoints of a folder were trained with one tokenizer: kept beside them, and
    // compared on every later run and on --load.
    if let Some(folder) = &args.run.checkpoint.local_folder()? {
        split.tokenizer.keep_beside(folder)?;
    }
    // (A checkpoint loaded from an object store has no tokenizer beside it: not checked.)
    if let Some(Location::Local(given)) = &args.run.checkpoint.load_location()? {
        let dir = &flashover::checkpoint::resolve_checkpoint(given);
        let beside = [
            dir.join(TOKENIZER_FILE),
            dir.join("..").join(TOKENIZER_FILE),
        ];
        match beside.iter().find(|p| p.exists()) {
            Some(saved) => split.tokenizer.check_against(saved)?,
            None => {
                tracing::warn!(checkpoint = %dir.display(), "no {TOKENIZER_FILE} beside the checkpoint: its vocabulary cannot be checked")
            }
        }
    }
    // The prompts are checked before training, not found untokenizable after it.
    let encode = |flag: &str, text: &str| -> anyhow::Result<Vec<u16>> {
        if text.is_empty() {
            anyhow::bail!("{flag} needs a prompt of at least one character");
        }
        split
            .tokenizer
            .encode(text.as_bytes())
            .map_err(|e| anyhow::anyhow!("{flag} {text:?}: {e}"))
    };
    let prompt = match &args.generate {
        Some(text) => Some(encode("--generate", text)?),
        None => None,
    };
    for p in &args.generate_prompt {
        encode("--generate-prompt", p)?;
    }
    // The extra text is read and tokenized before training, not found unreadable after it.
    let text = match &args.eval_text {
        None => None,
        Some(path) => {
            let bytes = read_text(path)?;
            let tokens = split
                .tokenizer
                .encode(&bytes)
                .map_err(|e| anyhow::anyhow!("--eval-text {}: {e}", path.display()))?;
            Some((path.clone(), tokens))
        }
    };
    let vocab = split.tokenizer.vocab_size();
    let config = GptConfig::new(vocab, args.context, args.layers, args.heads, args.width)
        .map_err(|e| {
            named_flag(
                e,
                &[
                    ("context", "--context"),
                    ("layers", "--layers"),
                    ("heads", "--heads"),
                    ("width", "--width"),
                    ("vocab", "--bpe-vocab"),
                ],
            )
        })?
        .with_tied_weights(!args.untied);
    // A shape that cannot fit is refused here, not met as an allocation abort.
    let copies = match args.run.optimizer {
        OptimizerKind::Adamw | OptimizerKind::Adam => 4,
        OptimizerKind::Sgd => 3,
    };
    let logits = (args.run.batch_size as u128)
        .saturating_mul(args.seq_len as u128)
        .saturating_mul(vocab as u128);
    let host = matches!(args.run.backend.as_str(), "flex" | "ndarray");
    flashover_examples::fits::check_fits(
        &format!(
            "--width {} with --layers {}, --context {} and a {vocab}-token vocabulary",
            args.width, args.layers, args.context
        ),
        &format!(
            "its {} parameters, their gradients and {}'s state, with one batch's logits,",
            config.num_params(),
            args.run.optimizer.name()
        ),
        flashover_examples::fits::least_training_bytes(config.num_params(), copies, logits),
        if host {
            flashover_examples::fits::available_host_memory()
        } else {
            None
        },
    )?;
    let device = B::Device::default();
    let mut model = config.init::<B>(&device, args.run.seed);
    model.burn_ops = args.kernels == Kernels::Burn;
    let prepared = Prepared {
        split,
        config,
        algorithms,
        scale_schedule_ratio,
        prompt,
        sampling,
        eval_seq_len,
        text,
        started,
    };
    let job = Job {
        args,
        prepared,
        dist,
    };
    cli::with_optimizer(
        args.run.optimizer,
        args.run.weight_decay,
        args.run.momentum,
        args.kernels == Kernels::Fast,
        model,
        job,
    )
}

/// The training run once `--optimizer` is built.
struct Job<'a> {
    args: &'a Args,
    prepared: Prepared,
    dist: &'a Distributed,
}

impl<B: TrainBackend> WithOptimizer<B, Gpt<B>> for Job<'_> {
    type Output = anyhow::Result<()>;

    fn run<O: Optimizer<Gpt<B>, B> + 'static>(self, model: Gpt<B>, optimizer: O) -> Self::Output {
        train(self.args, self.prepared, model, optimizer, self.dist)
    }
}

/// The continuation of `prompt` by the model, for the Generate callback.
fn generator<B: TrainBackend>(
    tokenizer: Tokenizer,
    sampling: Sampling,
    device: B::Device,
) -> flashover::callbacks::GenerateFn<Gpt<B>> {
    Box::new(move |model: &Gpt<B>, prompt: &str| {
        let ids = tokenizer
            .encode(prompt.as_bytes())
            .map_err(|e| e.to_string())?;
        let new = model
            .valid()
            .generate(&ids, &sampling, &device)
            .map_err(|e| e.to_string())?;
        Ok(tokenizer.decode(&new))
    })
}

/// A model error as a flag error: the setting's flag (from `flags`, setting name to flag)
/// first, then the model's own message.
fn named_flag(e: flashover::models::ModelError, flags: &[(&str, &str)]) -> anyhow::Error {
    match &e {
        flashover::models::ModelError::Config { name, value, .. } => {
            match flags.iter().find(|(setting, _)| setting == name) {
                Some((_, flag)) => anyhow::anyhow!("{flag} {value}: {e}"),
                None => anyhow::anyhow!("{e}"),
            }
        }
        _ => anyhow::anyhow!("{e}"),
    }
}

fn train<B: TrainBackend, O: Optimizer<Gpt<B>, B> + 'static>(
    args: &Args,
    p: Prepared,
    model: Gpt<B>,
    optimizer: O,
    dist: &Distributed,
) -> anyhow::Result<()> {
    let device = B::Device::default();
    let world = dist.world();
    let main = world.is_main();
    let data = Data::<B>::load(args, &p, &device, world)?;
    let curve = MetricCurve::of("val", "loss");
    let mut builder = Trainer::builder(
        model,
        optimizer,
        data.train,
        args.run.max_duration,
        device.clone(),
    )
    .lr(args.run.lr)
    .scheduler(cli::scheduler(args.run.schedule, args.run.warmup))
    .scale_schedule_ratio(p.scale_schedule_ratio)
    .seed(args.run.seed)
    .eval_interval(args.run.eval_interval)
    .skip_nonfinite_loss(args.run.skip_nonfinite_loss)
    .precision(args.run.precision)
    .callback(curve.clone())
    .hyperparameter("model", format!("{:?}", p.config))
    .sharding(args.processes.sharding)
    .boxed_collective(dist.collective(device.clone())?);
    for evaluator in data.evaluators {
        builder = builder.evaluator(evaluator);
    }
    match args.run.microbatch_size {
        Some(cli::MicrobatchSize::Fixed(mb)) => builder = builder.microbatch_size(mb),
        Some(cli::MicrobatchSize::Auto) => builder = builder.auto_microbatching(true),
        None => {}
    }
    for spec in &p.algorithms {
        builder = builder.boxed_algorithm(build_language_model(spec)?);
    }
    if !p.algorithms.is_empty() {
        let names: Vec<String> = p.algorithms.iter().map(|a| a.to_string()).collect();
        builder = builder.hyperparameter("algorithm_specs", names);
    }
    if let Some(generate) = generation::<B>(args, &p, &device)? {
        builder = builder.callback(generate);
    }
    let builder = session::attach(&args.run, builder)?;
    let (restore, resuming) = args.run.checkpoint.restore_on(dist)?;
    let (builder, outputs) =
        session::observe(&args.run, builder, &device, None, restore, resuming, main)?;
    let mut trainer = builder.build()?;
    let tokens_before = trainer.state().timestamp().token;
    let report = session::fit_unless_done(&mut trainer)?;
    // A run that only evaluates (resumed at its end) evaluates afresh: its evaluation
    // settings (--eval-seq-len, --eval-text) may differ from the ones saved with the metrics.
    let metrics = session::final_metrics(&mut trainer, report.is_some())?;
    // The prompt and settings were checked before training.
    let generated = match p.prompt.as_ref() {
        None => None,
        Some(prompt) => {
            let new = trainer
                .model()
                .valid()
                .generate(prompt, &p.sampling, &device)?;
            let (prompt, new) = (
                p.split.tokenizer.decode(prompt),
                p.split.tokenizer.decode(&new),
            );
            Some(format!("{prompt}{new}"))
        }
    };
    // Every rank's digest and optimizer state: the ranks must hold the same weights, and a
    // sharded rank only its share of the state.
    let digests = dist.all_gather_text(&params_sha256::<B, _>(trainer.model()))?;
    let peak = flashover::callbacks::monitors::process_memory().map_or(0, |(_, peak)| peak);
    let peaks = dist.all_gather_text(&peak.to_string())?;
    let optimizer_bytes = match args.report_optimizer_state {
        true => flashover_examples::optimizer_state_bytes::<B, Gpt<B>, O>(trainer.state())?,
        false => 0,
    };
    let optimizer_bytes = dist.all_gather_text(&optimizer_bytes.to_string())?;
    if !main {
        return Ok(());
    }
    let mut summary = summary(
        args,
        &p,
        &data.measures,
        &trainer,
        report.as_ref(),
        &metrics,
        tokens_before,
        &curve,
        &generated,
    )?;
    let numbers = |v: &[String]| -> Vec<u64> { v.iter().map(|b| b.parse().unwrap_or(0)).collect() };
    summary["world_size"] = json!(world.size);
    summary["sharding"] = json!(if trainer.state().is_sharded() {
        args.processes.sharding.name()
    } else {
        "no_shard"
    });
    summary["params_sha256_by_rank"] = json!(digests);
    summary["optimizer_state_bytes_by_rank"] = json!(numbers(&optimizer_bytes));
    summary["peak_rss_bytes_by_rank"] = json!(numbers(&peaks));
    outputs.finish(trainer, &summary, None)?;
    session::print(generated.as_deref(), &summary)
}

/// --generate-every's callback: the prompts (--generate-prompt, else --generate, else
/// `ROMEO:`) continued every so often during training.
fn generation<B: TrainBackend>(
    args: &Args,
    p: &Prepared,
    device: &B::Device,
) -> anyhow::Result<Option<Generate<Gpt<B>>>> {
    let Some(every) = args.generate_every else {
        return Ok(None);
    };
    let prompts = if !args.generate_prompt.is_empty() {
        args.generate_prompt.clone()
    } else {
        vec![args.generate.clone().unwrap_or_else(|| "ROMEO:".into())]
    };
    let f = generator::<B>(
        p.split.tokenizer.clone(),
        p.sampling.clone(),
        device.clone(),
    );
    Ok(Some(Generate::new(prompts, every, f)?))
}

/// The training windows and the evaluators: validation, and --eval-text's when given.
struct Data<B: TrainBackend> {
    train: DataLoader<B, Vec<u16>, TokenBatch<B>>,
    evaluators: Vec<Evaluator<B, Gpt<B>>>,
    measures: Measures,
}

/// What the summary converts losses with.
struct Measures {
    /// Tokens the validation evaluator scores.
    val_tokens: usize,
    /// Bytes of text per scored validation token.
    val_bytes_per_token: f64,
    /// The same for --eval-text.
    text_bytes_per_token: Option<f64>,
}

impl<B: TrainBackend> Data<B> {
    /// `--batch-size` is the global batch: each of `world`'s ranks reads its share of every
    /// batch of training windows, and evaluates its share of the validation windows (the
    /// metrics are summed over ranks).
    fn load(
        args: &Args,
        p: &Prepared,
        device: &B::Device,
        world: flashover::core::state::World,
    ) -> anyhow::Result<Self> {
        let batch = flashover::distributed::per_rank("batch_size", args.run.batch_size, world)?;
        let train = rank_window_loader::<B>(
            "shakespeare-train",
            Windows::over(p.split.train.clone(), args.seq_len, args.train_windows),
            batch,
            true,
            args.run.seed,
            device,
            world,
        )?
        .with_prefetch(args.run.prefetch)?;
        let val_windows =
            Windows::over(p.split.validation.clone(), p.eval_seq_len, args.val_windows);
        let measures = Measures {
            val_tokens: val_windows.len() * p.eval_seq_len,
            val_bytes_per_token: bytes_per_target(
                &p.split.tokenizer,
                &p.split.validation,
                p.eval_seq_len,
                val_windows.len(),
            ),
            text_bytes_per_token: p.text.as_ref().map(|(_, tokens)| {
                let windows = tokens.len().saturating_sub(1) / p.eval_seq_len;
                bytes_per_target(&p.split.tokenizer, tokens, p.eval_seq_len, windows)
            }),
        };
        let metrics = || -> Vec<Box<dyn flashover::core::metric::Metric<_>>> {
            vec![
                Box::new(LossMetric::default()),
                Box::new(Accuracy::default()),
                Box::new(Perplexity::default()),
            ]
        };
        let seed = args.run.seed;
        let val = rank_window_loader::<B::InnerBackend>(
            "shakespeare-validation",
            val_windows,
            batch,
            false,
            seed,
            device,
            world,
        )?;
        let mut evaluators = vec![Evaluator::new("val", val, metrics())];
        if let Some((path, tokens)) = &p.text {
            let windows = Windows::over(Arc::new(tokens.clone()), p.eval_seq_len, None);
            let name = path.display().to_string();
            let loader = rank_window_loader::<B::InnerBackend>(
                &name, windows, batch, false, seed, device, world,
            )
            .with_context(|| format!("--eval-text {}", path.display()))?;
            evaluators.push(Evaluator::new("text", loader, metrics()));
        }
        Ok(Self {
            train,
            evaluators,
            measures,
        })
    }
}

/// The summary line.
#[allow(clippy::too_many_arguments)]
fn summary<B: TrainBackend, O: Optimizer<Gpt<B>, B>>(
    args: &Args,
    p: &Prepared,
    m: &Measures,
    trainer: &Trainer<SetupOf<B, Gpt<B>, O>>,
    report: Option<&FitReport>,
    metrics: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, f64>>,
    tokens_before: u64,
    curve: &MetricCurve,
    generated: &Option<String>,
) -> anyhow::Result<serde_json::Value> {
    let val = metrics
        .get("val")
        .context("the validation evaluator returned no metrics")?;
    let loss = *val.get("loss").context("no validation loss")?;
    let text_loss = metrics.get("text").and_then(|m| m.get("loss")).copied();
    let state = trainer.state();
    let ts = state.timestamp();
    let train_seconds = report.map_or(0.0, |r| r.wall.as_secs_f64());
    // Tokens trained on in this call (a resumed run counts from where it resumed).
    // (Counted by the trainer: the tokens actually trained on, whatever ALiBi or
    // sequence-length warmup made of the windows.)
    let tokens = ts.token - tokens_before;
    let per_char = matches!(p.split.tokenizer, Tokenizer::Char(_));
    Ok(json!({
        "val_loss": loss,
        // The library's metric: exp of the mean over every scored token.
        "val_perplexity": val.get("perplexity"),
        "val_bits_per_char": per_char.then(|| loss / std::f64::consts::LN_2),
        // Bits per byte of text: comparable between tokenizers.
        "val_bits_per_byte": loss / std::f64::consts::LN_2 / m.val_bytes_per_token,
        "val_bytes_per_token": m.val_bytes_per_token,
        "val_accuracy": val.get("accuracy"),
        "val_tokens": m.val_tokens,
        "eval_seq_len": p.eval_seq_len,
        "tokens_per_second": tokens as f64 / train_seconds.max(f64::MIN_POSITIVE),
        "train_seconds": train_seconds,
        "wall_seconds": p.started.elapsed().as_secs_f64(),
        "params_sha256": params_sha256::<B, _>(trainer.model()),
        "params": trainer.model().num_params(),
        "activation_checkpointing": args.activation_checkpointing,
        // The kernels that ran: the fast path's only on a backend that has them.
        "kernels": if B::CHANNELS_LAST_IS_FAST && !trainer.model().burn_ops { "fast" } else { "burn" },
        // Peak resident memory of the process so far (Linux; null elsewhere).
        "peak_rss_bytes": flashover::callbacks::monitors::process_memory().map(|(_, peak)| peak),
        "batches": ts.batch,
        // Batches trained by this process (fewer than `batches` when it resumed a run).
        "trained_batches": report.map_or(0, |r| r.batches),
        "samples": ts.sample,
        "tokens": ts.token,
        "skipped_batches": state.skipped_batches(),
        "vocab": p.split.tokenizer.vocab_size(),
        // The count-based bigram model's validation loss, the reference of the README.
        "bigram_val_loss": bigram_loss(
            &p.split.train,
            &p.split.validation,
            p.split.tokenizer.vocab_size()
        ),
        "tokenizer": p.split.tokenizer.describe(),
        "train_works": p.split.works.0,
        "validation_works": p.split.works.1,
        "generated": generated,
        "text_loss": text_loss,
        "text_perplexity": metrics.get("text").and_then(|m| m.get("perplexity")),
        "text_bits_per_char": text_loss.filter(|_| per_char).map(|l| l / std::f64::consts::LN_2),
        "text_bits_per_byte": text_loss
            .zip(m.text_bytes_per_token)
            .map(|(l, b)| l / std::f64::consts::LN_2 / b),
        "backend": args.run.backend,
        "seed": args.run.seed,
        "optimizer": args.run.optimizer.name(),
        "max_duration": state.max_duration().to_string(),
        "recipe": args.run.recipe,
        "algorithms": p.algorithms.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        "scale_schedule_ratio": p.scale_schedule_ratio,
        "val_curve": curve.points(),
        "stopped": report.and_then(|r| r.stopped.clone()),
        "model": {
            "layers": args.layers, "heads": args.heads, "width": args.width,
            "context": args.context, "seq_len": args.seq_len, "tied": !args.untied,
        },
    }))
}

/// Bytes of text per scored token over the first `windows` windows of `seq_len` tokens of
/// `tokens` (their targets: positions 1 to `seq_len` of each window), so that a loss per
/// token converts to a loss per byte.
fn bytes_per_target(tokenizer: &Tokenizer, tokens: &[u16], seq_len: usize, windows: usize) -> f64 {
    let bytes: usize = (0..windows)
        .flat_map(|w| &tokens[w * seq_len + 1..=w * seq_len + seq_len])
        .map(|&t| tokenizer.token_len(t))
        .sum();
    bytes as f64 / (windows * seq_len).max(1) as f64
}
