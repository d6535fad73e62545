//! Several devices in one process, one training thread each: core's [`Collective`] over
//! burn-collective's local mode (measured bit-exact here with Burn 0.21 on 2-3 threads), so a
//! machine with 8 GPUs can run one process with 8 devices instead of 8 processes.
//!
//! Device buffers (gradients, weights) go through burn-collective's all-reduce and
//! broadcast, which move them between the devices. Host numbers (progress, metric totals,
//! stop flags) are summed in shared memory, in rank order, by every thread alike. Every
//! collective first meets the group at a host rendezvous with a deadline: burn-collective's
//! calls block until every device has called, so a thread that failed (or hangs) would
//! otherwise stop the others forever. A thread that fails calls [`LocalRank::fail`] (the
//! example does), and the others return its error at their next collective; a thread that
//! does not arrive within the timeout is named in the others' errors.

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};
use flashover_core::collective::Collective;
use flashover_core::error::{CoreError, Result as CoreResult};
use flashover_core::setup::{InnerBackendOf, Setup};
use flashover_core::state::World;

use crate::DistributedError;

/// A group of `size` ranks inside one process; hand [`LocalGroup::member`] to each thread.
#[derive(Debug, Clone)]
pub struct LocalGroup {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    meet: Mutex<Meeting>,
    changed: Condvar,
}

/// The rendezvous: how many ranks arrived in the current round, their host values, and the
/// failure that ends the group.
#[derive(Debug, Default)]
struct Meeting {
    round: u64,
    arrived: Vec<bool>,
    values: Vec<Vec<f64>>,
    sum: Vec<f64>,
    failed: Option<(usize, String)>,
}

impl LocalGroup {
    /// A group of `size` ranks; a rank that waits `timeout` in one collective for another
    /// fails with an error naming it.
    pub fn new(size: usize, timeout: Duration) -> Result<Self, DistributedError> {
        if size == 0 || size > 1024 {
            return Err(DistributedError::InvalidOption {
                name: "devices",
                value: size.to_string(),
                expected: "a number of devices between 1 and 1024",
            });
        }
        Ok(LocalGroup {
            shared: Arc::new(Shared {
                size,
                timeout,
                meet: Mutex::new(Meeting {
                    arrived: vec![false; size],
                    values: vec![Vec::new(); size],
                    ..Meeting::default()
                }),
                changed: Condvar::new(),
            }),
        })
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Waits until every rank of the group has called it (as rank `rank`).
    pub fn barrier(&self, rank: usize) -> CoreResult<()> {
        self.shared.meet(rank, &[], "a barrier").map(|_| ())
    }

    /// Every rank's `text` (at most 4096 bytes), in rank order, on every rank.
    pub fn all_gather_text(&self, rank: usize, text: &str) -> CoreResult<Vec<String>> {
        const MAX: usize = 4096;
        let size = self.shared.size;
        let bytes = &text.as_bytes()[..text.len().min(MAX)];
        let mut all = vec![0.0f64; (MAX + 1) * size];
        let at = (MAX + 1) * rank;
        all[at] = bytes.len() as f64;
        for (slot, b) in all[at + 1..].iter_mut().zip(bytes) {
            *slot = f64::from(*b);
        }
        let all = self.shared.meet(rank, &all, "a text gather")?;
        Ok(all
            .chunks(MAX + 1)
            .map(|c| {
                let n = (c[0] as usize).min(MAX);
                let b: Vec<u8> = c[1..=n].iter().map(|&v| v as u8).collect();
                String::from_utf8_lossy(&b).into_owned()
            })
            .collect())
    }

    /// Tells every rank that rank `rank` failed with `error`: each returns it (naming the
    /// rank) from its current or next collective. For the thread that owns `rank` when it
    /// fails before or after its trainer exists.
    pub fn fail(&self, rank: usize, error: &str) {
        let mut m = self.shared.meet.lock().unwrap_or_else(|p| p.into_inner());
        if m.failed.is_none() {
            m.failed = Some((rank, error.to_string()));
        }
        self.shared.changed.notify_all();
    }

    /// Rank `rank`'s collective on `device` (the inner, non-autodiff backend's device), to be
    /// used by one thread. The device joins burn-collective at the rank's first collective,
    /// once every rank of the group has arrived (burn-collective's registration waits for
    /// all devices, with no deadline). burn-collective keeps one local group per backend
    /// type per process: a second group on the same backend while one is alive is an error.
    pub fn member<B: Backend>(
        &self,
        rank: usize,
        device: B::Device,
    ) -> Result<LocalRank<B>, DistributedError> {
        if rank >= self.shared.size {
            return Err(DistributedError::InvalidOption {
                name: "rank",
                value: rank.to_string(),
                expected: "a rank below the group's size",
            });
        }
        let key = std::any::TypeId::of::<B>();
        let mut active = active_groups().lock().unwrap_or_else(|p| p.into_inner());
        match active.get(&key).and_then(std::sync::Weak::upgrade) {
            Some(other) if !Arc::ptr_eq(&other, &self.shared) => {
                return Err(DistributedError::InvalidOption {
                    name: "LocalGroup",
                    value: format!("a second group on backend {}", std::any::type_name::<B>()),
                    expected: "one LocalGroup per backend at a time in a process (burn-collective's local server is per process); drop the first group's members first",
                });
            }
            _ => {
                active.insert(key, Arc::downgrade(&self.shared));
            }
        }
        Ok(LocalRank {
            rank,
            shared: self.shared.clone(),
            device: Some(device),
            registered: false,
            _backend: PhantomData,
        })
    }
}

/// The group alive on each backend type in this process.
fn active_groups(
) -> &'static Mutex<std::collections::HashMap<std::any::TypeId, std::sync::Weak<Shared>>> {
    static ACTIVE: std::sync::OnceLock<
        Mutex<std::collections::HashMap<std::any::TypeId, std::sync::Weak<Shared>>>,
    > = std::sync::OnceLock::new();
    ACTIVE.get_or_init(Default::default)
}

/// One thread's rank in a [`LocalGroup`].
#[derive(Debug)]
pub struct LocalRank<B: Backend> {
    rank: usize,
    shared: Arc<Shared>,
    /// The device, until it joins burn-collective.
    device: Option<B::Device>,
    registered: bool,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> LocalRank<B> {
    /// This rank and the group's size.
    pub fn world(&self) -> World {
        World {
            rank: self.rank,
            size: self.shared.size,
        }
    }

    /// Tells the other ranks that this one failed with `error`: each returns it (naming this
    /// rank) from its current or next collective.
    pub fn fail(&self, error: &str) {
        LocalGroup {
            shared: self.shared.clone(),
        }
        .fail(self.rank, error);
    }

    /// Joins burn-collective once every rank is here: all meet, rank 0 clears what a
    /// previous group on this backend left in burn-collective's per-process server, all meet
    /// again, then each registers its device (which returns once all have).
    fn join(&mut self) -> CoreResult<()> {
        if self.registered || self.shared.size <= 1 {
            return Ok(());
        }
        self.meet(&[], "joining the device group")?;
        if self.rank == 0 {
            burn_collective::reset_collective::<B>();
        }
        self.meet(&[], "joining the device group")?;
        let device = self
            .device
            .take()
            .ok_or_else(|| failure("joining the device group", "the device was already taken"))?;
        let config = CollectiveConfig::default().with_num_devices(self.shared.size);
        burn_collective::register::<B>(PeerId(self.rank as u32), device, config).map_err(|e| {
            failure(
                "joining the device group",
                &format!("burn-collective register: {e:?}"),
            )
        })?;
        self.registered = true;
        Ok(())
    }

    /// Meets every rank: adds this rank's `values`, waits (with the deadline) for the others,
    /// and returns their sum in rank order, the same bits on every rank.
    fn meet(&self, values: &[f64], what: &str) -> CoreResult<Vec<f64>> {
        self.shared.meet(self.rank, values, what)
    }
}

impl Shared {
    /// Meets every rank: adds this rank's `values`, waits (with the deadline) for the others,
    /// and returns their sum in rank order, the same bits on every rank.
    fn meet(&self, rank: usize, values: &[f64], what: &str) -> CoreResult<Vec<f64>> {
        let s = self;
        let started = Instant::now();
        let mut m = s.meet.lock().unwrap_or_else(|p| p.into_inner());
        // A rank that finished the previous round early waits for it to be read.
        let round = loop {
            check_failed(&m, rank)?;
            if !m.arrived[rank] {
                break m.round;
            }
            m = wait(s, m, started, rank, what)?;
        };
        m.arrived[rank] = true;
        m.values[rank] = values.to_vec();
        if m.arrived.iter().all(|&a| a) {
            let n = values.len();
            let mut sum = vec![0.0; n];
            for v in &m.values {
                if v.len() != n {
                    return Err(failure(
                        what,
                        "the ranks brought buffers of different lengths",
                    ));
                }
                for (acc, x) in sum.iter_mut().zip(v) {
                    *acc += x;
                }
            }
            m.sum = sum;
            m.round += 1;
            m.arrived.iter_mut().for_each(|a| *a = false);
            s.changed.notify_all();
            return Ok(m.sum.clone());
        }
        while m.round == round {
            m = wait(s, m, started, rank, what)?;
        }
        Ok(m.sum.clone())
    }
}

fn wait<'a>(
    s: &'a Shared,
    m: std::sync::MutexGuard<'a, Meeting>,
    started: Instant,
    rank: usize,
    what: &str,
) -> CoreResult<std::sync::MutexGuard<'a, Meeting>> {
    check_failed(&m, rank)?;
    let left = s.timeout.saturating_sub(started.elapsed());
    if left.is_zero() {
        let missing: Vec<String> = m
            .arrived
            .iter()
            .enumerate()
            .filter(|(r, &a)| !a && *r != rank)
            .map(|(r, _)| r.to_string())
            .collect();
        return Err(failure(
            what,
            &format!(
                "rank {rank} waited {:.1} s for rank(s) {} of this process, which did not arrive",
                started.elapsed().as_secs_f64(),
                missing.join(", ")
            ),
        ));
    }
    let (m, _) = s
        .changed
        .wait_timeout(m, left.min(Duration::from_millis(200)))
        .unwrap_or_else(|p| p.into_inner());
    check_failed(&m, rank)?;
    Ok(m)
}

fn check_failed(m: &Meeting, rank: usize) -> CoreResult<()> {
    match &m.failed {
        Some((r, msg)) if *r != rank => Err(CoreError::Component {
            component: "collective".into(),
            event: "a collective",
            message: format!("rank {r} of this process failed: {msg}"),
        }),
        _ => Ok(()),
    }
}

fn failure(what: &str, message: &str) -> CoreError {
    CoreError::Component {
        component: "collective".into(),
        event: "a collective",
        message: format!("{what}: {message}"),
    }
}

impl<B: Backend> Drop for LocalRank<B> {
    fn drop(&mut self) {
        if self.registered {
            let _ = burn_collective::finish_collective::<B>(PeerId(self.rank as u32));
        }
    }
}

impl<S: Setup> Collective<S> for LocalRank<InnerBackendOf<S>> {
    fn world(&self) -> World {
        LocalRank::world(self)
    }

    fn all_reduce_sum(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> CoreResult<Tensor<InnerBackendOf<S>, 1>> {
        if self.shared.size <= 1 {
            return Ok(buffer);
        }
        self.join()?;
        self.meet(&[], "the gradient all-reduce")?;
        let primitive = buffer.into_primitive().tensor();
        let sum = burn_collective::all_reduce::<InnerBackendOf<S>>(
            PeerId(self.rank as u32),
            primitive,
            ReduceOperation::Sum,
        )
        .map_err(|e| failure("the gradient all-reduce", &format!("{e:?}")))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(sum)))
    }

    fn all_reduce_sum_host(&mut self, values: &mut [f64]) -> CoreResult<()> {
        let sum = self.meet(values, "a sum of host numbers")?;
        values.copy_from_slice(&sum);
        Ok(())
    }

    fn broadcast(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> CoreResult<Tensor<InnerBackendOf<S>, 1>> {
        if self.shared.size <= 1 {
            return Ok(buffer);
        }
        self.join()?;
        self.meet(&[], "the weight broadcast")?;
        let mine = (self.rank == 0).then(|| buffer.into_primitive().tensor());
        let got = burn_collective::broadcast::<InnerBackendOf<S>>(PeerId(self.rank as u32), mine)
            .map_err(|e| failure("the weight broadcast", &format!("{e:?}")))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(got)))
    }
}
