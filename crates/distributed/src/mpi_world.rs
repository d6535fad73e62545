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

use crate::ring::{back, chunk_bounds, gather_step, locate, scatter_step, segment, segments};
use crate::{DistributedError, Options};

/// Tag of the collectives' data messages (on the world communicator).
const DATA: i32 = 11;
/// The most elements one ring message carries: a chunk is sent in segments of this size, so
/// a rank's receive buffer is at most this large (a chunk is a `1/W` share of the whole
/// gradient, which a sharded run must not hold twice). 4 MiB of `f32`.
const SEGMENT: usize = 1 << 20;
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
    /// A sum of a buffer in pieces whose every rank keeps only the pieces it needs.
    ReduceScatterPieces(Vec<Vec<f32>>, Vec<Option<usize>>),
    /// Every rank's values (of the given counts), in rank order.
    AllGatherF32(Vec<f32>, Vec<usize>),
    SumF64(Vec<f64>),
    /// The root rank's values on every rank (the others bring a buffer of the same length).
    Broadcast(usize, Vec<f32>),
    GatherText(Vec<u8>),
    Fail(String),
}

enum Done {
    F32(Vec<f32>),
    Pieces(Vec<Vec<f32>>),
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

    /// The element-wise sum of a buffer given as `pieces` over every rank, with the
    /// all-reduce's bits, of which this rank gets the pieces `needs` gives it (`Some(rank)`,
    /// or `None` for every rank); the others come back empty.
    pub fn reduce_scatter_pieces(
        &self,
        pieces: Vec<Vec<f32>>,
        needs: Vec<Option<usize>>,
        what: &'static str,
    ) -> Vec<Vec<f32>> {
        match self.run(Op::ReduceScatterPieces(pieces, needs), what) {
            Done::Pieces(v) => v,
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
        self.broadcast_from_f32(0, values, what)
    }

    /// Rank `root`'s `values` on every rank; every other rank brings a buffer of the same
    /// length, which receives them.
    pub fn broadcast_from_f32(
        &self,
        root: usize,
        values: Vec<f32>,
        what: &'static str,
    ) -> Vec<f32> {
        match self.run(Op::Broadcast(root, values), what) {
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
    /// all-reduce's bits, a rank receiving its own pieces instead of the whole sum.
    fn reduce_scatter_pieces(
        &mut self,
        pieces: Vec<Vec<f32>>,
        needs: &[Option<usize>],
        _device: &burn::tensor::Device<InnerBackendOf<S>>,
    ) -> CoreResult<Vec<Vec<f32>>> {
        flashover_core::collective::check_needs(&pieces, needs)?;
        let size = self.inner.world.size.max(1);
        if let Some(bad) = needs.iter().flatten().find(|&&r| r >= size) {
            return Err(flashover_core::CoreError::config(
                "reduce-scatter pieces",
                format!("a piece for rank {bad}"),
                format!("ranks below the world size {size}"),
            ));
        }
        let started = Instant::now();
        let got =
            Mpi::reduce_scatter_pieces(self, pieces, needs.to_vec(), "the gradient reduce-scatter");
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.inner
            .allreduce_nanos
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        Ok(got)
    }

    fn broadcast_from(
        &mut self,
        root: usize,
        values: Vec<f32>,
        len: usize,
    ) -> CoreResult<Vec<f32>> {
        let world = self.inner.world;
        let mine = if world.rank == root {
            values.len()
        } else {
            len
        };
        if root >= world.size.max(1) || mine != len {
            return Err(flashover_core::CoreError::config(
                "broadcast root",
                format!("rank {root} bringing {mine} values"),
                format!(
                    "a rank below {} that brings the {len} values it sends",
                    world.size
                ),
            ));
        }
        let values = if world.rank == root {
            values
        } else {
            vec![0.0; len]
        };
        Ok(self.broadcast_from_f32(root, values, "the parameter gather"))
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

/// A device buffer's values on the host: the data's own allocation when it is already
/// `f32` (no second copy of a gradient buffer), converted otherwise.
fn host_f32<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    let data = t.into_data().convert::<f32>();
    // (An error is unreachable after `convert`.)
    data.into_vec::<f32>().unwrap_or_default()
}

/// `data[out]` to read and `data[into]` to write, two disjoint ranges of one buffer.
fn split_two<T>(data: &mut [T], out: Range<usize>, into: Range<usize>) -> (&[T], &mut [T]) {
    if out.start < into.start {
        let (a, b) = data.split_at_mut(into.start);
        (&a[out], &mut b[..into.len()])
    } else {
        let (a, b) = data.split_at_mut(out.start);
        (&b[..out.len()], &mut a[into])
    }
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
            Op::ReduceScatterPieces(pieces, needs) => {
                let mut scratch = std::mem::take(&mut self.scratch_f32);
                let out = self.reduce_scatter_pieces(pieces, &needs, &mut scratch, what);
                self.scratch_f32 = scratch;
                Done::Pieces(out)
            }
            Op::AllGatherF32(v, counts) => Done::F32(self.all_gather(v, &counts, what)),
            Op::Broadcast(root, mut v) => {
                self.broadcast(root, &mut v, what);
                Done::F32(v)
            }
            Op::GatherText(bytes) => Done::Texts(self.gather_text(bytes, what)),
            Op::Fail(message) => self.fail(&message),
        };
        let _ = job.reply.send(done);
    }

    /// The ring all-reduce (see `ring`): the same bits on every rank, in a fixed order. The
    /// all-gather half receives straight into place; only the reduce-scatter half needs a
    /// receive buffer, of at most one segment.
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
            for i in 0..segments(chunk_bounds(len, w, 0).len(), SEGMENT) {
                let (s, t) = (segment(&sb, i, SEGMENT), segment(&rb, i, SEGMENT));
                let (out, into) = split_two(data, s, t);
                self.exchange(out, right, into, left, what);
            }
        }
    }

    /// The ring's reduce-scatter half (see `ring`): afterwards this rank holds the whole
    /// sum of chunk `(rank + 1) mod W`, summed in the documented order. Each chunk travels
    /// in segments of at most [`SEGMENT`] elements (element-wise sums: the same bits).
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
        scratch.resize(len.div_ceil(w).min(SEGMENT), T::default());
        scratch.shrink_to(SEGMENT);
        for step in 0..w - 1 {
            let (send, recv) = scatter_step(r, step, w);
            let (sb, rb) = (chunk_bounds(len, w, send), chunk_bounds(len, w, recv));
            for i in 0..segments(chunk_bounds(len, w, 0).len(), SEGMENT) {
                let (s, t) = (segment(&sb, i, SEGMENT), segment(&rb, i, SEGMENT));
                let incoming = &mut scratch[..t.len()];
                self.exchange(&data[s], right, incoming, left, what);
                for (mine, theirs) in data[t].iter_mut().zip(incoming.iter()) {
                    *mine = *theirs + *mine;
                }
            }
        }
    }

    /// The ring's reduce-scatter over a buffer given as consecutive `pieces`, then each summed
    /// piece sent from the ranks that hold its elements to every rank that `needs` it
    /// (`Some(rank)`, or `None` for all), straight from and into the pieces; the pieces this
    /// rank does not need come back empty. Every message lies inside one piece (both ends cut
    /// a range at the same piece boundaries), so no piece is ever copied whole and the only
    /// other buffer is the ring's one-segment scratch. The sums are the all-reduce's bits:
    /// the ring adds element by element in its documented order whatever the cutting.
    fn reduce_scatter_pieces(
        &self,
        mut pieces: Vec<Vec<f32>>,
        needs: &[Option<usize>],
        scratch: &mut Vec<f32>,
        what: &'static str,
    ) -> Vec<Vec<f32>> {
        let (w, r) = (self.size, self.rank);
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        let mut len = 0;
        for p in &pieces {
            starts.push(len);
            len += p.len();
        }
        starts.push(len);
        if w > 1 {
            self.ring_scatter_pieces(&mut pieces, &starts, scratch, what);
            self.redistribute(&mut pieces, &starts, needs, what);
        }
        for (piece, need) in pieces.iter_mut().zip(needs) {
            if need.is_some_and(|q| q != r) {
                *piece = Vec::new();
            }
        }
        pieces
    }

    /// [`Comm::ring_scatter`] over pieces: each segment travels as one message per piece it
    /// touches.
    fn ring_scatter_pieces(
        &self,
        pieces: &mut [Vec<f32>],
        starts: &[usize],
        scratch: &mut Vec<f32>,
        what: &'static str,
    ) {
        let (w, r) = (self.size, self.rank);
        let len = starts.last().copied().unwrap_or(0);
        let right = (r + 1) % w;
        let left = back(r, 1, w);
        scratch.resize(len.div_ceil(w).min(SEGMENT), 0.0);
        scratch.shrink_to(SEGMENT);
        let world = &self.world;
        for step in 0..w - 1 {
            let (send, recv) = scatter_step(r, step, w);
            let (sb, rb) = (chunk_bounds(len, w, send), chunk_bounds(len, w, recv));
            for i in 0..segments(chunk_bounds(len, w, 0).len(), SEGMENT) {
                let (s, t) = (segment(&sb, i, SEGMENT), segment(&rb, i, SEGMENT));
                let outgoing = locate(starts, s);
                let incoming = locate(starts, t.clone());
                let (into, _) = scratch.split_at_mut(t.len());
                let pieces_ref: &[Vec<f32>] = pieces;
                scope(|sc| {
                    let mut reqs = Vec::new();
                    for (p, part) in &outgoing {
                        let buf: &[f32] = &pieces_ref[*p][part.clone()];
                        reqs.push(
                            world
                                .process_at_rank(right as i32)
                                .immediate_send_with_tag(sc, buf, DATA),
                        );
                    }
                    let mut rest: &mut [f32] = into;
                    for (_, part) in &incoming {
                        let (head, tail) = std::mem::take(&mut rest).split_at_mut(part.len());
                        rest = tail;
                        reqs.push(
                            world
                                .process_at_rank(left as i32)
                                .immediate_receive_into_with_tag(sc, head, DATA),
                        );
                    }
                    self.wait(reqs, &[right, left], what);
                });
                let mut at = 0;
                for (p, part) in incoming {
                    let n = part.len();
                    for (mine, theirs) in pieces[p][part].iter_mut().zip(&scratch[at..at + n]) {
                        // (IEEE addition commutes: the bits of `theirs + mine`, as
                        // `ring_scatter` adds.)
                        *mine += *theirs;
                    }
                    at += n;
                }
            }
        }
    }

    /// After the ring's reduce-scatter (rank `p` holds the whole sum of chunk `(p + 1) mod W`):
    /// every element a rank needs and another holds, sent from the holder's piece into the
    /// needing rank's piece, one message per (piece, holder, rank) range. Both ends list a
    /// pair's ranges in ascending order, which MPI's in-order delivery matches.
    fn redistribute(
        &self,
        pieces: &mut [Vec<f32>],
        starts: &[usize],
        needs: &[Option<usize>],
        what: &'static str,
    ) {
        let (w, r) = (self.size, self.rank);
        let len = starts.last().copied().unwrap_or(0);
        let held = |p: usize| chunk_bounds(len, w, (p + 1) % w);
        let needed_by = |k: usize, q: usize| needs[k].is_none_or(|o| o == q);
        // (peer, piece, range within the piece), ascending.
        let mut sends: Vec<(usize, usize, Range<usize>)> = Vec::new();
        let mut receives: Vec<(usize, usize, Range<usize>)> = Vec::new();
        for k in 0..pieces.len() {
            let (a, b) = (starts[k], starts[k + 1]);
            for p in (0..w).filter(|&p| p != r) {
                // Held by this rank, needed by p: a send; held by p, needed here: a receive.
                let h = held(r);
                if needed_by(k, p) && h.start.max(a) < h.end.min(b) {
                    sends.push((p, k, h.start.max(a) - a..h.end.min(b) - a));
                }
                let h = held(p);
                if needed_by(k, r) && h.start.max(a) < h.end.min(b) {
                    receives.push((p, k, h.start.max(a) - a..h.end.min(b) - a));
                }
            }
        }
        let mut peers: Vec<usize> = sends.iter().chain(&receives).map(|x| x.0).collect();
        peers.sort_unstable();
        peers.dedup();
        let mine = held(r);
        let world = &self.world;
        scope(|sc| {
            let mut reqs = Vec::new();
            for (k, piece) in pieces.iter_mut().enumerate() {
                let (a, b) = (starts[k], starts[k + 1]);
                // This rank's held part of the piece is read-only (sent, perhaps to several
                // ranks); the parts before and after it are written (received).
                let h0 = mine.start.clamp(a, b) - a;
                let h1 = mine.end.clamp(a, b) - a;
                let (h0, h1) = if h0 < h1 { (h0, h1) } else { (0, 0) };
                let (before, rest) = piece.split_at_mut(h0);
                let (held_part, after) = rest.split_at_mut(h1 - h0);
                let held_part: &[f32] = held_part;
                for (q, _, part) in sends.iter().filter(|s| s.1 == k) {
                    let buf = &held_part[part.start - h0..part.end - h0];
                    reqs.push(
                        world
                            .process_at_rank(*q as i32)
                            .immediate_send_with_tag(sc, buf, DATA),
                    );
                }
                let (mut low, mut high): (&mut [f32], &mut [f32]) = (before, after);
                let (mut low_at, mut high_at) = (0, h1);
                let mut mine_here: Vec<&(usize, usize, Range<usize>)> =
                    receives.iter().filter(|x| x.1 == k).collect();
                mine_here.sort_by_key(|x| x.2.start);
                for (p, _, part) in mine_here {
                    let buf = if part.end <= h0 {
                        let (_, tail) = std::mem::take(&mut low).split_at_mut(part.start - low_at);
                        let (buf, tail) = tail.split_at_mut(part.len());
                        low = tail;
                        low_at = part.end;
                        buf
                    } else {
                        let (_, tail) =
                            std::mem::take(&mut high).split_at_mut(part.start - high_at);
                        let (buf, tail) = tail.split_at_mut(part.len());
                        high = tail;
                        high_at = part.end;
                        buf
                    };
                    reqs.push(
                        world
                            .process_at_rank(*p as i32)
                            .immediate_receive_into_with_tag(sc, buf, DATA),
                    );
                }
            }
            self.wait(reqs, &peers, what);
        });
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

    /// Rank `root`'s buffer to every rank, sent directly from it.
    fn broadcast(&self, root: usize, data: &mut [f32], what: &'static str) {
        let world = &self.world;
        if self.rank == root {
            let others: Vec<usize> = (0..self.size).filter(|&p| p != root).collect();
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
                    .process_at_rank(root as i32)
                    .immediate_receive_into_with_tag(sc, data, DATA);
                self.wait(vec![r], &[root], what);
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
