//! Named presets that stack methods for image classification, as Composer's ResNet recipes
//! do: mild for the shortest budget, hot for the best accuracy at the full budget. Tuned on
//! the bundled MNIST task (see the README's time-to-accuracy table for what each buys there,
//! and ARCHITECTURE.md for the methods that were tried and left out because they cost this
//! small CNN accuracy or time).

use crate::error::{AlgorithmError, Result};
use crate::spec::{parse_list, AlgorithmSpec};

/// A recipe: its algorithms and the scale-schedule ratio it trains with.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// `mild`, `medium` or `hot`.
    pub name: &'static str,
    /// The algorithm list, in the `--algorithms` syntax.
    pub algorithms: &'static str,
    /// Multiplier of the run's length and of its schedule's milestones.
    pub scale_schedule_ratio: f64,
}

/// The recipes, mildest first.
pub const RECIPES: &[Recipe] = &[
    // The shortest budget: half the epochs; label smoothing and global-norm clipping make up
    // the accuracy.
    Recipe {
        name: "mild",
        algorithms: "label_smoothing:smoothing=0.1,gradient_clipping:clipping_type=norm:clipping_threshold=0.5",
        scale_schedule_ratio: 0.5,
    },
    // Two thirds of the epochs; EMA weights for evaluation smooth the late noise.
    Recipe {
        name: "medium",
        algorithms: "label_smoothing:smoothing=0.1,gradient_clipping:clipping_type=norm:clipping_threshold=0.5,ema:half_life=25ba",
        scale_schedule_ratio: 0.67,
    },
    // The full budget with the same stack.
    Recipe {
        name: "hot",
        algorithms: "label_smoothing:smoothing=0.1,gradient_clipping:clipping_type=norm:clipping_threshold=0.5,ema:half_life=25ba",
        scale_schedule_ratio: 1.0,
    },
];

/// The GPT recipes, mildest first, for the Shakespeare example's language model. Tuned on
/// the bundled corpus against a plain 2-block GPT (width 128, 1,000 batches of 32 windows of
/// 128 characters, which ends at 1.908 nats per character, well past the bigram plateau of
/// 2.595; 2026-12-07), by the training time each needs to reach that loss:
///
/// - ALiBi on the full window (`train_sequence_length_scaling=1`) reaches it after 750 of
///   its 1,000 batches and ends at 1.858; at a quarter of the window (Composer's default) it
///   learns less per batch (2.015 against 1.995 after 600).
/// - Sequence-length warmup from 8 to the window's 128 characters over the first 30% of
///   the run (`max_seq_length=128`: the default 1,024 would end the warmup after 3.5% of it)
///   trains on about 14% fewer tokens, on the bigram plateau where short contexts lose
///   nothing, and reaches the loss after 780 batches.
/// - Selective backprop (from half way to 90%, half of every other batch) keeps ALiBi's
///   curve (1.900 after 750 batches) with cheaper steps.
///
/// Measured there and left out: a shorter schedule (a scale-schedule ratio below 1: this
/// run is limited by its learning rate, and a cosine squeezed into 80% of the batches ends at
/// 1.937 with ALiBi and the warmup, above the target; 67% with ALiBi alone: 1.987), EMA
/// weights (half-life 50 batches: the loss after 800 batches instead of 750), a warmup over
/// half of the run (ends at 1.939), gated linear units (GEGLU at 2/3 width ended 0.16 above
/// the plain model in a 200-batch run), and label smoothing (it raises the cross-entropy it
/// is scored by).
pub const GPT_RECIPES: &[Recipe] = &[
    // ALiBi alone.
    Recipe {
        name: "gpt-mild",
        algorithms: "alibi:train_sequence_length_scaling=1",
        scale_schedule_ratio: 1.0,
    },
    // ALiBi and sequence-length warmup: fewer tokens on the bigram plateau.
    Recipe {
        name: "gpt-medium",
        algorithms: "alibi:train_sequence_length_scaling=1,seq_length_warmup:max_seq_length=128",
        scale_schedule_ratio: 1.0,
    },
    // The medium stack with selective backprop in the second half.
    Recipe {
        name: "gpt-hot",
        algorithms: "alibi:train_sequence_length_scaling=1,seq_length_warmup:max_seq_length=128,selective_backprop",
        scale_schedule_ratio: 1.0,
    },
];

/// The ResNet recipes, mildest first, modelled on Composer's ResNet recipes (BlurPool, label
/// smoothing and progressive resizing, on growing budgets) and tuned on the bundled digits
/// with ResNet-8 for 375 batches (the benchmark's `resnet_recipes` rows), checked on three
/// seeds so that they are not fitted to one. They run on any model with surgery-ready
/// convolutions or max pools (on the CNN, BlurPool blurs its max pool).
///
/// Measured there and left out (one to three repetitions each): EMA weights (no gain at these
/// lengths), SqueezeExcite and stochastic depth (Composer's hot recipes; here they cost
/// accuracy and step time), SAM every 10 steps, ColOut, gradient clipping and label smoothing
/// 0.2 (each lowered the final accuracy), progressive resizing from 0.4 or with a 0.1
/// finetune, and selective backprop keeping 0.3.
pub const RESNET_RECIPES: &[Recipe] = &[
    // Half the batches: anti-aliased strided convolutions, label smoothing, half-size digits
    // for most of the run (a quarter of the convolution work) and, from half way, backward
    // on the harder half of every other batch. The fastest; it ends below the baseline.
    Recipe {
        name: "resnet-mild",
        algorithms: "blurpool,label_smoothing:smoothing=0.1,progressive_resizing:initial_scale=0.5:delay_fraction=0:finetune_fraction=0.2,selective_backprop",
        scale_schedule_ratio: 0.5,
    },
    // The same stack on two thirds of the batches: the baseline's accuracy in about half its
    // time.
    Recipe {
        name: "resnet-medium",
        algorithms: "blurpool,label_smoothing:smoothing=0.1,progressive_resizing:initial_scale=0.5:delay_fraction=0:finetune_fraction=0.2,selective_backprop",
        scale_schedule_ratio: 0.67,
    },
    // The full budget for accuracy: no selective backprop, and a longer full-size finetune.
    Recipe {
        name: "resnet-hot",
        algorithms: "blurpool,label_smoothing:smoothing=0.1,progressive_resizing:initial_scale=0.5:delay_fraction=0:finetune_fraction=0.3",
        scale_schedule_ratio: 1.0,
    },
];

/// The recipe called `name`, among [`RECIPES`] and [`RESNET_RECIPES`].
pub fn recipe(name: &str) -> Result<&'static Recipe> {
    RECIPES
        .iter()
        .chain(RESNET_RECIPES)
        .chain(GPT_RECIPES)
        .find(|r| r.name == name)
        .ok_or_else(|| AlgorithmError::UnknownRecipe {
            name: name.to_string(),
            valid: RECIPES
                .iter()
                .chain(RESNET_RECIPES)
                .chain(GPT_RECIPES)
                .map(|r| r.name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

impl Recipe {
    /// The recipe's algorithms, parsed.
    pub fn specs(&self) -> Vec<AlgorithmSpec> {
        // The lists above are constants checked by the tests below.
        parse_list(self.algorithms).expect("recipe lists are valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_recipe_parses_and_unknown_ones_are_named() {
        for r in RECIPES.iter().chain(RESNET_RECIPES).chain(GPT_RECIPES) {
            assert!(!r.specs().is_empty());
            assert!(r.scale_schedule_ratio > 0.0 && r.scale_schedule_ratio <= 1.0);
        }
        let e = recipe("spicy").err().unwrap().to_string();
        assert!(
            e.contains("spicy") && e.contains("mild, medium, hot"),
            "{e}"
        );
    }
}
