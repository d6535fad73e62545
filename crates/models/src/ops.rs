//! The backend extension: [`ChannelsLastBackend`], convolution and pooling on channels-last
//! (NHWC) activations, following Burn's "backend extension" pattern (a trait on the backend
//! with the forward passes per backend, and an implementation for `Autodiff<B>` that records
//! the backward passes).
//!
//! Weights keep Burn's layout (`[out, in / groups, kh, kw]`), so a model's parameters,
//! checkpoints and optimizer state are the same in either layout; only activations change.
//!
//! - **Default methods** (wgpu, CUDA, ndarray): Burn's own kernels, with the activations
//!   permuted to channels-first and back around each call. GPU backends keep Burn's kernels
//!   this way; a model only takes this path when asked to run channels-last there.
//! - **Flex** (feature `flex`): the hand-written kernels of [`crate::kernels`] on `f32`
//!   (other float types take the default methods). Bit-identical for any thread count.
//! - **`Autodiff<B>`**: forward through `B`, backward through `B`'s backward methods; the
//!   max-pool indices and the ReLU output needed by the backward pass are kept in the node.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

use crate::optim_kernels::AdamWStep;

/// Gradients of a layer of the extension (channels-last convolution or dense layer), each
/// present when it was asked for.
#[derive(Debug)]
pub struct LayerGrads<B: Backend> {
    /// Of the input (NHWC for a convolution, `[rows, d_in]` for a dense layer).
    pub x: Option<FloatTensor<B>>,
    /// Of the weights (Burn's layout).
    pub weight: Option<FloatTensor<B>>,
    /// Of the bias.
    pub bias: Option<FloatTensor<B>>,
}

/// Convolution and pooling on channels-last activations `[batch, height, width, channels]`,
/// and the dense layer with a fused ReLU that follows them in the reference models.
///
/// Implemented for every backend the workspace compiles and their `Autodiff` wrappers; the
/// CPU backend `Flex` has fast kernels, the others run Burn's own kernels (see the module
/// docs). Padding is symmetric, as in Burn's `ConvOptions`; the layers pad asymmetric cases
/// explicitly.
pub trait ChannelsLastBackend: Backend {
    /// Whether this backend's channels-last path is its fast one, so that models built for
    /// it run channels-last unless told otherwise ([`MemoryFormat::Auto`]).
    ///
    /// [`MemoryFormat::Auto`]: crate::MemoryFormat::Auto
    const CHANNELS_LAST_IS_FAST: bool = false;

    /// 2-D convolution of NHWC `x` by `weight` (`[out, in / groups, kh, kw]`), plus `bias`,
    /// then ReLU when `relu` (the fused activation); NHWC output.
    fn conv2d_nhwc(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        relu: bool,
    ) -> FloatTensor<Self> {
        burn_conv2d_nhwc::<Self>(x, weight, bias, options, relu)
    }

    /// Gradients of [`conv2d_nhwc`](Self::conv2d_nhwc) for the output gradient `grad`.
    /// `output` is the forward's output, needed (and given) when `relu` was fused. `needs`
    /// says which of the input, weight and bias gradients to compute.
    #[allow(clippy::too_many_arguments)]
    fn conv2d_nhwc_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        output: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        needs: [bool; 3],
    ) -> LayerGrads<Self> {
        burn_conv2d_nhwc_backward::<Self>(x, weight, bias, output, grad, options, needs)
    }

    /// 2-D max pooling of NHWC `x`.
    fn max_pool2d_nhwc(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> FloatTensor<Self> {
        Self::max_pool2d_nhwc_with_indices(x, kernel, stride, padding, dilation).0
    }

    /// 2-D max pooling of NHWC `x`, with the indices its backward pass needs (their layout
    /// is the backend's own: only [`max_pool2d_nhwc_backward`] reads them).
    ///
    /// [`max_pool2d_nhwc_backward`]: Self::max_pool2d_nhwc_backward
    fn max_pool2d_nhwc_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        burn_max_pool2d_nhwc_with_indices::<Self>(x, kernel, stride, padding, dilation)
    }

    /// Gradient of max pooling for the NHWC output gradient `grad`.
    #[allow(clippy::too_many_arguments)]
    fn max_pool2d_nhwc_backward(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        indices: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        burn_max_pool2d_nhwc_backward::<Self>(x, kernel, stride, padding, dilation, indices, grad)
    }

    /// 2-D average pooling of NHWC `x`; padding counts in the divisor when
    /// `count_include_pad`.
    fn avg_pool2d_nhwc(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> FloatTensor<Self> {
        burn_avg_pool2d_nhwc::<Self>(x, kernel, stride, padding, count_include_pad)
    }

    /// Gradient of average pooling for the NHWC output gradient `grad`.
    fn avg_pool2d_nhwc_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> FloatTensor<Self> {
        burn_avg_pool2d_nhwc_backward::<Self>(x, grad, kernel, stride, padding, count_include_pad)
    }

    /// NHWC `x` as NCHW: the layout change between the channels-last features and a
    /// classifier that reads them channels-first. By default Burn's `permute` (a strided
    /// view, copied when it is next reshaped); the fast path copies it at once, in parallel.
    fn nhwc_to_nchw(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_permute(x, &TO_NCHW)
    }

    /// NCHW `x` as NHWC: the gradient of [`nhwc_to_nchw`](Self::nhwc_to_nchw).
    fn nchw_to_nhwc(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_permute(x, &TO_NHWC)
    }

    /// Dense layer `x · weight + bias` for `x: [rows, d_in]` and `weight: [d_in, d_out]`
    /// (Burn's `Linear` layout), then ReLU when `relu`. The fast path splits the batch
    /// between threads (Burn's CPU matrix product uses one).
    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        relu: bool,
    ) -> FloatTensor<Self> {
        burn_dense::<Self>(x, weight, bias, relu)
    }

    /// Gradients of [`dense`](Self::dense) for the output gradient `grad`; `output` is the
    /// forward's output, given when `relu` was fused. `needs`: input, weight, bias.
    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        needs: [bool; 3],
    ) -> LayerGrads<Self> {
        burn_dense_backward::<Self>(x, weight, output, grad, needs)
    }

    /// Dense layer with a residual: `residual + (x · weight + bias)` for `x: [rows, d_in]`
    /// and `residual: [rows, d_out]` (a transformer block's `x + layer(x')`). By default
    /// Burn's `linear` and add; the fast path adds the bias and the residual to each chunk
    /// of the product while it is in cache (one pass over the output instead of two, on the
    /// threads). The residual's gradient is the output gradient itself; the others are
    /// [`dense_backward`](Self::dense_backward)'s.
    fn dense_residual(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        burn_dense_residual::<Self>(x, weight, bias, residual)
    }

    /// Dense layer `x · weight + bias` followed by GELU (the exact one, through the error
    /// function) for `x: [rows, d_in]`. By default Burn's `linear` and `gelu`; the fast path
    /// applies the bias and GELU to each chunk of the product while it is in cache.
    fn dense_gelu(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::dense_gelu_with_pre(x, weight, bias).0
    }

    /// [`dense_gelu`](Self::dense_gelu) and the pre-activation `x · weight + bias` its
    /// backward pass needs.
    fn dense_gelu_with_pre(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        burn_dense_gelu::<Self>(x, weight, bias)
    }

    /// Gradients of [`dense_gelu`](Self::dense_gelu) for the output gradient `grad`, from
    /// the input, weight and pre-activation. `needs`: input, weight, bias.
    fn dense_gelu_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        pre: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        needs: [bool; 3],
    ) -> LayerGrads<Self> {
        burn_dense_gelu_backward::<Self>(x, weight, pre, grad, needs)
    }

    /// Layer norm of the rows of `x: [rows, width]` (biased variance, `epsilon` added before
    /// the square root), scaled by `gamma` and shifted by `beta` (both `[width]`). By default
    /// Burn's tensor ops; the fast path is one fused pass per row (`crate::norm_kernels`).
    fn layer_norm_rows(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        Self::layer_norm_rows_with_stats(x, gamma, beta, epsilon).0
    }

    /// [`layer_norm_rows`](Self::layer_norm_rows) and each row's mean and standard deviation
    /// (`[rows, 2]`), which its backward pass needs.
    fn layer_norm_rows_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        burn_layer_norm::<Self>(x, gamma, beta, epsilon)
    }

    /// Gradients of [`layer_norm_rows`](Self::layer_norm_rows) for the output gradient `grad`:
    /// `x` of the input, `weight` of `gamma`, `bias` of `beta`, each when `needs` asks.
    fn layer_norm_rows_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        needs: [bool; 3],
    ) -> LayerGrads<Self> {
        burn_layer_norm_backward::<Self>(x, gamma, stats, grad, needs)
    }

    /// Causal multi-head self-attention of `qkv: [batch, seq, 3 * width]` (queries, keys
    /// and values, each `heads` heads side by side): per head `softmax(q kᵀ / sqrt(d))` over
    /// the positions at or before each query, times `v`; output `[batch, seq, width]`, the
    /// heads side by side. With `alibi` (one slope per head, ALiBi), head `h`'s score of
    /// query `i` for key `j` gets `-alibi[h] * (i - j)` added before the softmax. By default
    /// Burn's tensor ops; the fast path reads the heads in place (no transposes) and splits
    /// the sequences between threads.
    fn causal_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        alibi: Option<&[f32]>,
    ) -> FloatTensor<Self> {
        Self::causal_attention_with_probs(qkv, heads, alibi).0
    }

    /// [`causal_attention`](Self::causal_attention) and its probabilities `[batch, heads,
    /// seq, seq]` (0 above the diagonal), which its backward pass needs (the biases are
    /// constants: the backward pass is the same with or without them).
    fn causal_attention_with_probs(
        qkv: FloatTensor<Self>,
        heads: usize,
        alibi: Option<&[f32]>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        burn_causal_attention::<Self>(qkv, heads, alibi)
    }

    /// The gradient of [`causal_attention`](Self::causal_attention) with respect to `qkv`,
    /// for the output gradient `grad`.
    fn causal_attention_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        burn_causal_attention_backward::<Self>(qkv, probs, grad, heads)
    }

    /// `x + positions` for `x: [batch, seq, width]` and `positions: [seq, width]`: the same
    /// rows added to each sequence (a transformer's learned position embeddings). By
    /// default Burn's broadcasting add; the fast path adds one sequence per chunk on the
    /// threads (flex's broadcast walks strided indices on one thread). The gradient of `x` is
    /// the output gradient; of `positions`, [`positions_grad`](Self::positions_grad).
    fn add_positions(x: FloatTensor<Self>, positions: FloatTensor<Self>) -> FloatTensor<Self> {
        let positions = tensor::<Self, 2>(positions).unsqueeze::<3>();
        primitive(tensor::<Self, 3>(x) + positions)
    }

    /// The gradient of [`add_positions`](Self::add_positions) with respect to `positions`
    /// for the output gradient `grad: [batch, seq, width]`: its sum over the batch, `[seq,
    /// width]`.
    fn positions_grad(grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let grad = tensor::<Self, 3>(grad);
        let [_, t, w] = grad.dims();
        primitive(grad.sum_dim(0).reshape([t, w]))
    }

    /// One AdamW step of a flat parameter (`[n]`, with its gradient and, after the first
    /// step, both moments): the new parameter and moments, exactly as Burn's `AdamW`
    /// computes them (see [`crate::optim_kernels`]). By default Burn's tensor ops in Burn's order;
    /// the fast path reads each input once and writes each output once, on the threads.
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: &AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m1, m2) = crate::optim_kernels::burn_adamw_step::<Self>(
            tensor(param),
            tensor(grad),
            moments.map(|(m1, m2)| (tensor(m1), tensor(m2))),
            step,
        );
        (primitive(p), primitive(m1), primitive(m2))
    }

    /// Mean cross-entropy of `logits: [rows, classes]` against class indices `targets:
    /// [rows]`, a `[1]` tensor: the mean over the rows of `logsumexp(row) - row[target]`
    /// (PyTorch's `cross_entropy`, mean reduction). By default Burn's tensor ops; the fast
    /// path is one pass per row on the threads (`crate::loss_kernels`). The targets must be
    /// classes (the fast path panics naming the first that is not; callers with untrusted
    /// targets check them with `flashover_core::loss::check_class_indices`).
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        Self::cross_entropy_with_lse(logits, targets).0
    }

    /// [`cross_entropy`](Self::cross_entropy) and each row's log-sum-exp `[rows]`, which its
    /// backward pass needs.
    fn cross_entropy_with_lse(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        burn_cross_entropy::<Self>(logits, targets)
    }

    /// The gradient of [`cross_entropy`](Self::cross_entropy) with respect to the logits for
    /// the output gradient `grad` (`[1]`): `(softmax(row) - onehot(target)) · grad / rows`.
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        burn_cross_entropy_backward::<Self>(logits, targets, lse, grad)
    }
}

/// `qkv: [batch, seq, 3 * width]` as queries, keys and values `[batch, heads, seq, head]`.
fn split_heads<B: Backend>(qkv: Tensor<B, 3>, heads: usize) -> [Tensor<B, 4>; 3] {
    let [b, t, w3] = qkv.dims();
    let dh = w3 / 3 / heads;
    let qkv = qkv.reshape([b, t, 3, heads, dh]);
    let part = |i: usize| {
        qkv.clone()
            .narrow(2, i, 1)
            .reshape([b, t, heads, dh])
            .swap_dims(1, 2)
    };
    [part(0), part(1), part(2)]
}

/// `[batch, heads, seq, head]` back to `[batch, seq, heads * head]`.
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, h, t, dh] = x.dims();
    x.swap_dims(1, 2).reshape([b, t, h * dh])
}

/// [`ChannelsLastBackend::causal_attention_with_probs`] through Burn's tensor ops.
pub fn burn_causal_attention<B: Backend>(
    qkv: FloatTensor<B>,
    heads: usize,
    alibi: Option<&[f32]>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let qkv = tensor::<B, 3>(qkv);
    let [_, t, w3] = qkv.dims();
    let device = qkv.device();
    let dh = w3 / 3 / heads;
    let [q, k, v] = split_heads(qkv, heads);
    // The causal mask, with each head's ALiBi biases below the diagonal.
    let bias_heads = if alibi.is_some() { heads } else { 1 };
    let mask: Vec<f32> = (0..bias_heads * t * t)
        .map(|n| {
            let (h, i, j) = (n / (t * t), n / t % t, n % t);
            if j > i {
                f32::NEG_INFINITY
            } else {
                alibi.map_or(0.0, |slopes| alibi_bias(slopes[h], i, j))
            }
        })
        .collect();
    let mask = Tensor::<B, 4>::from_data(
        burn::tensor::TensorData::new(mask, [1, bias_heads, t, t]),
        &device,
    );
    // The softmax in float32 whatever the activations' type (as PyTorch's autocast runs
    // it), its probabilities back in that type.
    let dtype = q.dtype();
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(1.0 / (dh as f64).sqrt());
    let scores =
        flashover_core::precision::cast_to(scores, burn::tensor::FloatDType::F32).add(mask);
    let probs =
        flashover_core::precision::cast_like(burn::tensor::activation::softmax(scores, 3), dtype);
    let out = merge_heads(probs.clone().matmul(v));
    (primitive(out), primitive(probs))
}

/// ALiBi's bias of query `i` for key `j <= i` (defined beside the kernels, which use it too).
pub use crate::kernels::alibi_bias;

/// [`ChannelsLastBackend::causal_attention_backward`] through Burn's tensor ops.
pub fn burn_causal_attention_backward<B: Backend>(
    qkv: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    heads: usize,
) -> FloatTensor<B> {
    let qkv = tensor::<B, 3>(qkv);
    let [b, t, w3] = qkv.dims();
    let dh = w3 / 3 / heads;
    let [q, k, v] = split_heads(qkv, heads);
    let p = tensor::<B, 4>(probs);
    let d_out = tensor::<B, 3>(grad)
        .reshape([b, t, heads, dh])
        .swap_dims(1, 2);
    let dv = p.clone().swap_dims(2, 3).matmul(d_out.clone());
    let dp = d_out.matmul(v.swap_dims(2, 3));
    let dot = (dp.clone() * p.clone()).sum_dim(3);
    let ds = (p * (dp - dot)).mul_scalar(1.0 / (dh as f64).sqrt());
    let dq = ds.clone().matmul(k);
    let dk = ds.swap_dims(2, 3).matmul(q);
    let parts: Vec<Tensor<B, 5>> = [dq, dk, dv]
        .into_iter()
        .map(|x| merge_heads(x).reshape([b, t, 1, heads, dh]))
        .collect();
    primitive(Tensor::cat(parts, 2).reshape([b, t, w3]))
}

/// NHWC to NCHW.
pub(crate) const TO_NCHW: [usize; 4] = [0, 3, 1, 2];
/// NCHW to NHWC.
pub(crate) const TO_NHWC: [usize; 4] = [0, 2, 3, 1];

fn tensor<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// [`ChannelsLastBackend::conv2d_nhwc`] through Burn's own convolution.
pub fn burn_conv2d_nhwc<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
    relu: bool,
) -> FloatTensor<B> {
    let x = B::float_permute(x, &TO_NCHW);
    let y = tensor::<B, 4>(B::conv2d(x, weight, bias, options));
    let y = if relu {
        burn::tensor::activation::relu(y)
    } else {
        y
    };
    B::float_permute(primitive(y), &TO_NHWC)
}

/// [`ChannelsLastBackend::conv2d_nhwc_backward`] through Burn's own backward kernels.
pub fn burn_conv2d_nhwc_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    output: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    options: ConvOptions<2>,
    needs: [bool; 3],
) -> LayerGrads<B> {
    let grad = relu_masked::<B, 4>(grad, output);
    let x = B::float_permute(x, &TO_NCHW);
    let grad = B::float_permute(grad, &TO_NCHW);
    let dx = needs[0].then(|| {
        let dx = B::conv2d_x_backward(x.clone(), weight.clone(), grad.clone(), options.clone());
        B::float_permute(dx, &TO_NHWC)
    });
    let dw = needs[1]
        .then(|| B::conv2d_weight_backward(x.clone(), weight, grad.clone(), options.clone()));
    let db = match bias {
        Some(b) if needs[2] => Some(B::conv2d_bias_backward(x, b, grad)),
        _ => None,
    };
    LayerGrads {
        x: dx,
        weight: dw,
        bias: db,
    }
}

/// The output gradient with ReLU's gradient applied where `output` (a ReLU's) is given:
/// it passes where the output is positive (Burn's rule).
fn relu_masked<B: Backend, const D: usize>(
    grad: FloatTensor<B>,
    output: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    match output {
        Some(y) => {
            let y = tensor::<B, D>(y);
            primitive(tensor::<B, D>(grad).mask_fill(y.lower_equal_elem(0.0), 0.0))
        }
        None => grad,
    }
}

/// [`ChannelsLastBackend::dense`] through Burn's own linear op and ReLU.
pub fn burn_dense<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    relu: bool,
) -> FloatTensor<B> {
    let y = B::linear(x, weight, bias);
    if relu {
        primitive(burn::tensor::activation::relu(tensor::<B, 2>(y)))
    } else {
        y
    }
}

/// [`ChannelsLastBackend::dense_residual`] through Burn's own linear op and add.
pub fn burn_dense_residual<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    residual: FloatTensor<B>,
) -> FloatTensor<B> {
    B::float_add(residual, B::linear(x, weight, bias))
}

/// [`ChannelsLastBackend::cross_entropy_with_lse`] through Burn's tensor ops.
pub fn burn_cross_entropy<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = tensor::<B, 2>(logits);
    let [n, _] = logits.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let max = logits.clone().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = logits.gather(1, targets.reshape([n, 1]));
    let loss = (lse.clone() - picked).mean();
    (primitive(loss), primitive(lse.reshape([n])))
}

/// [`ChannelsLastBackend::cross_entropy_backward`] through Burn's tensor ops.
pub fn burn_cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let logits = tensor::<B, 2>(logits);
    let [n, classes] = logits.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let softmax = (logits - tensor::<B, 1>(lse).reshape([n, 1])).exp();
    let onehot = targets.one_hot::<2>(classes).float();
    let scale = tensor::<B, 1>(grad).reshape([1, 1]).div_scalar(n as f64);
    primitive((softmax - onehot) * scale)
}

/// [`ChannelsLastBackend::dense_backward`] through Burn's own backward ops.
pub fn burn_dense_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    output: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    needs: [bool; 3],
) -> LayerGrads<B> {
    let grad = relu_masked::<B, 2>(grad, output);
    LayerGrads {
        x: needs[0].then(|| B::linear_x_backward(weight, grad.clone())),
        weight: needs[1].then(|| B::linear_weight_backward(x, grad.clone())),
        bias: needs[2].then(|| B::linear_bias_backward(grad)),
    }
}

/// [`ChannelsLastBackend::dense_gelu_with_pre`] through Burn's `linear` and `gelu`.
pub fn burn_dense_gelu<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let pre = B::linear(x, weight, bias);
    (B::gelu(pre.clone()), pre)
}

/// [`ChannelsLastBackend::dense_gelu_backward`] through Burn's `gelu_backward` and linear
/// backward ops.
pub fn burn_dense_gelu_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    pre: FloatTensor<B>,
    grad: FloatTensor<B>,
    needs: [bool; 3],
) -> LayerGrads<B> {
    let grad = B::gelu_backward(pre, grad);
    burn_dense_backward::<B>(x, weight, None, grad, needs)
}

/// [`ChannelsLastBackend::layer_norm_rows_with_stats`] through Burn's tensor ops (the statistics
/// as `[rows, 2]`: mean, standard deviation).
pub fn burn_layer_norm<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = tensor::<B, 2>(x);
    let [n, w] = x.dims();
    let mean = x.clone().mean_dim(1);
    let centered = x.sub(mean.clone().repeat_dim(1, w));
    let std = centered
        .clone()
        .square()
        .mean_dim(1)
        .add_scalar(epsilon)
        .sqrt();
    let gamma = tensor::<B, 1>(gamma).reshape([1, w]).repeat_dim(0, n);
    let beta = tensor::<B, 1>(beta).reshape([1, w]).repeat_dim(0, n);
    let y = centered
        .div(std.clone().repeat_dim(1, w))
        .mul(gamma)
        .add(beta);
    (primitive(y), primitive(Tensor::cat(vec![mean, std], 1)))
}

/// [`ChannelsLastBackend::layer_norm_rows_backward`] through Burn's tensor ops.
pub fn burn_layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    stats: FloatTensor<B>,
    grad: FloatTensor<B>,
    needs: [bool; 3],
) -> LayerGrads<B> {
    let x = tensor::<B, 2>(x);
    let [n, w] = x.dims();
    let stats = tensor::<B, 2>(stats);
    let mean = stats.clone().narrow(1, 0, 1).repeat_dim(1, w);
    let std = stats.narrow(1, 1, 1).repeat_dim(1, w);
    let xhat = x.sub(mean).div(std.clone());
    let dy = tensor::<B, 2>(grad);
    let gamma = tensor::<B, 1>(gamma).reshape([1, w]).repeat_dim(0, n);
    let gh = dy.clone().mul(gamma);
    let dx = needs[0].then(|| {
        let mean_g = gh.clone().mean_dim(1).repeat_dim(1, w);
        let mean_gx = gh.clone().mul(xhat.clone()).mean_dim(1).repeat_dim(1, w);
        primitive(gh.sub(mean_g).sub(xhat.clone().mul(mean_gx)).div(std))
    });
    LayerGrads {
        x: dx,
        weight: needs[1].then(|| primitive(dy.clone().mul(xhat).sum_dim(0).reshape([w]))),
        bias: needs[2].then(|| primitive(dy.sum_dim(0).reshape([w]))),
    }
}

/// [`ChannelsLastBackend::max_pool2d_nhwc_with_indices`] through Burn's own kernel.
pub fn burn_max_pool2d_nhwc_with_indices<B: Backend>(
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
) -> (FloatTensor<B>, IntTensor<B>) {
    let x = B::float_permute(x, &TO_NCHW);
    let out = B::max_pool2d_with_indices(x, kernel, stride, padding, dilation, false);
    (B::float_permute(out.output, &TO_NHWC), out.indices)
}

/// [`ChannelsLastBackend::max_pool2d_nhwc_backward`] through Burn's own kernel.
pub fn burn_max_pool2d_nhwc_backward<B: Backend>(
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    indices: IntTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = B::float_permute(x, &TO_NCHW);
    let grad = B::float_permute(grad, &TO_NCHW);
    let dx = B::max_pool2d_with_indices_backward(
        x, kernel, stride, padding, dilation, false, grad, indices,
    );
    B::float_permute(dx.x_grad, &TO_NHWC)
}

/// [`ChannelsLastBackend::avg_pool2d_nhwc`] through Burn's own kernel.
pub fn burn_avg_pool2d_nhwc<B: Backend>(
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
) -> FloatTensor<B> {
    let x = B::float_permute(x, &TO_NCHW);
    let out = B::avg_pool2d(x, kernel, stride, padding, count_include_pad, false);
    B::float_permute(out, &TO_NHWC)
}

/// [`ChannelsLastBackend::avg_pool2d_nhwc_backward`] through Burn's own kernel.
pub fn burn_avg_pool2d_nhwc_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
) -> FloatTensor<B> {
    let x = B::float_permute(x, &TO_NCHW);
    let grad = B::float_permute(grad, &TO_NCHW);
    let dx = B::avg_pool2d_backward(x, grad, kernel, stride, padding, count_include_pad, false);
    B::float_permute(dx, &TO_NHWC)
}

#[cfg(feature = "flex")]
mod flex {
    //! The fast path: flex's `f32` tensors handed to [`crate::kernels`] without copies
    //! (unless a tensor is a strided view, which is made contiguous first).
    use burn::backend::Flex;
    use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, IntTensor};
    use burn::tensor::{DType, TensorData, TensorMetadata};
    use burn_flex::FlexTensor;

    use super::{
        burn_avg_pool2d_nhwc, burn_avg_pool2d_nhwc_backward, burn_causal_attention,
        burn_causal_attention_backward, burn_conv2d_nhwc, burn_conv2d_nhwc_backward,
        burn_cross_entropy, burn_cross_entropy_backward, burn_dense, burn_dense_backward,
        burn_dense_gelu, burn_dense_gelu_backward, burn_dense_residual, burn_layer_norm,
        burn_layer_norm_backward, burn_max_pool2d_nhwc_backward, burn_max_pool2d_nhwc_with_indices,
        ChannelsLastBackend, LayerGrads,
    };
    use super::{primitive, tensor};
    use crate::kernels::{self, AttentionShape, Conv2dShape, DenseShape, Pool2dShape};
    use crate::loss_kernels::{self, ClassesShape};
    use crate::norm_kernels::{self, RowsShape};
    use crate::optim_kernels::AdamWStep;

    fn is_f32(t: &FlexTensor) -> bool {
        t.dtype() == DType::F32
    }

    /// `t` with its elements in order, starting at its buffer's first element.
    fn contiguous(t: FlexTensor) -> FlexTensor {
        if t.as_slice::<f32>().is_some() || t.as_slice::<i32>().is_some() {
            t
        } else {
            t.to_contiguous()
        }
    }

    fn f32s(t: &FlexTensor) -> &[f32] {
        // Invariant: callers checked the dtype (`is_f32`) and made `t` contiguous.
        t.as_slice::<f32>()
            .expect("a contiguous f32 tensor (checked by the caller)")
    }

    fn dims4(t: &FlexTensor) -> [usize; 4] {
        let shape = t.shape();
        assert_eq!(shape.num_dims(), 4, "a 4-D tensor, got shape {shape:?}");
        shape.dims::<4>()
    }

    /// The shape of a dense layer of 2-D `x` by 2-D `weight`, if they are that.
    fn dense_shape(x: &FlexTensor, weight: &FlexTensor) -> Option<DenseShape> {
        let (xs, ws) = (x.shape(), weight.shape());
        if xs.num_dims() != 2 || ws.num_dims() != 2 {
            return None;
        }
        let ([rows, d_in], [w_in, d_out]) = (xs.dims::<2>(), ws.dims::<2>());
        assert_eq!(
            d_in, w_in,
            "dense layer of a [{rows}, {d_in}] input by a [{w_in}, {d_out}] weight: the input's \
             features must be the weight's rows"
        );
        Some(DenseShape { rows, d_in, d_out })
    }

    fn float2(values: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape))
    }

    fn float(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape))
    }

    fn vector(values: Vec<f32>) -> FlexTensor {
        let n = values.len();
        FlexTensor::from_data(TensorData::new(values, [n]))
    }

    fn pool_shape(
        x: &FlexTensor,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Pool2dShape {
        Pool2dShape::new(dims4(x), kernel, stride, padding, dilation)
    }

    impl ChannelsLastBackend for Flex {
        const CHANNELS_LAST_IS_FAST: bool = true;

        fn conv2d_nhwc(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
            options: ConvOptions<2>,
            relu: bool,
        ) -> FloatTensor<Self> {
            if !is_f32(&x) || !is_f32(&weight) || bias.as_ref().is_some_and(|b| !is_f32(b)) {
                return burn_conv2d_nhwc::<Self>(x, weight, bias, options, relu);
            }
            let (x, weight) = (contiguous(x), contiguous(weight));
            let bias = bias.map(contiguous);
            let s = Conv2dShape::new(
                dims4(&x),
                dims4(&weight),
                options.stride,
                options.padding,
                options.dilation,
                options.groups,
            );
            let out =
                kernels::conv2d_forward(&s, f32s(&x), f32s(&weight), bias.as_ref().map(f32s), relu);
            float(out, [s.batch, s.out_h, s.out_w, s.out_c])
        }

        fn conv2d_nhwc_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
            output: Option<FloatTensor<Self>>,
            grad: FloatTensor<Self>,
            options: ConvOptions<2>,
            needs: [bool; 3],
        ) -> LayerGrads<Self> {
            let all_f32 = is_f32(&x)
                && is_f32(&weight)
                && is_f32(&grad)
                && output.as_ref().is_none_or(is_f32);
            if !all_f32 {
                return burn_conv2d_nhwc_backward::<Self>(
                    x, weight, bias, output, grad, options, needs,
                );
            }
            let (x, weight, grad) = (contiguous(x), contiguous(weight), contiguous(grad));
            let output = output.map(contiguous);
            let s = Conv2dShape::new(
                dims4(&x),
                dims4(&weight),
                options.stride,
                options.padding,
                options.dilation,
                options.groups,
            );
            let needs = [needs[0], needs[1], needs[2] && bias.is_some()];
            let g = kernels::conv2d_backward(
                &s,
                f32s(&x),
                f32s(&weight),
                output.as_ref().map(f32s),
                f32s(&grad),
                needs,
            );
            LayerGrads {
                x: g.x.map(|v| float(v, [s.batch, s.in_h, s.in_w, s.in_c])),
                weight: g.weight.map(|v| float(v, dims4(&weight))),
                bias: g.bias.map(vector),
            }
        }

        fn max_pool2d_nhwc_with_indices(
            x: FloatTensor<Self>,
            kernel: [usize; 2],
            stride: [usize; 2],
            padding: [usize; 2],
            dilation: [usize; 2],
        ) -> (FloatTensor<Self>, IntTensor<Self>) {
            if !is_f32(&x) {
                return burn_max_pool2d_nhwc_with_indices::<Self>(
                    x, kernel, stride, padding, dilation,
                );
            }
            let x = contiguous(x);
            let s = pool_shape(&x, kernel, stride, padding, dilation);
            let (out, idx) = kernels::max_pool2d_forward(&s, f32s(&x));
            let shape = [s.batch, s.out_h, s.out_w, s.channels];
            (
                float(out, shape),
                FlexTensor::from_data(TensorData::new(idx, shape)),
            )
        }

        fn max_pool2d_nhwc_backward(
            x: FloatTensor<Self>,
            kernel: [usize; 2],
            stride: [usize; 2],
            padding: [usize; 2],
            dilation: [usize; 2],
            indices: IntTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            if !is_f32(&grad) || indices.dtype() != DType::I32 {
                return burn_max_pool2d_nhwc_backward::<Self>(
                    x, kernel, stride, padding, dilation, indices, grad,
                );
            }
            let (grad, indices) = (contiguous(grad), contiguous(indices));
            let s = pool_shape(&x, kernel, stride, padding, dilation);
            let idx = indices
                .as_slice::<i32>()
                // Invariant: the dtype was checked above and `contiguous` made it so.
                .expect("contiguous i32 indices (checked above)");
            let dx = kernels::max_pool2d_backward(&s, idx, f32s(&grad));
            float(dx, [s.batch, s.in_h, s.in_w, s.channels])
        }

        fn avg_pool2d_nhwc(
            x: FloatTensor<Self>,
            kernel: [usize; 2],
            stride: [usize; 2],
            padding: [usize; 2],
            count_include_pad: bool,
        ) -> FloatTensor<Self> {
            if !is_f32(&x) {
                return burn_avg_pool2d_nhwc::<Self>(x, kernel, stride, padding, count_include_pad);
            }
            let x = contiguous(x);
            let s = pool_shape(&x, kernel, stride, padding, [1, 1]);
            let out = kernels::avg_pool2d_forward(&s, f32s(&x), count_include_pad);
            float(out, [s.batch, s.out_h, s.out_w, s.channels])
        }

        fn avg_pool2d_nhwc_backward(
            x: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            kernel: [usize; 2],
            stride: [usize; 2],
            padding: [usize; 2],
            count_include_pad: bool,
        ) -> FloatTensor<Self> {
            if !is_f32(&grad) {
                return burn_avg_pool2d_nhwc_backward::<Self>(
                    x,
                    grad,
                    kernel,
                    stride,
                    padding,
                    count_include_pad,
                );
            }
            let grad = contiguous(grad);
            let s = pool_shape(&x, kernel, stride, padding, [1, 1]);
            let dx = kernels::avg_pool2d_backward(&s, f32s(&grad), count_include_pad);
            float(dx, [s.batch, s.in_h, s.in_w, s.channels])
        }

        fn nhwc_to_nchw(x: FloatTensor<Self>) -> FloatTensor<Self> {
            if !is_f32(&x) {
                return Self::float_permute(x, &super::TO_NCHW);
            }
            let x = contiguous(x);
            let [n, h, w, c] = dims4(&x);
            float(
                kernels::transpose_images(f32s(&x), n, h * w, c),
                [n, c, h, w],
            )
        }

        fn nchw_to_nhwc(x: FloatTensor<Self>) -> FloatTensor<Self> {
            if !is_f32(&x) {
                return Self::float_permute(x, &super::TO_NHWC);
            }
            let x = contiguous(x);
            let [n, c, h, w] = dims4(&x);
            float(
                kernels::transpose_images(f32s(&x), n, c, h * w),
                [n, h, w, c],
            )
        }

        fn dense(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
            relu: bool,
        ) -> FloatTensor<Self> {
            let all_f32 = is_f32(&x) && is_f32(&weight) && bias.as_ref().is_none_or(is_f32);
            let Some(s) = dense_shape(&x, &weight).filter(|_| all_f32) else {
                return burn_dense::<Self>(x, weight, bias, relu);
            };
            let (x, weight) = (contiguous(x), contiguous(weight));
            let bias = bias.map(contiguous);
            let out =
                kernels::dense_forward(&s, f32s(&x), f32s(&weight), bias.as_ref().map(f32s), relu);
            float2(out, [s.rows, s.d_out])
        }

        fn dense_residual(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
            residual: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            let all_f32 = is_f32(&x)
                && is_f32(&weight)
                && is_f32(&residual)
                && bias.as_ref().is_none_or(is_f32);
            let fits = |s: &DenseShape| {
                let r = residual.shape();
                r.num_dims() == 2 && r.dims::<2>() == [s.rows, s.d_out]
            };
            let shape = dense_shape(&x, &weight).filter(|s| all_f32 && fits(s));
            let Some(s) = shape else {
                return burn_dense_residual::<Self>(x, weight, bias, residual);
            };
            let (x, weight, residual) = (contiguous(x), contiguous(weight), contiguous(residual));
            let bias = bias.map(contiguous);
            let out = kernels::dense_residual_forward(
                &s,
                f32s(&x),
                f32s(&weight),
                bias.as_ref().map(f32s),
                f32s(&residual),
            );
            float2(out, [s.rows, s.d_out])
        }

        fn dense_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            output: Option<FloatTensor<Self>>,
            grad: FloatTensor<Self>,
            needs: [bool; 3],
        ) -> LayerGrads<Self> {
            let all_f32 = is_f32(&x)
                && is_f32(&weight)
                && is_f32(&grad)
                && output.as_ref().is_none_or(is_f32);
            let Some(s) = dense_shape(&x, &weight).filter(|_| all_f32) else {
                return burn_dense_backward::<Self>(x, weight, output, grad, needs);
            };
            let (x, weight, grad) = (contiguous(x), contiguous(weight), contiguous(grad));
            let output = output.map(contiguous);
            let g = kernels::dense_backward(
                &s,
                f32s(&x),
                f32s(&weight),
                output.as_ref().map(f32s),
                f32s(&grad),
                needs,
            );
            LayerGrads {
                x: g.x.map(|v| float2(v, [s.rows, s.d_in])),
                weight: g.weight.map(|v| float2(v, [s.d_in, s.d_out])),
                bias: g.bias.map(vector),
            }
        }

        fn dense_gelu_with_pre(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let all_f32 = is_f32(&x) && is_f32(&weight) && bias.as_ref().is_none_or(is_f32);
            let Some(s) = dense_shape(&x, &weight).filter(|_| all_f32) else {
                return burn_dense_gelu::<Self>(x, weight, bias);
            };
            let (x, weight) = (contiguous(x), contiguous(weight));
            let bias = bias.map(contiguous);
            let (y, pre) =
                kernels::dense_gelu_forward(&s, f32s(&x), f32s(&weight), bias.as_ref().map(f32s));
            (float2(y, [s.rows, s.d_out]), float2(pre, [s.rows, s.d_out]))
        }

        fn dense_gelu_backward(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            pre: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            needs: [bool; 3],
        ) -> LayerGrads<Self> {
            let all_f32 = is_f32(&x) && is_f32(&weight) && is_f32(&grad) && is_f32(&pre);
            let Some(s) = dense_shape(&x, &weight).filter(|_| all_f32) else {
                return burn_dense_gelu_backward::<Self>(x, weight, pre, grad, needs);
            };
            let (x, weight) = (contiguous(x), contiguous(weight));
            let (pre, grad) = (contiguous(pre), contiguous(grad));
            let g = kernels::dense_gelu_backward(
                &s,
                f32s(&x),
                f32s(&weight),
                f32s(&pre),
                f32s(&grad),
                needs,
            );
            LayerGrads {
                x: g.x.map(|v| float2(v, [s.rows, s.d_in])),
                weight: g.weight.map(|v| float2(v, [s.d_in, s.d_out])),
                bias: g.bias.map(vector),
            }
        }

        fn layer_norm_rows_with_stats(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let all_f32 = is_f32(&x) && is_f32(&gamma) && is_f32(&beta);
            let Some(s) = rows_shape(&x).filter(|_| all_f32) else {
                return burn_layer_norm::<Self>(x, gamma, beta, epsilon);
            };
            let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
            let (y, stats) = norm_kernels::layer_norm_forward(
                &s,
                f32s(&x),
                f32s(&gamma),
                f32s(&beta),
                epsilon as f32,
            );
            (float2(y, [s.rows, s.width]), float2(stats, [s.rows, 2]))
        }

        fn layer_norm_rows_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            stats: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            needs: [bool; 3],
        ) -> LayerGrads<Self> {
            let all_f32 = is_f32(&x) && is_f32(&gamma) && is_f32(&stats) && is_f32(&grad);
            let Some(s) = rows_shape(&x).filter(|_| all_f32) else {
                return burn_layer_norm_backward::<Self>(x, gamma, stats, grad, needs);
            };
            let (x, gamma) = (contiguous(x), contiguous(gamma));
            let (stats, grad) = (contiguous(stats), contiguous(grad));
            let g = norm_kernels::layer_norm_backward(
                &s,
                f32s(&x),
                f32s(&gamma),
                f32s(&stats),
                f32s(&grad),
                needs,
            );
            LayerGrads {
                x: g.x.map(|v| float2(v, [s.rows, s.width])),
                weight: g.weight.map(vector),
                bias: g.bias.map(vector),
            }
        }

        fn causal_attention_with_probs(
            qkv: FloatTensor<Self>,
            heads: usize,
            alibi: Option<&[f32]>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let Some(s) = attention_shape(&qkv, heads).filter(|_| is_f32(&qkv)) else {
                return burn_causal_attention::<Self>(qkv, heads, alibi);
            };
            let qkv = contiguous(qkv);
            let (out, probs) = kernels::attention_forward(&s, f32s(&qkv), alibi);
            (
                FlexTensor::from_data(TensorData::new(out, [s.batch, s.seq, s.width])),
                float(probs, [s.batch, s.heads, s.seq, s.seq]),
            )
        }

        fn causal_attention_backward(
            qkv: FloatTensor<Self>,
            probs: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            heads: usize,
        ) -> FloatTensor<Self> {
            let all_f32 = is_f32(&qkv) && is_f32(&probs) && is_f32(&grad);
            let Some(s) = attention_shape(&qkv, heads).filter(|_| all_f32) else {
                return burn_causal_attention_backward::<Self>(qkv, probs, grad, heads);
            };
            let (qkv, probs, grad) = (contiguous(qkv), contiguous(probs), contiguous(grad));
            let dx = kernels::attention_backward(&s, f32s(&qkv), f32s(&probs), f32s(&grad));
            FlexTensor::from_data(TensorData::new(dx, [s.batch, s.seq, 3 * s.width]))
        }

        fn add_positions(x: FloatTensor<Self>, positions: FloatTensor<Self>) -> FloatTensor<Self> {
            let (xs, ps) = (x.shape(), positions.shape());
            let fits = is_f32(&x)
                && is_f32(&positions)
                && xs.num_dims() == 3
                && ps.num_dims() == 2
                && xs.dims::<3>()[1..] == ps.dims::<2>();
            if !fits {
                let positions = tensor::<Self, 2>(positions).unsqueeze::<3>();
                return primitive(tensor::<Self, 3>(x) + positions);
            }
            let shape = xs.dims::<3>();
            let (x, positions) = (contiguous(x), contiguous(positions));
            let out = kernels::add_positions(f32s(&x), f32s(&positions));
            FlexTensor::from_data(TensorData::new(out, shape))
        }

        fn positions_grad(grad: FloatTensor<Self>) -> FloatTensor<Self> {
            let gs = grad.shape();
            if !(is_f32(&grad) && gs.num_dims() == 3 && gs.dims::<3>()[0] > 0) {
                let grad = tensor::<Self, 3>(grad);
                let [_, t, w] = grad.dims();
                return primitive(grad.sum_dim(0).reshape([t, w]));
            }
            let [_, t, w] = gs.dims::<3>();
            let grad = contiguous(grad);
            float2(kernels::positions_grad(f32s(&grad), t * w), [t, w])
        }

        fn adamw_step(
            param: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
            step: &AdamWStep,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            let n = param.shape().num_elements();
            let flat_f32 = |t: &FlexTensor| {
                is_f32(t) && t.shape().num_dims() == 1 && t.shape().num_elements() == n
            };
            let fits = flat_f32(&param)
                && flat_f32(&grad)
                && moments
                    .as_ref()
                    .is_none_or(|(m1, m2)| flat_f32(m1) && flat_f32(m2));
            if !fits {
                let (p, m1, m2) = crate::optim_kernels::burn_adamw_step::<Self>(
                    tensor(param),
                    tensor(grad),
                    moments.map(|(m1, m2)| (tensor(m1), tensor(m2))),
                    step,
                );
                return (primitive(p), primitive(m1), primitive(m2));
            }
            let (param, grad) = (contiguous(param), contiguous(grad));
            let moments = moments.map(|(m1, m2)| (contiguous(m1), contiguous(m2)));
            let (p, m1, m2) = crate::optim_kernels::adamw_step(
                f32s(&param),
                f32s(&grad),
                moments.as_ref().map(|(m1, m2)| (f32s(m1), f32s(m2))),
                step,
            );
            (vector(p), vector(m1), vector(m2))
        }

        fn cross_entropy_with_lse(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let Some(s) = classes_shape(&logits, &targets) else {
                return burn_cross_entropy::<Self>(logits, targets);
            };
            let logits = contiguous(logits);
            let targets = class_indices(targets);
            let (loss, lse) = loss_kernels::cross_entropy_forward(&s, f32s(&logits), &targets);
            (vector(vec![loss]), vector(lse))
        }

        fn cross_entropy_backward(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            lse: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            let fits = |s: &ClassesShape| {
                is_f32(&lse)
                    && is_f32(&grad)
                    && lse.shape().num_elements() == s.rows
                    && grad.shape().num_elements() == 1
            };
            let Some(s) = classes_shape(&logits, &targets).filter(fits) else {
                return burn_cross_entropy_backward::<Self>(logits, targets, lse, grad);
            };
            let (logits, lse, grad) = (contiguous(logits), contiguous(lse), contiguous(grad));
            let targets = class_indices(targets);
            let dx = loss_kernels::cross_entropy_backward(
                &s,
                f32s(&logits),
                &targets,
                f32s(&lse),
                f32s(&grad)[0],
            );
            float2(dx, [s.rows, s.classes])
        }
    }

    /// The shape of a cross-entropy of 2-D `f32` `logits` against 1-D `targets` of one class
    /// index per row, held as `i64` or `i32`, if they are that.
    fn classes_shape(logits: &FlexTensor, targets: &FlexTensor) -> Option<ClassesShape> {
        let (ls, ts) = (logits.shape(), targets.shape());
        let ints = matches!(targets.dtype(), DType::I64 | DType::I32);
        if !(is_f32(logits) && ints && ls.num_dims() == 2 && ts.num_dims() == 1) {
            return None;
        }
        let [rows, classes] = ls.dims::<2>();
        (ts.dims::<1>() == [rows]).then_some(ClassesShape { rows, classes })
    }

    /// The class indices of a 1-D `i64` or `i32` tensor (checked by [`classes_shape`]), as
    /// `i64`s in order.
    fn class_indices(t: FlexTensor) -> Vec<i64> {
        let t = t.to_contiguous();
        match t.as_slice::<i64>() {
            Some(v) => v.to_vec(),
            None => t
                .as_slice::<i32>()
                // Invariant: `classes_shape` accepted only these two dtypes.
                .expect("i64 or i32 class indices (checked by classes_shape)")
                .iter()
                .map(|&v| i64::from(v))
                .collect(),
        }
    }

    /// The rows and width of a 2-D `x`, if it is that.
    fn rows_shape(x: &FlexTensor) -> Option<RowsShape> {
        let shape = x.shape();
        (shape.num_dims() == 2).then(|| {
            let [rows, width] = shape.dims::<2>();
            RowsShape { rows, width }
        })
    }

    /// The attention shape of a 3-D `qkv` whose last axis is three times a multiple of
    /// `heads`.
    fn attention_shape(qkv: &FlexTensor, heads: usize) -> Option<AttentionShape> {
        let shape = qkv.shape();
        if shape.num_dims() != 3 {
            return None;
        }
        let [batch, seq, w3] = shape.dims::<3>();
        assert!(
            heads > 0 && w3.is_multiple_of(3 * heads),
            "attention over {heads} heads given queries, keys and values of width {w3}: \
             expected three times a multiple of the heads"
        );
        Some(AttentionShape {
            batch,
            seq,
            width: w3 / 3,
            heads,
        })
    }
}

#[cfg(feature = "ndarray")]
impl ChannelsLastBackend for burn::backend::NdArray {}

#[cfg(feature = "wgpu")]
impl ChannelsLastBackend for burn::backend::Wgpu {}

#[cfg(feature = "cuda")]
impl ChannelsLastBackend for burn::backend::Cuda {}

// ---------------------------------------------------------------------------------------
// Autodiff: the forward through the inner backend, the backward recorded in the graph.
// ---------------------------------------------------------------------------------------

/// Registers each gradient whose parent is tracked (`id` names the parent's node: the node
/// type is private to burn-autodiff, so callers pass `|n| n.id`).
fn register<B: Backend, N>(
    grads: &mut Gradients,
    parents: [Option<N>; 3],
    values: [Option<FloatTensor<B>>; 3],
    id: impl Fn(&N) -> NodeId,
) {
    for (node, value) in parents.into_iter().zip(values) {
        if let (Some(node), Some(value)) = (node, value) {
            grads.register::<B>(id(&node), value);
        }
    }
}

/// What a convolution's backward pass needs.
#[derive(Debug, Clone)]
struct ConvState<B: Backend> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    output: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
}

#[derive(Debug)]
struct ConvWithBias;
#[derive(Debug)]
struct ConvNoBias;

fn conv_backward<B: ChannelsLastBackend>(
    state: ConvState<B>,
    grad: FloatTensor<B>,
    needs: [bool; 3],
) -> LayerGrads<B> {
    B::conv2d_nhwc_backward(
        state.x,
        state.weight,
        state.bias,
        state.output,
        grad,
        state.options,
        needs,
    )
}

impl<B: ChannelsLastBackend> Backward<B, 3> for ConvWithBias {
    type State = ConvState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), node_b.is_some()];
        let g = conv_backward(ops.state, grad, needs);
        register::<B, _>(
            grads,
            [node_x, node_w, node_b],
            [g.x, g.weight, g.bias],
            |n| n.id,
        );
    }
}

impl<B: ChannelsLastBackend> Backward<B, 2> for ConvNoBias {
    type State = ConvState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), false];
        let g = conv_backward(ops.state, grad, needs);
        register::<B, _>(grads, [node_x, node_w, None], [g.x, g.weight, None], |n| {
            n.id
        });
    }
}

#[derive(Debug)]
struct ToNchw;

impl<B: ChannelsLastBackend> Backward<B, 1> for ToNchw {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::nchw_to_nhwc(grad));
        }
    }
}

#[derive(Debug)]
struct ToNhwc;

impl<B: ChannelsLastBackend> Backward<B, 1> for ToNhwc {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::nhwc_to_nchw(grad));
        }
    }
}

/// What a dense layer's backward pass needs: its input and weight, and what its activation
/// kept (ReLU's output, or GELU's input, the pre-activation).
#[derive(Debug, Clone)]
struct DenseState<B: Backend> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    kept: Kept<B>,
}

/// What a dense layer's activation keeps for the backward pass.
#[derive(Debug, Clone)]
enum Kept<B: Backend> {
    /// No activation.
    Nothing,
    /// ReLU: its output.
    ReluOutput(FloatTensor<B>),
    /// GELU: its input.
    GeluInput(FloatTensor<B>),
}

impl<B: ChannelsLastBackend> DenseState<B> {
    /// The layer's gradients for its output gradient `grad` (`needs`: input, weight, bias).
    fn grads(self, grad: FloatTensor<B>, needs: [bool; 3]) -> LayerGrads<B> {
        match self.kept {
            Kept::Nothing => B::dense_backward(self.x, self.weight, None, grad, needs),
            Kept::ReluOutput(out) => B::dense_backward(self.x, self.weight, Some(out), grad, needs),
            Kept::GeluInput(pre) => B::dense_gelu_backward(self.x, self.weight, pre, grad, needs),
        }
    }
}

/// The autodiff node of a dense layer (with or without an activation) with a bias.
#[derive(Debug)]
struct DenseWithBias;
/// The same without a bias.
#[derive(Debug)]
struct DenseNoBias;

impl<B: ChannelsLastBackend> Backward<B, 3> for DenseWithBias {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), node_b.is_some()];
        let g = ops.state.grads(grad, needs);
        register::<B, _>(
            grads,
            [node_x, node_w, node_b],
            [g.x, g.weight, g.bias],
            |n| n.id,
        );
    }
}

impl<B: ChannelsLastBackend> Backward<B, 2> for DenseNoBias {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), false];
        let g = ops.state.grads(grad, needs);
        register::<B, _>(grads, [node_x, node_w, None], [g.x, g.weight, None], |n| {
            n.id
        });
    }
}

/// The autodiff node of a dense layer with a residual added ([`ChannelsLastBackend::
/// dense_residual`]), with a bias: parents input, weight, bias, residual.
#[derive(Debug)]
struct DenseResidualWithBias;
/// The same without a bias: parents input, weight, residual.
#[derive(Debug)]
struct DenseResidualNoBias;

/// The gradients of a dense layer with a residual: the layer's for the needed ones of input,
/// weight and bias, and the output gradient itself for the residual (when `residual`).
fn dense_residual_grads<B: ChannelsLastBackend>(
    state: DenseState<B>,
    grad: FloatTensor<B>,
    needs: [bool; 3],
    residual: bool,
) -> (LayerGrads<B>, Option<FloatTensor<B>>) {
    let layer = match needs.iter().any(|&n| n) {
        true => state.grads(grad.clone(), needs),
        false => LayerGrads {
            x: None,
            weight: None,
            bias: None,
        },
    };
    (layer, residual.then_some(grad))
}

impl<B: ChannelsLastBackend> Backward<B, 4> for DenseResidualWithBias {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b, node_r] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), node_b.is_some()];
        let (g, r) = dense_residual_grads(ops.state, grad, needs, node_r.is_some());
        register::<B, _>(
            grads,
            [node_x, node_w, node_b],
            [g.x, g.weight, g.bias],
            |n| n.id,
        );
        register::<B, _>(grads, [node_r, None, None], [r, None, None], |n| n.id);
    }
}

impl<B: ChannelsLastBackend> Backward<B, 3> for DenseResidualNoBias {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_r] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_w.is_some(), false];
        let (g, r) = dense_residual_grads(ops.state, grad, needs, node_r.is_some());
        register::<B, _>(grads, [node_x, node_w, node_r], [g.x, g.weight, r], |n| {
            n.id
        });
    }
}

/// The autodiff node of [`ChannelsLastBackend::add_positions`]: parents `x`, `positions`.
#[derive(Debug)]
struct AddPositionsOp;

impl<B: ChannelsLastBackend> Backward<B, 2> for AddPositionsOp {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_p] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let positions = node_p.is_some().then(|| B::positions_grad(grad.clone()));
        register::<B, _>(
            grads,
            [node_x, node_p, None],
            [Some(grad), positions, None],
            |n| n.id,
        );
    }
}

/// What a cross-entropy needs for its backward pass: the logits, the targets and each
/// row's log-sum-exp.
#[derive(Debug, Clone)]
struct CrossEntropyState<B: Backend> {
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
}

#[derive(Debug)]
struct CrossEntropyOp;

impl<B: ChannelsLastBackend> Backward<B, 1> for CrossEntropyOp {
    type State = CrossEntropyState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            let s = ops.state;
            grads.register::<B>(
                node.id,
                B::cross_entropy_backward(s.logits, s.targets, s.lse, grad),
            );
        }
    }
}

/// What a layer norm needs for its backward pass: its input, scale and per-row statistics.
#[derive(Debug, Clone)]
struct LayerNormState<B: Backend> {
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    stats: FloatTensor<B>,
}

#[derive(Debug)]
struct LayerNormOp;

impl<B: ChannelsLastBackend> Backward<B, 3> for LayerNormOp {
    type State = LayerNormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_g, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let needs = [node_x.is_some(), node_g.is_some(), node_b.is_some()];
        let s = ops.state;
        let g = B::layer_norm_rows_backward(s.x, s.gamma, s.stats, grad, needs);
        register::<B, _>(
            grads,
            [node_x, node_g, node_b],
            [g.x, g.weight, g.bias],
            |n| n.id,
        );
    }
}

/// What causal attention's backward pass needs: the probabilities `[batch, heads, seq,
/// seq]` as the forward pass made them, or, under activation checkpointing (a checkpoint
/// strategy other than Burn's `NoCheckpointing`), nothing but the input and the ALiBi
/// slopes: the backward pass computes the probabilities again (Korthikanti et al., 2022,
/// "selective activation recomputation": the attention's probabilities are the largest
/// activation of a transformer layer at long context and the cheapest to remake). The
/// kernels are deterministic, so the recomputed probabilities, and the gradients, are the
/// same bits.
#[derive(Debug, Clone)]
struct AttentionState<B: Backend> {
    qkv: FloatTensor<B>,
    probs: Option<FloatTensor<B>>,
    heads: usize,
    alibi: Option<Vec<f32>>,
}

#[derive(Debug)]
struct CausalAttention;

impl<B: ChannelsLastBackend> Backward<B, 1> for CausalAttention {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            let s = ops.state;
            let probs = match s.probs {
                Some(p) => p,
                None => {
                    B::causal_attention_with_probs(s.qkv.clone(), s.heads, s.alibi.as_deref()).1
                }
            };
            grads.register::<B>(
                node.id,
                B::causal_attention_backward(s.qkv, probs, grad, s.heads),
            );
        }
    }
}

/// What a max pool's backward pass needs.
#[derive(Debug, Clone)]
struct MaxPoolState<B: Backend> {
    x: FloatTensor<B>,
    indices: IntTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

#[derive(Debug)]
struct MaxPoolNhwc;

impl<B: ChannelsLastBackend> Backward<B, 1> for MaxPoolNhwc {
    type State = MaxPoolState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            let s = ops.state;
            let dx = B::max_pool2d_nhwc_backward(
                s.x, s.kernel, s.stride, s.padding, s.dilation, s.indices, grad,
            );
            grads.register::<B>(node.id, dx);
        }
    }
}

/// What an average pool's backward pass needs.
#[derive(Debug, Clone)]
struct AvgPoolState<B: Backend> {
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
}

#[derive(Debug)]
struct AvgPoolNhwc;

impl<B: ChannelsLastBackend> Backward<B, 1> for AvgPoolNhwc {
    type State = AvgPoolState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            let s = ops.state;
            let dx = B::avg_pool2d_nhwc_backward(
                s.x,
                grad,
                s.kernel,
                s.stride,
                s.padding,
                s.count_include_pad,
            );
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: ChannelsLastBackend, C: CheckpointStrategy> ChannelsLastBackend for Autodiff<B, C> {
    const CHANNELS_LAST_IS_FAST: bool = B::CHANNELS_LAST_IS_FAST;

    fn conv2d_nhwc(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        relu: bool,
    ) -> FloatTensor<Self> {
        let forward = |bias: Option<FloatTensor<B>>| {
            B::conv2d_nhwc(
                x.primitive.clone(),
                weight.primitive.clone(),
                bias,
                options.clone(),
                relu,
            )
        };
        let state = |output: &FloatTensor<B>, bias: Option<FloatTensor<B>>| ConvState::<B> {
            x: x.primitive.clone(),
            weight: weight.primitive.clone(),
            bias,
            output: relu.then(|| output.clone()),
            options: options.clone(),
        };
        match &bias {
            Some(b) => {
                let nodes = [x.node.clone(), weight.node.clone(), b.node.clone()];
                match ConvWithBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let out = forward(Some(b.primitive.clone()));
                        let st = state(&out, Some(b.primitive.clone()));
                        prep.finish(st, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(forward(Some(b.primitive.clone()))),
                }
            }
            None => {
                let nodes = [x.node.clone(), weight.node.clone()];
                match ConvNoBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let out = forward(None);
                        let st = state(&out, None);
                        prep.finish(st, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(forward(None)),
                }
            }
        }
    }

    fn causal_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        alibi: Option<&[f32]>,
    ) -> FloatTensor<Self> {
        match CausalAttention
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let recompute = std::any::TypeId::of::<C>()
                    != std::any::TypeId::of::<
                        burn::backend::autodiff::checkpoint::strategy::NoCheckpointing,
                    >();
                let (out, probs) = if recompute {
                    (
                        B::causal_attention(qkv.primitive.clone(), heads, alibi),
                        None,
                    )
                } else {
                    let (out, probs) =
                        B::causal_attention_with_probs(qkv.primitive.clone(), heads, alibi);
                    (out, Some(probs))
                };
                let state = AttentionState::<B> {
                    qkv: qkv.primitive,
                    probs,
                    heads,
                    alibi: recompute.then(|| alibi.map(<[f32]>::to_vec)).flatten(),
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::causal_attention(qkv.primitive, heads, alibi))
            }
        }
    }

    fn nhwc_to_nchw(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match ToNchw
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), B::nhwc_to_nchw(x.primitive)),
            OpsKind::UnTracked(prep) => prep.finish(B::nhwc_to_nchw(x.primitive)),
        }
    }

    fn nchw_to_nhwc(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match ToNhwc
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), B::nchw_to_nhwc(x.primitive)),
            OpsKind::UnTracked(prep) => prep.finish(B::nchw_to_nhwc(x.primitive)),
        }
    }

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        relu: bool,
    ) -> FloatTensor<Self> {
        let forward = |bias: Option<FloatTensor<B>>| {
            B::dense(x.primitive.clone(), weight.primitive.clone(), bias, relu)
        };
        let state = |output: &FloatTensor<B>| DenseState::<B> {
            x: x.primitive.clone(),
            weight: weight.primitive.clone(),
            kept: match relu {
                true => Kept::ReluOutput(output.clone()),
                false => Kept::Nothing,
            },
        };
        match &bias {
            Some(b) => {
                let nodes = [x.node.clone(), weight.node.clone(), b.node.clone()];
                match DenseWithBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let out = forward(Some(b.primitive.clone()));
                        let st = state(&out);
                        prep.finish(st, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(forward(Some(b.primitive.clone()))),
                }
            }
            None => {
                let nodes = [x.node.clone(), weight.node.clone()];
                match DenseNoBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let out = forward(None);
                        let st = state(&out);
                        prep.finish(st, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(forward(None)),
                }
            }
        }
    }

    fn add_positions(x: FloatTensor<Self>, positions: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::add_positions(x.primitive.clone(), positions.primitive.clone());
        match AddPositionsOp
            .prepare::<C>([x.node.clone(), positions.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        match CrossEntropyOp
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (loss, lse) =
                    B::cross_entropy_with_lse(logits.primitive.clone(), targets.clone());
                let state = CrossEntropyState::<B> {
                    logits: logits.primitive,
                    targets,
                    lse,
                };
                prep.finish(state, loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::cross_entropy(logits.primitive, targets)),
        }
    }

    fn dense_residual(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let forward = |bias: Option<FloatTensor<B>>| {
            B::dense_residual(
                x.primitive.clone(),
                weight.primitive.clone(),
                bias,
                residual.primitive.clone(),
            )
        };
        let state = || DenseState::<B> {
            x: x.primitive.clone(),
            weight: weight.primitive.clone(),
            kept: Kept::Nothing,
        };
        let (xn, wn, rn) = (x.node.clone(), weight.node.clone(), residual.node.clone());
        match &bias {
            Some(b) => {
                let nodes = [xn, wn, b.node.clone(), rn];
                match DenseResidualWithBias
                    .prepare::<C>(nodes)
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => {
                        prep.finish(state(), forward(Some(b.primitive.clone())))
                    }
                    OpsKind::UnTracked(prep) => prep.finish(forward(Some(b.primitive.clone()))),
                }
            }
            None => match DenseResidualNoBias
                .prepare::<C>([xn, wn, rn])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state(), forward(None)),
                OpsKind::UnTracked(prep) => prep.finish(forward(None)),
            },
        }
    }

    fn dense_gelu(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let forward = |bias: Option<FloatTensor<B>>| {
            B::dense_gelu_with_pre(x.primitive.clone(), weight.primitive.clone(), bias)
        };
        let state = |pre: FloatTensor<B>| DenseState::<B> {
            x: x.primitive.clone(),
            weight: weight.primitive.clone(),
            kept: Kept::GeluInput(pre),
        };
        match &bias {
            Some(b) => {
                let nodes = [x.node.clone(), weight.node.clone(), b.node.clone()];
                match DenseWithBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let (out, pre) = forward(Some(b.primitive.clone()));
                        prep.finish(state(pre), out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::dense_gelu(
                        x.primitive.clone(),
                        weight.primitive.clone(),
                        Some(b.primitive.clone()),
                    )),
                }
            }
            None => {
                let nodes = [x.node.clone(), weight.node.clone()];
                match DenseNoBias.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let (out, pre) = forward(None);
                        prep.finish(state(pre), out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::dense_gelu(
                        x.primitive.clone(),
                        weight.primitive.clone(),
                        None,
                    )),
                }
            }
        }
    }

    fn layer_norm_rows(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let nodes = [x.node.clone(), gamma.node.clone(), beta.node.clone()];
        match LayerNormOp.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, stats) = B::layer_norm_rows_with_stats(
                    x.primitive.clone(),
                    gamma.primitive.clone(),
                    beta.primitive,
                    epsilon,
                );
                let state = LayerNormState::<B> {
                    x: x.primitive,
                    gamma: gamma.primitive,
                    stats,
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::layer_norm_rows(
                x.primitive,
                gamma.primitive,
                beta.primitive,
                epsilon,
            )),
        }
    }

    fn max_pool2d_nhwc_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        match MaxPoolNhwc
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, indices) = B::max_pool2d_nhwc_with_indices(
                    x.primitive.clone(),
                    kernel,
                    stride,
                    padding,
                    dilation,
                );
                let state = MaxPoolState::<B> {
                    x: x.primitive,
                    indices: indices.clone(),
                    kernel,
                    stride,
                    padding,
                    dilation,
                };
                (prep.finish(state, out), indices)
            }
            OpsKind::UnTracked(prep) => {
                let (out, indices) =
                    B::max_pool2d_nhwc_with_indices(x.primitive, kernel, stride, padding, dilation);
                (prep.finish(out), indices)
            }
        }
    }

    fn avg_pool2d_nhwc(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> FloatTensor<Self> {
        match AvgPoolNhwc
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::avg_pool2d_nhwc(
                    x.primitive.clone(),
                    kernel,
                    stride,
                    padding,
                    count_include_pad,
                );
                let state = AvgPoolState::<B> {
                    x: x.primitive,
                    kernel,
                    stride,
                    padding,
                    count_include_pad,
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::avg_pool2d_nhwc(
                x.primitive,
                kernel,
                stride,
                padding,
                count_include_pad,
            )),
        }
    }
}
