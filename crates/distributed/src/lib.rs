//! Data-parallel training for Flashover: core's [`Collective`] seams implemented across
//! processes and machines through MPI (the `mpi` feature, over OpenMPI), with a watchdog so
//! that a lost rank ends the job instead of hanging it.
//!
//! A program calls [`init`] first thing. Started by `mpirun -n N` (or `cargo xtask launch -n
//! N`), a build with the `mpi` feature joins the job and gets a [`Distributed`] with
//! `world().size == N`; started on its own it is a single process and nothing here runs. The
//! program then
//! - shards its data by [`Distributed::world`] (`Sampler::sharded` for training,
//!   `Sampler::sharded_exact` for evaluation),
//! - hands [`Distributed::collective`] to the trainer builder,
//! - orders what one rank must do first with [`Distributed::barrier`] (rank 0 moves damaged
//!   checkpoints aside before the others look), and
//! - ends with [`Distributed::finish`], which on failure tells every other rank and stops
//!   the job.
//!
//! What crosses the network, and when, is core's business (see `flashover_core::collective`):
//! one all-reduce of the step's gradients, loss and sample count per optimizer step, a few
//! host numbers per batch (progress), per evaluation (metric totals) and per checkpoint
//! event (stop requests), and a broadcast of rank 0's weights at the start.
//!
//! ## Why the reduction is ours
//! MPI's own `MPI_Allreduce` may sum in an order that depends on the algorithm the library
//! picks for the message size and world size, and it blocks with no way to give up. The
//! all-reduce here is a ring (reduce-scatter, then all-gather) on MPI's non-blocking
//! point-to-point calls, written by hand for two reasons: its summation order is fixed and
//! documented (chunk `c` is summed starting at rank `c`, then `c+1`, ... around the ring), and
//! every rank receives the same bits because the all-gather copies them; and while it waits
//! it can watch the clock and answer its peers' questions (see [`Options::timeout`]).
//!
//! ## Faults
//! - A rank that returns an error calls [`Distributed::finish`] with it: the error is sent to
//!   every other rank, each prints it (`rank 1 (pid 123 on host) failed: ...`) and the job
//!   ends with a non-zero status.
//! - A rank that stops answering (SIGSTOP, a hung driver, a lost machine) is found by the
//!   watchdog: a rank that has waited [`Options::timeout`] in one collective asks every peer
//!   where it is; the ones that do not answer within a few seconds are named as lost
//!   (`lost rank 1 (pid 123 on host): ...`), the others as behind, and the job is aborted.
//! - A rank killed outright (SIGKILL, out of memory) is noticed by `mpirun` itself, which
//!   names it (`process rank 1 ... exited on signal 9`) and ends the job within about a
//!   second (measured with OpenMPI 4.1).
//!
//! A rank that timed out cannot return an error to its caller: MPI has no way to take back
//! a buffer handed to a pending receive, so it prints the error and calls `MPI_Abort`, which
//! ends every rank of the job (`mpirun` kills even a stopped one). Checkpoints are written
//! atomically (see `flashover-checkpoint`), so an abort never leaves a partial one.

use std::time::Duration;

use flashover_core::collective::Collective;
use flashover_core::setup::{InnerBackendOf, Setup};
use flashover_core::state::World;

mod local;
#[cfg(feature = "mpi")]
mod mpi_world;
mod ring;

pub use local::{LocalGroup, LocalRank};

#[cfg(feature = "mpi")]
pub use mpi_world::Mpi;
pub use ring::chunk_bounds;

/// Everything that can go wrong when a data-parallel job starts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// The process was started by a launcher as one of several ranks, but the build has no
    /// MPI support.
    #[error("this process was started as rank {rank} of {size} ({variable}={size}), but this build has no MPI support: build with the `mpi` feature (`cargo build --release -p flashover-examples --example mnist --features flashover-examples/mpi --target-dir target/mpi`; `cargo xtask launch` does this), or run one process without mpirun")]
    NoMpiSupport {
        /// The rank the launcher gave.
        rank: usize,
        /// The world size the launcher gave.
        size: usize,
        /// The environment variable it was read from.
        variable: &'static str,
    },

    /// Several processes were asked for, but this one was not started by a launcher.
    #[error("{requested} processes were asked for (--processes {requested}), but this process was started on its own: start it with `cargo xtask launch -n {requested} -- ...` or `mpirun -n {requested} ...`")]
    NoLauncher {
        /// The number of processes asked for.
        requested: usize,
    },

    /// The launcher started another number of processes than the program asked for.
    #[error("{requested} processes were asked for (--processes {requested}), but the launcher started {actual}: make the two agree")]
    WorldMismatch {
        /// The number asked for.
        requested: usize,
        /// The number started.
        actual: usize,
    },

    /// A global quantity does not divide over the ranks.
    #[error("invalid value {value} for `{name}`: with {world} processes it must be a multiple of {world} (each rank takes {name} / {world}); use for example {suggestion} for a new run (a run that resumes a checkpoint keeps its global batch: then choose a number of processes that divides it)")]
    NotDivisible {
        /// The setting.
        name: &'static str,
        /// Its value.
        value: usize,
        /// The world size.
        world: usize,
        /// The nearest multiple at or above the value.
        suggestion: usize,
    },

    /// An invalid option.
    #[error("invalid value {value} for `{name}`: expected {expected}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },

    /// MPI could not start, or failed in a way it reports.
    #[error("MPI: {0}")]
    Mpi(String),

    /// Another rank failed, or did not arrive in time.
    #[error("{0}")]
    Peer(String),

    /// Two ways of running several ranks were asked for at once.
    #[error("{devices} devices in one process were asked for (--devices {devices}), but this process is already one of {processes} processes started by mpirun: use one or the other")]
    DevicesAndProcesses {
        /// Devices asked for.
        devices: usize,
        /// Processes the launcher started.
        processes: usize,
    },
}

/// Settings of a data-parallel job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// How long a rank waits in one collective before it asks where the others are and, if
    /// one is lost or behind, ends the job (default 60 s). Keep it above the longest a rank
    /// may legitimately work alone between two collectives: rank 0 writing a synchronous
    /// checkpoint, or the first batch of a GPU backend compiling its kernels.
    pub timeout: Duration,
    /// How many processes the program expects (`--processes N`): started on its own with
    /// N > 1, or by a launcher with another number, is an error. `None`: whatever the
    /// launcher started.
    pub expected: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_secs(60),
            expected: None,
        }
    }
}

impl Options {
    fn validate(&self) -> Result<(), DistributedError> {
        if self.timeout < Duration::from_millis(100) || self.timeout > Duration::from_secs(86_400) {
            return Err(DistributedError::InvalidOption {
                name: "timeout",
                value: format!("{:?}", self.timeout),
                expected: "a time between 100 ms and 24 h",
            });
        }
        if self.expected == Some(0) {
            return Err(DistributedError::InvalidOption {
                name: "processes",
                value: "0".into(),
                expected: "a number of processes >= 1",
            });
        }
        Ok(())
    }
}

/// The rank and world size a launcher gave this process, read from its environment:
/// OpenMPI's `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, or the PMI variables of MPICH and
/// Slurm (`PMI_RANK`/`PMI_SIZE`). `None` when no launcher started it.
pub fn launched() -> Option<(World, &'static str)> {
    for (rank, size) in [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ] {
        let read = |name: &str| std::env::var(name).ok()?.trim().parse::<usize>().ok();
        if let (Some(r), Some(s)) = (read(rank), read(size)) {
            return Some((World { rank: r, size: s }, size));
        }
    }
    None
}

/// This process's place in a data-parallel job: a single process, or one rank of an MPI job.
#[derive(Debug, Clone)]
pub enum Distributed {
    /// One process; nothing is communicated.
    Single,
    /// One of several training threads of this process, each on its own device
    /// (burn-collective's local mode).
    Local {
        /// The group the threads share.
        group: LocalGroup,
        /// This thread's rank.
        rank: usize,
    },
    /// One rank of an MPI job.
    #[cfg(feature = "mpi")]
    Mpi(Mpi),
}

/// Joins the data-parallel job this process was started in, if any (see the crate docs).
///
/// Errors: the launcher started several ranks but the build has no `mpi` feature; more
/// processes were expected than were started; MPI fails to start. Every error says what to
/// do instead.
pub fn init(options: Options) -> Result<Distributed, DistributedError> {
    options.validate()?;
    let launched = launched();
    let actual = launched.map_or(1, |(w, _)| w.size);
    match (options.expected, launched) {
        (Some(n), None) if n > 1 => return Err(DistributedError::NoLauncher { requested: n }),
        (Some(n), Some(_)) if n != actual => {
            return Err(DistributedError::WorldMismatch {
                requested: n,
                actual,
            })
        }
        _ => {}
    }
    match launched {
        Some((world, variable)) if world.size > 1 => join(world, variable, options),
        _ => Ok(Distributed::Single),
    }
}

#[cfg(feature = "mpi")]
fn join(
    _world: World,
    _var: &'static str,
    options: Options,
) -> Result<Distributed, DistributedError> {
    Ok(Distributed::Mpi(Mpi::init(options)?))
}

#[cfg(not(feature = "mpi"))]
fn join(
    world: World,
    variable: &'static str,
    _options: Options,
) -> Result<Distributed, DistributedError> {
    Err(DistributedError::NoMpiSupport {
        rank: world.rank,
        size: world.size,
        variable,
    })
}

impl Distributed {
    /// This process's rank and the world size.
    pub fn world(&self) -> World {
        match self {
            Distributed::Single => World::default(),
            Distributed::Local { group, rank } => World {
                rank: *rank,
                size: group.size(),
            },
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => m.world(),
        }
    }

    /// Time spent in gradient all-reduces so far (moving the buffer to and from the host
    /// included, and waits for slower ranks); zero for a single process.
    pub fn allreduce_time(&self) -> Duration {
        match self {
            Distributed::Single | Distributed::Local { .. } => Duration::ZERO,
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => m.allreduce_time(),
        }
    }

    /// Whether this is rank 0 (or the only process).
    pub fn is_main(&self) -> bool {
        self.world().is_main()
    }

    /// The collective to hand to `TrainerBuilder::boxed_collective`; `None` for a single
    /// process. `device` is this rank's device (used by the local mode, where each thread
    /// has its own).
    pub fn collective<S: Setup>(
        &self,
        device: <InnerBackendOf<S> as burn::tensor::backend::BackendTypes>::Device,
    ) -> Result<Option<Box<dyn Collective<S>>>, DistributedError> {
        let _ = &device;
        Ok(match self {
            Distributed::Single => None,
            Distributed::Local { group, rank } => {
                Some(Box::new(group.member::<InnerBackendOf<S>>(*rank, device)?))
            }
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => Some(Box::new(m.clone())),
        })
    }

    /// Waits until every rank has called it.
    pub fn barrier(&self) -> Result<(), DistributedError> {
        match self {
            Distributed::Single => Ok(()),
            Distributed::Local { group, rank } => group
                .barrier(*rank)
                .map_err(|e| DistributedError::Peer(e.to_string())),
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => {
                m.barrier();
                Ok(())
            }
        }
    }

    /// Every rank's `text` (at most 4096 bytes each), in rank order, on every rank: to check
    /// that the ranks agree (their weights' digests, for example).
    pub fn all_gather_text(&self, text: &str) -> Result<Vec<String>, DistributedError> {
        match self {
            Distributed::Single => Ok(vec![text.to_string()]),
            Distributed::Local { group, rank } => group
                .all_gather_text(*rank, text)
                .map_err(|e| DistributedError::Peer(e.to_string())),
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => Ok(m.all_gather_text(text)),
        }
    }

    /// Ends this rank's part in the job. With no error, waits for every rank to get here and
    /// returns (an MPI rank shuts MPI down when its last handle is dropped). With an error
    /// (already printed by the caller), tells every other rank: an MPI rank ends the job with
    /// a non-zero status and does not return; a thread of a local group returns, and the
    /// other threads return the error from their next collective. A single process returns
    /// at once.
    pub fn finish(&self, error: Option<&str>) {
        match self {
            Distributed::Single => {}
            Distributed::Local { group, rank } => match error {
                Some(e) => group.fail(*rank, e),
                // A failure elsewhere was already reported by the rank that failed.
                None => {
                    let _ = group.barrier(*rank);
                }
            },
            #[cfg(feature = "mpi")]
            Distributed::Mpi(m) => match error {
                Some(e) => m.fail(e),
                None => m.barrier(),
            },
        }
    }
}

/// Checks that `value` (a global batch size, for example) divides over `world` ranks and
/// returns each rank's share.
pub fn per_rank(name: &'static str, value: usize, world: World) -> Result<usize, DistributedError> {
    let size = world.size.max(1);
    if value == 0 {
        return Err(DistributedError::InvalidOption {
            name,
            value: "0".into(),
            expected: "an integer >= 1",
        });
    }
    if !value.is_multiple_of(size) {
        return Err(DistributedError::NotDivisible {
            name,
            value,
            world: size,
            suggestion: value.div_ceil(size).max(1) * size,
        });
    }
    Ok(value / size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_global_size_that_does_not_divide_names_a_multiple() {
        let w = World { rank: 1, size: 3 };
        assert_eq!(per_rank("batch_size", 96, w).unwrap(), 32);
        let e = per_rank("batch_size", 64, w).unwrap_err().to_string();
        assert!(
            e.contains("64") && e.contains("multiple of 3") && e.contains("66"),
            "{e}"
        );
        assert!(per_rank("batch_size", 0, w).is_err());
    }

    #[test]
    fn bad_options_are_named() {
        let e = init(Options {
            expected: Some(0),
            ..Options::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("processes") && e.contains(">= 1"), "{e}");
        let e = init(Options {
            timeout: Duration::from_millis(1),
            ..Options::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("timeout"), "{e}");
    }
}
