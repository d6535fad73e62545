//! A character-level language model on the bundled Shakespeare text, for the token-batch
//! algorithms (sequence-length warmup) and their tests: the corpus reader, a dataset of
//! fixed-length windows, a batcher to [`TokenBatch`], and a small model.

use std::io::Read;
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
use flashover::core::Result;

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
        let io = |source| CoreError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let mut text = Vec::new();
        flate2::read::GzDecoder::new(file)
            .read_to_end(&mut text)
            .map_err(io)?;
        if text.len() < 2 {
            return Err(CoreError::MalformedData {
                path: path.to_path_buf(),
                reason: format!("{} bytes of text; at least 2 are needed", text.len()),
            });
        }
        let mut seen = [false; 256];
        text.iter().for_each(|&b| seen[b as usize] = true);
        let vocab: Vec<u8> = (0..=255u8).filter(|&b| seen[b as usize]).collect();
        let mut id = [0u16; 256];
        vocab
            .iter()
            .enumerate()
            .for_each(|(i, &b)| id[b as usize] = i as u16);
        let tokens = text.iter().map(|&b| id[b as usize]).collect();
        Ok(CharCorpus {
            vocab,
            tokens: Arc::new(tokens),
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
        let fit = corpus.tokens.len().saturating_sub(1) / seq_len.max(1);
        Windows {
            tokens: corpus.tokens.clone(),
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
        TokenBatch {
            tokens: Tensor::from_data(TensorData::new(x, [n, t]), device),
            targets: Tensor::from_data(TensorData::new(y, [n, t]), device),
        }
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
    let windows = Windows::new(corpus, seq_len, limit);
    let sampler = Sampler::new(windows.len(), batch_size, true, seed)?;
    DataLoader::new(
        "shakespeare",
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

fn flat<B: Backend>(t: &Tensor<B, 2, Int>) -> Tensor<B, 1, Int> {
    let [b, s] = t.dims();
    t.clone().reshape([b * s])
}

impl<B: AutodiffBackend> TrainModel<B> for CharLm<B> {
    type Batch = TokenBatch<B>;
    type Output = Tensor<B, 2>;

    fn forward(&self, batch: &TokenBatch<B>) -> Tensor<B, 2> {
        self.logits(batch.tokens.clone())
    }

    fn loss(&self, logits: &Tensor<B, 2>, batch: &TokenBatch<B>) -> Tensor<B, 1> {
        cross_entropy(logits.clone(), flat(&batch.targets))
    }
}

impl<B: Backend> EvalModel<B> for CharLm<B> {
    type Batch = TokenBatch<B>;
    type Output = ClassificationOutput<B>;

    fn forward_eval(&self, batch: &TokenBatch<B>) -> ClassificationOutput<B> {
        ClassificationOutput::scored(self.logits(batch.tokens.clone()), flat(&batch.targets))
    }
}
