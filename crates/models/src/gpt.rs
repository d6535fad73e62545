//! A decoder-only transformer language model (GPT: Radford et al., "Improving Language
//! Understanding by Generative Pre-Training", 2018; the block layout of GPT-2, Radford et al.,
//! 2019): token embeddings plus learned position embeddings, `layers` pre-LayerNorm blocks of
//! causal multi-head self-attention and a 4x-wide GELU MLP, each added to the residual
//! stream, a final LayerNorm, and logits over the vocabulary, by default through the token
//! embeddings themselves (weight tying, Press and Wolf, 2017).
//!
//! Initialisation is GPT-2's: embeddings and linear weights from N(0, 0.02), biases 0,
//! LayerNorm scale 1 and shift 0, and the two projections that write into the residual
//! stream (attention's output, the MLP's second layer) from N(0, 0.02 / sqrt(2 * layers)).
//! No dropout: the bundled corpus is trained for too few tokens to overfit.
//!
//! The dense layers are this crate's [`Linear`] (the CPU fast path's matrix products, and
//! what Factorize changes). On a backend with the fast path (`ChannelsLastBackend`), the
//! attention, the layer norms, the MLP's GELU, the residual adds (into the output
//! projections) and the training loss run through its fused kernels; elsewhere, and with
//! `burn_ops`, through Burn's tensor ops.

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LinearConfig};
use burn::tensor::activation::{gelu, relu, sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData, TensorPrimitive};
use flashover_core::loss::classification_loss;
use flashover_core::model::{
    ClassTargets, ClassificationOutput, EvalModel, TokenBatch, TrainModel,
};
use flashover_core::params::init_model;
use flashover_core::precision::{cast_like, cast_to, Autocast};
use flashover_core::rng::Rng;
use flashover_surgery::{
    AttentionInfo, AttentionLayer, AttentionVariant, GluActivation, GluSettings, Layers, MlpInfo,
    MlpLayer, PositionEmbeddings, Surgical,
};

use crate::layers::Linear;
use crate::norm::LayerNorm;
use crate::{ChannelsLastBackend, ModelError, TrainBackend};

/// Standard deviation of GPT-2's initial weights.
const INIT_STD: f64 = 0.02;

/// A GPT's shape. Built by [`GptConfig::new`], which checks it, so every `GptConfig` is one a
/// model can be built with (the fields are private for that reason; read them through the
/// methods of the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptConfig {
    vocab: usize,
    context: usize,
    layers: usize,
    heads: usize,
    width: usize,
    tie_weights: bool,
}

impl GptConfig {
    /// A shape, checked: every size at least 1 and `heads` dividing `width`.
    pub fn new(
        vocab: usize,
        context: usize,
        layers: usize,
        heads: usize,
        width: usize,
    ) -> Result<Self, ModelError> {
        let config = Self {
            vocab,
            context,
            layers,
            heads,
            width,
            tie_weights: true,
        };
        config.check()?;
        Ok(config)
    }

    /// Distinct tokens.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// Longest input, in tokens (the rows of the position embeddings).
    pub fn context(&self) -> usize {
        self.context
    }
    /// Transformer blocks.
    pub fn layers(&self) -> usize {
        self.layers
    }
    /// Attention heads per block (dividing `width`).
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// Width of the residual stream.
    pub fn width(&self) -> usize {
        self.width
    }
    /// Whether the logits go through the token embeddings (no separate output layer).
    pub fn tie_weights(&self) -> bool {
        self.tie_weights
    }

    /// The same shape with a separate output layer when `tie` is false.
    pub fn with_tied_weights(mut self, tie: bool) -> Self {
        self.tie_weights = tie;
        self
    }

    /// The parameters a model of this shape has (before surgery), counted from the shape
    /// without building it, in `u128` so that no shape overflows: token and position
    /// embeddings, per block two layer norms (`2w` each), `qkv` (`3w² + 3w`), the attention
    /// projection (`w² + w`) and the MLP (`4w² + 4w` and `4w² + w`), the final norm, and the
    /// untied output layer (`w·vocab`, no bias). Saturates at `u128::MAX`.
    pub fn num_params(&self) -> u128 {
        let (v, c, l, w) = (
            self.vocab as u128,
            self.context as u128,
            self.layers as u128,
            self.width as u128,
        );
        let block = (12u128.saturating_mul(w).saturating_mul(w)).saturating_add(13 * w);
        let head = if self.tie_weights {
            0
        } else {
            w.saturating_mul(v)
        };
        [
            v.saturating_mul(w),
            c.saturating_mul(w),
            l.saturating_mul(block),
            2 * w,
            head,
        ]
        .into_iter()
        .fold(0u128, u128::saturating_add)
    }

    fn check(&self) -> Result<(), ModelError> {
        let sizes = [
            ("vocab", self.vocab),
            ("context", self.context),
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(ModelError::config("a GPT", name, 0, "at least 1"));
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(ModelError::config(
                "a GPT",
                "heads",
                self.heads,
                format!("a number of heads that divides its width {}", self.width),
            ));
        }
        Ok(())
    }

    /// A model with this shape, its parameters drawn in field order from a generator seeded
    /// by `seed`.
    pub fn init<B: Backend>(&self, device: &B::Device, seed: u64) -> Gpt<B> {
        let normal = |std: f64| Initializer::Normal { mean: 0.0, std };
        let residual_std = INIT_STD / ((2 * self.layers) as f64).sqrt();
        // Burn draws a layer's bias with its weights' initializer; GPT-2's biases start at 0.
        let linear = |d_in: usize, d_out: usize, std: f64, d: &B::Device| {
            let mut layer: Linear<B> = Linear::new(
                &LinearConfig::new(d_in, d_out).with_initializer(normal(std)),
                d,
            );
            layer.bias = Some(Param::from_tensor(Tensor::zeros([d_out], d)));
            layer
        };
        init_model::<B, _>(device, seed, |d| {
            let w = self.width;
            Gpt {
                token_embedding: EmbeddingConfig::new(self.vocab, w)
                    .with_initializer(normal(INIT_STD))
                    .init(d),
                position_embedding: Some(normal(INIT_STD).init([self.context, w], d)),
                blocks: (0..self.layers)
                    .map(|_| Block {
                        norm1: LayerNorm::new(w, d),
                        attention: Attention {
                            qkv: linear(w, 3 * w, INIT_STD, d),
                            proj: linear(w, w, residual_std, d),
                            heads: self.heads,
                            variant: AttentionVariant::default(),
                        },
                        norm2: LayerNorm::new(w, d),
                        mlp: Mlp {
                            fc: linear(w, 4 * w, INIT_STD, d),
                            proj: linear(4 * w, w, residual_std, d),
                            gate: None,
                            activation: None,
                        },
                    })
                    .collect(),
                final_norm: LayerNorm::new(w, d),
                head: (!self.tie_weights).then(|| {
                    Linear::new(
                        &LinearConfig::new(w, self.vocab)
                            .with_bias(false)
                            .with_initializer(normal(INIT_STD)),
                        d,
                    )
                }),
                context: self.context,
                compute: None,
                burn_ops: false,
            }
        })
    }
}

/// Causal multi-head self-attention: `heads` heads of `width / heads` features, queries,
/// keys and values from one `[width, 3 * width]` layer, the heads' outputs concatenated and
/// projected back.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Queries, keys and values, `width -> 3 * width` (in that order).
    pub qkv: Linear<B>,
    /// Output projection, `width -> width`.
    pub proj: Linear<B>,
    /// Heads.
    pub heads: usize,
    /// The variant model surgery chose (ALiBi's biases; default: none).
    pub variant: AttentionVariant,
}

impl<B: ChannelsLastBackend> Attention<B> {
    /// Attention over `x: [batch, seq, width]`, each position seeing itself and the ones
    /// before it (through [`ChannelsLastBackend::causal_attention`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(x, B::CHANNELS_LAST_IS_FAST)
    }

    /// [`forward`](Self::forward) through the fast path's kernels when `fast`, else through
    /// Burn's tensor ops alone.
    pub fn forward_with(&self, x: Tensor<B, 3>, fast: bool) -> Tensor<B, 3> {
        let [b, t, w] = x.dims();
        self.proj
            .forward(self.heads_out(x, fast), fast, false)
            .reshape([b, t, w])
    }

    /// `residual + attention(x)` for `x` and `residual` `[batch, seq, width]` (the block's
    /// residual stream): [`forward_with`](Self::forward_with) with the residual added by
    /// the output projection ([`Linear::forward_residual`]).
    pub fn forward_residual(
        &self,
        x: Tensor<B, 3>,
        residual: Tensor<B, 3>,
        fast: bool,
    ) -> Tensor<B, 3> {
        let [b, t, w] = x.dims();
        self.proj
            .forward_residual(self.heads_out(x, fast), residual.reshape([b * t, w]), fast)
            .reshape([b, t, w])
    }

    /// The heads' outputs side by side, `[batch * seq, width]`, before the output
    /// projection.
    fn heads_out(&self, x: Tensor<B, 3>, fast: bool) -> Tensor<B, 2> {
        let [b, t, w] = x.dims();
        let qkv = self
            .qkv
            .forward(x.reshape([b * t, w]), fast, false)
            .reshape([b, t, 3 * w]);
        let alibi = self.variant.alibi_slopes.as_deref();
        let y = if fast {
            causal_attention(qkv, self.heads, alibi)
        } else {
            let (out, _) = crate::ops::burn_causal_attention::<B>(
                qkv.into_primitive().tensor(),
                self.heads,
                alibi,
            );
            Tensor::from_primitive(TensorPrimitive::Float(out))
        };
        y.reshape([b * t, w])
    }
}

/// Causal multi-head self-attention of `qkv: [batch, seq, 3 * width]` (queries, keys and
/// values, `heads` heads side by side in each), with ALiBi's biases when `alibi` gives one
/// slope per head; output `[batch, seq, width]`. See [`ChannelsLastBackend::causal_attention`].
pub fn causal_attention<B: ChannelsLastBackend>(
    qkv: Tensor<B, 3>,
    heads: usize,
    alibi: Option<&[f32]>,
) -> Tensor<B, 3> {
    let out = B::causal_attention(qkv.into_primitive().tensor(), heads, alibi);
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(out))
}

/// The block's MLP: `width -> 4 * width`, GELU, back to `width`; or, after
/// GatedLinearUnits' surgery, a gated linear unit `proj(act(gate(x)) * fc(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// First layer (the value layer of a gated unit).
    pub fc: Linear<B>,
    /// Second layer (writes into the residual stream).
    pub proj: Linear<B>,
    /// The gate layer of a gated linear unit (`None`: the plain MLP).
    pub gate: Option<Linear<B>>,
    /// The gate's activation, with `gate`.
    pub activation: Option<GluActivation>,
}

impl<B: ChannelsLastBackend> Mlp<B> {
    /// The MLP on `x: [rows, width]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.forward_with(x, B::CHANNELS_LAST_IS_FAST)
    }

    /// [`forward`](Self::forward) through the fast path's kernels (the first layer's GELU
    /// fused into its product) when `fast`, else through Burn's tensor ops alone.
    pub fn forward_with(&self, x: Tensor<B, 2>, fast: bool) -> Tensor<B, 2> {
        self.proj.forward(self.hidden(x, fast), fast, false)
    }

    /// `residual + mlp(x)` for `x` and `residual` `[rows, width]` (the block's residual
    /// stream): [`forward_with`](Self::forward_with) with the residual added by the output
    /// layer ([`Linear::forward_residual`]).
    pub fn forward_residual(
        &self,
        x: Tensor<B, 2>,
        residual: Tensor<B, 2>,
        fast: bool,
    ) -> Tensor<B, 2> {
        self.proj
            .forward_residual(self.hidden(x, fast), residual, fast)
    }

    /// The hidden layer's activations, `[rows, hidden]`.
    fn hidden(&self, x: Tensor<B, 2>, fast: bool) -> Tensor<B, 2> {
        match &self.gate {
            None => self.fc.forward_gelu(x, fast),
            Some(gate) => {
                let g = gate.forward(x.clone(), fast, false);
                let g = match self.activation.unwrap_or(GluActivation::Gelu) {
                    GluActivation::Gelu => gelu(g),
                    GluActivation::Relu => relu(g),
                    GluActivation::Silu => silu(g),
                    GluActivation::Sigmoid => sigmoid(g),
                    GluActivation::Identity => g,
                };
                g.mul(self.fc.forward(x, fast, false))
            }
        }
    }
}

impl<B: Backend> Mlp<B> {
    /// What the model's surgery sees of this MLP, at `path`.
    pub fn info(&self, path: &str) -> MlpInfo {
        let [width, hidden] = self.fc.dims();
        MlpInfo {
            path: path.to_string(),
            width,
            hidden,
        }
    }

    /// Rebuilds this MLP as a gated linear unit with `settings`, its layers drawn from a
    /// generator seeded by `seed`: value and gate `width -> hidden` from N(0, 0.02), the
    /// output layer `hidden -> width` from N(0, `out_std`), keeping its bias. `fc` and `proj`
    /// keep their parameter ids.
    pub fn make_gated(&mut self, settings: &GluSettings, seed: u64, out_std: f64) {
        let [width, _] = self.fc.dims();
        let h = settings.hidden;
        let device = self.fc.weight.device();
        let mut rng = Rng::new(seed);
        let mut normal = |n: usize, std: f64| -> Vec<f32> {
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        };
        let tensor2 = |v: Vec<f32>, shape: [usize; 2]| {
            Tensor::<B, 2>::from_data(TensorData::new(v, shape), &device)
        };
        let zeros = |n: usize| Param::from_tensor(Tensor::<B, 1>::zeros([n], &device));
        let value = tensor2(normal(width * h, INIT_STD), [width, h]);
        let gate = tensor2(normal(width * h, INIT_STD), [width, h]);
        let out = tensor2(normal(h * width, out_std), [h, width]);
        self.fc.weight = Param::initialized(self.fc.weight.id, value.require_grad());
        self.fc.bias = settings.non_gated_bias.then(|| zeros(h));
        self.fc.factors = None;
        self.proj.weight = Param::initialized(self.proj.weight.id, out.require_grad());
        self.proj.factors = None;
        self.gate = Some(Linear {
            weight: Param::from_tensor(gate),
            bias: settings.gated_bias.then(|| zeros(h)),
            input_dropout: Default::default(),
            factors: None,
        });
        self.activation = Some(settings.activation);
    }
}

/// A pre-LayerNorm transformer block: `x + attention(norm1(x))`, then `x + mlp(norm2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Before attention.
    pub norm1: LayerNorm<B>,
    /// Causal self-attention.
    pub attention: Attention<B>,
    /// Before the MLP.
    pub norm2: LayerNorm<B>,
    /// The MLP.
    pub mlp: Mlp<B>,
}

impl<B: ChannelsLastBackend> Block<B> {
    /// The block on `x: [batch, seq, width]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(x, B::CHANNELS_LAST_IS_FAST)
    }

    /// [`forward`](Self::forward) through the fast path's kernels when `fast`, else through
    /// Burn's tensor ops alone.
    pub fn forward_with(&self, x: Tensor<B, 3>, fast: bool) -> Tensor<B, 3> {
        let [b, t, w] = x.dims();
        let normed = self.norm1.forward_with(x.clone(), fast);
        let x = self.attention.forward_residual(normed, x, fast);
        let normed = self.norm2.forward_with(x.clone(), fast).reshape([b * t, w]);
        self.mlp
            .forward_residual(normed, x.reshape([b * t, w]), fast)
            .reshape([b, t, w])
    }
}

/// The GPT; see the module docs.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    /// `[vocab, width]`.
    pub token_embedding: Embedding<B>,
    /// `[context, width]`, added to the token embeddings.
    pub position_embedding: Option<Param<Tensor<B, 2>>>,
    /// The transformer blocks.
    pub blocks: Vec<Block<B>>,
    /// After the last block.
    pub final_norm: LayerNorm<B>,
    /// Output layer `width -> vocab`; `None` with tied weights (logits through the token
    /// embeddings).
    pub head: Option<Linear<B>>,
    /// Longest input the model takes: the rows of the position embeddings, or ALiBi's
    /// `max_sequence_length` once they are removed.
    pub context: usize,
    /// The type the forward pass computes in (`None`: the parameters'); see [`Autocast`].
    pub compute: Option<FloatDType>,
    /// Whether the forward pass uses Burn's tensor ops even where the backend has the fast
    /// path's kernels (`ChannelsLastBackend::CHANNELS_LAST_IS_FAST`): for comparisons of the
    /// two (`--kernels burn` on the shakespeare example). Default `false`.
    pub burn_ops: bool,
}

/// Surgery (`flashover_surgery`) reaches, in each block, the layer norms, the attention
/// layer (ALiBi) and its dense layers, and the MLP (GatedLinearUnits) and its dense layers;
/// then the final norm, the position embeddings (which ALiBi removes) and the untied output
/// layer (the tied output goes through the token embeddings, which stay whole).
impl<B: Backend> Surgical for Gpt<B> {
    fn visit_layers(&mut self, layers: &mut Layers<'_>) {
        let out_std = INIT_STD / ((2 * self.blocks.len()) as f64).sqrt();
        for (i, block) in self.blocks.iter_mut().enumerate() {
            let path = format!("blocks.{i}");
            layers.layer_norm(&format!("{path}.norm1"), &mut block.norm1);
            let attention = &mut block.attention;
            layers.attention(&format!("{path}.attention"), &mut *attention);
            layers.linear(&format!("{path}.attention.qkv"), &mut attention.qkv);
            layers.linear(&format!("{path}.attention.proj"), &mut attention.proj);
            layers.layer_norm(&format!("{path}.norm2"), &mut block.norm2);
            let mlp = &mut block.mlp;
            layers.mlp(
                &format!("{path}.mlp"),
                &mut GptMlp {
                    mlp: &mut *mlp,
                    out_std,
                },
            );
            layers.linear(&format!("{path}.mlp.fc"), &mut mlp.fc);
            if let Some(gate) = mlp.gate.as_mut() {
                layers.linear(&format!("{path}.mlp.gate"), gate);
            }
            layers.linear(&format!("{path}.mlp.proj"), &mut mlp.proj);
        }
        layers.layer_norm("final_norm", &mut self.final_norm);
        let mut positions = Positions {
            embedding: &mut self.position_embedding,
            context: &mut self.context,
        };
        layers.position_embeddings("position_embedding", &mut positions);
        if let Some(head) = self.head.as_mut() {
            layers.linear("head", head);
        }
    }
}

impl<B: Backend> AttentionLayer for Attention<B> {
    fn info(&self, path: &str) -> AttentionInfo {
        AttentionInfo {
            path: path.to_string(),
            heads: self.heads,
        }
    }

    fn variant(&mut self) -> &mut AttentionVariant {
        &mut self.variant
    }
}

/// A block's MLP with the standard deviation its rebuilt output layer is drawn with (GPT-2's
/// `0.02 / sqrt(2 * blocks)`, which depends on the model).
struct GptMlp<'a, B: Backend> {
    mlp: &'a mut Mlp<B>,
    out_std: f64,
}

impl<B: Backend> MlpLayer for GptMlp<'_, B> {
    fn info(&self, path: &str) -> MlpInfo {
        self.mlp.info(path)
    }

    fn is_gated(&self) -> bool {
        self.mlp.gate.is_some()
    }

    fn make_gated(&mut self, settings: &GluSettings, seed: u64) {
        self.mlp.make_gated(settings, seed, self.out_std);
    }
}

/// The learned position embeddings with the context they set: ALiBi's model has none and
/// takes inputs up to its `max_sequence_length`.
struct Positions<'a, B: Backend> {
    embedding: &'a mut Option<Param<Tensor<B, 2>>>,
    context: &'a mut usize,
}

impl<B: Backend> PositionEmbeddings for Positions<'_, B> {
    fn remove(&mut self, max_sequence_length: usize) -> bool {
        *self.context = max_sequence_length;
        self.embedding.take().is_some()
    }
}

impl<B: Backend> Autocast for Gpt<B> {
    fn compute_dtype(&self) -> Option<FloatDType> {
        self.compute
    }

    fn with_compute_dtype(mut self, dtype: Option<FloatDType>) -> Self {
        self.compute = dtype;
        self
    }
}

impl<B: ChannelsLastBackend> Gpt<B> {
    /// Logits `[batch * seq, vocab]` (row `i * seq + j`: the distribution of the token after
    /// position `j` of sequence `i`) for tokens `[batch, seq]`. Panics if `seq` exceeds the
    /// model's context.
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        let [b, t] = tokens.dims();
        assert!(
            t <= self.context,
            "a sequence of {t} tokens is longer than the model's context of {}",
            self.context
        );
        let fast = B::CHANNELS_LAST_IS_FAST && !self.burn_ops;
        let mut x = self.token_embedding.forward(tokens);
        if let Some(p) = &self.position_embedding {
            let p = p.val().narrow(0, 0, t);
            x = match fast {
                true => crate::layers::add_positions(x, p),
                false => x + p.unsqueeze::<3>(),
            };
        }
        if let Some(dtype) = self.compute {
            x = cast_to(x, dtype);
        }
        for block in &self.blocks {
            x = block.forward_with(x, fast);
        }
        let w = x.dims()[2];
        let x = self.final_norm.forward_with(x, fast).reshape([b * t, w]);
        let logits = match &self.head {
            Some(head) => head.forward(x, fast, false),
            None => {
                let e = cast_like(self.token_embedding.weight.val(), x.dtype());
                crate::layers::dense(x, e.transpose(), None, false)
            }
        };
        cast_to(logits, FloatDType::F32)
    }
}

/// How [`Gpt::generate`] picks each next token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Tokens to add after the prompt.
    pub tokens: usize,
    /// Logits are divided by this before the softmax; 0 picks the most likely token
    /// (greedy decoding).
    pub temperature: f64,
    /// Sample among only this many most likely tokens (`None`: all of them).
    pub top_k: Option<usize>,
    /// Seed of the draws: the same seed, model and prompt give the same text.
    pub seed: u64,
}

impl Sampling {
    /// The most tokens one generation adds: each is a forward pass over the context, so a
    /// billion would run for days with nothing shown (a long text is several calls).
    pub const MAX_TOKENS: usize = 100_000;

    /// Checks the settings: at most [`Sampling::MAX_TOKENS`] tokens, a finite temperature
    /// of at least 0 and a top-k of at least 1.
    pub fn check(&self) -> Result<(), ModelError> {
        if self.tokens > Self::MAX_TOKENS {
            return Err(ModelError::config(
                "generation",
                "tokens",
                self.tokens,
                format!(
                    "at most {} tokens per generation (each is a forward pass; generate longer texts in several calls)",
                    Self::MAX_TOKENS
                ),
            ));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::config(
                "generation",
                "temperature",
                self.temperature,
                "a number >= 0 (0: greedy)",
            ));
        }
        if self.top_k == Some(0) {
            return Err(ModelError::config("generation", "top_k", 0, "k >= 1"));
        }
        Ok(())
    }

    /// The next token for `logits` (one per vocabulary entry), drawing from `rng`.
    fn pick(&self, logits: &[f32], rng: &mut Rng) -> usize {
        let best = |v: &[f32]| {
            // The first of the largest, so ties break by token id.
            (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
        };
        if self.temperature == 0.0 {
            return best(logits);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        // Most likely first; equal logits in token order (a stable sort).
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(self.top_k.unwrap_or(order.len()).min(order.len()));
        let max = logits[order[0]] as f64;
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i] as f64 - max) / self.temperature).exp())
            .collect();
        let mut u = rng.next_f64() * weights.iter().sum::<f64>();
        for (&token, w) in order.iter().zip(&weights) {
            if u < *w {
                return token;
            }
            u -= w;
        }
        // Rounding left `u` past the last weight.
        order[order.len() - 1]
    }
}

impl<B: ChannelsLastBackend> Gpt<B> {
    /// `prompt` continued by `sampling.tokens` tokens, each drawn from the model's
    /// distribution of the next token given the text so far (its last `context` tokens).
    /// Returns the new tokens only. An empty prompt, or settings [`Sampling::check`]
    /// refuses, are errors.
    pub fn generate(
        &self,
        prompt: &[u16],
        sampling: &Sampling,
        device: &B::Device,
    ) -> Result<Vec<u16>, ModelError> {
        if prompt.is_empty() {
            return Err(ModelError::config(
                "generation",
                "prompt",
                "(empty)",
                "a prompt of at least one token",
            ));
        }
        sampling.check()?;
        let mut rng = Rng::new(sampling.seed);
        let mut text: Vec<u16> = prompt.to_vec();
        for _ in 0..sampling.tokens {
            let window = &text[text.len().saturating_sub(self.context)..];
            let ids: Vec<i64> = window.iter().map(|&t| t as i64).collect();
            let tokens = Tensor::<B, 2, Int>::from_data(
                burn::tensor::TensorData::new(ids, [1, window.len()]),
                device,
            );
            let logits = self.logits(tokens);
            let [rows, vocab] = logits.dims();
            // Invariant: the logits are the model's float activations, so they convert to
            // `f32` values.
            let last: Vec<f32> = logits
                .narrow(0, rows - 1, 1)
                .into_data()
                .convert::<f32>()
                .to_vec()
                .expect("float logits");
            debug_assert_eq!(last.len(), vocab);
            text.push(sampling.pick(&last, &mut rng) as u16);
        }
        Ok(text.split_off(prompt.len()))
    }
}

impl<B: TrainBackend> TrainModel<B> for Gpt<B> {
    type Batch = TokenBatch<B>;
    type Output = Tensor<B, 2>;

    fn forward(&self, batch: &TokenBatch<B>) -> Tensor<B, 2> {
        self.logits(batch.tokens.clone())
    }

    fn loss(&self, logits: &Tensor<B, 2>, batch: &TokenBatch<B>) -> Tensor<B, 1> {
        // Soft targets (label smoothing) when an algorithm set them; on the fast path, class
        // indices through its fused cross-entropy.
        // A padded batch's loss skips its padding (the mean over the scored tokens), through
        // Burn's ops.
        let fast = B::CHANNELS_LAST_IS_FAST && !self.burn_ops && !batch.is_padded();
        if fast && batch.soft_targets().is_none() {
            return crate::layers::cross_entropy(logits.clone(), batch.classes().clone());
        }
        classification_loss(logits.clone(), batch)
    }
}

impl<B: ChannelsLastBackend> EvalModel<B> for Gpt<B> {
    type Batch = TokenBatch<B>;
    type Output = ClassificationOutput<B>;

    fn forward_eval(&self, batch: &TokenBatch<B>) -> ClassificationOutput<B> {
        ClassificationOutput::scored_ignoring(
            self.logits(batch.tokens.clone()),
            batch.flat_targets(),
            batch.ignore_index(),
        )
    }
}

// The tests run on flex, the fast path they compare against Burn's ops.
#[cfg(feature = "flex")]
#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, TensorData};
    use flashover_surgery::SurgicalExt;

    type B = Flex;

    fn tiny(tie: bool) -> Gpt<B> {
        GptConfig::new(11, 8, 2, 2, 8)
            .unwrap()
            .with_tied_weights(tie)
            .init::<B>(&Default::default(), 7)
    }

    fn tokens(rows: &[&[i64]]) -> Tensor<B, 2, Int> {
        let t = rows[0].len();
        let v: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(TensorData::new(v, [rows.len(), t]), &Default::default())
    }

    fn values(x: Tensor<B, 2>) -> Vec<f32> {
        x.into_data().to_vec().unwrap()
    }

    #[test]
    fn shapes_are_checked_and_named() {
        assert_eq!(
            GptConfig::new(10, 8, 2, 3, 8).unwrap_err().to_string(),
            "invalid value 3 for `heads` of a GPT: expected a number of heads that divides its width 8"
        );
        assert_eq!(
            GptConfig::new(10, 0, 2, 2, 8).unwrap_err(),
            ModelError::config("a GPT", "context", 0, "at least 1")
        );
    }

    #[test]
    fn logits_have_one_row_per_position_and_the_future_is_not_seen() {
        let m = tiny(true);
        let a = values(m.logits(tokens(&[&[1, 2, 3, 4, 5]])));
        assert_eq!(a.len(), 5 * 11);
        // Changing the last token changes only the last position's logits.
        let b = values(m.logits(tokens(&[&[1, 2, 3, 4, 9]])));
        assert_eq!(a[..4 * 11], b[..4 * 11]);
        assert_ne!(a[4 * 11..], b[4 * 11..]);
        // A shorter input gives the same logits for the positions it has.
        let c = values(m.logits(tokens(&[&[1, 2, 3]])));
        for (x, y) in c.iter().zip(&a[..3 * 11]) {
            assert!((x - y).abs() < 1e-5, "{x} against {y}");
        }
    }

    #[test]
    fn the_shape_counts_the_parameters_burn_builds() {
        for (tie, vocab, context, layers, heads, width) in [
            (true, 11, 6, 2, 2, 8),
            (false, 65, 16, 3, 4, 12),
            (true, 7, 1, 1, 1, 1),
        ] {
            let config = GptConfig::new(vocab, context, layers, heads, width)
                .unwrap()
                .with_tied_weights(tie);
            let built = config.init::<B>(&Default::default(), 1).num_params();
            assert_eq!(config.num_params(), built as u128, "{config:?}");
        }
        // GPT-2 small (124M with tied weights, 1024 positions, 50257 tokens): the published count.
        let gpt2 = GptConfig::new(50257, 1024, 12, 12, 768).unwrap();
        assert_eq!(gpt2.num_params(), 124_439_808);
        // No shape overflows.
        let huge = GptConfig::new(usize::MAX, usize::MAX, usize::MAX, 1, usize::MAX).unwrap();
        assert_eq!(huge.num_params(), u128::MAX);
    }

    #[test]
    fn tied_weights_have_no_output_layer_and_the_same_seed_gives_the_same_model() {
        let tied = tiny(true);
        let untied = tiny(false);
        assert!(tied.head.is_none());
        assert_eq!(
            untied.num_params() - tied.num_params(),
            8 * 11,
            "an untied model adds a width x vocab output layer"
        );
        let x = tokens(&[&[0, 1, 2], &[3, 4, 5]]);
        assert_eq!(values(tied.logits(x.clone())), values(tiny(true).logits(x)));
    }

    #[test]
    #[should_panic(expected = "longer than the model's context of 8")]
    fn inputs_longer_than_the_context_are_refused() {
        tiny(true).logits(tokens(&[&[0; 9]]));
    }

    /// One head, width 2: attention by hand from the layers' own weights.
    #[test]
    fn attention_matches_the_formula() {
        let d = Default::default();
        let m = GptConfig::new(3, 4, 1, 1, 2).unwrap().init::<B>(&d, 3);
        let att = &m.blocks[0].attention;
        let x: Vec<f32> = vec![0.5, -1.0, 2.0, 0.25, -0.75, 1.5];
        let xt = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [1, 3, 2]), &d);
        let got: Vec<f32> = att.forward(xt).into_data().to_vec().unwrap();
        let w: Vec<f32> = att.qkv.weight.val().into_data().to_vec().unwrap(); // [2, 6]
        let bq: Vec<f32> = att
            .qkv
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .to_vec()
            .unwrap();
        let wo: Vec<f32> = att.proj.weight.val().into_data().to_vec().unwrap(); // [2, 2]
        let bo: Vec<f32> = att
            .proj
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .to_vec()
            .unwrap();
        let lin = |r: &[f32], c: usize| -> f64 {
            (0..2)
                .map(|i| r[i] as f64 * w[i * 6 + c] as f64)
                .sum::<f64>()
                + bq[c] as f64
        };
        let rows: Vec<&[f32]> = x.chunks(2).collect();
        for i in 0..3 {
            let q: Vec<f64> = (0..2).map(|c| lin(rows[i], c)).collect();
            let s: Vec<f64> = (0..=i)
                .map(|j| (0..2).map(|c| q[c] * lin(rows[j], 2 + c)).sum::<f64>() / 2f64.sqrt())
                .collect();
            let max = s.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
            let y: Vec<f64> = (0..2)
                .map(|c| {
                    (0..=i)
                        .map(|j| (s[j] - max).exp() / z * lin(rows[j], 4 + c))
                        .sum()
                })
                .collect();
            for c in 0..2 {
                let out = (0..2).map(|k| y[k] * wo[k * 2 + c] as f64).sum::<f64>() + bo[c] as f64;
                let g = got[i * 2 + c] as f64;
                assert!(
                    (g - out).abs() < 1e-5,
                    "position {i}, feature {c}: {g} against {out}"
                );
            }
        }
    }

    /// Layer norm against the paper's formula, with a scale and shift that are not 1 and 0.
    #[test]
    fn layer_norm_matches_the_formula() {
        let d = Default::default();
        let mut norm = LayerNorm::<B>::new(4, &d);
        let (gamma, beta) = ([1.5f32, -0.5, 2.0, 1.0], [0.1f32, 0.2, -0.3, 0.0]);
        norm.gamma =
            Param::from_tensor(Tensor::from_data(TensorData::new(gamma.to_vec(), [4]), &d));
        norm.beta = Param::from_tensor(Tensor::from_data(TensorData::new(beta.to_vec(), [4]), &d));
        let x = [
            1.0f32, 2.0, 4.0, 9.0, -3.0, 0.5, 0.5, 2.0, 7.0, 7.0, 7.0, 7.5,
        ];
        let got: Vec<f32> = norm
            .forward(Tensor::<B, 3>::from_data(
                TensorData::new(x.to_vec(), [1, 3, 4]),
                &d,
            ))
            .into_data()
            .to_vec()
            .unwrap();
        for (r, row) in x.chunks(4).enumerate() {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / 4.0;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 4.0;
            for c in 0..4 {
                let want =
                    (row[c] as f64 - mean) / (var + 1e-5).sqrt() * gamma[c] as f64 + beta[c] as f64;
                let g = got[r * 4 + c] as f64;
                assert!(
                    (g - want).abs() < 1e-5,
                    "row {r}, feature {c}: {g} against {want}"
                );
            }
        }
    }

    /// The fast path's attention (flex) against Burn's tensor ops: output, and the gradient
    /// through autodiff, on odd sizes (70 and 33 positions: causal blocks of 32 with a short
    /// last one).
    #[test]
    fn fast_attention_matches_burns_ops_and_their_gradient() {
        use crate::ops::burn_causal_attention;
        type AB = Autodiff<B>;
        let d = Default::default();
        for (b, t, w, h) in [
            (2, 5, 6, 2),
            (1, 7, 12, 3),
            (3, 1, 4, 1),
            (1, 70, 8, 2),
            (2, 33, 6, 3),
        ] {
            <B as burn::tensor::backend::Backend>::seed(&d, (b * 100 + t) as u64);
            let x = Tensor::<B, 3>::random([b, t, 3 * w], Distribution::Normal(0.0, 1.0), &d);
            let r = Tensor::<B, 3>::random([b, t, w], Distribution::Normal(0.0, 1.0), &d);
            let fast: Vec<f32> = causal_attention(x.clone(), h, None)
                .into_data()
                .to_vec()
                .unwrap();
            let (reference, _) =
                burn_causal_attention::<B>(x.clone().into_primitive().tensor(), h, None);
            let reference: Vec<f32> =
                Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(reference))
                    .into_data()
                    .to_vec()
                    .unwrap();
            for (a, e) in fast.iter().zip(&reference) {
                assert!((a - e).abs() < 1e-5, "{b}x{t}x{w}/{h}: {a} against {e}");
            }
            // d/dx of sum(attention(x) * r), through the op's backward and through Burn's
            // autodiff of its own ops.
            let grad_of = |fast: bool| -> Vec<f32> {
                let xa = Tensor::<AB, 3>::from_data(x.to_data(), &d).require_grad();
                let ra = Tensor::<AB, 3>::from_data(r.to_data(), &d);
                let out = if fast {
                    causal_attention(xa.clone(), h, None)
                } else {
                    let (o, _) =
                        burn_causal_attention::<AB>(xa.clone().into_primitive().tensor(), h, None);
                    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(o))
                };
                let grads = (out * ra).sum().backward();
                xa.grad(&grads).unwrap().into_data().to_vec().unwrap()
            };
            let autodiff = grad_of(false);
            for (a, e) in grad_of(true).iter().zip(&autodiff) {
                assert!(
                    (a - e).abs() < 1e-4,
                    "gradient {b}x{t}x{w}/{h}: {a} against {e}"
                );
            }
            // The default backward (what GPU backends run), by Burn's tensor ops.
            let (_, probs) =
                burn_causal_attention::<B>(x.clone().into_primitive().tensor(), h, None);
            let default = crate::ops::burn_causal_attention_backward::<B>(
                x.clone().into_primitive().tensor(),
                probs,
                r.clone().into_primitive().tensor(),
                h,
            );
            let default: Vec<f32> =
                Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(default))
                    .into_data()
                    .to_vec()
                    .unwrap();
            for (a, e) in default.iter().zip(&autodiff) {
                assert!(
                    (a - e).abs() < 1e-4,
                    "default backward {b}x{t}x{w}/{h}: {a} against {e}"
                );
            }
        }
    }

    /// ALiBi's biases: the fast kernel and Burn's ops against the formula by hand, and the
    /// gradient through the op against autodiff of Burn's ops.
    #[test]
    fn alibi_attention_matches_the_formula_and_its_gradient() {
        use crate::ops::burn_causal_attention;
        type AB = Autodiff<B>;
        let d = Default::default();
        // 40 positions: two causal blocks, the second short.
        let (b, t, w, h) = (2, 40, 8, 2);
        let slopes = [0.5f32, 0.125];
        <B as burn::tensor::backend::Backend>::seed(&d, 17);
        let x = Tensor::<B, 3>::random([b, t, 3 * w], Distribution::Normal(0.0, 1.0), &d);
        let xv: Vec<f32> = x.clone().into_data().to_vec().unwrap();
        let fast: Vec<f32> = causal_attention(x.clone(), h, Some(&slopes))
            .into_data()
            .to_vec()
            .unwrap();
        let (reference, _) =
            burn_causal_attention::<B>(x.clone().into_primitive().tensor(), h, Some(&slopes));
        let reference: Vec<f32> =
            Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(reference))
                .into_data()
                .to_vec()
                .unwrap();
        let dh = w / h;
        let at = |s: usize, i: usize, c: usize| xv[(s * t + i) * 3 * w + c] as f64;
        for s in 0..b {
            for (head, &slope) in slopes.iter().enumerate() {
                for i in 0..t {
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let dot: f64 = (0..dh)
                                .map(|c| at(s, i, head * dh + c) * at(s, j, w + head * dh + c))
                                .sum();
                            dot / (dh as f64).sqrt() - slope as f64 * (i - j) as f64
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|v| (v - max).exp()).sum();
                    for c in 0..dh {
                        let want: f64 = (0..=i)
                            .map(|j| (scores[j] - max).exp() / z * at(s, j, 2 * w + head * dh + c))
                            .sum();
                        let k = (s * t + i) * w + head * dh + c;
                        assert!(
                            (fast[k] as f64 - want).abs() < 1e-5,
                            "fast {k}: {} against {want}",
                            fast[k]
                        );
                        assert!(
                            (reference[k] as f64 - want).abs() < 1e-5,
                            "burn {k}: {} against {want}",
                            reference[k]
                        );
                    }
                }
            }
        }
        // The biases are constants: the gradient through the op equals autodiff's.
        let r = Tensor::<B, 3>::random([b, t, w], Distribution::Normal(0.0, 1.0), &d);
        let grad_of = |fast: bool| -> Vec<f32> {
            let xa = Tensor::<AB, 3>::from_data(x.to_data(), &d).require_grad();
            let ra = Tensor::<AB, 3>::from_data(r.to_data(), &d);
            let out = if fast {
                causal_attention(xa.clone(), h, Some(&slopes))
            } else {
                let (o, _) = burn_causal_attention::<AB>(
                    xa.clone().into_primitive().tensor(),
                    h,
                    Some(&slopes),
                );
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(o))
            };
            let grads = (out * ra).sum().backward();
            xa.grad(&grads).unwrap().into_data().to_vec().unwrap()
        };
        for (a, e) in grad_of(true).iter().zip(&grad_of(false)) {
            assert!((a - e).abs() < 1e-4, "gradient: {a} against {e}");
        }
    }

    /// After ALiBi's surgery the model has no position embeddings, takes inputs up to the new
    /// maximum length, and is still causal.
    #[test]
    fn an_alibi_model_reads_past_its_training_context() {
        let mut m = tiny(true);
        let before = m.num_params();
        assert_eq!(
            m.remove_position_embeddings(32).as_deref(),
            Some("position_embedding")
        );
        let mut heads = Vec::new();
        m.for_each_attention(&mut |info, v| {
            heads.push(info.path.clone());
            v.alibi_slopes = Some(vec![0.25, 0.0625]);
        });
        assert_eq!(heads, ["blocks.0.attention", "blocks.1.attention"]);
        assert_eq!(
            before - m.num_params(),
            8 * 8,
            "the [context, width] embeddings are gone"
        );
        let long: Vec<i64> = (0..20).map(|i| i % 11).collect();
        let a = values(m.logits(tokens(&[&long])));
        assert_eq!(a.len(), 20 * 11);
        let mut changed = long.clone();
        changed[19] = 3;
        let b = values(m.logits(tokens(&[&changed])));
        assert_eq!(a[..19 * 11], b[..19 * 11]);
    }

    /// GatedLinearUnits' surgery: about the same parameters at 2/3 of the hidden width, the
    /// first and second layers' ids kept, and the forward pass as the formula.
    #[test]
    fn gated_mlps_match_the_formula_and_keep_the_parameter_ids() {
        let d = Default::default();
        let mut m = GptConfig::new(11, 8, 2, 2, 12).unwrap().init::<B>(&d, 7);
        let before = m.num_params();
        let ids = (m.blocks[0].mlp.fc.weight.id, m.blocks[0].mlp.proj.weight.id);
        let done = m.gated_linear_units(
            &mut |info| {
                assert_eq!((info.width, info.hidden), (12, 48));
                Some(GluSettings {
                    activation: GluActivation::Silu,
                    hidden: 32,
                    gated_bias: false,
                    non_gated_bias: false,
                })
            },
            3,
        );
        assert_eq!(done, ["blocks.0.mlp", "blocks.1.mlp"]);
        let mlp = &m.blocks[0].mlp;
        assert_eq!((mlp.fc.weight.id, mlp.proj.weight.id), ids);
        // Per block: 2 * 12 * 48 + 48 (fc bias) before; 3 * 12 * 32 after.
        assert_eq!(
            before - m.num_params(),
            2 * (2 * 12 * 48 + 48 - 3 * 12 * 32)
        );
        assert_eq!(mlp.fc.dims(), [12, 32]);
        let x = Tensor::<B, 2>::random([3, 12], Distribution::Normal(0.0, 1.0), &d);
        let got = values(mlp.forward(x.clone()));
        let w = |l: &Linear<B>| -> Vec<f32> { l.weight.val().into_data().to_vec().unwrap() };
        let (wv, wg, wo) = (w(&mlp.fc), w(mlp.gate.as_ref().unwrap()), w(&mlp.proj));
        let bo: Vec<f32> = mlp
            .proj
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .to_vec()
            .unwrap();
        let xv = values(x);
        for r in 0..3 {
            let hidden: Vec<f64> = (0..32)
                .map(|k| {
                    let dot = |wt: &[f32]| -> f64 {
                        (0..12)
                            .map(|i| xv[r * 12 + i] as f64 * wt[i * 32 + k] as f64)
                            .sum()
                    };
                    let g = dot(&wg);
                    g / (1.0 + (-g).exp()) * dot(&wv)
                })
                .collect();
            for c in 0..12 {
                let want: f64 = (0..32)
                    .map(|k| hidden[k] * wo[k * 12 + c] as f64)
                    .sum::<f64>()
                    + bo[c] as f64;
                let g = got[r * 12 + c] as f64;
                assert!(
                    (g - want).abs() < 1e-5,
                    "row {r}, feature {c}: {g} against {want}"
                );
            }
        }
        // The same seed draws the same layers; an MLP already gated is left alone.
        let mut again = GptConfig::new(11, 8, 2, 2, 12).unwrap().init::<B>(&d, 7);
        let settings = |_: &MlpInfo| {
            Some(GluSettings {
                activation: GluActivation::Silu,
                hidden: 32,
                gated_bias: false,
                non_gated_bias: false,
            })
        };
        again.gated_linear_units(&mut settings.clone(), 3);
        assert_eq!(w(&again.blocks[1].mlp.proj), w(&m.blocks[1].mlp.proj));
        assert!(again
            .gated_linear_units(&mut settings.clone(), 3)
            .is_empty());
    }

    /// Layer norm in f16 (emulated on flex) stays within f16's precision of the f32 one.
    #[test]
    fn low_precision_layer_norm_is_close_to_the_float32_one() {
        let d = Default::default();
        let mut norm = LayerNorm::<B>::new(16, &d);
        let x = Tensor::<B, 3>::random([2, 5, 16], Distribution::Normal(1.0, 2.0), &d);
        let exact = values(norm.forward(x.clone()).reshape([10, 16]));
        norm.variant.low_precision = Some(flashover_surgery::HalfType::F16);
        let half = norm.forward(x);
        assert_eq!(
            half.dtype(),
            burn::tensor::DType::F32,
            "cast back to the activations' type"
        );
        let half = values(half.reshape([10, 16]));
        let worst = exact
            .iter()
            .zip(&half)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst > 0.0 && worst < 1e-2, "largest difference {worst}");
    }

    /// Factorize reaches every dense layer of the blocks (and the untied head), and a
    /// full-rank factorization leaves the logits unchanged.
    #[test]
    fn factorize_reaches_the_dense_layers() {
        let mut m = tiny(false);
        let x = tokens(&[&[1, 2, 3, 4]]);
        let before = values(m.logits(x.clone()));
        let done = m.factorize(&mut |_| None, &mut |info| {
            Some(info.in_features.min(info.out_features))
        });
        assert_eq!(done.len(), 2 * 4 + 1, "{done:?}");
        assert_eq!(done[0], "blocks.0.attention.qkv");
        assert_eq!(done[8], "head");
        let after = values(m.logits(x));
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() < 1e-4, "{a} against {b}");
        }
    }

    #[test]
    fn generation_repeats_with_its_seed_and_greedy_is_the_argmax() {
        let d = Default::default();
        let m = tiny(true);
        let sampling = |seed, temperature, top_k| Sampling {
            tokens: 12,
            temperature,
            top_k,
            seed,
        };
        let a = m.generate(&[1, 2, 3], &sampling(5, 1.0, None), &d).unwrap();
        assert_eq!(a.len(), 12);
        assert!(a.iter().all(|&t| t < 11));
        assert_eq!(
            a,
            m.generate(&[1, 2, 3], &sampling(5, 1.0, None), &d).unwrap()
        );
        assert_ne!(
            a,
            m.generate(&[1, 2, 3], &sampling(6, 1.0, None), &d).unwrap()
        );
        // Top-1 sampling is greedy decoding, whatever the seed and temperature.
        let greedy = m.generate(&[1, 2, 3], &sampling(0, 0.0, None), &d).unwrap();
        assert_eq!(
            greedy,
            m.generate(&[1, 2, 3], &sampling(9, 2.0, Some(1)), &d)
                .unwrap()
        );
        // Greedy picks the argmax of the logits at each step.
        let mut text = vec![1u16, 2, 3];
        for &t in &greedy {
            // The model's context is 8: the last 8 tokens.
            let ids: Vec<i64> = text[text.len().saturating_sub(8)..]
                .iter()
                .map(|&t| t as i64)
                .collect();
            let n = ids.len();
            let logits = values(m.logits(tokens(&[&ids])));
            let last = &logits[(n - 1) * 11..];
            let best = (0..11).fold(0, |b, i| if last[i] > last[b] { i } else { b });
            assert_eq!(t as usize, best);
            text.push(t);
        }
        // Longer than the context: the window slides.
        assert_eq!(
            m.generate(&[1; 8], &sampling(1, 1.0, Some(3)), &d)
                .unwrap()
                .len(),
            12
        );
        assert!(sampling(1, -1.0, None)
            .check()
            .unwrap_err()
            .to_string()
            .contains("invalid value -1 for `temperature`"));
        assert!(sampling(1, 1.0, Some(0))
            .check()
            .unwrap_err()
            .to_string()
            .contains("k >= 1"));
        // An empty prompt and invalid settings are errors, not panics.
        assert!(m.generate(&[], &sampling(1, 1.0, None), &d).is_err());
        assert!(m.generate(&[1], &sampling(1, f64::NAN, None), &d).is_err());
    }

    /// Sampling draws each token with its softmax probability (at temperature T).
    #[test]
    fn sampling_follows_the_softmax_at_its_temperature() {
        let logits = [0.0f32, 1.0, 2.0];
        for (t, top_k) in [(1.0, None), (0.5, None), (1.0, Some(2))] {
            let s = Sampling {
                tokens: 1,
                temperature: t,
                top_k,
                seed: 0,
            };
            let mut rng = Rng::new(11);
            let mut counts = [0usize; 3];
            let n = 60_000;
            for _ in 0..n {
                counts[s.pick(&logits, &mut rng)] += 1;
            }
            let kept = top_k.unwrap_or(3);
            let w: Vec<f64> = (0..3)
                .map(|i| {
                    if i >= 3 - kept {
                        (logits[i] as f64 / t).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            let z: f64 = w.iter().sum();
            for i in 0..3 {
                let (got, want) = (counts[i] as f64 / n as f64, w[i] / z);
                assert!(
                    (got - want).abs() < 0.01,
                    "T {t}, top-k {top_k:?}, token {i}: {got} against {want}"
                );
            }
        }
    }

    #[test]
    fn initial_weights_follow_gpt2() {
        let d = Default::default();
        let m = GptConfig::new(50, 16, 8, 4, 64).unwrap().init::<B>(&d, 1);
        let std = |t: Tensor<B, 2>| {
            let v: Vec<f32> = t.into_data().to_vec().unwrap();
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
        };
        let e = std(m.token_embedding.weight.val());
        assert!((e - 0.02).abs() < 0.002, "embedding std {e}");
        let fc = std(m.blocks[0].mlp.fc.weight.val());
        assert!((fc - 0.02).abs() < 0.002, "MLP std {fc}");
        let proj = std(m.blocks[0].mlp.proj.weight.val());
        let want = 0.02 / 4.0; // 1 / sqrt(2 * 8 layers)
        assert!(
            (proj - want).abs() < 0.001,
            "residual projection std {proj}, want {want}"
        );
        let bias: Vec<f32> = m.blocks[0]
            .attention
            .qkv
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .to_vec()
            .unwrap();
        assert!(bias.iter().all(|&b| b == 0.0));
    }

    /// Activation checkpointing (Burn's `BalancedCheckpointing`; the attention recomputes
    /// its probabilities in the backward pass) gives the plain backward pass's gradients,
    /// bit for bit, with learned positions and with ALiBi.
    #[test]
    fn activation_checkpointing_gives_the_same_gradients_bit_for_bit() {
        use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
        use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
        use burn::tensor::backend::AutodiffBackend;

        // One model, drawn once: a second draw could see another test's draws from the
        // backend's generator in between (the tests of this crate run side by side).
        fn grads_of<AB: crate::TrainBackend<InnerBackend = B>>(
            start: &Gpt<B>,
            alibi: bool,
        ) -> Vec<f32> {
            let d = Default::default();
            struct Trainable;
            impl<AB: AutodiffBackend> ModuleMapper<AB> for Trainable {
                fn map_float<const D: usize>(
                    &mut self,
                    p: Param<Tensor<AB, D>>,
                ) -> Param<Tensor<AB, D>> {
                    p.set_require_grad(true)
                }
            }
            let mut m = Gpt::<AB>::from_inner(start.clone()).map(&mut Trainable);
            if alibi {
                m.remove_position_embeddings(16);
                m.for_each_attention(&mut |_, v| v.alibi_slopes = Some(vec![0.25, 0.0625]));
            }
            let ids: Vec<i64> = (0..2 * 16).map(|i| (i * 7 + 3) % 11).collect();
            let x = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids, [2, 16]), &d);
            let logits = m.logits(x);
            let loss = (logits.clone() * logits).mean();
            let grads = loss.backward();
            struct All<'a, AB: AutodiffBackend>(&'a AB::Gradients, Vec<f32>);
            impl<AB: AutodiffBackend> ModuleVisitor<AB> for All<'_, AB> {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
                    if let Some(g) = p.val().grad(self.0) {
                        self.1.extend(g.into_data().to_vec::<f32>().unwrap());
                    }
                }
            }
            let mut v = All::<AB>(&grads, Vec::new());
            m.visit(&mut v);
            v.1
        }
        let start = GptConfig::new(11, 16, 2, 2, 8)
            .unwrap()
            .init::<B>(&Default::default(), 7);
        for alibi in [false, true] {
            let plain = grads_of::<Autodiff<B>>(&start, alibi);
            let checkpointed = grads_of::<Autodiff<B, BalancedCheckpointing>>(&start, alibi);
            assert!(!plain.is_empty() && plain.iter().any(|&g| g != 0.0));
            assert!(plain == checkpointed, "alibi {alibi}: the gradients differ");
        }
    }

    /// The fast path (fused dense layers with GELU or the residual, fused layer norms, the
    /// attention kernel, the fused cross-entropy) and Burn's tensor ops (`burn_ops`) compute
    /// the same model: the same loss and every parameter's gradient to float32 rounding,
    /// with and without ALiBi, tied and untied.
    #[test]
    fn the_fast_path_and_burns_ops_give_the_same_loss_and_gradients() {
        use burn::backend::autodiff::grads::Gradients;
        use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor};
        type AB = Autodiff<B>;
        struct Trainable;
        impl ModuleMapper<AB> for Trainable {
            fn map_float<const D: usize>(
                &mut self,
                p: Param<Tensor<AB, D>>,
            ) -> Param<Tensor<AB, D>> {
                p.set_require_grad(true)
            }
        }
        struct All<'a>(&'a Gradients, Vec<f32>);
        impl ModuleVisitor<AB> for All<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
                let g = p
                    .val()
                    .grad(self.0)
                    .expect("every parameter has a gradient");
                self.1.extend(g.into_data().to_vec::<f32>().unwrap());
            }
        }
        for (alibi, tie) in [(false, true), (true, true), (false, false)] {
            let start = GptConfig::new(13, 24, 2, 3, 12)
                .unwrap()
                .with_tied_weights(tie)
                .init::<B>(&Default::default(), 9);
            let run = |burn_ops: bool| -> (f32, Vec<f32>) {
                let mut m = Gpt::<AB>::from_inner(start.clone()).map(&mut Trainable);
                m.burn_ops = burn_ops;
                if alibi {
                    m.remove_position_embeddings(24);
                    m.for_each_attention(&mut |_, v| v.alibi_slopes = Some(vec![0.5, 0.25, 0.125]));
                }
                let d = Default::default();
                let ids: Vec<i64> = (0..3 * 21).map(|i| (i * 5 + 2) % 13).collect();
                let tokens = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids, [3, 21]), &d);
                let targets: Vec<i64> = (0..3 * 21).map(|i| (i * 3 + 1) % 13).collect();
                let targets =
                    Tensor::<AB, 2, Int>::from_data(TensorData::new(targets, [3, 21]), &d);
                // The training step's loss: the fused cross-entropy on the fast path.
                let batch = TokenBatch::new(tokens, targets);
                let logits = TrainModel::forward(&m, &batch);
                let loss = m.loss(&logits, &batch);
                let value = loss.clone().into_scalar();
                let grads = loss.backward();
                let mut all = All(&grads, Vec::new());
                m.visit(&mut all);
                (value, all.1)
            };
            let (fast_loss, fast) = run(false);
            let (burn_loss, burn) = run(true);
            assert!(
                (fast_loss - burn_loss).abs() < 1e-5,
                "alibi {alibi}, tied {tie}: loss {fast_loss} vs {burn_loss}"
            );
            assert_eq!(fast.len(), burn.len());
            let worst = fast
                .iter()
                .zip(&burn)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-5,
                "alibi {alibi}, tied {tie}: gradients differ by up to {worst}"
            );
            assert!(fast.iter().any(|&g| g != 0.0));
        }
    }
}
