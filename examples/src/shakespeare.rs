//! The bundled Shakespeare text for language models: the corpus reader, its split into
//! training and validation text by whole works ([`ShakespeareSplit`]), a character tokenizer
//! ([`CharTokenizer`]), a dataset of fixed-length windows, a batcher to [`TokenBatch`], and a
//! small per-character model ([`CharLm`], a bigram model: it sees one character) for the
//! token-batch algorithms' tests. The GPT itself is `flashover_models::Gpt`.

use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, Relu};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use flashover::core::data::{DataLoader, Sampler};
use flashover::core::error::CoreError;
use flashover::core::loss::cross_entropy;
use flashover::core::model::{ClassificationOutput, EvalModel, TokenBatch, TrainModel};
use flashover::core::params::init_model;
use flashover::core::state::World;
use flashover::core::Result;

pub use crate::tokenizer::CharTokenizer;
use crate::tokenizer::{BpeTokenizer, Tokenizer};

/// The bundled corpus (gzipped ASCII), relative to the workspace.
pub fn bundled_shakespeare() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("data")
        .join("shakespeare")
        .join("plays.txt.gz")
}

/// A text as token ids, one per distinct byte.
#[derive(Debug, Clone)]
pub struct CharCorpus {
    /// The distinct bytes, sorted; a token id indexes this.
    pub vocab: Vec<u8>,
    /// The text as token ids.
    pub tokens: Arc<Vec<u16>>,
}

impl CharCorpus {
    /// Reads a gzipped text file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        if text.len() < 2 {
            return Err(CoreError::MalformedData {
                path: path.to_path_buf(),
                reason: format!("{} bytes of text; at least 2 are needed", text.len()),
            });
        }
        let tokenizer = CharTokenizer::fit(&text);
        // Invariant: the tokenizer was fitted on this text, so every byte is in it.
        let tokens = tokenizer.encode(&text).expect("fitted on this text");
        Ok(CharCorpus {
            vocab: tokenizer.vocab,
            tokens: Arc::new(tokens),
        })
    }
}

/// The text of `path`: gunzipped when it starts with gzip's magic bytes, else as it is.
pub fn read_text(path: &Path) -> Result<Vec<u8>> {
    let io = |source| CoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let raw = std::fs::read(path).map_err(io)?;
    if !raw.starts_with(&[0x1f, 0x8b]) {
        return Ok(raw);
    }
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(raw.as_slice())
        .read_to_end(&mut text)
        .map_err(io)?;
    Ok(text)
}

/// The line under each work's title in the bundled corpus.
const BYLINE: &[u8] = b"by William Shakespeare";

/// The works held out for validation: two plays, 5.3% of the text (256 kB of 4.84 MB), so
/// that the validation loss measures plays the model has not seen a line of.
pub const VALIDATION_WORKS: &[&str] = &["MACBETH", "THE WINTER'S TALE"];

/// One work of the corpus: its title and its byte range (from its title line to the next
/// work's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Work {
    /// The title line.
    pub title: String,
    /// Its bytes in the corpus.
    pub range: Range<usize>,
}

/// The works of the bundled corpus, in order: each starts at the title line above a
/// "by William Shakespeare" line (one blank line may sit between them).
pub fn works(text: &[u8]) -> Vec<Work> {
    let mut lines = Vec::new();
    let mut at = 0;
    for line in text.split(|&b| b == b'\n') {
        lines.push((at, line));
        at += line.len() + 1;
    }
    let mut starts: Vec<(usize, String)> = Vec::new();
    for (i, &(_, line)) in lines.iter().enumerate() {
        if line != BYLINE {
            continue;
        }
        let title = lines[..i].iter().rev().take(2).find(|(_, l)| !l.is_empty());
        if let Some(&(start, title)) = title {
            starts.push((start, String::from_utf8_lossy(title).into_owned()));
        }
    }
    (0..starts.len())
        .map(|k| Work {
            title: starts[k].1.clone(),
            range: starts[k].0..starts.get(k + 1).map_or(text.len(), |s| s.0),
        })
        .collect()
}

/// Which tokenizer a split uses, learned from its training text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerChoice {
    /// One token per distinct byte.
    Char,
    /// Byte-level BPE with this many tokens (at most: merges stop when no pair repeats).
    Bpe(usize),
}

/// The corpus as training and validation tokens, split by whole works
/// ([`VALIDATION_WORKS`] are the validation text), with a tokenizer learned from the
/// training text (characters by default).
#[derive(Debug, Clone)]
pub struct ShakespeareSplit {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The training works, concatenated in corpus order.
    pub train: Arc<Vec<u16>>,
    /// The validation works, concatenated in corpus order.
    pub validation: Arc<Vec<u16>>,
    /// How many works each side has.
    pub works: (usize, usize),
}

impl ShakespeareSplit {
    /// Reads and splits the corpus at `path` (the bundled one: [`bundled_shakespeare`]),
    /// with the character tokenizer.
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, TokenizerChoice::Char)
    }

    /// Reads and splits the corpus at `path` with the tokenizer `choice` names.
    pub fn load_with(path: &Path, choice: TokenizerChoice) -> Result<Self> {
        let text = read_text(path)?;
        Self::split(&text, path, choice)
    }

    /// Reads the corpus from shards (`cargo xtask shards shakespeare` writes them: one sample
    /// per work, its `text`), in index order, and splits it as [`ShakespeareSplit::load_with`]
    /// does. The works are read whole into memory: the model trains on windows of the whole
    /// token sequence.
    pub fn load_shards_with(location: &str, choice: TokenizerChoice) -> Result<Self> {
        let bad = |e: String| CoreError::config("data", location, e);
        let options = flashover::streaming::StreamingOptions {
            shuffle: false,
            ..Default::default()
        };
        let data = flashover::streaming::StreamingDataset::open(location, options)
            .map_err(|e| bad(e.to_string()))?;
        let mut text = Vec::new();
        for i in 0..data.len() {
            let sample = data.get(i).map_err(|e| bad(e.to_string()))?;
            text.extend_from_slice(sample.str("text").map_err(&bad)?.as_bytes());
        }
        Self::split(&text, Path::new(location), choice)
    }

    fn split(text: &[u8], path: &Path, choice: TokenizerChoice) -> Result<Self> {
        let malformed = |reason: String| CoreError::MalformedData {
            path: path.to_path_buf(),
            reason,
        };
        let all = works(text);
        let missing: Vec<&&str> = VALIDATION_WORKS
            .iter()
            .filter(|v| !all.iter().any(|w| w.title == **v))
            .collect();
        if all.is_empty() || !missing.is_empty() {
            return Err(malformed(format!(
                "expected the bundled Shakespeare corpus: {} works found (titles above a \"by William Shakespeare\" line), missing the validation works {missing:?}",
                all.len()
            )));
        }
        let (mut train, mut validation) = (Vec::new(), Vec::new());
        let (mut n_train, mut n_val) = (0, 0);
        for w in &all {
            if VALIDATION_WORKS.contains(&w.title.as_str()) {
                validation.extend_from_slice(&text[w.range.clone()]);
                n_val += 1;
            } else {
                train.extend_from_slice(&text[w.range.clone()]);
                n_train += 1;
            }
        }
        let tokenizer = match choice {
            TokenizerChoice::Char => Tokenizer::Char(CharTokenizer::fit(&train)),
            TokenizerChoice::Bpe(size) => {
                tracing::info!(
                    tokens = size,
                    training_bytes = train.len(),
                    "learning the byte-level BPE on the training works"
                );
                Tokenizer::Bpe(BpeTokenizer::train(&train, size).map_err(|e| {
                    CoreError::External {
                        component: "tokenizer".into(),
                        source: e.into(),
                    }
                })?)
            }
        };
        let encode = |t: &[u8], what: &str| {
            tokenizer
                .encode(t)
                .map_err(|e| malformed(format!("the {what} text: {e}")))
        };
        Ok(Self {
            train: Arc::new(encode(&train, "training")?),
            validation: Arc::new(encode(&validation, "validation")?),
            tokenizer,
            works: (n_train, n_val),
        })
    }
}

/// Non-overlapping windows of `seq_len + 1` tokens (inputs and next-token targets).
#[derive(Debug, Clone)]
pub struct Windows {
    tokens: Arc<Vec<u16>>,
    seq_len: usize,
    count: usize,
}

impl Windows {
    /// The first `limit` windows (all that fit when `None`).
    pub fn new(corpus: &CharCorpus, seq_len: usize, limit: Option<usize>) -> Self {
        Self::over(corpus.tokens.clone(), seq_len, limit)
    }

    /// The first `limit` windows of `tokens` (all that fit when `None`).
    pub fn over(tokens: Arc<Vec<u16>>, seq_len: usize, limit: Option<usize>) -> Self {
        let fit = tokens.len().saturating_sub(1) / seq_len.max(1);
        Windows {
            tokens,
            seq_len,
            count: limit.map_or(fit, |l| l.min(fit)),
        }
    }
}

impl Dataset<Vec<u16>> for Windows {
    fn get(&self, index: usize) -> Option<Vec<u16>> {
        (index < self.count).then(|| {
            let s = index * self.seq_len;
            self.tokens[s..s + self.seq_len + 1].to_vec()
        })
    }

    fn len(&self) -> usize {
        self.count
    }
}

/// Stacks windows into a [`TokenBatch`]: tokens are a window's first `seq_len`, targets the
/// same shifted by one.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenBatcher;

impl<B: Backend> Batcher<B, Vec<u16>, TokenBatch<B>> for TokenBatcher {
    fn batch(&self, items: Vec<Vec<u16>>, device: &B::Device) -> TokenBatch<B> {
        let n = items.len();
        let t = items.first().map_or(0, |w| w.len() - 1);
        let mut x = Vec::with_capacity(n * t);
        let mut y = Vec::with_capacity(n * t);
        for w in &items {
            x.extend(w[..t].iter().map(|&v| v as i64));
            y.extend(w[1..].iter().map(|&v| v as i64));
        }
        TokenBatch::new(
            Tensor::from_data(TensorData::new(x, [n, t]), device),
            Tensor::from_data(TensorData::new(y, [n, t]), device),
        )
    }
}

/// A shuffled loader of `batch_size` windows of `seq_len` tokens.
pub fn token_loader<B: Backend>(
    corpus: &CharCorpus,
    seq_len: usize,
    batch_size: usize,
    limit: Option<usize>,
    seed: u64,
    device: &B::Device,
) -> Result<DataLoader<B, Vec<u16>, TokenBatch<B>>> {
    window_loader(
        "shakespeare",
        Windows::new(corpus, seq_len, limit),
        batch_size,
        true,
        seed,
        device,
    )
}

/// A loader of `batch_size` of `windows` at a time, in a seeded shuffled order when
/// `shuffle` (through the trainer's sampler, so resumption is exact without replaying data).
pub fn window_loader<B: Backend>(
    name: &str,
    windows: Windows,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    device: &B::Device,
) -> Result<DataLoader<B, Vec<u16>, TokenBatch<B>>> {
    rank_window_loader(
        name,
        windows,
        batch_size,
        shuffle,
        seed,
        device,
        World::default(),
    )
}

/// [`window_loader`] for rank `world.rank` of a data-parallel run: a shuffled (training)
/// order is shared out padded to equal shares (every rank takes the same number of steps),
/// an unshuffled (evaluation) one exactly, so no window is scored twice.
pub fn rank_window_loader<B: Backend>(
    name: &str,
    windows: Windows,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    device: &B::Device,
    world: World,
) -> Result<DataLoader<B, Vec<u16>, TokenBatch<B>>> {
    if windows.len() == 0 {
        return Err(CoreError::MalformedData {
            path: PathBuf::from(name),
            reason: format!(
                "{} tokens hold no window of {} tokens and its next-token target",
                windows.tokens.len(),
                windows.seq_len + 1
            ),
        });
    }
    let sampler = Sampler::new(windows.len(), batch_size, shuffle, seed)?;
    let sampler = match shuffle {
        true => sampler.sharded(world.rank, world.size)?,
        false => sampler.sharded_exact(world.rank, world.size)?,
    };
    DataLoader::new(
        name,
        Arc::new(windows),
        Arc::new(TokenBatcher),
        sampler,
        device.clone(),
    )
}

/// A small next-character model: embedding, one hidden layer, vocabulary logits per position.
#[derive(Module, Debug)]
pub struct CharLm<B: Backend> {
    embed: Embedding<B>,
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> CharLm<B> {
    /// A model for `vocab` tokens with `width` hidden units, drawn from `seed`.
    pub fn new(device: &B::Device, vocab: usize, width: usize, seed: u64) -> Self {
        init_model::<B, _>(device, seed, |d| CharLm {
            embed: EmbeddingConfig::new(vocab, width).init(d),
            hidden: LinearConfig::new(width, width).init(d),
            out: LinearConfig::new(width, vocab).init(d),
            relu: Relu::new(),
        })
    }

    /// Logits `[batch * seq, vocab]` for tokens `[batch, seq]`.
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        let [b, t] = tokens.dims();
        let h = self.embed.forward(tokens);
        let h = self.relu.forward(self.hidden.forward(h));
        let v = self.out.forward(h);
        let vocab = v.dims()[2];
        v.reshape([b * t, vocab])
    }
}

impl<B: AutodiffBackend> TrainModel<B> for CharLm<B> {
    type Batch = TokenBatch<B>;
    type Output = Tensor<B, 2>;

    fn forward(&self, batch: &TokenBatch<B>) -> Tensor<B, 2> {
        self.logits(batch.tokens.clone())
    }

    fn loss(&self, logits: &Tensor<B, 2>, batch: &TokenBatch<B>) -> Tensor<B, 1> {
        cross_entropy(logits.clone(), batch.flat_targets())
    }
}

impl<B: Backend> EvalModel<B> for CharLm<B> {
    type Batch = TokenBatch<B>;
    type Output = ClassificationOutput<B>;

    fn forward_eval(&self, batch: &TokenBatch<B>) -> ClassificationOutput<B> {
        ClassificationOutput::scored(self.logits(batch.tokens.clone()), batch.flat_targets())
    }
}

/// The validation loss (nats per token) of the count-based bigram model of `train`: the next
/// token's probability given the current one is its count after it, smoothed towards the
/// training text's token frequencies with weight one token (`p(b|a) = (c(a, b) + p(b)) /
/// (c(a) + 1)`, `p(b)` add-one smoothed), averaged over every consecutive pair of `eval`. No
/// model that sees one token of context (the `CharLm` here, at any training time) does much
/// better: this is the reference the GPT is measured against.
///
/// The pair counts are kept sparse (only the pairs the text holds), so the cost grows with
/// the training text, not with the square of the vocabulary: a 65,535-token vocabulary
/// would otherwise ask for 34 GB of counts.
pub fn bigram_loss(train: &[u16], eval: &[u16], vocab: usize) -> f64 {
    let mut pairs: std::collections::HashMap<(u16, u16), u64> = std::collections::HashMap::new();
    let mut firsts = vec![0u64; vocab];
    let mut unigram = vec![1u64; vocab];
    for w in train.windows(2) {
        *pairs.entry((w[0], w[1])).or_insert(0) += 1;
        firsts[w[0] as usize] += 1;
    }
    train.iter().for_each(|&t| unigram[t as usize] += 1);
    let total: u64 = unigram.iter().sum();
    let n = eval.len().saturating_sub(1).max(1);
    eval.windows(2)
        .map(|w| {
            let (a, b) = (w[0] as usize, w[1] as usize);
            let prior = unigram[b] as f64 / total as f64;
            let pair = pairs.get(&(w[0], w[1])).copied().unwrap_or(0);
            -((pair as f64 + prior) / (firsts[a] as f64 + 1.0)).ln()
        })
        .sum::<f64>()
        / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bigram_loss_is_the_smoothed_count_model_worked_by_hand() {
        // Train "abab" over {a, b, c}: pairs ab x2, ba x1; unigram counts a 3, b 3, c 1 (add-one),
        // total 7. Eval "abc": p(b|a) = (2 + 3/7) / (2 + 1), p(c|b) = (0 + 1/7) / (1 + 1).
        let want = -(((2.0 + 3.0 / 7.0) / 3.0f64).ln() + ((1.0 / 7.0) / 2.0f64).ln()) / 2.0;
        let got = bigram_loss(&[0, 1, 0, 1], &[0, 1, 2], 3);
        assert!((got - want).abs() < 1e-12, "{got} against {want}");
        // The largest vocabulary costs only the pairs present.
        let got = bigram_loss(&[0, 65534, 0, 65534], &[0, 65534, 2], 65535);
        assert!(got.is_finite() && got > 0.0);
    }

    #[test]
    fn the_bundled_corpus_splits_into_its_40_works_by_title() {
        let text = read_text(&bundled_shakespeare()).unwrap();
        let all = works(&text);
        assert_eq!(all.len(), 40, "the README's count of works");
        assert_eq!(all[0].title, "ALL'S WELL THAT ENDS WELL");
        assert_eq!(all[0].range.start, 0);
        // The sonnets have no blank line between title and byline.
        assert!(all.iter().any(|w| w.title == "THE SONNETS"));
        // Consecutive and covering: every byte belongs to exactly one work.
        for pair in all.windows(2) {
            assert_eq!(pair[0].range.end, pair[1].range.start);
        }
        assert_eq!(all.last().unwrap().range.end, text.len());
        let split = ShakespeareSplit::load(&bundled_shakespeare()).unwrap();
        assert_eq!(split.works, (38, 2));
        assert_eq!(split.train.len() + split.validation.len(), text.len());
        let share = split.validation.len() as f64 / text.len() as f64;
        assert!((0.05..0.06).contains(&share), "validation share {share}");
        assert_eq!(split.tokenizer.vocab_size(), 84);
        // The validation text is Macbeth, then The Winter's Tale, exactly.
        let decoded = split.tokenizer.decode(&split.validation[..7]);
        assert_eq!(decoded, "MACBETH");
    }

    #[test]
    fn the_char_tokenizer_round_trips_and_names_unknown_bytes() {
        let t = CharTokenizer::fit(b"to be, or not to be");
        assert_eq!(t.vocab, b" ,benort".to_vec());
        let ids = t.encode(b"not to be").unwrap();
        assert_eq!(t.decode(&ids), "not to be");
        let e = t.encode(b"to bee?").unwrap_err();
        assert!(
            e.contains("'?'") && e.contains("offset 6") && e.contains("8 characters"),
            "{e}"
        );
    }
}
