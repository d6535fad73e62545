//! The ordered list of training events. The order is data, stated once here in
//! [`for_each_event!`], and everything that depends on it (the [`Event`] enum, the
//! per-event methods of [`Callback`](crate::callback::Callback)) is generated from that list.
//!
//! # Lifecycle
//! ```text
//! INIT, BEFORE_LOAD, AFTER_LOAD                          once, when the trainer is built
//! FIT_START                                              each call to fit
//!   EPOCH_START
//!     BEFORE_DATALOADER, AFTER_DATALOADER                each batch
//!     BATCH_START, BEFORE_TRAIN_BATCH
//!       BEFORE_FORWARD, AFTER_FORWARD, BEFORE_LOSS,      each microbatch
//!       AFTER_LOSS, BEFORE_BACKWARD, AFTER_BACKWARD
//!     AFTER_TRAIN_BATCH                                  gradient clipping; optimizer step follows
//!     BATCH_END, [EVAL_*], BATCH_CHECKPOINT
//!   EPOCH_END, [EVAL_*], EPOCH_CHECKPOINT
//! FIT_END
//! EVAL_BEFORE_ALL, (EVAL_START, (EVAL_BATCH_START, EVAL_BEFORE_FORWARD, EVAL_AFTER_FORWARD,
//!   EVAL_BATCH_END)*, EVAL_END)* per evaluator, EVAL_AFTER_ALL
//! EVAL_STANDALONE_START ... EVAL_STANDALONE_END          around a direct call to eval
//! PREDICT_START, (PREDICT_BATCH_START, PREDICT_BEFORE_FORWARD, PREDICT_AFTER_FORWARD,
//!   PREDICT_BATCH_END)*, PREDICT_END
//! ```
//! This module must not know how events are run; that is the engine's job.

/// Calls `$m!` with the full event list: `Variant => method, "NAME";` in lifecycle order.
#[macro_export]
#[doc(hidden)]
macro_rules! for_each_event {
    ($m:ident) => {
        $m! {
            Init => init, "INIT";
            BeforeLoad => before_load, "BEFORE_LOAD";
            AfterLoad => after_load, "AFTER_LOAD";
            FitStart => fit_start, "FIT_START";
            EpochStart => epoch_start, "EPOCH_START";
            BeforeDataloader => before_dataloader, "BEFORE_DATALOADER";
            AfterDataloader => after_dataloader, "AFTER_DATALOADER";
            BatchStart => batch_start, "BATCH_START";
            BeforeTrainBatch => before_train_batch, "BEFORE_TRAIN_BATCH";
            BeforeForward => before_forward, "BEFORE_FORWARD";
            AfterForward => after_forward, "AFTER_FORWARD";
            BeforeLoss => before_loss, "BEFORE_LOSS";
            AfterLoss => after_loss, "AFTER_LOSS";
            BeforeBackward => before_backward, "BEFORE_BACKWARD";
            AfterBackward => after_backward, "AFTER_BACKWARD";
            AfterTrainBatch => after_train_batch, "AFTER_TRAIN_BATCH";
            BatchEnd => batch_end, "BATCH_END";
            BatchCheckpoint => batch_checkpoint, "BATCH_CHECKPOINT";
            EpochEnd => epoch_end, "EPOCH_END";
            EpochCheckpoint => epoch_checkpoint, "EPOCH_CHECKPOINT";
            FitEnd => fit_end, "FIT_END";
            EvalBeforeAll => eval_before_all, "EVAL_BEFORE_ALL";
            EvalStart => eval_start, "EVAL_START";
            EvalBatchStart => eval_batch_start, "EVAL_BATCH_START";
            EvalBeforeForward => eval_before_forward, "EVAL_BEFORE_FORWARD";
            EvalAfterForward => eval_after_forward, "EVAL_AFTER_FORWARD";
            EvalBatchEnd => eval_batch_end, "EVAL_BATCH_END";
            EvalEnd => eval_end, "EVAL_END";
            EvalAfterAll => eval_after_all, "EVAL_AFTER_ALL";
            EvalStandaloneStart => eval_standalone_start, "EVAL_STANDALONE_START";
            EvalStandaloneEnd => eval_standalone_end, "EVAL_STANDALONE_END";
            PredictStart => predict_start, "PREDICT_START";
            PredictBatchStart => predict_batch_start, "PREDICT_BATCH_START";
            PredictBeforeForward => predict_before_forward, "PREDICT_BEFORE_FORWARD";
            PredictAfterForward => predict_after_forward, "PREDICT_AFTER_FORWARD";
            PredictBatchEnd => predict_batch_end, "PREDICT_BATCH_END";
            PredictEnd => predict_end, "PREDICT_END";
        }
    };
}

macro_rules! define_events {
    ($($variant:ident => $method:ident, $name:literal;)*) => {
        /// A point in the training lifecycle at which algorithms, callbacks and loggers run.
        /// See the module docs for the order.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Event {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Event {
            /// Every event, in lifecycle order.
            pub const ALL: &'static [Event] = &[$(Event::$variant),*];

            /// The event's name in upper snake case, as in Composer (`"BEFORE_FORWARD"`).
            pub fn name(self) -> &'static str {
                match self {
                    $(Event::$variant => $name,)*
                }
            }
        }
    };
}

for_each_event!(define_events);

impl Event {
    /// Whether this is an `AFTER_*` event, at which algorithms run in reverse order (first in,
    /// last out) so that each can undo what it did at the matching `BEFORE_*` event.
    pub fn is_after(self) -> bool {
        self.name().starts_with("AFTER_")
    }

    /// Whether the event belongs to the evaluation family.
    pub fn is_eval(self) -> bool {
        self.name().starts_with("EVAL_")
    }

    /// Whether the event belongs to the prediction family.
    pub fn is_predict(self) -> bool {
        self.name().starts_with("PREDICT_")
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_composers() {
        let names: Vec<_> = Event::ALL.iter().map(|e| e.name()).collect();
        let train = &names[..21];
        assert_eq!(
            train.join(" "),
            "INIT BEFORE_LOAD AFTER_LOAD FIT_START EPOCH_START BEFORE_DATALOADER AFTER_DATALOADER \
             BATCH_START BEFORE_TRAIN_BATCH BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS \
             BEFORE_BACKWARD AFTER_BACKWARD AFTER_TRAIN_BATCH BATCH_END BATCH_CHECKPOINT EPOCH_END \
             EPOCH_CHECKPOINT FIT_END"
        );
        let mut sorted = Event::ALL.to_vec();
        sorted.sort();
        assert_eq!(
            sorted,
            Event::ALL,
            "derive(Ord) must follow the lifecycle order"
        );
    }

    #[test]
    fn after_events_are_exactly_the_after_family() {
        let after: Vec<_> = Event::ALL
            .iter()
            .filter(|e| e.is_after())
            .map(|e| e.name())
            .collect();
        assert_eq!(
            after,
            [
                "AFTER_LOAD",
                "AFTER_DATALOADER",
                "AFTER_FORWARD",
                "AFTER_LOSS",
                "AFTER_BACKWARD",
                "AFTER_TRAIN_BATCH"
            ]
        );
        assert_eq!(Event::ALL.iter().filter(|e| e.is_eval()).count(), 10);
        assert_eq!(Event::ALL.iter().filter(|e| e.is_predict()).count(), 6);
    }
}
