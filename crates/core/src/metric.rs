//! Evaluation metrics: running averages over the batches of one evaluation. Each metric reads
//! a model's evaluation output; the built-in ones read [`ClassificationOutput`]. A metric
//! computes on the device and reads back one number per batch. Its running totals (sums and
//! counts) add across the ranks of a data-parallel run, so every rank can read the global
//! value.

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};

use crate::model::ClassificationOutput;

/// A value accumulated over the batches of an evaluation.
pub trait Metric<O>: Send {
    /// The metric's name, used as its key in `State::eval_metrics` and in logs.
    fn name(&self) -> String;
    /// Adds one batch's output.
    fn update(&mut self, output: &O);
    /// The value over everything added since the last reset; `NaN` if nothing was added.
    fn value(&self) -> f64;
    /// Forgets everything added.
    fn reset(&mut self);

    /// The running totals `value` is computed from (sums and counts), which add across the
    /// ranks of a data-parallel run; `None` for a metric whose state does not add (then a
    /// multi-rank evaluation refuses it with an error naming it).
    fn totals(&self) -> Option<Vec<f64>> {
        None
    }

    /// Replaces the running totals with `totals` (what [`Metric::totals`] returned, summed
    /// over every rank).
    fn set_totals(&mut self, totals: &[f64]) {
        let _ = totals;
    }
}

/// Running mean weighted by batch size.
#[derive(Debug, Default, Clone, Copy)]
struct Mean {
    sum: f64,
    count: f64,
}

impl Mean {
    fn totals(&self) -> Option<Vec<f64>> {
        Some(vec![self.sum, self.count])
    }
    fn set_totals(&mut self, totals: &[f64]) {
        if let [sum, count] = totals {
            self.sum = *sum;
            self.count = *count;
        }
    }
    fn add(&mut self, value_sum: f64, count: usize) {
        self.sum += value_sum;
        self.count += count as f64;
    }
    fn value(&self) -> f64 {
        if self.count == 0.0 {
            f64::NAN
        } else {
            self.sum / self.count
        }
    }
}

/// Mean loss over samples (each batch's mean loss weighted by its size).
#[derive(Debug, Default, Clone)]
pub struct LossMetric(Mean);

impl<B: Backend> Metric<ClassificationOutput<B>> for LossMetric {
    fn name(&self) -> String {
        "loss".into()
    }
    fn update(&mut self, o: &ClassificationOutput<B>) {
        let n = o.targets.dims()[0];
        let loss: f64 = o.loss.clone().into_scalar().elem();
        self.0.add(loss * n as f64, n);
    }
    fn value(&self) -> f64 {
        self.0.value()
    }
    fn reset(&mut self) {
        self.0 = Mean::default();
    }
    fn totals(&self) -> Option<Vec<f64>> {
        self.0.totals()
    }
    fn set_totals(&mut self, totals: &[f64]) {
        self.0.set_totals(totals);
    }
}

/// Fraction of samples whose highest-scoring class is the target.
#[derive(Debug, Default, Clone)]
pub struct Accuracy(Mean);

impl<B: Backend> Metric<ClassificationOutput<B>> for Accuracy {
    fn name(&self) -> String {
        "accuracy".into()
    }
    fn update(&mut self, o: &ClassificationOutput<B>) {
        let n = o.targets.dims()[0];
        let predicted = o.logits.clone().argmax(1).flatten::<1>(0, 1);
        let correct: i64 = predicted
            .equal(o.targets.clone())
            .int()
            .sum()
            .into_scalar()
            .elem();
        self.0.add(correct as f64, n);
    }
    fn value(&self) -> f64 {
        self.0.value()
    }
    fn reset(&mut self) {
        self.0 = Mean::default();
    }
    fn totals(&self) -> Option<Vec<f64>> {
        self.0.totals()
    }
    fn set_totals(&mut self, totals: &[f64]) {
        self.0.set_totals(totals);
    }
}

/// Fraction of samples whose target is among the `k` highest-scoring classes. A sample's
/// target counts as in the top k when fewer than `k` classes score strictly higher than it,
/// so ties are resolved in the sample's favour.
#[derive(Debug, Clone)]
pub struct TopKAccuracy {
    k: usize,
    mean: Mean,
}

impl TopKAccuracy {
    /// Top-`k` accuracy; `k` of 1 is plain accuracy (up to ties).
    pub fn new(k: usize) -> Self {
        TopKAccuracy {
            k: k.max(1),
            mean: Mean::default(),
        }
    }
}

impl<B: Backend> Metric<ClassificationOutput<B>> for TopKAccuracy {
    fn name(&self) -> String {
        format!("top{}_accuracy", self.k)
    }
    fn update(&mut self, o: &ClassificationOutput<B>) {
        let [n, _classes] = o.logits.dims();
        let target_score = o
            .logits
            .clone()
            .gather(1, o.targets.clone().reshape([n, 1]));
        let higher = o
            .logits
            .clone()
            .greater(target_score)
            .int()
            .sum_dim(1)
            .flatten::<1>(0, 1);
        let hits: i64 = higher
            .lower_elem(self.k as i64)
            .int()
            .sum()
            .into_scalar()
            .elem();
        self.mean.add(hits as f64, n);
    }
    fn value(&self) -> f64 {
        self.mean.value()
    }
    fn reset(&mut self) {
        self.mean = Mean::default();
    }
    fn totals(&self) -> Option<Vec<f64>> {
        self.mean.totals()
    }
    fn set_totals(&mut self, totals: &[f64]) {
        self.mean.set_totals(totals);
    }
}

/// Mean cross-entropy over the scored tokens of a language model's evaluation, in nats per
/// token (Composer's `LanguageCrossEntropy`): each batch adds its summed token loss and its
/// count of tokens whose target is not the ignore index (padding, by default
/// [`IGNORE_INDEX`](crate::cross_entropy::IGNORE_INDEX)), so that the value is the mean over
/// every scored token of the evaluation, whatever the batches' sizes and padding, and the
/// totals add across ranks. Reads a [`ClassificationOutput`] whose rows are tokens (a
/// language model's `[batch * seq_len, vocab]` logits and its flattened targets); the
/// output's own `loss` is not used, so a padded batch scored by a plain loss still counts
/// right. One read from the device per batch (the sum and the count together).
#[derive(Debug, Clone)]
pub struct LanguageCrossEntropy {
    ignore_index: i64,
    mean: Mean,
}

impl Default for LanguageCrossEntropy {
    fn default() -> Self {
        Self::new(crate::cross_entropy::IGNORE_INDEX)
    }
}

impl LanguageCrossEntropy {
    /// The metric skipping targets equal to `ignore_index`.
    pub fn new(ignore_index: i64) -> Self {
        LanguageCrossEntropy {
            ignore_index,
            mean: Mean::default(),
        }
    }

    /// Tokens scored since the last reset (over every rank once the totals were reduced).
    pub fn tokens(&self) -> f64 {
        self.mean.count
    }

    fn add<B: Backend>(&mut self, o: &ClassificationOutput<B>) {
        let (losses, counted) = crate::cross_entropy::per_sample_cross_entropy_ignoring(
            o.logits.clone(),
            o.targets.clone(),
            self.ignore_index,
        );
        let both = Tensor::cat(vec![losses.sum(), counted.sum()], 0);
        let both: Vec<f64> = both
            .into_data()
            .iter::<f32>()
            .map(|v| f64::from(v.elem::<f32>()))
            .collect();
        if let [sum, count] = both[..] {
            self.mean.sum += sum;
            self.mean.count += count;
        }
    }
}

impl<B: Backend> Metric<ClassificationOutput<B>> for LanguageCrossEntropy {
    fn name(&self) -> String {
        "cross_entropy".into()
    }
    fn update(&mut self, o: &ClassificationOutput<B>) {
        self.add(o);
    }
    fn value(&self) -> f64 {
        self.mean.value()
    }
    fn reset(&mut self) {
        self.mean = Mean::default();
    }
    fn totals(&self) -> Option<Vec<f64>> {
        self.mean.totals()
    }
    fn set_totals(&mut self, totals: &[f64]) {
        self.mean.set_totals(totals);
    }
}

/// Perplexity over the scored tokens of a language model's evaluation (Composer's
/// `LanguagePerplexity`): `exp` of [`LanguageCrossEntropy`]'s mean over every scored token,
/// not a mean of per-batch perplexities (which would weigh a short batch like a long one and
/// lie above the true value). Its totals are the cross-entropy's, so they add across ranks
/// the same way.
#[derive(Debug, Clone, Default)]
pub struct Perplexity(LanguageCrossEntropy);

impl Perplexity {
    /// The metric skipping targets equal to `ignore_index`.
    pub fn new(ignore_index: i64) -> Self {
        Perplexity(LanguageCrossEntropy::new(ignore_index))
    }
}

impl<B: Backend> Metric<ClassificationOutput<B>> for Perplexity {
    fn name(&self) -> String {
        "perplexity".into()
    }
    fn update(&mut self, o: &ClassificationOutput<B>) {
        self.0.add(o);
    }
    fn value(&self) -> f64 {
        self.0.mean.value().exp()
    }
    fn reset(&mut self) {
        self.0.mean = Mean::default();
    }
    fn totals(&self) -> Option<Vec<f64>> {
        self.0.mean.totals()
    }
    fn set_totals(&mut self, totals: &[f64]) {
        self.0.mean.set_totals(totals);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor};

    type B = Flex;

    fn output() -> ClassificationOutput<B> {
        let device = Default::default();
        // Three samples, four classes. Sample 0: target 2 is the best; sample 1: target 0 is
        // second; sample 2: target 3 is last.
        let logits = Tensor::<B, 2>::from_floats(
            [
                [0.1, 0.2, 0.9, 0.0],
                [0.5, 0.8, 0.1, 0.2],
                [0.4, 0.3, 0.2, 0.1],
            ],
            &device,
        );
        let targets = Tensor::<B, 1, Int>::from_ints([2, 0, 3], &device);
        let loss = Tensor::<B, 1>::from_floats([1.5], &device);
        ClassificationOutput {
            loss,
            logits,
            targets,
        }
    }

    #[test]
    fn accuracy_and_top_k_by_hand() {
        let o = output();
        let mut acc = Accuracy::default();
        Metric::<ClassificationOutput<B>>::update(&mut acc, &o);
        assert!((Metric::<ClassificationOutput<B>>::value(&acc) - 1.0 / 3.0).abs() < 1e-12);
        let mut top2 = TopKAccuracy::new(2);
        Metric::<ClassificationOutput<B>>::update(&mut top2, &o);
        assert!((Metric::<ClassificationOutput<B>>::value(&top2) - 2.0 / 3.0).abs() < 1e-12);
        let mut top4 = TopKAccuracy::new(4);
        Metric::<ClassificationOutput<B>>::update(&mut top4, &o);
        assert_eq!(Metric::<ClassificationOutput<B>>::value(&top4), 1.0);
    }

    #[test]
    fn loss_is_weighted_by_batch_size_and_resets() {
        let device = Default::default();
        let mut m = LossMetric::default();
        Metric::<ClassificationOutput<B>>::update(&mut m, &output());
        // A second batch of one sample with loss 3.5.
        let one = ClassificationOutput::<B> {
            loss: Tensor::from_floats([3.5], &device),
            logits: Tensor::from_floats([[1.0, 0.0]], &device),
            targets: Tensor::from_ints([0], &device),
        };
        Metric::<ClassificationOutput<B>>::update(&mut m, &one);
        assert!(
            (Metric::<ClassificationOutput<B>>::value(&m) - (1.5 * 3.0 + 3.5) / 4.0).abs() < 1e-9
        );
        Metric::<ClassificationOutput<B>>::reset(&mut m);
        assert!(Metric::<ClassificationOutput<B>>::value(&m).is_nan());
    }

    #[test]
    fn totals_of_two_ranks_add_up_to_the_metric_over_both() {
        // Rank 0 sees `output()` (1 of 3 correct), rank 1 a batch of one correct sample: the
        // summed totals give 2 correct of 4, the accuracy over both shards.
        let device = Default::default();
        let one = ClassificationOutput::<B> {
            loss: Tensor::from_floats([0.5], &device),
            logits: Tensor::from_floats([[1.0, 0.0]], &device),
            targets: Tensor::from_ints([0], &device),
        };
        let (mut r0, mut r1) = (Accuracy::default(), Accuracy::default());
        Metric::<ClassificationOutput<B>>::update(&mut r0, &output());
        Metric::<ClassificationOutput<B>>::update(&mut r1, &one);
        let a = Metric::<ClassificationOutput<B>>::totals(&r0).unwrap();
        let b = Metric::<ClassificationOutput<B>>::totals(&r1).unwrap();
        let sum: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        Metric::<ClassificationOutput<B>>::set_totals(&mut r1, &sum);
        assert_eq!(Metric::<ClassificationOutput<B>>::value(&r1), 0.5);
        let (mut l0, mut l1) = (LossMetric::default(), LossMetric::default());
        Metric::<ClassificationOutput<B>>::update(&mut l0, &output());
        Metric::<ClassificationOutput<B>>::update(&mut l1, &one);
        let mut t = Metric::<ClassificationOutput<B>>::totals(&l0).unwrap();
        for (x, y) in t
            .iter_mut()
            .zip(Metric::<ClassificationOutput<B>>::totals(&l1).unwrap())
        {
            *x += y;
        }
        Metric::<ClassificationOutput<B>>::set_totals(&mut l0, &t);
        let want = (1.5 * 3.0 + 0.5) / 4.0;
        assert!((Metric::<ClassificationOutput<B>>::value(&l0) - want).abs() < 1e-12);
    }

    /// Two batches of four-class token logits with padding, worked by hand:
    /// batch A: uniform logits with target 2 (ln 4), `[ln 2, 0, 0, 0]` with target 0
    /// (-ln(2/5) = ln 2.5), and a padding row; batch B: `[ln 5, 0, 0, 0]` with target 3
    /// (-ln(1/8) = ln 8) and two padding rows.
    fn padded_batches() -> (ClassificationOutput<B>, ClassificationOutput<B>) {
        let device = Default::default();
        let ln = |x: f32| x.ln();
        let a = ClassificationOutput::<B>::scored_ignoring(
            Tensor::from_floats(
                [
                    [0.0, 0.0, 0.0, 0.0],
                    [ln(2.0), 0.0, 0.0, 0.0],
                    [5.0, -3.0, 2.0, 0.0],
                ],
                &device,
            ),
            Tensor::from_ints([2, 0, -100], &device),
            Some(-100),
        );
        let b = ClassificationOutput::<B>::scored_ignoring(
            Tensor::from_floats(
                [
                    [ln(5.0), 0.0, 0.0, 0.0],
                    [1.0, 2.0, 3.0, 4.0],
                    [0.0, 9.0, 0.0, 0.0],
                ],
                &device,
            ),
            Tensor::from_ints([3, -100, -100], &device),
            Some(-100),
        );
        (a, b)
    }

    #[test]
    fn language_cross_entropy_and_perplexity_skip_padding_and_weigh_by_tokens() {
        let (a, b) = padded_batches();
        // The outputs' own losses skip the padding too: (ln 4 + ln 2.5) / 2 and ln 8.
        let loss_a: f32 = a.loss.clone().into_scalar().elem();
        let loss_b: f32 = b.loss.clone().into_scalar().elem();
        assert!(
            (f64::from(loss_a) - (10f64).ln() / 2.0).abs() < 1e-6,
            "{loss_a}"
        );
        assert!((f64::from(loss_b) - (8f64).ln()).abs() < 1e-6, "{loss_b}");
        let mut ce = LanguageCrossEntropy::default();
        let mut ppl = Perplexity::default();
        for o in [&a, &b] {
            Metric::<ClassificationOutput<B>>::update(&mut ce, o);
            Metric::<ClassificationOutput<B>>::update(&mut ppl, o);
        }
        // Three scored tokens: (ln 4 + ln 2.5 + ln 8) / 3 = ln(80) / 3.
        let want = (80f64).ln() / 3.0;
        let got = Metric::<ClassificationOutput<B>>::value(&ce);
        assert!((got - want).abs() < 1e-6, "{got} against {want}");
        assert_eq!(ce.tokens(), 3.0);
        // Perplexity: the cube root of 80 (4.3089), not the mean of the batches' perplexities
        // (sqrt(10) and 8: 5.58).
        let got = Metric::<ClassificationOutput<B>>::value(&ppl);
        assert!((got - 80f64.cbrt()).abs() < 1e-5, "{got}");
        assert_eq!(
            Metric::<ClassificationOutput<B>>::name(&ce),
            "cross_entropy"
        );
        assert_eq!(Metric::<ClassificationOutput<B>>::name(&ppl), "perplexity");
        Metric::<ClassificationOutput<B>>::reset(&mut ppl);
        assert!(Metric::<ClassificationOutput<B>>::value(&ppl).is_nan());
    }

    #[test]
    fn language_metrics_over_two_ranks_equal_the_metric_over_both_batches() {
        // Rank 0 scores batch A (two tokens), rank 1 batch B (one token): the summed totals
        // give the mean over the three tokens, as one rank seeing both would.
        let (a, b) = padded_batches();
        let (mut r0, mut r1) = (Perplexity::default(), Perplexity::default());
        Metric::<ClassificationOutput<B>>::update(&mut r0, &a);
        Metric::<ClassificationOutput<B>>::update(&mut r1, &b);
        let t0 = Metric::<ClassificationOutput<B>>::totals(&r0).unwrap();
        let t1 = Metric::<ClassificationOutput<B>>::totals(&r1).unwrap();
        let sum: Vec<f64> = t0.iter().zip(&t1).map(|(x, y)| x + y).collect();
        Metric::<ClassificationOutput<B>>::set_totals(&mut r0, &sum);
        let got = Metric::<ClassificationOutput<B>>::value(&r0);
        assert!((got - 80f64.cbrt()).abs() < 1e-5, "{got}");
        // Another ignore index: 7 marks the padding of this batch, so one token (ln 4) counts.
        let device = Default::default();
        let own = ClassificationOutput::<B>::scored_ignoring(
            Tensor::from_floats([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]], &device),
            Tensor::from_ints([2, 7], &device),
            Some(7),
        );
        let mut skip7 = LanguageCrossEntropy::new(7);
        Metric::<ClassificationOutput<B>>::update(&mut skip7, &own);
        assert_eq!(skip7.tokens(), 1.0);
        let got = Metric::<ClassificationOutput<B>>::value(&skip7);
        assert!((got - 4f64.ln()).abs() < 1e-6, "{got}");
    }
}
