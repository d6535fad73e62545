//! Cross-crate tests, built as one binary. Index:
//! - `events`: the recorded event trace of a short run (as text), exact call counts per event,
//!   and the order of algorithms, callbacks and loggers.
//! - `trainer`: fit twice, stop requests, non-finite losses, eval and predict, the learning
//!   rate against the schedule's formula, each optimizer through the trainer.
//! - `microbatch`: gradients with 1, 2, 4 (and uneven) microbatches equal the full batch's.
//! - `resume`: a run stopped and resumed in a new process ends with the same bits (epoch
//!   boundary, mid-epoch, after an epoch, microbatches, warmup, other schedules, async saves);
//!   `resume::in_process`: the same through the library's saver in one process (the GPU
//!   subset's form).
//! - `precision`: every precision trains the CNN about as well as float32, keeps its weights
//!   in the type it says, float16 overflow skips the step and lowers the scale, the scale
//!   grows after clean steps, half and mixed runs resume bit for bit, checkpoints record
//!   their precision and resume in another.
//! - `crash`: SIGKILL at random points, autoresume, same bits as the uninterrupted run.
//! - `damage`: damaged or hostile checkpoints and failed saves are typed errors naming the file.
//! - `hardening`: a new user's mistakes through the example: a run that would train nothing,
//!   damaged checkpoints under autoresume (moved aside, or an error that changes nothing), two
//!   processes on one save folder, output paths and token times checked before the first
//!   batch, a missing font, wrong image sizes, a closed stdout, unbounded settings, errors
//!   said once.
//! - `data`: the IDX reader on the real bundled files, raw and gzipped, whole and truncated.
//! - `determinism`: same seed, same bits; another seed, other bits.
//! - `bad_input`: every bad configuration is a typed error that names the value.
//! - `accuracy`: the example's default recipe reaches 97% on the bundled MNIST test digits.
//! - `observe`: every precision with every monitor and logger on; monitors against hand-computed values (fake clock, schedule formula, host
//!   sums), NaN watch, stoppers on real runs, the example's JSONL/CSV/TensorBoard files read
//!   back (TensorBoard's own reader), its Chrome trace nesting and its PNG plot.
//! - `algorithms`: every speed-up algorithm and recipe trains the MNIST CNN, changes what it
//!   should and resumes exactly in a new process; target rewriters compose in a defined order;
//!   bad algorithm lists are errors; sequence-length warmup trains a character model.
//! - `surgery`: BlurPool, GhostBatchNorm and StochasticDepth change the layers their definitions name, in code
//!   and by name; a surgery a model cannot take is an error naming what is missing; each
//!   resumes exactly; a checkpoint of other surgery is refused naming both.
//! - `seams`: the scale-out seams with two ranks on threads: rank 0's weights broadcast, two
//!   half batches train like one whole batch, global evaluation metrics, a stop on one rank
//!   stops both (also at `FIT_START`), a non-finite loss on one rank skips the step on both,
//!   ranks agree on samples and on the slowest clock, SAM steps alike, only rank 0 writes.
//! - `distributed`: the example under `mpirun` (built with MPI by the tests themselves, or
//!   skipped with a note where OpenMPI is missing): two processes train
//!   like one on the whole batch and repeat bit-exactly, every rank holds the same weights,
//!   SIGKILLed jobs resume to the same bits, a checkpoint of 2 ranks resumes on 1 and 3
//!   seeing every sample once, a stopped rank is named and the job ends, one rank's error
//!   ends all, bad launches are errors, and two ranks train across a veth pair between two
//!   network namespaces; sharded runs hold the data-parallel bits, re-shard on resumption
//!   (1, 2, 3 processes), name a damaged shard, survive SIGKILLs during sharded saves, and
//!   upload every rank's shard to an object store.
//! - `sharding`: sharded optimizer state and gradients on ranks in threads: the weights of
//!   data-parallel training bit for bit (Adam and AdamW over 300 steps; clipping, SAM, layer
//!   freezing and EMA on three ranks), each rank's optimizer state its share, a sharded
//!   checkpoint's one file per rank, a rank that cannot write its shard failing the save.
//! - `library`: Flashover as a library: EMA and SWA end with their average in the model and
//!   the example writes the weights it evaluated (reloaded, they give the reported metrics
//!   exactly); a loss that ignores soft targets stops the run naming the algorithm; the
//!   quickstart example trains, saves and resumes.
//! - `language`: the GPT example on the Shakespeare corpus: it learns, its metrics agree, it
//!   resumes bit for bit, bad shapes are errors naming them.
//! - `streaming`: datasets streamed from shards: MDS from mosaicml-streaming's writer (every
//!   encoding and compression) and Parquet from pyarrow read back value for value, damaged
//!   and missing shards named, the cache within its limit over a dataset 20x its size,
//!   shards from a real S3-compatible server through an outage mid-epoch.
//! - `mlflow`: the example's run in a real MLflow tracking server, read back with MLflow's
//!   client (params, every metric's history, tags, plot, weights, images, checkpoints), a
//!   resumed run continuing the same MLflow run, a server stopped and restarted mid-run losing
//!   no metric, a dead server costing only warnings, bad settings named; images through the
//!   JSONL folder and TensorBoard's reader.
//! - `object_store`: checkpoints and logs in a real S3-compatible server (`s3s-fs`): remote
//!   saves rotate and resume bit for bit on an empty disk, damaged or incomplete remote
//!   checkpoints are skipped by autoresume and refused by `--load`, a stopped server delays
//!   uploads and a dead one is an error at the end, SIGKILLs during uploads, logs continue,
//!   bad settings are clear errors and the secret appears nowhere.
//! - `tidy`: the architecture's rules, enforced: crate arrows from `cargo metadata`, a `//!`
//!   opening every file, an invariant comment above every `unwrap`/`expect` in library code;
//!   the GPU backends' test subset matches tests and starts no example program.

mod support;

#[path = "suite/accuracy.rs"]
mod accuracy;
#[path = "suite/algorithms.rs"]
mod algorithms;
#[path = "suite/bad_input.rs"]
mod bad_input;
#[path = "suite/crash.rs"]
mod crash;
#[path = "suite/damage.rs"]
mod damage;
#[path = "suite/data.rs"]
mod data;
#[path = "suite/determinism.rs"]
mod determinism;
#[path = "suite/distributed.rs"]
mod distributed;
#[path = "suite/events.rs"]
mod events;
#[path = "suite/hardening.rs"]
mod hardening;
#[path = "suite/language.rs"]
mod language;
#[path = "suite/library.rs"]
mod library;
#[path = "suite/microbatch.rs"]
mod microbatch;
#[path = "suite/mlflow.rs"]
mod mlflow;
#[path = "suite/object_store.rs"]
mod object_store;
#[path = "suite/observe.rs"]
mod observe;
#[path = "suite/precision.rs"]
mod precision;
#[path = "suite/resume.rs"]
mod resume;
#[path = "suite/seams.rs"]
mod seams;
#[path = "suite/sharding.rs"]
mod sharding;
#[path = "suite/streaming.rs"]
mod streaming;
#[path = "suite/surgery.rs"]
mod surgery;
#[path = "suite/tidy.rs"]
mod tidy;
#[path = "suite/trainer.rs"]
mod trainer;
