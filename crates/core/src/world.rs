//! Who is who in a data-parallel run, and who acts where: [`World`] (this process's rank and
//! the number of ranks), [`Ranks`] (the ranks a component asks to act on) and
//! [`OnEveryRank`] (the wrapper that makes a rank-0 component act everywhere). Plain data,
//! with no dependency in the crate, so that the callback, logger, state and collective
//! modules can all use it without pointing at each other.

/// Rank and size of the data-parallel world this process belongs to, and so who writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
}

impl Default for World {
    fn default() -> Self {
        World { rank: 0, size: 1 }
    }
}

impl World {
    /// Whether this is the main rank (0): the one whose loggers, progress bar, plots and
    /// checkpoint saver act, unless a component is configured to act on every rank
    /// ([`Ranks`]).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Whether a component that acts on `ranks` acts on this process (in a run whose
    /// optimizer state is not sharded: see [`World::runs_in`]).
    pub fn runs(&self, ranks: Ranks) -> bool {
        self.runs_in(ranks, false)
    }

    /// Whether a component that acts on `ranks` acts on this process, in a run whose
    /// optimizer state is `sharded` or not.
    pub fn runs_in(&self, ranks: Ranks, sharded: bool) -> bool {
        match ranks {
            Ranks::Every => true,
            Ranks::Main => self.is_main(),
            Ranks::Shards => sharded || self.is_main(),
        }
    }
}

/// Which ranks of a data-parallel run a component acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// Rank 0 only: components that write files or the terminal.
    Main,
    /// Every rank.
    Every,
    /// Rank 0, and every rank of a run whose optimizer state is sharded
    /// ([`crate::shard`]), where each rank holds a part of what the component writes (the
    /// checkpoint saver: each rank writes its own shard).
    Shards,
}

/// Makes a component that would act on rank 0 only (a logger, a writing callback) act on
/// every rank of a data-parallel run; everything else passes through unchanged. Give each
/// rank its own files then. (Its `LoggerDestination` impl is in `logger`, its `Callback` impl
/// in `callback`.)
///
/// ```
/// use flashover_core::collective::{OnEveryRank, Ranks};
/// use flashover_core::logger::LoggerDestination;
///
/// struct Lines;
/// impl LoggerDestination for Lines {
///     fn name(&self) -> &str { "lines" }
/// }
/// assert_eq!(Lines.ranks(), Ranks::Main);
/// assert_eq!(OnEveryRank(Lines).ranks(), Ranks::Every);
/// assert_eq!(OnEveryRank(Lines).name(), "lines");
/// ```
pub struct OnEveryRank<T>(pub T);
