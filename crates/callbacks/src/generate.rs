//! Generate (Composer's `Generate` callback): during training, every `interval`, continue a
//! fixed set of prompts with the model and log the text through the run's loggers (the
//! console prints it, the JSONL file records it, TensorBoard shows it in its Text tab, under
//! `generate/<i>` for the `i`-th prompt), so a run shows what the model writes as it learns.
//! Once more at the end of training, unless the last batch already generated.
//!
//! The callback knows nothing of models or tokenizers: the program hands it a function from
//! the model and a prompt to the continuation (for Flashover's GPT: encode, `Gpt::generate`
//! with a seeded `Sampling`, decode). With a fixed seed the function gives the same text for
//! the same weights, so the samples of a resumed run equal those of an uninterrupted one.
//! Only the main process generates; nothing in training changes.

use flashover_core::callback::{Callback, Control};
use flashover_core::collective::Ranks;
use flashover_core::error::{CoreError, Result};
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Time;

use crate::error::CallbackError;
use crate::monitors::{batch_interval, due};

/// The function [`Generate`] calls: the continuation of `prompt` by `model`, or why not.
pub type GenerateFn<M> = Box<dyn FnMut(&M, &str) -> std::result::Result<String, String> + Send>;

/// The Generate callback; see the module docs.
pub struct Generate<M> {
    prompts: Vec<String>,
    every: Time,
    generate: GenerateFn<M>,
    last: Option<u64>,
}

impl<M> Generate<M> {
    /// Continues each of `prompts` (at least one, none empty) with `generate` every `every`
    /// (batches or epochs) and at the end of training.
    pub fn new(
        prompts: Vec<String>,
        every: Time,
        generate: GenerateFn<M>,
    ) -> crate::error::Result<Self> {
        if prompts.is_empty() || prompts.iter().any(String::is_empty) {
            return Err(CallbackError::param(
                "generate",
                "prompts",
                format!("{prompts:?}"),
                "at least one prompt, none of them empty",
            ));
        }
        Ok(Self {
            prompts,
            every: batch_interval("generate", every)?,
            generate,
            last: None,
        })
    }

    fn run(
        &mut self,
        model: &M,
        batch: u64,
        logger: &mut Logger,
        ts: &flashover_core::time::Timestamp,
    ) -> Result<()> {
        for (i, prompt) in self.prompts.iter().enumerate() {
            let text = (self.generate)(model, prompt).map_err(|reason| CoreError::External {
                component: "generate".into(),
                source: format!("continuing prompt {i} ({prompt:?}): {reason}").into(),
            })?;
            logger.log_text(ts, &format!("generate/{i}"), &format!("{prompt}{text}"))?;
        }
        self.last = Some(batch);
        Ok(())
    }
}

impl<S: Setup> Callback<S> for Generate<S::Model> {
    fn name(&self) -> &str {
        "generate"
    }

    fn ranks(&self) -> Ranks {
        Ranks::Main
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        let ts = state.timestamp().clone();
        if due(
            self.every,
            ts.batch,
            ts.epoch,
            ts.batch_in_epoch,
            state.batches_per_epoch(),
        ) {
            self.run(state.model(), ts.batch, ctl.logger(), &ts)?;
        }
        Ok(())
    }

    fn fit_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        let ts = state.timestamp().clone();
        if self.last != Some(ts.batch) && ts.batch > 0 {
            self.run(state.model(), ts.batch, ctl.logger(), &ts)?;
        }
        Ok(())
    }
}
