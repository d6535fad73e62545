//! Evaluation and prediction: the [`Evaluator`] type, when evaluators are due during `fit`,
//! the `EVAL_*` and `PREDICT_*` event loops, and the reduction of metric totals over the
//! ranks of a data-parallel run. Both use the model's inner (gradient-free) module.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use crate::collective::unreducible_metric;
use crate::data::BatchSource;
use crate::error::Result;
use crate::event::Event;
use crate::metric::Metric;
use crate::model::{EvalModel, TrainModel};
use crate::setup::Setup;
use crate::time::{Time, TimeUnit, Timestamp};

use super::Trainer;

/// The inner (gradient-free) module of a trainable model.
pub type InnerModel<B, M> = <M as AutodiffModule<B>>::InnerModule;
/// The batch type an evaluator of `M` reads.
pub type EvalBatch<B, M> =
    <InnerModel<B, M> as EvalModel<<B as AutodiffBackend>::InnerBackend>>::Batch;
/// What an evaluator of `M` produces per batch.
pub type EvalOutput<B, M> =
    <InnerModel<B, M> as EvalModel<<B as AutodiffBackend>::InnerBackend>>::Output;

/// A named evaluation dataset with its metrics and how often to run it.
pub struct Evaluator<B: AutodiffBackend, M: TrainModel<B>> {
    pub(super) label: String,
    pub(super) source: Box<dyn BatchSource<EvalBatch<B, M>>>,
    metrics: Vec<Box<dyn Metric<EvalOutput<B, M>>>>,
    pub(super) interval: Option<Time>,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Evaluator<B, M> {
    /// An evaluator labelled `label` (the key of its results in `State::eval_metrics`).
    pub fn new(
        label: impl Into<String>,
        source: impl BatchSource<EvalBatch<B, M>> + 'static,
        metrics: Vec<Box<dyn Metric<EvalOutput<B, M>>>>,
    ) -> Self {
        Evaluator {
            label: label.into(),
            source: Box::new(source),
            metrics,
            interval: None,
        }
    }

    /// How often to evaluate during `fit`, overriding the trainer's `eval_interval`.
    pub fn with_interval(mut self, interval: Time) -> Self {
        self.interval = Some(interval);
        self
    }
}

impl<S: Setup> Trainer<S> {
    fn interval_of(&self, e: &Evaluator<S::Backend, S::Model>) -> Time {
        e.interval.unwrap_or(self.eval_interval)
    }

    /// Whether an evaluator with an epoch interval is due after epoch `epoch` ended.
    pub(super) fn epoch_eval_due(&self, e: &Evaluator<S::Backend, S::Model>, epoch: u64) -> bool {
        match self.interval_of(e) {
            Time::Epoch(n) => epoch.is_multiple_of(n),
            _ => false,
        }
    }

    /// Whether an evaluator with a non-epoch interval crossed a multiple of it in the batch
    /// that just ended.
    pub(super) fn batch_eval_due(
        &self,
        e: &Evaluator<S::Backend, S::Model>,
        before: &Timestamp,
    ) -> bool {
        let interval = self.interval_of(e);
        let progress = self.state.progress();
        let unit = interval.unit();
        if unit == TimeUnit::Epoch {
            return false;
        }
        let crossings =
            |ts: &Timestamp| (progress.elapsed(ts, unit) / interval.value() + 1e-9).floor();
        crossings(&self.state.timestamp) > crossings(before)
    }

    /// Sums the metric totals of evaluator `index` over every rank (a data-parallel run).
    fn reduce_metrics(&mut self, index: usize) -> Result<()> {
        let (Some(c), Some(ev)) = (
            self.state.collective.as_mut(),
            self.evaluators.get_mut(index),
        ) else {
            return Ok(());
        };
        if self.state.world.size <= 1 {
            return Ok(());
        }
        let mut totals = Vec::new();
        let mut lengths = Vec::with_capacity(ev.metrics.len());
        for m in &ev.metrics {
            let t = m
                .totals()
                .ok_or_else(|| unreducible_metric(&ev.label, &m.name()))?;
            lengths.push(t.len());
            totals.extend(t);
        }
        c.reduce_metrics(&mut totals)?;
        let mut rest = totals.as_slice();
        for (m, len) in ev.metrics.iter_mut().zip(lengths) {
            let (mine, tail) = rest.split_at(len);
            m.set_totals(mine);
            rest = tail;
        }
        Ok(())
    }

    /// Runs the evaluators that `select` picks, with the `EVAL_*` events, and stores their
    /// results in `State::eval_metrics`.
    pub(super) fn run_evaluators(
        &mut self,
        select: impl Fn(&Self, &Evaluator<S::Backend, S::Model>) -> bool,
    ) -> Result<()> {
        let chosen: Vec<bool> = self.evaluators.iter().map(|e| select(self, e)).collect();
        self.state.evaluated.clear();
        self.engine.run(Event::EvalBeforeAll, &mut self.state)?;
        let model = self.state.model().valid();
        for (index, _) in chosen.iter().enumerate().filter(|(_, &c)| c) {
            self.engine.run(Event::EvalStart, &mut self.state)?;
            let ev = &mut self.evaluators[index];
            for m in ev.metrics.iter_mut() {
                m.reset();
            }
            for batch in ev.source.iter_from(0, 0) {
                let batch = batch?;
                self.engine.run(Event::EvalBatchStart, &mut self.state)?;
                self.engine.run(Event::EvalBeforeForward, &mut self.state)?;
                let output = model.forward_eval(&batch);
                self.engine.run(Event::EvalAfterForward, &mut self.state)?;
                for m in ev.metrics.iter_mut() {
                    m.update(&output);
                }
                self.engine.run(Event::EvalBatchEnd, &mut self.state)?;
            }
            self.reduce_metrics(index)?;
            let ev = &self.evaluators[index];
            let results: BTreeMap<String, f64> =
                ev.metrics.iter().map(|m| (m.name(), m.value())).collect();
            tracing::info!(
                evaluator = %ev.label,
                epoch = self.state.timestamp.epoch,
                batch = self.state.timestamp.batch,
                metrics = ?results,
                "evaluation"
            );
            let label = ev.label.clone();
            if !self.engine.logger().is_empty() {
                let keys: Vec<(String, f64)> = results
                    .iter()
                    .map(|(k, v)| (format!("eval/{label}/{k}"), *v))
                    .collect();
                let values: Vec<(&str, f64)> = keys.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                let ts = self.state.timestamp.clone();
                self.engine.logger().log_metrics(&ts, &values)?;
            }
            self.state.eval_metrics.insert(label.clone(), results);
            self.state.evaluated.push(label);
            self.engine.run(Event::EvalEnd, &mut self.state)?;
        }
        self.state.last_eval_batch = Some(self.state.timestamp.batch);
        self.engine.run(Event::EvalAfterAll, &mut self.state)?;
        Ok(())
    }

    /// Runs every evaluator now and returns all results (evaluator label, metric, value).
    pub fn eval(&mut self) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
        self.engine
            .run(Event::EvalStandaloneStart, &mut self.state)?;
        self.run_evaluators(|_, _| true)?;
        self.engine.run(Event::EvalStandaloneEnd, &mut self.state)?;
        Ok(self.state.eval_metrics.clone())
    }

    /// Runs the model without gradients over every batch of `source` and returns the outputs
    /// in order (each rank of a data-parallel run predicts what its own `source` holds).
    pub fn predict(
        &mut self,
        source: &dyn BatchSource<EvalBatch<S::Backend, S::Model>>,
    ) -> Result<Vec<EvalOutput<S::Backend, S::Model>>> {
        self.engine.run(Event::PredictStart, &mut self.state)?;
        let model = self.state.model().valid();
        let mut out = Vec::with_capacity(source.num_batches());
        for batch in source.iter_from(0, 0) {
            let batch = batch?;
            self.engine.run(Event::PredictBatchStart, &mut self.state)?;
            self.engine
                .run(Event::PredictBeforeForward, &mut self.state)?;
            out.push(model.forward_eval(&batch));
            self.engine
                .run(Event::PredictAfterForward, &mut self.state)?;
            self.engine.run(Event::PredictBatchEnd, &mut self.state)?;
        }
        self.engine.run(Event::PredictEnd, &mut self.state)?;
        Ok(out)
    }
}
