//! The MPI transport: one communication thread per process owns MPI (it initialises it, so
//! `MPI_THREAD_FUNNELED` holds: only that thread ever calls MPI) and runs every collective
//! the training thread asks for, in order, over a channel. Buffers move through the channel;
//! nothing is copied on the way.
//!
//! While the training thread computes, the communication thread still answers its peers
//! (every millisecond it looks for control messages), so a rank that is merely busy is told
//! apart from one that is gone: see the crate docs, "Faults".

use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData};
use flashover_core::collective::Collective;
use flashover_core::error::Result as CoreResult;
use flashover_core::setup::{InnerBackendOf, Setup};
use flashover_core::state::World;
use mpi::request::{scope, Request, Scope, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Equivalence, Source};

use crate::ring::{back, chunk_bounds, gather_step, scatter_step};
use crate::{DistributedError, Options};

/// Tag of the collectives' data messages (on the world communicator).
const DATA: i32 = 11;
/// Tag of control messages (on a communicator of their own).
const CONTROL: i32 = 12;
/// The exit status of a job this crate aborts.
const ABORT_STATUS: i32 = 1;
/// How long a rank that timed out waits for its peers to answer before naming them lost.
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// Control messages: a one-byte kind, then a little-endian `u64`, then text.
const PROBE: u8 = b'?';
const ANSWER: u8 = b'!';
const FAILED: u8 = b'F';
const ACK: u8 = b'K';

/// One rank of an MPI job; cheap to clone (every clone talks to the same communication
/// thread). Implements core's [`Collective`].
#[derive(Clone)]
pub struct Mpi {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("world", &self.inner.world)
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}

struct Inner {
    world: World,
    timeout: Duration,
    /// Nanoseconds the training thread spent in gradient all-reduces (including waiting for
    /// slower ranks), for the benchmark's all-reduce share of a step.
    allreduce_nanos: std::sync::atomic::AtomicU64,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel lets the thread finalise MPI; joined so that the process does
        // not exit while it does.
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

enum Op {
    SumF32(Vec<f32>),
    /// A sum whose every rank keeps only the ranges it needs (one list per rank).
    ReduceScatterF32(Vec<f32>, Vec<Vec<Range<usize>>>),
    /// Every rank's values (of the given counts), in rank order.
    AllGatherF32(Vec<f32>, Vec<usize>),
    SumF64(Vec<f64>),
    Broadcast(Vec<f32>),
    GatherText(Vec<u8>),
    Fail(String),
}

enum Done {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Texts(Vec<String>),
}

struct Job {
    op: Op,
    what: &'static str,
    reply: mpsc::Sender<Done>,
}

impl Mpi {
    /// Initialises MPI on a communication thread and joins the job.
    pub fn init(options: Options) -> Result<Self, DistributedError> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let timeout = options.timeout;
        let thread = std::thread::Builder::new()
            .name("flashover-mpi".into())
            .spawn(move || {
                let Some((universe, _level)) =
                    mpi::initialize_with_threading(mpi::Threading::Funneled)
                else {
                    let _ = ready_tx.send(Err("MPI was already initialised in this process"));
                    return;
                };
                let world = universe.world();
                let mut comm = Comm::new(world, timeout);
                let _ = ready_tx.send(Ok(World {
                    rank: comm.rank,
                    size: comm.size,
                }));
                comm.serve(jobs_rx);
                drop(comm);
                drop(universe);
            })
            .map_err(|e| DistributedError::Mpi(format!("cannot start its thread: {e}")))?;
        let world = match ready_rx.recv() {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => return Err(DistributedError::Mpi(e.into())),
            Err(_) => {
                return Err(DistributedError::Mpi(
                    "MPI_Init failed (its thread ended before joining the job)".into(),
                ))
            }
        };
        tracing::info!(
            rank = world.rank,
            size = world.size,
            timeout = ?timeout,
            "joined a data-parallel job over MPI"
        );
        Ok(Mpi {
            inner: Arc::new(Inner {
                world,
                timeout,
                allreduce_nanos: Default::default(),
                jobs: Mutex::new(Some(jobs_tx)),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// This rank and the world size.
    pub fn world(&self) -> World {
        self.inner.world
    }

    /// The watchdog's timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Time the training thread has spent in gradient all-reduces so far, waits for slower
    /// ranks included.
    pub fn allreduce_time(&self) -> Duration {
        Duration::from_nanos(
            self.inner
                .allreduce_nanos
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn run(&self, op: Op, what: &'static str) -> Done {
        let (tx, rx) = mpsc::channel();
        let sent = self.inner.jobs.lock().ok().and_then(|j| {
            j.as_ref().map(|j| {
                j.send(Job {
                    op,
                    what,
                    reply: tx,
                })
            })
        });
        match (sent, rx.recv()) {
            (Some(Ok(())), Ok(done)) => done,
            // The thread only ends early by aborting the job (which ends this process too)
            // or when the handle is dropped, which cannot happen while `self` is alive.
            _ => {
                eprintln!("error: the MPI thread of this rank ended during {what}");
                std::process::exit(ABORT_STATUS)
            }
        }
    }

    /// The element-wise sum of `values` over every rank (the same bits on every rank).
    pub fn sum_f32(&self, values: Vec<f32>, what: &'static str) -> Vec<f32> {
        match self.run(Op::SumF32(values), what) {
            Done::F32(v) => v,
            _ => unreachable_reply(what),
        }
    }

    /// The element-wise sum of `values` over every rank, with the all-reduce's bits, of which
    /// this rank gets the ranges `needs[rank]` lists, concatenated.
    pub fn reduce_scatter_f32(
        &self,
        values: Vec<f32>,
        needs: Vec<Vec<Range<usize>>>,
        what: &'static str,
    ) -> Vec<f32> {
        match self.run(Op::ReduceScatterF32(values, needs), what) {
            Done::F32(v) => v,
            _ => unreachable_reply(what),
        }
    }

    /// Every rank's `values` (rank `r` brings `counts[r]`), concatenated in rank order.
    pub fn all_gather_f32(
        &self,
        values: Vec<f32>,
        counts: Vec<usize>,
        what: &'static str,
    ) -> Vec<f32> {
        match self.run(Op::AllGatherF32(values, counts), what) {
            Done::F32(v) => v,
            _ => unreachable_reply(what),
        }
    }

    /// The element-wise sum of `values` over every rank (the same bits on every rank).
    pub fn sum_f64(&self, values: Vec<f64>, what: &'static str) -> Vec<f64> {
        match self.run(Op::SumF64(values), what) {
            Done::F64(v) => v,
            _ => unreachable_reply(what),
        }
    }

    /// Rank 0's `values` on every rank.
    pub fn broadcast_f32(&self, values: Vec<f32>, what: &'static str) -> Vec<f32> {
        match self.run(Op::Broadcast(values), what) {
            Done::F32(v) => v,
            _ => unreachable_reply(what),
        }
    }

    /// Waits until every rank has called it.
    pub fn barrier(&self) {
        self.sum_f64(vec![0.0], "a barrier");
    }

    /// Every rank's `text`, in rank order (each truncated to 4096 bytes at a character
    /// boundary).
    pub fn all_gather_text(&self, text: &str) -> Vec<String> {
        let mut end = text.len().min(4096);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        match self.run(
            Op::GatherText(text.as_bytes()[..end].to_vec()),
            "a text gather",
        ) {
            Done::Texts(t) => t,
            _ => unreachable_reply("a text gather"),
        }
    }

    /// Tells every other rank that this one failed with `error`, waits a few seconds for
    /// them to acknowledge, and ends the job with a non-zero status.
    pub fn fail(&self, error: &str) -> ! {
        self.run(Op::Fail(error.to_string()), "reporting a failure");
        // The thread aborts the job; it never replies.
        std::process::exit(ABORT_STATUS)
    }
}

fn unreachable_reply(what: &str) -> ! {
    eprintln!("error: the MPI thread answered {what} with another kind of result");
    std::process::exit(ABORT_STATUS)
}

impl<S: Setup> Collective<S> for Mpi {
    fn world(&self) -> World {
        self.inner.world
    }

    fn all_reduce_sum(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> CoreResult<Tensor<InnerBackendOf<S>, 1>> {
        let started = Instant::now();
        let device = buffer.device();
        let values = host_f32(buffer);
        let n = values.len();
        let sum = self.sum_f32(values, "the gradient all-reduce");
        let out = Tensor::from_data(TensorData::new(sum, [n]), &device);
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.inner
            .allreduce_nanos
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        Ok(out)
    }

    fn all_reduce_sum_host(&mut self, values: &mut [f64]) -> CoreResult<()> {
        let sum = self.sum_f64(values.to_vec(), "a sum of host numbers");
        values.copy_from_slice(&sum);
        Ok(())
    }

    fn broadcast(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> CoreResult<Tensor<InnerBackendOf<S>, 1>> {
        let device = buffer.device();
        let values = host_f32(buffer);
        let n = values.len();
        let got = self.broadcast_f32(values, "the weight broadcast");
        Ok(Tensor::from_data(TensorData::new(got, [n]), &device))
    }

    /// The ring's reduce-scatter, then each element straight to the rank that needs it: the
    /// all-reduce's bits, a rank receiving its own share instead of the whole sum.
    fn reduce_scatter_sum(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
        parts: &[Range<usize>],
        tail: usize,
    ) -> CoreResult<Tensor<InnerBackendOf<S>, 1>> {
        let started = Instant::now();
        let device = buffer.device();
        let values = host_f32(buffer);
        let len = values.len();
        let w = self.inner.world.size.max(1);
        check_parts(parts, w, len, tail)?;
        let needs: Vec<Vec<Range<usize>>> = parts
            .iter()
            .map(|p| vec![p.clone(), len - tail..len])
            .collect();
        let got = self.reduce_scatter_f32(values, needs, "the gradient reduce-scatter");
        let n = got.len();
        let out = Tensor::from_data(TensorData::new(got, [n]), &device);
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.inner
            .allreduce_nanos
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        Ok(out)
    }

    fn all_gather_f32(&mut self, mine: Vec<f32>, counts: &[usize]) -> CoreResult<Vec<f32>> {
        let world = self.inner.world;
        if counts.len() != world.size.max(1) || counts.get(world.rank) != Some(&mine.len()) {
            return Err(flashover_core::CoreError::config(
                "all-gather counts",
                format!(
                    "{counts:?} with {} values on rank {}",
                    mine.len(),
                    world.rank
                ),
                format!(
                    "one count per rank ({}), this rank's equal to the values it brings",
                    world.size
                ),
            ));
        }
        Ok(Mpi::all_gather_f32(
            self,
            mine,
            counts.to_vec(),
            "the parameter all-gather",
        ))
    }
}

/// `parts` has one range per rank, each inside the buffer before its tail.
fn check_parts(parts: &[Range<usize>], world: usize, len: usize, tail: usize) -> CoreResult<()> {
    let body = len.checked_sub(tail);
    let fits = |p: &Range<usize>| body.is_some_and(|b| p.start <= p.end && p.end <= b);
    if parts.len() != world || !parts.iter().all(fits) {
        return Err(flashover_core::CoreError::config(
            "reduce-scatter parts",
            format!("{parts:?} of a buffer of {len} with a tail of {tail}"),
            format!("one range per rank ({world}), each inside the buffer before its tail"),
        ));
    }
    Ok(())
}

/// A device buffer's values on the host: the data's own allocation when it is already
/// `f32` (no second copy of a gradient buffer), converted otherwise.
fn host_f32<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    let data = t.into_data().convert::<f32>();
    // (An error is unreachable after `convert`.)
    data.into_vec::<f32>().unwrap_or_default()
}

/// Who a rank is, for messages: `rank 1 (pid 123 on node2)`.
#[derive(Debug, Clone)]
struct Peer {
    pid: u32,
    host: String,
}

/// The communication thread's side: MPI handles, the peers' identities and the watchdog.
struct Comm {
    world: SimpleCommunicator,
    control: SimpleCommunicator,
    rank: usize,
    size: usize,
    peers: Vec<Peer>,
    timeout: Duration,
    /// Collectives this rank has entered (its position, as peers are told).
    entered: u64,
    /// Reused receive buffers.
    scratch_f32: Vec<f32>,
    scratch_f64: Vec<f64>,
}

impl Comm {
    fn new(world: SimpleCommunicator, timeout: Duration) -> Self {
        let control = world.duplicate();
        let rank = world.rank().max(0) as usize;
        let size = world.size().max(1) as usize;
        // Identities: pid and host name of every rank, in fixed-size records (a blocking
        // collective once at start; mpirun ends the job if a rank never starts).
        const RECORD: usize = 256;
        let mut mine = [0u8; RECORD];
        let host = mpi::environment::processor_name().unwrap_or_else(|_| "?".into());
        let pid = std::process::id();
        mine[..4].copy_from_slice(&pid.to_le_bytes());
        let name = host.as_bytes();
        let n = name.len().min(RECORD - 5);
        mine[4] = n as u8;
        mine[5..5 + n].copy_from_slice(&name[..n]);
        let mut all = vec![0u8; RECORD * size];
        mpi::collective::CommunicatorCollectives::all_gather_into(&world, &mine[..], &mut all[..]);
        let peers = all
            .chunks(RECORD)
            .map(|r| Peer {
                pid: u32::from_le_bytes([r[0], r[1], r[2], r[3]]),
                host: String::from_utf8_lossy(&r[5..5 + r[4] as usize]).into_owned(),
            })
            .collect();
        Comm {
            world,
            control,
            rank,
            size,
            peers,
            timeout,
            entered: 0,
            scratch_f32: Vec::new(),
            scratch_f64: Vec::new(),
        }
    }

    fn who(&self, rank: usize) -> String {
        match self.peers.get(rank) {
            Some(p) => format!("rank {rank} (pid {} on {})", p.pid, p.host),
            None => format!("rank {rank}"),
        }
    }

    /// Runs jobs until the channel closes; between jobs, answers peers every millisecond.
    fn serve(&mut self, jobs: mpsc::Receiver<Job>) {
        loop {
            match jobs.recv_timeout(Duration::from_millis(1)) {
                Ok(job) => self.run(job),
                Err(mpsc::RecvTimeoutError::Timeout) => self.service(),
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn run(&mut self, job: Job) {
        self.entered += 1;
        let what = job.what;
        let done = match job.op {
            Op::SumF32(mut v) => {
                let mut scratch = std::mem::take(&mut self.scratch_f32);
                self.ring_sum(&mut v, &mut scratch, what);
                self.scratch_f32 = scratch;
                Done::F32(v)
            }
            Op::SumF64(mut v) => {
                let mut scratch = std::mem::take(&mut self.scratch_f64);
                self.ring_sum(&mut v, &mut scratch, what);
                self.scratch_f64 = scratch;
                Done::F64(v)
            }
            Op::ReduceScatterF32(mut v, needs) => {
                let mut scratch = std::mem::take(&mut self.scratch_f32);
                let out = self.reduce_scatter(&mut v, &needs, &mut scratch, what);
                self.scratch_f32 = scratch;
                Done::F32(out)
            }
            Op::AllGatherF32(v, counts) => Done::F32(self.all_gather(v, &counts, what)),
            Op::Broadcast(mut v) => {
                self.broadcast(&mut v, what);
                Done::F32(v)
            }
            Op::GatherText(bytes) => Done::Texts(self.gather_text(bytes, what)),
            Op::Fail(message) => self.fail(&message),
        };
        let _ = job.reply.send(done);
    }

    /// The ring all-reduce (see `ring`): the same bits on every rank, in a fixed order.
    fn ring_sum<T>(&self, data: &mut [T], scratch: &mut Vec<T>, what: &'static str)
    where
        T: Equivalence + Copy + Default + std::ops::Add<Output = T>,
    {
        let (w, r) = (self.size, self.rank);
        if w <= 1 {
            return;
        }
        let len = data.len();
        let right = (r + 1) % w;
        let left = back(r, 1, w);
        self.ring_scatter(data, scratch, what);
        for step in 0..w - 1 {
            let (send, recv) = gather_step(r, step, w);
            let (sb, rb) = (chunk_bounds(len, w, send), chunk_bounds(len, w, recv));
            let incoming = &mut scratch[..rb.len()];
            self.exchange(&data[sb], right, incoming, left, what);
            data[rb].copy_from_slice(incoming);
        }
    }

    /// The ring's reduce-scatter half (see `ring`): afterwards this rank holds the whole
    /// sum of chunk `(rank + 1) mod W`, summed in the documented order.
    fn ring_scatter<T>(&self, data: &mut [T], scratch: &mut Vec<T>, what: &'static str)
    where
        T: Equivalence + Copy + Default + std::ops::Add<Output = T>,
    {
        let (w, r) = (self.size, self.rank);
        if w <= 1 {
            return;
        }
        let len = data.len();
        let right = (r + 1) % w;
        let left = back(r, 1, w);
        scratch.resize(len.div_ceil(w), T::default());
        for step in 0..w - 1 {
            let (send, recv) = scatter_step(r, step, w);
            let (sb, rb) = (chunk_bounds(len, w, send), chunk_bounds(len, w, recv));
            let incoming = &mut scratch[..rb.len()];
            self.exchange(&data[sb], right, incoming, left, what);
            for (mine, theirs) in data[rb].iter_mut().zip(incoming.iter()) {
                *mine = *theirs + *mine;
            }
        }
    }

    /// The ring's reduce-scatter, then each summed element sent from the rank that holds it
    /// to every rank whose `needs` list it (one message per pair at most), so every element
    /// a rank gets has the bits the all-reduce gives it; returns this rank's needs,
    /// concatenated in their order.
    fn reduce_scatter(
        &self,
        data: &mut [f32],
        needs: &[Vec<Range<usize>>],
        scratch: &mut Vec<f32>,
        what: &'static str,
    ) -> Vec<f32> {
        let (w, r) = (self.size, self.rank);
        let len = data.len();
        self.ring_scatter(data, scratch, what);
        if w > 1 {
            // Rank p holds the whole sum of chunk (p + 1) mod W.
            let held = |p: usize| chunk_bounds(len, w, (p + 1) % w);
            let overlaps = |p: usize, q: usize| -> Vec<Range<usize>> {
                let h = held(p);
                needs[q]
                    .iter()
                    .map(|n| n.start.max(h.start)..n.end.min(h.end))
                    .filter(|o| o.start < o.end)
                    .collect()
            };
            let outgoing: Vec<(usize, Vec<f32>)> = (0..w)
                .filter(|&q| q != r)
                .map(|q| {
                    let v: Vec<f32> = overlaps(r, q)
                        .into_iter()
                        .flat_map(|o| data[o].to_vec())
                        .collect();
                    (q, v)
                })
                .filter(|(_, v)| !v.is_empty())
                .collect();
            let mut incoming: Vec<(usize, Vec<Range<usize>>, Vec<f32>)> = (0..w)
                .filter(|&p| p != r)
                .map(|p| {
                    let o = overlaps(p, r);
                    let n = o.iter().map(|o| o.len()).sum();
                    (p, o, vec![0.0f32; n])
                })
                .filter(|(_, _, v)| !v.is_empty())
                .collect();
            let world = &self.world;
            let peers: Vec<usize> = outgoing
                .iter()
                .map(|(q, _)| *q)
                .chain(incoming.iter().map(|(p, _, _)| *p))
                .collect();
            scope(|sc| {
                let mut reqs = Vec::new();
                for (q, v) in &outgoing {
                    reqs.push(world.process_at_rank(*q as i32).immediate_send_with_tag(
                        sc,
                        &v[..],
                        DATA,
                    ));
                }
                for (p, _, v) in incoming.iter_mut() {
                    reqs.push(
                        world
                            .process_at_rank(*p as i32)
                            .immediate_receive_into_with_tag(sc, &mut v[..], DATA),
                    );
                }
                self.wait(reqs, &peers, what);
            });
            for (_, ranges, v) in &incoming {
                let mut at = 0;
                for o in ranges {
                    data[o.clone()].copy_from_slice(&v[at..at + o.len()]);
                    at += o.len();
                }
            }
        }
        needs[r]
            .iter()
            .flat_map(|n| data[n.clone()].iter().copied())
            .collect()
    }

    /// Every rank's values in rank order: each rank sends its own to every other directly.
    fn all_gather(&self, mine: Vec<f32>, counts: &[usize], what: &'static str) -> Vec<f32> {
        let (w, r) = (self.size, self.rank);
        if w <= 1 {
            return mine;
        }
        let mut parts: Vec<Vec<f32>> = counts
            .iter()
            .enumerate()
            .map(|(p, &n)| if p == r { Vec::new() } else { vec![0.0; n] })
            .collect();
        let others: Vec<usize> = (0..w).filter(|&p| p != r).collect();
        let world = &self.world;
        let peers: Vec<usize> = others
            .iter()
            .copied()
            .filter(|&p| !mine.is_empty() || counts[p] > 0)
            .collect();
        scope(|sc| {
            let mut reqs = Vec::new();
            if !mine.is_empty() {
                for &q in &others {
                    reqs.push(world.process_at_rank(q as i32).immediate_send_with_tag(
                        sc,
                        &mine[..],
                        DATA,
                    ));
                }
            }
            for (p, v) in parts.iter_mut().enumerate() {
                if p != r && !v.is_empty() {
                    reqs.push(
                        world
                            .process_at_rank(p as i32)
                            .immediate_receive_into_with_tag(sc, &mut v[..], DATA),
                    );
                }
            }
            self.wait(reqs, &peers, what);
        });
        parts[r] = mine;
        parts.concat()
    }

    /// Sends `out` to `to` while receiving `into` from `from`, watching the clock.
    fn exchange<T: Equivalence>(
        &self,
        out: &[T],
        to: usize,
        into: &mut [T],
        from: usize,
        what: &'static str,
    ) {
        let world = &self.world;
        scope(|sc| {
            let s = world
                .process_at_rank(to as i32)
                .immediate_send_with_tag(sc, out, DATA);
            let r = world
                .process_at_rank(from as i32)
                .immediate_receive_into_with_tag(sc, into, DATA);
            self.wait(vec![s, r], &[to, from], what);
        });
    }

    /// Rank 0's buffer to every rank, sent directly from rank 0.
    fn broadcast(&self, data: &mut [f32], what: &'static str) {
        let world = &self.world;
        if self.rank == 0 {
            let others: Vec<usize> = (1..self.size).collect();
            let buf: &[f32] = data;
            scope(|sc| {
                let reqs = others
                    .iter()
                    .map(|&p| {
                        world
                            .process_at_rank(p as i32)
                            .immediate_send_with_tag(sc, buf, DATA)
                    })
                    .collect();
                self.wait(reqs, &others, what);
            });
        } else {
            scope(|sc| {
                let r = world
                    .process_at_rank(0)
                    .immediate_receive_into_with_tag(sc, data, DATA);
                self.wait(vec![r], &[0], what);
            });
        }
    }

    /// Every rank's bytes, in rank order, through rank 0 (a fixed-size length exchange, then
    /// the texts).
    fn gather_text(&mut self, mine: Vec<u8>, what: &'static str) -> Vec<String> {
        const MAX: usize = 4096;
        let mut all = vec![0.0f64; (MAX + 1) * self.size];
        let at = (MAX + 1) * self.rank;
        all[at] = mine.len() as f64;
        for (slot, b) in all[at + 1..].iter_mut().zip(&mine) {
            *slot = f64::from(*b);
        }
        let mut scratch = std::mem::take(&mut self.scratch_f64);
        self.ring_sum(&mut all, &mut scratch, what);
        self.scratch_f64 = scratch;
        all.chunks(MAX + 1)
            .map(|c| {
                let n = (c[0] as usize).min(MAX);
                let bytes: Vec<u8> = c[1..=n].iter().map(|&v| v as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .collect()
    }

    /// Polls `reqs` to completion. Between polls it answers peers; past the timeout it
    /// finds out which of `peers` is lost and ends the job.
    fn wait<'a, D: ?Sized, Sc: Scope<'a>>(
        &self,
        reqs: Vec<Request<'a, D, Sc>>,
        peers: &[usize],
        what: &'static str,
    ) {
        let started = Instant::now();
        let mut pending: Vec<Option<Request<'a, D, Sc>>> = reqs.into_iter().map(Some).collect();
        let mut polls: u64 = 0;
        loop {
            let mut open = 0;
            for slot in pending.iter_mut() {
                if let Some(req) = slot.take() {
                    match req.test() {
                        Ok(_) => {}
                        Err(req) => {
                            *slot = Some(req);
                            open += 1;
                        }
                    }
                }
            }
            if open == 0 {
                return;
            }
            polls += 1;
            if polls.is_multiple_of(64) {
                self.service();
                if started.elapsed() > self.timeout {
                    self.lost(peers, what, started.elapsed());
                }
            }
            if polls > 20_000 {
                std::thread::sleep(Duration::from_micros(50));
            } else if polls > 1_000 {
                std::thread::yield_now();
            }
        }
    }

    /// Answers control messages: probes (where is this rank?), and failures of other
    /// ranks, which end this rank too.
    fn service(&self) {
        while let Some(status) = self.control.any_process().immediate_probe_with_tag(CONTROL) {
            let from = status.source_rank();
            let (msg, _) = self
                .control
                .process_at_rank(from)
                .receive_vec_with_tag::<u8>(CONTROL);
            let from = from.max(0) as usize;
            match msg.first() {
                Some(&PROBE) => self.send_control(from, ANSWER, self.entered, ""),
                Some(&FAILED) => {
                    let text = String::from_utf8_lossy(msg.get(9..).unwrap_or(&[]));
                    eprintln!(
                        "error: {} failed: {text}; stopping {} too",
                        self.who(from),
                        self.who(self.rank)
                    );
                    self.send_control(from, ACK, 0, "");
                    self.world.abort(ABORT_STATUS);
                }
                // Late answers and acknowledgements: nothing to do.
                _ => {}
            }
        }
    }

    /// Sends a small control message without waiting for it to arrive (a stopped peer
    /// must not block this rank). Its buffer and request are leaked: control messages are
    /// sent only when something went wrong, a few per job.
    fn send_control(&self, to: usize, kind: u8, value: u64, text: &str) {
        let mut msg = Vec::with_capacity(9 + text.len());
        msg.push(kind);
        msg.extend_from_slice(&value.to_le_bytes());
        msg.extend_from_slice(text.as_bytes());
        let msg: &'static [u8] = Box::leak(msg.into_boxed_slice());
        let req = self
            .control
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, msg, CONTROL);
        std::mem::forget(req);
    }

    /// Past the timeout in a collective: asks every peer where it is, waits a few seconds
    /// for answers, names the ranks that did not answer (lost) or are behind, and ends the
    /// job.
    fn lost(&self, waiting_on: &[usize], what: &str, waited: Duration) -> ! {
        let others: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
        for &p in &others {
            self.send_control(p, PROBE, self.entered, "");
        }
        let mut answers: Vec<Option<u64>> = vec![None; self.size];
        let grace = ANSWER_GRACE.min(self.timeout);
        let asked = Instant::now();
        while asked.elapsed() < grace && others.iter().any(|&p| answers[p].is_none()) {
            while let Some(status) = self.control.any_process().immediate_probe_with_tag(CONTROL) {
                let from = status.source_rank();
                let (msg, _) = self
                    .control
                    .process_at_rank(from)
                    .receive_vec_with_tag::<u8>(CONTROL);
                let from = from.max(0) as usize;
                let value = msg
                    .get(1..9)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .unwrap_or(0);
                match msg.first() {
                    Some(&ANSWER) => answers[from] = Some(value),
                    Some(&PROBE) => self.send_control(from, ANSWER, self.entered, ""),
                    Some(&FAILED) => {
                        let text = String::from_utf8_lossy(msg.get(9..).unwrap_or(&[]));
                        eprintln!("error: {} failed: {text}", self.who(from));
                        self.world.abort(ABORT_STATUS);
                    }
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let silent: Vec<String> = others
            .iter()
            .filter(|&&p| answers[p].is_none())
            .map(|&p| self.who(p))
            .collect();
        let behind: Vec<String> = others
            .iter()
            .filter_map(|&p| match answers[p] {
                Some(at) if at < self.entered => Some(format!(
                    "{} (alive, but still before it: collective #{at})",
                    self.who(p)
                )),
                _ => None,
            })
            .collect();
        let me = self.who(self.rank);
        let message = if !silent.is_empty() {
            format!(
                "lost {}: {me} waited {:.1} s in {what} (collective #{}) and the rank did not answer within {:.0} s; ending the job (--peer-timeout sets the wait)",
                silent.join(", "),
                waited.as_secs_f64(),
                self.entered,
                grace.as_secs_f64()
            )
        } else if !behind.is_empty() {
            format!(
                "{} did not reach {what} (collective #{}) within {:.1} s while {me} waited; ending the job (--peer-timeout sets the wait)",
                behind.join(", "),
                self.entered,
                waited.as_secs_f64()
            )
        } else {
            let names: Vec<String> = waiting_on.iter().map(|&p| self.who(p)).collect();
            format!(
                "{what} (collective #{}) did not complete within {:.1} s though every rank answers; {me} was exchanging with {}; ending the job",
                self.entered,
                waited.as_secs_f64(),
                names.join(" and ")
            )
        };
        eprintln!("error: {message}");
        tracing::error!("{message}");
        self.world.abort(ABORT_STATUS)
    }

    /// Tells every peer that this rank failed, waits for their acknowledgements (or a few
    /// seconds), and ends the job.
    fn fail(&self, message: &str) -> ! {
        let others: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
        for &p in &others {
            self.send_control(p, FAILED, 0, message);
        }
        let mut acked = vec![false; self.size];
        let asked = Instant::now();
        let grace = ANSWER_GRACE.min(self.timeout);
        while asked.elapsed() < grace && others.iter().any(|&p| !acked[p]) {
            while let Some(status) = self.control.any_process().immediate_probe_with_tag(CONTROL) {
                let from = status.source_rank();
                let (msg, _) = self
                    .control
                    .process_at_rank(from)
                    .receive_vec_with_tag::<u8>(CONTROL);
                let from = from.max(0) as usize;
                match msg.first() {
                    Some(&ACK) => acked[from] = true,
                    Some(&PROBE) => self.send_control(from, ANSWER, self.entered, ""),
                    Some(&FAILED) => acked[from] = true,
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.world.abort(ABORT_STATUS)
    }
}
