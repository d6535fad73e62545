//! Where monitors read the time. [`SystemClock`] is the real one; [`ManualClock`] is set by
//! hand, so that a speed or runtime figure can be checked against arithmetic in a test.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A monotonic clock: time since some fixed origin.
pub trait Clock: Send {
    /// Time since the clock's origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock (`Instant`), with its origin where it was created.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that only moves when told to. Clones share one time, so a test keeps a clone and
/// advances it while the monitor that owns the other reads it.
///
/// ```
/// use flashover_callbacks::clock::{Clock, ManualClock};
/// use std::time::Duration;
/// let clock = ManualClock::default();
/// let seen_by_monitor = clock.clone();
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(seen_by_monitor.now(), Duration::from_millis(250));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.nanos.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `to` (since its origin).
    pub fn set(&self, to: Duration) {
        self.nanos.store(to.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}
