//! Sharded optimizer state and gradients (`Sharding::ShardGradOp`), on ranks that are threads
//! of this process (`support/threads.rs`), so they run wherever the suite runs; the same runs
//! across processes under `mpirun`, with the transport's own reduce-scatter and all-gather,
//! are in `distributed.rs`. Sharded training holds the weights of data-parallel training bit
//! for bit (Adam and AdamW over hundreds of steps; with clipping, EMA, SAM and layer freezing
//! on three ranks); each rank's optimizer state is its share; a rank that cannot write its
//! shard fails the save on every rank, naming itself, and leaves no checkpoint.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::support::threads::ranks;
use crate::support::*;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Optimizer, SimpleOptimizer};
use flashover::algorithms::ema::Ema;
use flashover::algorithms::gradient_clipping::{ClippingType, GradientClipping};
use flashover::algorithms::layer_freezing::LayerFreezing;
use flashover::algorithms::sam::Sam;
use flashover::checkpoint::{SaveInterval, Saver, SaverConfig};
use flashover::core::data::{DataLoader, Dataset, MnistBatcher, MnistDataset, MnistSplit, Sampler};
use flashover::core::setup::SetupOf;
use flashover::core::shard::{ShardPlan, Sharding};
use flashover::core::state::World;
use flashover::core::time::Time;
use flashover::core::trainer::{Trainer, TrainerBuilder};
use flashover_examples::{bundled_mnist_dir, MnistCnn};

/// A trainer for rank `world.rank` on the first 64 training digits, `batch` a rank per step,
/// the CNN drawn from seed 5 (every rank takes rank 0's weights anyway).
fn builder<O: Optimizer<MnistCnn<TB>, TB>>(
    world: World,
    optimizer: O,
    batch: usize,
    max: &str,
) -> TrainerBuilder<SetupOf<TB, MnistCnn<TB>, O>> {
    let mut train = MnistDataset::from_dir(&bundled_mnist_dir(), MnistSplit::Train).unwrap();
    train.truncate(64);
    let sampler = Sampler::new(train.len(), batch, true, 3)
        .unwrap()
        .sharded(world.rank, world.size)
        .unwrap();
    let train = DataLoader::new(
        "train",
        Arc::new(train),
        Arc::new(MnistBatcher),
        sampler,
        device(),
    )
    .unwrap();
    Trainer::builder(
        MnistCnn::<TB>::new(&device(), 5 + world.rank as u64),
        optimizer,
        train,
        max.parse::<Time>().unwrap(),
        device(),
    )
    .lr(2e-3)
    .seed(3)
}

/// What a rank ends with: its weights and the parameters its optimizer holds state for.
#[derive(Debug, PartialEq)]
struct Ended {
    weights: Vec<f32>,
    optimizer_params: BTreeSet<u64>,
}

/// An optimizer of Burn's (an `OptimizerAdaptor`) for the CNN.
type Opt<SO> = OptimizerAdaptor<SO, MnistCnn<TB>, TB>;

fn ended<SO: SimpleOptimizer<Inner>>(t: &Trainer<SetupOf<TB, MnistCnn<TB>, Opt<SO>>>) -> Ended {
    Ended {
        weights: flashover::core::params::flatten_params::<TB, _>(t.model())
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
        optimizer_params: t
            .state()
            .optimizer()
            .to_record()
            .keys()
            .map(|id| id.val())
            .collect(),
    }
}

/// Runs `n` ranks with `sharding`, each trainer built by `build(world)`.
fn run<SO: SimpleOptimizer<Inner> + 'static>(
    n: usize,
    sharding: Sharding,
    build: impl Fn(World) -> TrainerBuilder<SetupOf<TB, MnistCnn<TB>, Opt<SO>>> + Send + Sync + 'static,
) -> Vec<Ended> {
    ranks(n, move |rank, c| {
        let world = World { rank, size: n };
        let mut t = build(world)
            .sharding(sharding)
            .collective(c)
            .build()
            .unwrap();
        t.fit().unwrap();
        assert_eq!(t.state().is_sharded(), sharding == Sharding::ShardGradOp);
        ended(&t)
    })
}

/// Sharded and data-parallel runs end with the same weights on every rank; the sharded
/// ranks' optimizer states are disjoint and together the data-parallel rank's.
fn assert_same_weights_and_split_state(dp: &[Ended], sharded: &[Ended]) {
    for (r, e) in dp.iter().chain(sharded).enumerate() {
        assert!(
            e.weights == dp[0].weights,
            "rank {r} of the runs ended with other weights"
        );
    }
    let whole = &dp[0].optimizer_params;
    let mut union = BTreeSet::new();
    for e in sharded {
        assert!(e.optimizer_params.is_disjoint(&union), "state kept twice");
        union.extend(&e.optimizer_params);
        assert!(
            e.optimizer_params.len() < whole.len(),
            "a rank kept everything"
        );
    }
    // (Each run draws its own parameter ids: the sets compare by size.)
    assert_eq!(
        union.len(),
        whole.len(),
        "every parameter's state is kept by one rank"
    );
}

#[test]
fn sharded_training_holds_the_data_parallel_weights_bit_for_bit_with_adam_and_adamw() {
    // 300 steps of 8 digits a rank (two ranks, 16 a step): 75 epochs of the 64 digits.
    let adam = |w: World| builder(w, burn::optim::AdamConfig::new().init(), 8, "300ba");
    let dp = run(2, Sharding::NoShard, adam);
    let sharded = run(2, Sharding::ShardGradOp, adam);
    assert_same_weights_and_split_state(&dp, &sharded);
    let adamw = |w: World| {
        let o = burn::optim::AdamWConfig::new()
            .with_weight_decay(0.05)
            .init();
        builder(w, o, 8, "300ba")
    };
    let dp = run(2, Sharding::NoShard, adamw);
    let sharded = run(2, Sharding::ShardGradOp, adamw);
    assert_same_weights_and_split_state(&dp, &sharded);
    // The weights moved: a run that stepped nothing would pass too.
    let start =
        flashover::core::params::flatten_params::<TB, _>(&MnistCnn::<TB>::new(&device(), 5))
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
    assert!(dp[0].weights != start);
}

#[test]
fn clipping_ema_sam_and_layer_freezing_keep_the_bits_on_three_ranks() {
    // Norm clipping's global norm, SAM's whole gradient and layer freezing's changing set
    // of trainable parameters each meet the shards; EMA swaps its weights in at the end.
    let with_all = |w: World| {
        builder(w, burn::optim::AdamWConfig::new().init(), 4, "24ba")
            .algorithm(GradientClipping::new(ClippingType::Norm, 0.05).unwrap())
            .algorithm(Sam::new(0.05, 1e-12, 2).unwrap())
            .algorithm(LayerFreezing::new(0.3, 0.5).unwrap())
            .algorithm(Ema::new(Time::Batch(4)).unwrap())
    };
    let dp = run(3, Sharding::NoShard, with_all);
    let sharded = run(3, Sharding::ShardGradOp, with_all);
    for (r, e) in dp.iter().chain(&sharded).enumerate() {
        assert!(
            e.weights == dp[0].weights,
            "rank {r} ended with other weights"
        );
    }
}

#[test]
fn a_world_of_one_shards_nothing_and_the_plan_balances_elements() {
    let mut t = builder(
        World::default(),
        burn::optim::AdamConfig::new().init(),
        8,
        "2ba",
    )
    .sharding(Sharding::ShardGradOp)
    .build()
    .unwrap();
    t.fit().unwrap();
    assert!(!t.state().is_sharded());
    // The CNN over two ranks: each a contiguous run of parameters, in module order.
    let plan = ShardPlan::for_model::<TB, _>(t.model(), World { rank: 0, size: 2 });
    let per_rank = plan.elements_per_rank::<TB, _>(t.model()).unwrap();
    let total: usize = per_rank.iter().sum();
    assert_eq!(total, t.model().num_params_of_floats());
    assert!(plan.owners().windows(2).all(|o| o[0] <= o[1]));
}

/// Counts the float parameter elements of a model.
trait FloatElements {
    fn num_params_of_floats(&self) -> usize;
}

impl FloatElements for MnistCnn<TB> {
    fn num_params_of_floats(&self) -> usize {
        use burn::module::Module;
        self.num_params()
    }
}

/// The saver of one rank of a sharded run, saving every `every` into `folder`.
fn saver(folder: &Path, every: Time) -> Saver {
    Saver::new(SaverConfig::new(folder), SaveInterval::Every(every)).unwrap()
}

#[test]
fn a_rank_that_cannot_write_its_shard_fails_the_save_on_every_rank_and_leaves_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let folder: PathBuf = dir.path().join("ck");
    // Rank 1's shard of the checkpoint at batch 2 cannot be created: a directory is in its
    // way (as a full disk or a lost mount would stop it).
    let staging = folder.join(".shards-ep0-ba2");
    std::fs::create_dir_all(staging.join("optimizer-rank1-of2.mpk").join("in-the-way")).unwrap();
    let f = folder.clone();
    let errors = ranks(2, move |rank, c| {
        let mut t = builder(
            World { rank, size: 2 },
            burn::optim::AdamConfig::new().init(),
            8,
            "4ba",
        )
        .sharding(Sharding::ShardGradOp)
        .collective(c)
        .callback(saver(&f, Time::Batch(2)))
        .build()
        .unwrap();
        t.fit().unwrap_err().to_string()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("rank 1") && e.contains("optimizer-rank1-of2.mpk"),
            "rank {rank}: {e}"
        );
    }
    assert!(!folder.join("ep0-ba2").exists(), "no partial checkpoint");
    assert!(!folder.join("latest").exists());
}

#[test]
fn a_sharded_checkpoint_holds_one_optimizer_file_per_rank_under_one_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let folder: PathBuf = dir.path().join("ck");
    let f = folder.clone();
    ranks(2, move |rank, c| {
        let mut t = builder(
            World { rank, size: 2 },
            burn::optim::AdamConfig::new().init(),
            8,
            "2ba",
        )
        .sharding(Sharding::ShardGradOp)
        .collective(c)
        .callback(saver(&f, Time::Batch(2)))
        .build()
        .unwrap();
        t.fit().unwrap();
    });
    let ck = folder.join("ep0-ba2");
    let manifest = flashover::checkpoint::format::verify(&ck).unwrap();
    let names: BTreeSet<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "model.safetensors",
            "optimizer-rank0-of2.mpk",
            "optimizer-rank1-of2.mpk",
            "trainer_state.json",
        ])
    );
    // No staging left behind.
    let left: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".lock")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn without_sharding_the_saver_writes_on_rank_zero_unless_it_is_on_every_rank() {
    use flashover::core::collective::OnEveryRank;
    let dir = tempfile::tempdir().unwrap();
    let root: PathBuf = dir.path().to_path_buf();
    let r = root.clone();
    ranks(2, move |rank, c| {
        let mut t = builder(
            World { rank, size: 2 },
            burn::optim::AdamConfig::new().init(),
            8,
            "2ba",
        )
        .collective(c)
        .callback(saver(&r.join(format!("main-{rank}")), Time::Batch(2)))
        .callback(OnEveryRank(saver(
            &r.join(format!("every-{rank}")),
            Time::Batch(2),
        )))
        .build()
        .unwrap();
        t.fit().unwrap();
    });
    let saved = |name: &str| {
        root.join(name)
            .join("ep0-ba2")
            .join("optimizer.mpk")
            .exists()
    };
    assert!(saved("main-0") && !saved("main-1"));
    assert!(saved("every-0") && saved("every-1"));
}
