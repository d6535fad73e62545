//! Channels-last (NHWC) convolution and pooling on `f32` slices: the CPU fast path behind
//! [`ChannelsLastBackend`](crate::ops::ChannelsLastBackend). Written by hand because the
//! layout, the fusions and the determinism contract are ours; the matrix products go to the
//! `gemm` crate through [`crate::gemm`].
//!
//! - Convolution is im2col + GEMM: the patches of a few images at once (a *chunk*) become
//!   the rows of a matrix whose columns run over (kernel row, kernel column, channel), so
//!   that a patch row copies `channels` contiguous values per kernel tap; the packed weights
//!   are `[kernel taps x channels, out channels]` per group. The output rows of a chunk are
//!   the NHWC output itself, so no layout conversion happens anywhere. Bias and ReLU are
//!   applied in the same pass over the chunk's output, while it is in cache. 1x1 convolutions
//!   with stride 1 and no padding skip im2col.
//! - The input gradient is the product of the output gradient and the transposed weights,
//!   scattered back (col2im) image by image; the weight and bias gradients are summed per
//!   chunk, then the chunks' partial sums are added in chunk order.
//! - Pooling loops over windows with the channel as the innermost, contiguous index.
//!
//! **Determinism.** Chunks are sized from the shapes alone (about 2048 output positions per
//! chunk) and every reduction that crosses chunks runs in chunk order after the parallel part,
//! so the results are bit-identical for any number of threads.
//!
//! **Threads.** `RAYON_NUM_THREADS` threads (default: the CPUs) share a call's chunks: the
//! calling thread and `RAYON_NUM_THREADS - 1` helpers of a pool of this module's, so that a
//! 2-core machine runs 2 threads, not the trainer's plus 2 (see [`helpers`]). Called inside a
//! rayon pool, the call uses that pool instead, the caller included.
//!
//! **Memory.** The im2col buffers are per-thread scratch space that grows to the largest
//! chunk seen and is then reused, step after step; only outputs are allocated per call,
//! and each thread writes the chunks of an output it computes ([`written_chunks`]; a
//! product's chunk is written once, never zero-filled first), so that neither the writing
//! nor the page faults of fresh memory fall on the calling thread alone.

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::gemm::{matmul, matmul_into, MatMut, MatRef};

/// ALiBi's bias of query `i` for key `j <= i` with slope `slope`: `-slope * (i - j)`, the
/// one expression every implementation (these kernels, and Burn's ops in `crate::ops`) uses, so that they agree to the bit on it.
#[inline]
pub fn alibi_bias(slope: f32, i: usize, j: usize) -> f32 {
    -(slope * (i - j) as f32)
}

/// Output positions a chunk aims for: enough rows for an efficient matrix product, few
/// enough that a batch splits into several chunks for threads and the scratch stays in cache.
const CHUNK_POSITIONS: usize = 2048;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's scratch buffer, at least `len` long (grown if needed, then kept).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

/// Threads that work on one kernel call from outside a rayon pool: `RAYON_NUM_THREADS` when
/// set to a positive number (rayon's own convention), else the CPUs available.
fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// The helper threads of calls from outside a rayon pool: one fewer than [`threads`], since
/// the calling thread works too. (Handing all the work to a pool of `threads()` while the
/// caller waits would put one thread more than the cores asked for on the CPU: idle pool
/// threads spin while the trainer's thread runs the rest of the step, and took the second
/// core's gain away.) `None` with one thread, or if the threads could not be started.
fn helpers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = threads();
        if n < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n - 1)
            .thread_name(|i| format!("flashover-kernels-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Calls `f` on every item of `items`, spread over the threads there are: inside a rayon
/// pool (a test's `install`, a user's pool) over that pool's threads, the caller included;
/// elsewhere over the caller and the [`helpers`], which take items from one shared queue.
/// Which thread runs an item never changes what it computes, so the results do not depend
/// on the thread count.
pub(crate) fn for_each_item<I, F>(items: I, f: F)
where
    I: Iterator + Send,
    I::Item: Send,
    F: Fn(I::Item) + Sync + Send,
{
    // One item (a small tensor's one chunk): no thread to wake, nothing to share.
    if items.size_hint().1.is_some_and(|n| n <= 1) {
        items.for_each(f);
        return;
    }
    if rayon::current_thread_index().is_some() {
        if rayon::current_num_threads() > 1 {
            items.par_bridge().for_each(f);
        } else {
            items.for_each(f);
        }
        return;
    }
    let Some(pool) = helpers() else {
        items.for_each(f);
        return;
    };
    let region = REGIONS.fetch_add(1, Ordering::Relaxed) + 1;
    let queue = Mutex::new(items);
    let work = || loop {
        // A panic in `f` happens outside the lock; a poisoned queue is still a valid iterator.
        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
        match next {
            Some(item) => f(item),
            None => break,
        }
    };
    pool.in_place_scope(|scope| {
        for _ in 0..pool.current_num_threads() {
            scope.spawn(|_| work());
        }
        work();
    });
    keep_awake(pool, region);
}

/// Parallel calls made from outside a rayon pool so far (see [`keep_awake`]).
static REGIONS: AtomicU64 = AtomicU64::new(0);

/// How long a helper stays awake after a parallel call for the next one, at most.
const HELPER_SPIN: Duration = Duration::from_micros(200);

/// Keeps the helpers awake for up to [`HELPER_SPIN`] after parallel call number `region`,
/// until the next call begins. A rayon thread that finds no work sleeps after a few
/// microseconds, and `in_place_scope` waits until each spawned job has run, so each call
/// waited for a helper to be woken (a futex wake, the other CPU scheduled: tens of
/// microseconds on a virtual machine) even when the caller had done all the work. A GPT
/// step makes about two hundred calls separated by a few microseconds of the trainer's
/// bookkeeping, so the waits were several percent of a two-thread step; OpenMP's threads
/// spin between parallel regions for the same reason. The spin is bounded, so helpers of
/// an idle trainer go back to sleep; it yields the CPU on each turn, so that another
/// runnable thread (a data loader, another test) is not kept off its core; and a spinner
/// started before the next call's job returns as soon as it sees the call.
fn keep_awake(pool: &rayon::ThreadPool, region: u64) {
    for _ in 0..pool.current_num_threads() {
        pool.spawn(move || {
            let start = Instant::now();
            while REGIONS.load(Ordering::Relaxed) == region && start.elapsed() < HELPER_SPIN {
                std::thread::yield_now();
            }
        });
    }
}

/// Calls `f(chunk_index, chunk)` for consecutive `chunk_len`-sized pieces of `data`, in
/// parallel when there are threads for it.
pub(crate) fn for_each_chunk<T: Send, F>(data: &mut [T], chunk_len: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    let chunk_len = chunk_len.max(1);
    if data.len() > chunk_len {
        for_each_item(data.chunks_mut(chunk_len).enumerate(), |(i, c)| f(i, c));
    } else if !data.is_empty() {
        f(0, data);
    }
}

/// Like [`for_each_chunk`] over two buffers cut at the same chunk indices.
pub(crate) fn for_each_chunk2<T: Send, U: Send, F>(
    a: &mut [T],
    a_len: usize,
    b: &mut [U],
    b_len: usize,
    f: F,
) where
    F: Fn(usize, &mut [T], &mut [U]) + Sync + Send,
{
    let (a_len, b_len) = (a_len.max(1), b_len.max(1));
    let items = a.chunks_mut(a_len).zip(b.chunks_mut(b_len)).enumerate();
    for_each_item(items, |(i, (x, y))| f(i, x, y));
}

/// A new buffer of `len` values written chunk by chunk: `f(chunk_index, chunk)` gets each
/// consecutive `chunk_len`-sized piece (as in [`for_each_chunk`]) uninitialised and returns
/// it written whole, as the `&mut [T]` that [`write_each`], [`fill_default`] or
/// [`matmul_into`] hand back; a returned slice that is not the whole chunk panics. The
/// threads write the chunks they compute, so neither a zero fill nor the page faults of
/// fresh memory fall on the calling thread alone (zeroing the whole output there first
/// was 5% of a two-thread training step while the others waited), and a product's output
/// is written once, not zeroed and then overwritten.
pub(crate) fn written_chunks<T, F>(len: usize, chunk_len: usize, f: F) -> Vec<T>
where
    T: Copy + Send,
    F: for<'a> Fn(usize, &'a mut [MaybeUninit<T>]) -> &'a mut [T] + Sync + Send,
{
    let mut out: Vec<T> = Vec::with_capacity(len);
    for_each_chunk(
        &mut out.spare_capacity_mut()[..len],
        chunk_len,
        |i, chunk| {
            let (at, n) = (chunk.as_ptr().cast::<T>(), chunk.len());
            let written = f(i, chunk);
            check_whole(i, at, n, written);
        },
    );
    // SAFETY: `for_each_chunk` cuts the whole of the first `len` slots into chunks and calls
    // the closure on each (it returns only after all of them, and unwinds if one panicked);
    // the closure checked that each chunk came back as initialised `T`s in its place, and
    // only initialising code can turn the chunk's `MaybeUninit<T>`s into `&mut [T]`.
    #[allow(unsafe_code)]
    unsafe {
        out.set_len(len)
    };
    out
}

/// Panics unless `written` is the whole of chunk `i`, which starts at `at` with `n` slots.
fn check_whole<T>(i: usize, at: *const T, n: usize, written: &[T]) {
    assert!(
        std::ptr::eq(written.as_ptr(), at) && written.len() == n,
        "chunk {i} of {n} values came back as another slice ({} values)",
        written.len()
    );
}

/// Like [`written_chunks`] for two buffers cut at the same chunk indices (as
/// [`for_each_chunk2`]); `f` returns both chunks written.
pub(crate) fn written_chunks2<T, U, F>(
    (a_len, a_chunk): (usize, usize),
    (b_len, b_chunk): (usize, usize),
    f: F,
) -> (Vec<T>, Vec<U>)
where
    T: Copy + Send,
    U: Copy + Send,
    F: for<'a, 'b> Fn(
            usize,
            &'a mut [MaybeUninit<T>],
            &'b mut [MaybeUninit<U>],
        ) -> (&'a mut [T], &'b mut [U])
        + Sync
        + Send,
{
    assert_eq!(
        a_len.div_ceil(a_chunk.max(1)),
        b_len.div_ceil(b_chunk.max(1)),
        "two buffers cut into different numbers of chunks: {a_len} in chunks of {a_chunk}, {b_len} in chunks of {b_chunk}"
    );
    let mut a: Vec<T> = Vec::with_capacity(a_len);
    let mut b: Vec<U> = Vec::with_capacity(b_len);
    for_each_chunk2(
        &mut a.spare_capacity_mut()[..a_len],
        a_chunk,
        &mut b.spare_capacity_mut()[..b_len],
        b_chunk,
        |i, x, y| {
            let (xa, xn) = (x.as_ptr().cast::<T>(), x.len());
            let (ya, yn) = (y.as_ptr().cast::<U>(), y.len());
            let (wx, wy) = f(i, x, y);
            check_whole(i, xa, xn, wx);
            check_whole(i, ya, yn, wy);
        },
    );
    // SAFETY: as in `written_chunks`: both buffers have as many chunks (asserted above), so
    // the zipped iteration of `for_each_chunk2` visits every chunk of each, and each came
    // back written whole (checked in the closure).
    #[allow(unsafe_code)]
    unsafe {
        a.set_len(a_len);
        b.set_len(b_len);
    };
    (a, b)
}

/// A new buffer of `len` values computed chunk by chunk: `f(chunk_index, chunk)` runs on
/// each piece of [`written_chunks`] zero-filled (`T::default()`) by the thread that then
/// computes it. For outputs that are accumulated into, or written in parts.
pub(crate) fn zeroed_chunks<T, F>(len: usize, chunk_len: usize, f: F) -> Vec<T>
where
    T: Copy + Default + Send,
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    written_chunks(len, chunk_len, |i, chunk| {
        let chunk = fill_default(chunk);
        f(i, chunk);
        chunk
    })
}

/// Like [`zeroed_chunks`] for two buffers cut at the same chunk indices (as
/// [`for_each_chunk2`]).
pub(crate) fn zeroed_chunks2<T, U, F>(
    a: (usize, usize),
    b: (usize, usize),
    f: F,
) -> (Vec<T>, Vec<U>)
where
    T: Copy + Default + Send,
    U: Copy + Default + Send,
    F: Fn(usize, &mut [T], &mut [U]) + Sync + Send,
{
    written_chunks2(a, b, |i, x, y| {
        let (x, y) = (fill_default(x), fill_default(y));
        f(i, x, y);
        (x, y)
    })
}

/// Writes `T::default()` to every slot of `chunk` and returns it as initialised values.
fn fill_default<T: Copy + Default>(chunk: &mut [MaybeUninit<T>]) -> &mut [T] {
    write_each(chunk, std::iter::repeat(T::default()))
}

/// Writes the values `values` yields, in order, to the slots of `dst`, and returns them as
/// initialised values; panics, before any slot is read, unless it yielded one per slot.
/// The loop is compiled for each vector extension the `pulp` crate knows (AVX-512, AVX2
/// with FMA) and the best one the CPU has is chosen at run time (the workspace builds for
/// plain x86-64, whose SSE2 does 4 lanes where AVX-512 does 16), so that arithmetic in
/// `values` (inlined functions over slices) vectorises; the arithmetic, and so the result,
/// is the same in every variant (no fused multiply-adds are formed from separate `*` and
/// `+`).
#[inline(always)]
pub(crate) fn write_each<T: Copy>(
    dst: &mut [MaybeUninit<T>],
    values: impl IntoIterator<Item = T>,
) -> &mut [T] {
    let (dst, written) = pulp::Arch::new().dispatch(WriteEach {
        dst,
        values: values.into_iter(),
    });
    assert_eq!(written, dst.len(), "values for {} slots", dst.len());
    // SAFETY: each of the `dst.len()` slots was written above (asserted), and
    // `MaybeUninit<T>` has the size, alignment and layout of `T`.
    #[allow(unsafe_code)]
    unsafe {
        &mut *(dst as *mut [MaybeUninit<T>] as *mut [T])
    }
}

/// [`write_each`]'s loop as `pulp` runs it: a type whose `with_simd` is inlined into each
/// variant `pulp` compiles (a closure's body was not, and ran in scalar code); returns the
/// slots with how many it wrote.
struct WriteEach<'a, T, I> {
    dst: &'a mut [MaybeUninit<T>],
    values: I,
}

impl<'a, T: Copy, I: Iterator<Item = T>> pulp::WithSimd for WriteEach<'a, T, I> {
    type Output = (&'a mut [MaybeUninit<T>], usize);

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Self::Output {
        let mut written = 0;
        for (d, v) in self.dst.iter_mut().zip(self.values) {
            d.write(v);
            written += 1;
        }
        (self.dst, written)
    }
}

/// `sum[i] += part[i]` for each of `parts` in turn (each as long as `sum`), compiled for
/// the best vector extension the CPU has, as [`write_each`] is: partial sums and column
/// sums added in a fixed order, 16 lanes at a time where plain x86-64 code did 4. Each
/// element's additions are the same, in the same order, in every variant.
#[inline(always)]
pub(crate) fn add_into<'p>(sum: &mut [f32], parts: impl Iterator<Item = &'p [f32]>) {
    pulp::Arch::new().dispatch(AddInto { sum, parts });
}

/// [`add_into`]'s loop as `pulp` runs it (see [`WriteEach`]).
struct AddInto<'a, I> {
    sum: &'a mut [f32],
    parts: I,
}

impl<'p, I: Iterator<Item = &'p [f32]>> pulp::WithSimd for AddInto<'_, I> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for part in self.parts {
            assert_eq!(part.len(), self.sum.len(), "a part of another length");
            for (t, v) in self.sum.iter_mut().zip(part) {
                *t += v;
            }
        }
    }
}

/// The row-major `rows x cols` matrix `x` transposed to `cols x rows`, in tiles: each chunk
/// is [`TRANSPOSE_ROWS`] output rows, written in pieces of [`TRANSPOSE_TILE`] contiguous
/// values (one cache line) read from that many input rows, which stay in cache for the
/// chunk's output rows. An element-by-element transpose that walked the input's rows wrote
/// 32 lines 2 KiB apart per input row for a 512-row weight, which collide in the cache's
/// sets: it ran at 4 ns an element against 0.6 for the tiles.
pub fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    transpose_into(x, rows, cols, &mut out);
    out
}

/// [`transpose`] into `out` (`rows * cols` values, overwritten).
pub fn transpose_into(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(x.len(), rows * cols, "a {rows}x{cols} matrix");
    assert_eq!(out.len(), x.len(), "a {cols}x{rows} destination");
    if rows == 0 || cols == 0 {
        return;
    }
    for_each_chunk(out, TRANSPOSE_ROWS * rows, |ci, dst| {
        transpose_rows(x, rows, cols, ci * TRANSPOSE_ROWS, dst);
    });
}

/// Rows `c0..` of the transpose of the row-major `rows x cols` matrix `x`, as many as `dst`
/// holds (whole rows of `rows` values), on this thread: in tiles of [`TRANSPOSE_TILE`]
/// input rows, each output row's piece of a tile one contiguous write.
fn transpose_rows(x: &[f32], rows: usize, cols: usize, c0: usize, dst: &mut [f32]) {
    for r0 in (0..rows).step_by(TRANSPOSE_TILE) {
        let tile = TRANSPOSE_TILE.min(rows - r0);
        for (c, out_row) in dst.chunks_exact_mut(rows).enumerate() {
            let column = c0 + c;
            for (k, d) in out_row[r0..][..tile].iter_mut().enumerate() {
                *d = x[(r0 + k) * cols + column];
            }
        }
    }
}

thread_local! {
    /// The transposed weight of the dense layer whose input gradient this thread is
    /// computing ([`dense_backward_linear`]): kept between calls, so that the step's dozens
    /// of transposes write memory already mapped (a fresh buffer each time was zero-filled
    /// and page-faulted, twice the transpose's own time).
    static WEIGHT_T: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Output rows per chunk of [`transpose`].
const TRANSPOSE_ROWS: usize = 32;
/// Input rows per tile of [`transpose`]: a 64-byte line of `f32`s.
const TRANSPOSE_TILE: usize = 16;

/// Images per chunk for feature maps of `positions` output positions.
fn images_per_chunk(positions: usize) -> usize {
    (CHUNK_POSITIONS / positions.max(1)).clamp(1, 64)
}

/// Output length of a convolution or pooling along one axis, if the window fits.
pub fn output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let span = dilation * (kernel - 1) + 1;
    let padded = input + 2 * padding;
    (stride > 0 && kernel > 0 && padded >= span).then(|| (padded - span) / stride + 1)
}

/// The shapes of one 2-D convolution over NHWC input `[batch, in_h, in_w, in_c]` with weights
/// in Burn's layout `[out_c, in_c / groups, kernel_h, kernel_w]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dShape {
    /// Images.
    pub batch: usize,
    /// Input rows.
    pub in_h: usize,
    /// Input columns.
    pub in_w: usize,
    /// Input channels.
    pub in_c: usize,
    /// Output channels.
    pub out_c: usize,
    /// Kernel rows and columns.
    pub kernel: [usize; 2],
    /// Stride along rows and columns.
    pub stride: [usize; 2],
    /// Zero padding on each side, rows and columns.
    pub padding: [usize; 2],
    /// Spacing between kernel taps, rows and columns.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
    /// Output rows.
    pub out_h: usize,
    /// Output columns.
    pub out_w: usize,
}

impl Conv2dShape {
    /// The convolution of `x` (NHWC dims) by `weight` (Burn's dims). Panics, naming the
    /// values, if they do not fit together (as Burn's own convolution does).
    pub fn new(
        x: [usize; 4],
        weight: [usize; 4],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
    ) -> Self {
        let [batch, in_h, in_w, in_c] = x;
        let [out_c, cg, kh, kw] = weight;
        assert!(
            groups > 0 && in_c % groups == 0 && out_c % groups == 0 && cg * groups == in_c,
            "convolution of input channels {in_c} by weights {weight:?} in {groups} groups: \
             the weights' second dimension must be input channels / groups and both channel \
             counts divisible by groups"
        );
        let out_h = output_size(in_h, kh, stride[0], padding[0], dilation[0]);
        let out_w = output_size(in_w, kw, stride[1], padding[1], dilation[1]);
        let (Some(out_h), Some(out_w)) = (out_h, out_w) else {
            panic!(
                "convolution of a {in_h}x{in_w} input by a {kh}x{kw} kernel (stride {stride:?}, \
                 padding {padding:?}, dilation {dilation:?}): the kernel does not fit"
            )
        };
        Self {
            batch,
            in_h,
            in_w,
            in_c,
            out_c,
            kernel: [kh, kw],
            stride,
            padding,
            dilation,
            groups,
            out_h,
            out_w,
        }
    }

    fn cg(&self) -> usize {
        self.in_c / self.groups
    }
    fn og(&self) -> usize {
        self.out_c / self.groups
    }
    /// Columns of a patch row: kernel taps times the group's channels.
    fn kg(&self) -> usize {
        self.kernel[0] * self.kernel[1] * self.cg()
    }
    fn positions(&self) -> usize {
        self.out_h * self.out_w
    }
    fn image_len(&self) -> usize {
        self.in_h * self.in_w * self.in_c
    }
    fn pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.padding == [0, 0] && self.groups == 1
    }
    /// Elements of the NHWC output.
    pub fn output_len(&self) -> usize {
        self.batch * self.positions() * self.out_c
    }
}

/// Weights from Burn's `[out, in/groups, kh, kw]` to `[group][(tap, channel)][out in group]`.
fn pack_weight(s: &Conv2dShape, weight: &[f32]) -> Vec<f32> {
    let (cg, og, kg) = (s.cg(), s.og(), s.kg());
    let taps = s.kernel[0] * s.kernel[1];
    assert_eq!(weight.len(), s.out_c * cg * taps, "weights of {s:?}");
    let mut packed = vec![0.0f32; s.groups * kg * og];
    for g in 0..s.groups {
        for oo in 0..og {
            let src = &weight[(g * og + oo) * cg * taps..][..cg * taps];
            for c in 0..cg {
                for t in 0..taps {
                    packed[(g * kg + t * cg + c) * og + oo] = src[c * taps + t];
                }
            }
        }
    }
    packed
}

/// The inverse of [`pack_weight`].
fn unpack_weight(s: &Conv2dShape, packed: &[f32]) -> Vec<f32> {
    let (cg, og, kg) = (s.cg(), s.og(), s.kg());
    let taps = s.kernel[0] * s.kernel[1];
    let mut weight = vec![0.0f32; s.out_c * cg * taps];
    for g in 0..s.groups {
        for oo in 0..og {
            let dst = &mut weight[(g * og + oo) * cg * taps..][..cg * taps];
            for c in 0..cg {
                for t in 0..taps {
                    dst[c * taps + t] = packed[(g * kg + t * cg + c) * og + oo];
                }
            }
        }
    }
    weight
}

/// Input row and column of tap `(i, j)` for output position `(oh, ow)`, if inside the image.
#[inline]
fn tap(s: &Conv2dShape, oh: usize, ow: usize, i: usize, j: usize) -> Option<(usize, usize)> {
    let ih = (oh * s.stride[0] + i * s.dilation[0]).checked_sub(s.padding[0])?;
    let iw = (ow * s.stride[1] + j * s.dilation[1]).checked_sub(s.padding[1])?;
    (ih < s.in_h && iw < s.in_w).then_some((ih, iw))
}

/// Patch rows of `images` (consecutive NHWC images) for channel group `g` into `col`.
///
/// With one group and no column dilation, the taps of one kernel row are adjacent pixels,
/// so a kernel row inside the image is one copy of `kernel_w * channels` values (the common
/// case, and the one that matters for few channels, where per-tap copies would dominate).
fn im2col(s: &Conv2dShape, images: &[f32], g: usize, col: &mut [f32]) {
    let (cg, kg) = (s.cg(), s.kg());
    let kw = s.kernel[1];
    let (w, c) = (s.in_w, s.in_c);
    let runs = s.groups == 1 && s.dilation[1] == 1;
    let run = kw * cg;
    let mut rows = col.chunks_exact_mut(kg);
    for image in images.chunks_exact(s.image_len()) {
        for oh in 0..s.out_h {
            for ow in 0..s.out_w {
                let Some(row) = rows.next() else { return };
                // Left edge of the window, possibly in the padding (negative).
                let iw0 = (ow * s.stride[1]) as isize - s.padding[1] as isize;
                let inside = iw0 >= 0 && iw0 as usize + kw <= w;
                for (i, dst) in row.chunks_exact_mut(run).enumerate() {
                    let ih = (oh * s.stride[0] + i * s.dilation[0]).checked_sub(s.padding[0]);
                    let Some(ih) = ih.filter(|&ih| ih < s.in_h) else {
                        dst.fill(0.0);
                        continue;
                    };
                    let line = &image[ih * w * c..(ih + 1) * w * c];
                    if runs && inside {
                        let at = iw0 as usize * c;
                        copy_run(dst, &line[at..at + run]);
                        continue;
                    }
                    for (j, d) in dst.chunks_exact_mut(cg).enumerate() {
                        let iw = iw0 + (j * s.dilation[1]) as isize;
                        if iw >= 0 && (iw as usize) < w {
                            let at = iw as usize * c + g * cg;
                            d.copy_from_slice(&line[at..at + cg]);
                        } else {
                            d.fill(0.0);
                        }
                    }
                }
            }
        }
    }
}

/// `dst.copy_from_slice(src)`, with the short runs of few-channel inputs (a 3x3 kernel row of
/// a one-channel image is three values) copied inline rather than through a call to
/// `memcpy`, which costs more than the copy at that size.
#[inline]
fn copy_run(dst: &mut [f32], src: &[f32]) {
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) -> bool {
        match (<&mut [f32; N]>::try_from(dst), <&[f32; N]>::try_from(src)) {
            (Ok(d), Ok(s)) => {
                *d = *s;
                true
            }
            _ => false,
        }
    }
    let done = match dst.len() {
        1 => fixed::<1>(dst, src),
        2 => fixed::<2>(dst, src),
        3 => fixed::<3>(dst, src),
        4 => fixed::<4>(dst, src),
        5 => fixed::<5>(dst, src),
        6 => fixed::<6>(dst, src),
        7 => fixed::<7>(dst, src),
        8 => fixed::<8>(dst, src),
        9 => fixed::<9>(dst, src),
        _ => false,
    };
    if !done {
        dst.copy_from_slice(src);
    }
}

/// Adds patch-row gradients `dcol` of group `g` back into the NHWC image gradients `dx`.
fn col2im(s: &Conv2dShape, dcol: &[f32], g: usize, dx: &mut [f32]) {
    let (cg, kg) = (s.cg(), s.kg());
    let [kh, kw] = s.kernel;
    let mut rows = dcol.chunks_exact(kg);
    for image in dx.chunks_exact_mut(s.image_len()) {
        for oh in 0..s.out_h {
            for ow in 0..s.out_w {
                let Some(row) = rows.next() else { return };
                for i in 0..kh {
                    for j in 0..kw {
                        if let Some((ih, iw)) = tap(s, oh, ow, i, j) {
                            let dst = &mut image[(ih * s.in_w + iw) * s.in_c + g * cg..][..cg];
                            let src = &row[(i * kw + j) * cg..][..cg];
                            for (d, v) in dst.iter_mut().zip(src) {
                                *d += v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// NHWC convolution `[batch, out_h, out_w, out_c]`, plus `bias`, then ReLU if `relu`.
pub fn conv2d_forward(
    s: &Conv2dShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    assert_eq!(x.len(), s.batch * s.image_len(), "input of {s:?}");
    if let Some(b) = bias {
        assert_eq!(b.len(), s.out_c, "bias of {s:?}");
    }
    let packed = pack_weight(s, weight);
    let (p, o, og, kg) = (s.positions(), s.out_c, s.og(), s.kg());
    let per = images_per_chunk(p);
    let out = zeroed_chunks(s.output_len(), per * p * o, |ci, dst| {
        let rows = dst.len() / o;
        let images = &x[ci * per * s.image_len()..][..rows / p * s.image_len()];
        if s.pointwise() {
            matmul(
                MatMut::row_major(dst, rows, o),
                MatRef::row_major(images, rows, s.in_c),
                MatRef::row_major(&packed, kg, o),
            );
        } else {
            with_scratch(rows * kg, |col| {
                for g in 0..s.groups {
                    im2col(s, images, g, col);
                    matmul(
                        MatMut::new(&mut dst[g * og..], rows, og, o, 1),
                        MatRef::row_major(col, rows, kg),
                        MatRef::row_major(&packed[g * kg * og..][..kg * og], kg, og),
                    );
                }
            });
        }
        // Bias and ReLU in one pass over the chunk while it is in cache.
        bias_relu(dst, o, bias, relu);
    });
    out
}

/// Adds `bias` to every `width`-long row of `dst`, then applies ReLU when `relu`. `v < 0`
/// keeps a NaN a NaN, as Burn's ReLU does; branch-free, so that it vectorises.
fn bias_relu(dst: &mut [f32], width: usize, bias: Option<&[f32]>, relu: bool) {
    match (bias, relu) {
        (Some(b), true) => {
            for row in dst.chunks_exact_mut(width) {
                for (v, b) in row.iter_mut().zip(b) {
                    let y = *v + b;
                    *v = if y < 0.0 { 0.0 } else { y };
                }
            }
        }
        (Some(b), false) => {
            for row in dst.chunks_exact_mut(width) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        (None, true) => {
            for v in dst.iter_mut() {
                *v = if *v < 0.0 { 0.0 } else { *v };
            }
        }
        (None, false) => {}
    }
}

/// The output gradient with ReLU's gradient applied: zero where the forward's (ReLU) output
/// is not positive (Burn's rule), or `grad` itself without a fused ReLU.
fn relu_masked<'a>(
    grad: &'a [f32],
    relu_output: Option<&[f32]>,
    keep: &'a mut Vec<f32>,
) -> &'a [f32] {
    // Element-wise, so it is split between the threads in fixed chunks.
    const CHUNK: usize = 1 << 14;
    match relu_output {
        Some(y) => {
            assert_eq!(y.len(), grad.len(), "ReLU output and its gradient");
            *keep = zeroed_chunks(grad.len(), CHUNK, |ci, dst| {
                let g = &grad[ci * CHUNK..][..dst.len()];
                let y = &y[ci * CHUNK..][..dst.len()];
                for ((d, g), y) in dst.iter_mut().zip(g).zip(y) {
                    // `g` unless `y <= 0` (a NaN output passes the gradient, as in Burn), as a
                    // bit mask: a float select here compiled to an unpredictable branch.
                    #[allow(clippy::neg_cmp_op_on_partial_ord)]
                    let pass = (!(*y <= 0.0)) as u32;
                    *d = f32::from_bits(g.to_bits() & pass.wrapping_neg());
                }
            });
            keep
        }
        None => grad,
    }
}

/// Gradients of a layer (convolution or dense), each computed only when asked for.
#[derive(Debug, Default)]
pub struct LayerGrads {
    /// Of the input (NHWC for a convolution).
    pub x: Option<Vec<f32>>,
    /// Of the weights, in Burn's layout.
    pub weight: Option<Vec<f32>>,
    /// Of the bias.
    pub bias: Option<Vec<f32>>,
}

/// Gradients of [`conv2d_forward`] for the output gradient `grad`; `relu_output` is the
/// forward's output when it applied ReLU (the gradient passes where it is positive).
/// `needs` says which of input, weight and bias gradients to compute.
pub fn conv2d_backward(
    s: &Conv2dShape,
    x: &[f32],
    weight: &[f32],
    relu_output: Option<&[f32]>,
    grad: &[f32],
    needs: [bool; 3],
) -> LayerGrads {
    assert_eq!(grad.len(), s.output_len(), "output gradient of {s:?}");
    let mut masked = Vec::new();
    let gout = relu_masked(grad, relu_output, &mut masked);
    let packed = pack_weight(s, weight);
    let (p, o, og, kg) = (s.positions(), s.out_c, s.og(), s.kg());
    let per = images_per_chunk(p);
    let mut grads = LayerGrads::default();

    if needs[0] {
        let dx = zeroed_chunks(s.batch * s.image_len(), per * s.image_len(), |ci, dxc| {
            let rows = dxc.len() / s.image_len() * p;
            let g_rows = &gout[ci * per * p * o..][..rows * o];
            if s.pointwise() {
                matmul(
                    MatMut::row_major(dxc, rows, s.in_c),
                    MatRef::row_major(g_rows, rows, o),
                    MatRef::new(&packed, o, kg, 1, o),
                );
                return;
            }
            with_scratch(rows * kg, |dcol| {
                for g in 0..s.groups {
                    matmul(
                        MatMut::row_major(dcol, rows, kg),
                        MatRef::new(&g_rows[g * og..], rows, og, o, 1),
                        MatRef::new(&packed[g * kg * og..][..kg * og], og, kg, 1, og),
                    );
                    col2im(s, dcol, g, dxc);
                }
            });
        });
        grads.x = Some(dx);
    }

    if needs[1] || needs[2] {
        assert_eq!(x.len(), s.batch * s.image_len(), "input of {s:?}");
        let chunks = s.batch.div_ceil(per);
        let part_len = s.groups * kg * og + o;
        let parts = zeroed_chunks(chunks * part_len, part_len, |ci, part| {
            let images = per.min(s.batch - ci * per);
            let rows = images * p;
            let g_rows = &gout[ci * per * p * o..][..rows * o];
            let xs = &x[ci * per * s.image_len()..][..images * s.image_len()];
            let (dw, db) = part.split_at_mut(s.groups * kg * og);
            if needs[1] {
                if s.pointwise() {
                    matmul(
                        MatMut::row_major(dw, kg, og),
                        MatRef::new(xs, kg, rows, 1, s.in_c),
                        MatRef::row_major(g_rows, rows, o),
                    );
                } else {
                    with_scratch(rows * kg, |col| {
                        for g in 0..s.groups {
                            im2col(s, xs, g, col);
                            matmul(
                                MatMut::row_major(&mut dw[g * kg * og..][..kg * og], kg, og),
                                MatRef::new(col, kg, rows, 1, kg),
                                MatRef::new(&g_rows[g * og..], rows, og, o, 1),
                            );
                        }
                    });
                }
            }
            if needs[2] {
                for row in g_rows.chunks_exact(o) {
                    for (d, v) in db.iter_mut().zip(row) {
                        *d += v;
                    }
                }
            }
        });
        // The chunks' partial sums, added in chunk order whatever the thread count.
        let mut total = vec![0.0f32; part_len];
        for part in parts.chunks_exact(part_len) {
            for (t, v) in total.iter_mut().zip(part) {
                *t += v;
            }
        }
        let db = total.split_off(s.groups * kg * og);
        if needs[1] {
            grads.weight = Some(unpack_weight(s, &total));
        }
        if needs[2] {
            grads.bias = Some(db);
        }
    }
    grads
}

/// Each of `images` consecutive `[rows, cols]` matrices of `x` transposed to `[cols, rows]`:
/// NHWC to NCHW with `rows` the pixels and `cols` the channels, and back with them swapped.
/// Chunks of whole images, sized from the shapes.
pub fn transpose_images(x: &[f32], images: usize, rows: usize, cols: usize) -> Vec<f32> {
    let len = rows * cols;
    assert_eq!(x.len(), images * len, "{images} images of {rows}x{cols}");
    if len == 0 {
        return vec![0.0; x.len()];
    }
    let per = (1usize << 14).div_ceil(len).max(1);
    let out = zeroed_chunks(x.len(), per * len, |ci, dst| {
        let src = &x[ci * per * len..][..dst.len()];
        for (d, s) in dst.chunks_exact_mut(len).zip(src.chunks_exact(len)) {
            transpose_rows(s, rows, cols, 0, d);
        }
    });
    out
}

/// Batch rows per chunk of a dense layer's forward pass and input gradient.
const DENSE_ROWS: usize = 16;
/// Input features (weight rows) per chunk of a dense layer's weight gradient.
const DENSE_FEATURES: usize = 128;

/// The shapes of a dense layer: `x: [rows, d_in]`, `weight: [d_in, d_out]` (Burn's `Linear`
/// layout), output `[rows, d_out]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseShape {
    /// Rows of the input (the batch, with any leading dimensions folded in).
    pub rows: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
}

/// A dense layer `x · weight + bias`, then ReLU when `relu`. The batch is cut into chunks of
/// rows fixed by the shape ([`dense_chunk_rows`]), each one matrix product against the whole
/// weight; so results do not depend on the thread count.
pub fn dense_forward(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    relu: bool,
) -> Vec<f32> {
    check_dense(s, x, weight, bias);
    let d_out = s.d_out;
    if d_out == 0 {
        return Vec::new();
    }
    let rows = dense_chunk_rows(s);
    written_chunks(s.rows * d_out, rows * d_out, |ci, dst| {
        let dst = dense_chunk(s, x, weight, ci * rows, dst);
        bias_relu(dst, d_out, bias, relu);
        dst
    })
}

/// [`dense_forward`] without an activation, with `residual` (`[rows, d_out]`) added to its
/// output: `residual + (x · weight + bias)`, the transformer block's `x + layer(x')`. The
/// bias and the residual are added to each chunk of the product while it is in cache, in
/// the order of a separate add after the layer (the same values, to the bit).
pub fn dense_residual_forward(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    residual: &[f32],
) -> Vec<f32> {
    check_dense(s, x, weight, bias);
    let d_out = s.d_out;
    assert_eq!(residual.len(), s.rows * d_out, "residual of {s:?}");
    if d_out == 0 {
        return Vec::new();
    }
    let rows = dense_chunk_rows(s);
    written_chunks(s.rows * d_out, rows * d_out, |ci, dst| {
        let dst = dense_chunk(s, x, weight, ci * rows, dst);
        bias_relu(dst, d_out, bias, false);
        // `residual + y` of a separate add; IEEE addition commutes, so `y + residual` is it.
        for (v, r) in dst.iter_mut().zip(&residual[ci * rows * d_out..]) {
            *v += r;
        }
        dst
    })
}

/// `x + positions` for `x` of `batch` sequences of `positions.len()` values each (a
/// transformer's learned position embeddings, added to each sequence's token embeddings):
/// one sequence per chunk, `x`'s value first in each sum as in Burn's broadcasting add.
pub fn add_positions(x: &[f32], positions: &[f32]) -> Vec<f32> {
    let n = positions.len();
    if n == 0 {
        assert!(x.is_empty(), "{} values for sequences of none", x.len());
        return Vec::new();
    }
    assert_eq!(x.len() % n, 0, "{} values in sequences of {n}", x.len());
    written_chunks(x.len(), n, |ci, dst| {
        let x = &x[ci * n..][..n];
        write_each(dst, x.iter().zip(positions).map(|(a, p)| a + p))
    })
}

/// The position embeddings' gradient of [`add_positions`]: the sum over the sequences of
/// `grad` (`batch` sequences of `n` values), each value's terms added in sequence order;
/// cut into chunks of values, so the bits do not depend on the thread count.
pub fn positions_grad(grad: &[f32], n: usize) -> Vec<f32> {
    if n == 0 {
        return Vec::new();
    }
    assert!(
        grad.len().is_multiple_of(n) && !grad.is_empty(),
        "{} values in sequences of {n}",
        grad.len()
    );
    sum_parts(grad, n)
}

/// The element-wise sum of the consecutive `len`-value parts of `parts` (at least one):
/// each element's first part written, the others added in order ([`add_into`]); cut into
/// chunks of elements, so the bits do not depend on the thread count. The reduction of the
/// kernels' partial sums: a weight gradient's pieces, the chunks' bias sums, the sequences'
/// position gradients.
pub(crate) fn sum_parts(parts: &[f32], len: usize) -> Vec<f32> {
    const CHUNK: usize = 1 << 14;
    assert!(
        len > 0 && parts.len().is_multiple_of(len) && !parts.is_empty(),
        "{} values in parts of {len}",
        parts.len()
    );
    written_chunks(len, CHUNK, |ci, dst| {
        let (at, here) = (ci * CHUNK, dst.len());
        let mut each = parts.chunks_exact(len).map(|p| &p[at..][..here]);
        // Invariant: there is a part at least (asserted above).
        let first = each.next().expect("one part at least");
        let sum = write_each(dst, first.iter().copied());
        add_into(sum, each);
        sum
    })
}

/// Panics, naming the shape, unless the input, weight and bias fit `s`.
fn check_dense(s: &DenseShape, x: &[f32], weight: &[f32], bias: Option<&[f32]>) {
    assert_eq!(x.len(), s.rows * s.d_in, "input of {s:?}");
    assert_eq!(weight.len(), s.d_in * s.d_out, "weight of {s:?}");
    if let Some(b) = bias {
        assert_eq!(b.len(), s.d_out, "bias of {s:?}");
    }
}

/// One chunk of a dense layer's product: `dst` (whole output rows) is written with the rows
/// of `x · weight` from row `first` on, and returned.
fn dense_chunk<'a>(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    first: usize,
    dst: &'a mut [MaybeUninit<f32>],
) -> &'a mut [f32] {
    let (d_in, d_out) = (s.d_in, s.d_out);
    let rows = dst.len() / d_out;
    matmul_into(
        dst,
        MatRef::row_major(&x[first * d_in..][..rows * d_in], rows, d_in),
        MatRef::row_major(weight, d_in, d_out),
    )
}

/// Gradients of [`dense_forward`] for the output gradient `grad`; `relu_output` is the
/// forward's output when it applied ReLU. `needs`: input, weight, bias. The input gradient
/// is cut by batch rows and the weight gradient by input features (each a whole sum over
/// the batch), so no sum is split between chunks; the bias gradient adds the rows in order.
pub fn dense_backward(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    relu_output: Option<&[f32]>,
    grad: &[f32],
    needs: [bool; 3],
) -> LayerGrads {
    assert_eq!(grad.len(), s.rows * s.d_out, "output gradient of {s:?}");
    let mut masked = Vec::new();
    let gout = relu_masked(grad, relu_output, &mut masked);
    dense_backward_linear(s, x, weight, gout, needs)
}

/// The gradients of the linear part of a dense layer, `x · weight + bias`, for the gradient
/// `gout` of its (pre-activation) output.
fn dense_backward_linear(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    gout: &[f32],
    needs: [bool; 3],
) -> LayerGrads {
    let (n, d_in, d_out) = (s.rows, s.d_in, s.d_out);
    let mut grads = LayerGrads::default();
    if needs[0] {
        assert_eq!(weight.len(), d_in * d_out, "weight of {s:?}");
        let rows = dense_chunk_rows(s);
        // The transposed weight, row-major `[d_out, d_in]`, made once for all the chunks: as
        // a right-hand side read with row stride 1 the products ran a third slower on the
        // wider layers (the GEMM's packing of a column-major operand is the slow one).
        let mut weight_t = WEIGHT_T.take();
        weight_t.resize(d_in * d_out, 0.0);
        transpose_into(weight, d_in, d_out, &mut weight_t);
        // Chunk `ci`'s rows of the output gradient.
        let g = |ci: usize, dst_len: usize| &gout[ci * rows * d_out..][..dst_len / d_in * d_out];
        if needs[2] && n > 0 && d_in > 0 && d_out > 0 {
            // The bias gradient in the same pass: each chunk's column sums of its rows of
            // `gout` (in cache after its product), then the chunks' sums in chunk order. A
            // separate pass read every layer's output gradient again.
            let (dx, partial) = written_chunks2(
                (n * d_in, rows * d_in),
                (n.div_ceil(rows) * d_out, d_out),
                |ci, dst, sums| {
                    let g = g(ci, dst.len());
                    let dx = input_grad_chunk(dst, g, &weight_t, d_in);
                    let sums = write_each(sums, g[..d_out].iter().copied());
                    add_into(sums, g[d_out..].chunks_exact(d_out));
                    (dx, sums)
                },
            );
            grads.bias = Some(sum_parts(&partial, d_out));
            grads.x = Some(dx);
        } else {
            let dx = written_chunks(n * d_in, rows * d_in, |ci, dst| {
                let g = g(ci, dst.len());
                input_grad_chunk(dst, g, &weight_t, d_in)
            });
            grads.x = Some(dx);
        }
        WEIGHT_T.set(weight_t);
    }
    if needs[1] {
        assert_eq!(x.len(), n * d_in, "input of {s:?}");
        grads.weight = Some(dense_weight_grad(s, x, gout));
    }
    if needs[2] && grads.bias.is_none() {
        grads.bias = Some(column_sums(gout, n, d_out));
    }
    grads
}

/// One chunk of a dense layer's input gradient: `dst` (whole rows of `d_in`) is written with
/// `g · weightᵀ` for the chunk's rows `g` of the output gradient, from the transposed weight
/// (`[d_out, d_in]`, row-major), and returned. `d_in` is not 0 (no chunk is cut then).
fn input_grad_chunk<'a>(
    dst: &'a mut [MaybeUninit<f32>],
    g: &[f32],
    weight_t: &[f32],
    d_in: usize,
) -> &'a mut [f32] {
    let rows = dst.len() / d_in;
    let d_out = weight_t.len() / d_in;
    matmul_into(
        dst,
        MatRef::row_major(g, rows, d_out),
        MatRef::row_major(weight_t, d_out, d_in),
    )
}

/// The weight gradient of a dense layer, `xᵀ · gout` (`d_in x d_out`), in blocks of
/// [`DENSE_FEATURES`] input features by [`dense_grad_columns`] output columns: each block is a
/// whole sum over the batch (one product), so no sum is split between threads, and the
/// blocks are a function of the shape alone. A language model's `d_in` of 128 is one block
/// of features; cutting the columns too gives the threads several blocks to share (one
/// block per layer left the other threads idle for a fifth of the step's products).
fn dense_weight_grad(s: &DenseShape, x: &[f32], gout: &[f32]) -> Vec<f32> {
    let (n, d_in, d_out) = (s.rows, s.d_in, s.d_out);
    let pieces = dense_grad_pieces(s);
    if pieces > 1 {
        return dense_weight_grad_pieces(s, x, gout, pieces);
    }
    let cols = dense_grad_columns(s);
    if cols >= d_out {
        return written_chunks(d_in * d_out, DENSE_FEATURES * d_out, |ci, dst| {
            let features = dst.len() / d_out;
            matmul_into(
                dst,
                // Rows `ci * 128..` of the transposed input: element (i, k) is x[k][i].
                MatRef::new(&x[ci * DENSE_FEATURES..], features, n, 1, d_in),
                MatRef::row_major(gout, n, d_out),
            )
        });
    }
    // Blocks (feature chunk, column chunk) in row-major order, each computed row-major into
    // its own `DENSE_FEATURES x cols` slot (edge blocks use part of theirs, zeroed first),
    // then placed.
    let (feature_blocks, column_blocks) = (d_in.div_ceil(DENSE_FEATURES), d_out.div_ceil(cols));
    let slot = DENSE_FEATURES * cols;
    // Block `bi`'s first feature and column, and its numbers of features and columns.
    let block = |bi: usize| {
        let (f0, c0) = (
            (bi / column_blocks) * DENSE_FEATURES,
            (bi % column_blocks) * cols,
        );
        (f0, c0, DENSE_FEATURES.min(d_in - f0), cols.min(d_out - c0))
    };
    let blocks = written_chunks(feature_blocks * column_blocks * slot, slot, |bi, dst| {
        let (f0, c0, features, width) = block(bi);
        let (lhs, rhs) = (
            MatRef::new(&x[f0..], features, n, 1, d_in),
            MatRef::new(&gout[c0..], n, width, d_out, 1),
        );
        if features * width == slot {
            return matmul_into(dst, lhs, rhs);
        }
        let dst = fill_default(dst);
        matmul(
            MatMut::row_major(&mut dst[..features * width], features, width),
            lhs,
            rhs,
        );
        dst
    });
    // The rows of `dw` in order, each the blocks' pieces of it side by side.
    let mut dw = Vec::with_capacity(d_in * d_out);
    for f in 0..d_in {
        let (fb, r) = (f / DENSE_FEATURES, f % DENSE_FEATURES);
        for cb in 0..column_blocks {
            let (_, _, _, width) = block(fb * column_blocks + cb);
            let values = &blocks[(fb * column_blocks + cb) * slot..][..slot];
            dw.extend_from_slice(&values[r * width..][..width]);
        }
    }
    dw
}

/// The weight gradient of a large batch cut by batch rows: `pieces` products, each the
/// whole `d_in x d_out` gradient of `rows / pieces` (rounded up) consecutive rows, then added
/// element by element in piece order. Blocks of a few output columns (the other way to
/// share a narrow layer's gradient between threads) ran the GEMM at half its speed on a
/// language model's layers: a 64-column block of a 4096-row sum packs its operands for
/// little work each. Each piece and the order of the additions are fixed by the shape, so
/// the result does not depend on the thread count.
fn dense_weight_grad_pieces(s: &DenseShape, x: &[f32], gout: &[f32], pieces: usize) -> Vec<f32> {
    let (n, d_in, d_out) = (s.rows, s.d_in, s.d_out);
    let (len, piece_rows) = (d_in * d_out, n.div_ceil(pieces));
    let partials = written_chunks(pieces * len, len, |p, dst| {
        let r0 = p * piece_rows;
        let rows = piece_rows.min(n - r0);
        matmul_into(
            dst,
            // Rows `r0..` of the input, transposed: element (i, k) is x[r0 + k][i].
            MatRef::new(&x[r0 * d_in..][..rows * d_in], d_in, rows, 1, d_in),
            MatRef::row_major(&gout[r0 * d_out..][..rows * d_out], rows, d_out),
        )
    });
    sum_parts(&partials, len)
}

/// Pieces of batch rows a dense layer's weight gradient is cut into
/// ([`dense_weight_grad_pieces`]); 1 keeps it whole (cut by features and columns instead).
/// A large batch ([`DENSE_LARGE_BATCH`] rows or more) whose input features make fewer than
/// [`DENSE_GRAD_BLOCKS`] blocks gets up to that many pieces of at least
/// [`DENSE_GRAD_ROWS`] rows, as many as keep the partial gradients within
/// [`DENSE_GRAD_PARTIALS`] values. A function of the shape alone.
fn dense_grad_pieces(s: &DenseShape) -> usize {
    let feature_blocks = s.d_in.div_ceil(DENSE_FEATURES);
    if s.rows < DENSE_LARGE_BATCH || feature_blocks >= DENSE_GRAD_BLOCKS {
        return 1;
    }
    (s.rows / DENSE_GRAD_ROWS)
        .min(DENSE_GRAD_BLOCKS)
        .min(DENSE_GRAD_PARTIALS / (s.d_in * s.d_out).max(1))
        .max(1)
}

/// Batch rows per piece of a weight gradient cut by rows, at least.
const DENSE_GRAD_ROWS: usize = 512;
/// Values the partial weight gradients of [`dense_weight_grad_pieces`] may take, at most
/// (16 MiB of `f32`).
const DENSE_GRAD_PARTIALS: usize = 1 << 22;

/// Output columns per block of a dense layer's weight gradient: all of them when the input
/// features alone make [`DENSE_GRAD_BLOCKS`] blocks; otherwise as many as make about that
/// many blocks, a multiple of 16 and at least 32 (narrower blocks would pack the input
/// again for too little work each).
fn dense_grad_columns(s: &DenseShape) -> usize {
    let feature_blocks = s.d_in.div_ceil(DENSE_FEATURES).max(1);
    if feature_blocks >= DENSE_GRAD_BLOCKS {
        return s.d_out.max(1);
    }
    let column_blocks = DENSE_GRAD_BLOCKS.div_ceil(feature_blocks);
    let cols = s.d_out.div_ceil(column_blocks).next_multiple_of(16).max(32);
    cols.min(s.d_out).max(1)
}

/// Blocks a dense layer's weight gradient is cut into, at least (see [`dense_grad_columns`]).
const DENSE_GRAD_BLOCKS: usize = 8;

/// The sums of the columns of the row-major `rows x width` matrix `m`, rows added in order
/// (each column its own sum, so the columns are split between threads in fixed groups).
pub(crate) fn column_sums(m: &[f32], rows: usize, width: usize) -> Vec<f32> {
    assert_eq!(m.len(), rows * width, "a {rows}x{width} matrix");
    // Columns per piece: the rows of a piece stay in cache and each piece is long enough to
    // vectorise; a narrow matrix is one piece.
    const COLUMNS: usize = 64;
    if width <= COLUMNS || rows < 256 {
        let mut sums = vec![0.0f32; width];
        add_into(&mut sums, m.chunks_exact(width.max(1)));
        return sums;
    }
    zeroed_chunks(width, COLUMNS, |ci, dst| {
        let (c0, here) = (ci * COLUMNS, dst.len());
        add_into(dst, m.chunks_exact(width).map(|row| &row[c0..][..here]));
    })
}

/// Rows per chunk of a dense layer's batch: 16 for the small batches of the image models
/// (several chunks per thread), more for the thousands of rows of a language model's tokens,
/// where 16-row products spent as long packing the weight as multiplying by it. A function
/// of the shape alone, so results never depend on the thread count.
fn dense_chunk_rows(s: &DenseShape) -> usize {
    if s.rows >= DENSE_LARGE_BATCH {
        DENSE_ROWS_LARGE
    } else {
        DENSE_ROWS
    }
}

/// Batches of at least this many rows take [`DENSE_ROWS_LARGE`]-row chunks.
const DENSE_LARGE_BATCH: usize = 1024;
/// Rows per chunk of a large batch (see [`dense_chunk_rows`]).
const DENSE_ROWS_LARGE: usize = 128;

/// `e^x` in `f32` without branches or calls, so that loops over slices vectorise: `x`
/// clamped to `[-87, 88]` (beyond, `f32`'s `e^x` is 0 or overflows), split as `n ln 2 + r`
/// with `n` an integer (Cody and Waite's two-part `ln 2`) and `|r| <= ln 2 / 2`, `e^r` by
/// its Taylor polynomial of degree 7 (truncation below `4e-9` relative), times `2^n` built
/// in the exponent bits. Within about 2 ulp of the correctly rounded value.
///
/// `2^n` is made from the bits of the rounded `x log₂e + 1.5·2²³`, whose low mantissa bits
/// hold `n`, with integer arithmetic only: a float-to-integer `as` cast saturates in Rust,
/// which the compiler could not vectorise (it converted lane by lane, 8% of a GPT step).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // `shifted` lies in [2^23, 2^24), where its bits are `ROUND`'s plus `n` (|n| <= 126), so
    // `bits - ROUND's bits + 127` is the biased exponent of `2^n`, in 1..=254. A NaN `x`
    // gives a NaN `p`, and NaN times any scale is NaN, so the NaN passes through.
    let biased = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127);
    p * f32::from_bits(biased << 23)
}

/// `(erf(x), e^{-x²})` by Abramowitz and Stegun's 7.1.26, `erf(x) = 1 - t(a₁ + t(a₂ + t(a₃ +
/// t(a₄ + t a₅)))) e^{-x²}` with `t = 1 / (1 + p|x|)` (odd in `x`), absolute error below
/// `1.5e-7`: the formula PyTorch's vectorised CPU `erf` (under its GELU) uses. Branch-free,
/// so that GELU's loops vectorise; `e^{-x²}` is returned for GELU's derivative, which needs
/// it too.
#[inline(always)]
fn erf_and_gauss(x: f32) -> (f32, f32) {
    const P: f32 = 0.327_591_1;
    const A1: f32 = 0.254_829_6;
    const A2: f32 = -0.284_496_74;
    const A3: f32 = 1.421_413_7;
    const A4: f32 = -1.453_152_1;
    const A5: f32 = 1.061_405_4;
    let a = x.abs();
    let t = 1.0 / (1.0 + P * a);
    let gauss = exp_f32(-(x * x));
    let poly = t * (A1 + t * (A2 + t * (A3 + t * (A4 + t * A5))));
    ((1.0 - poly * gauss).copysign(x), gauss)
}

/// GELU of `z` (Hendrycks and Gimpel, 2016), the exact form `z Φ(z) = 0.5 z (1 + erf(z /
/// √2))` with `erf` from [`erf_and_gauss`] (as PyTorch's CPU GELU computes it): within about
/// `1e-7 |z|` of the exact value. Burn's CPU backend uses `libm`'s `erff` instead, slower by
/// a call per element; the two differ by float32 rounding.
#[inline(always)]
pub fn gelu(z: f32) -> f32 {
    let (erf, _) = erf_and_gauss(z * std::f32::consts::FRAC_1_SQRT_2);
    0.5 * z * (1.0 + erf)
}

/// GELU's derivative at `z` times `g`: `g (Φ(z) + z φ(z))`, `φ` the normal density, whose
/// `e^{-z²/2}` [`erf_and_gauss`] computes once for both terms.
#[inline(always)]
pub fn gelu_grad(z: f32, g: f32) -> f32 {
    // 1 / sqrt(2 pi).
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    let (erf, gauss) = erf_and_gauss(z * std::f32::consts::FRAC_1_SQRT_2);
    let cdf = 0.5 * (1.0 + erf);
    g * (cdf + z * (INV_SQRT_2PI * gauss))
}

/// `y = gelu(z)` element by element, written into `y` (as long as `z`) and returned; through
/// [`write_each`], so vectorised for the CPU's widest extension.
fn gelu_into<'a>(y: &'a mut [MaybeUninit<f32>], z: &[f32]) -> &'a mut [f32] {
    write_each(y, z.iter().map(|z| gelu(*z)))
}

/// A dense layer followed by GELU, `gelu(x · weight + bias)`, with the pre-activation
/// `x · weight + bias` it keeps for the backward pass: `(output, pre_activation)`. Chunked
/// as [`dense_forward`]; the bias and GELU are applied to each chunk while it is in cache.
pub fn dense_gelu_forward(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    check_dense(s, x, weight, bias);
    let d_out = s.d_out;
    if d_out == 0 {
        return (Vec::new(), Vec::new());
    }
    let rows = dense_chunk_rows(s);
    let len = s.rows * d_out;
    written_chunks2((len, rows * d_out), (len, rows * d_out), |ci, y, z| {
        let z = dense_chunk(s, x, weight, ci * rows, z);
        bias_relu(z, d_out, bias, false);
        (gelu_into(y, z), z)
    })
}

/// Gradients of [`dense_gelu_forward`] for the output gradient `grad`, from the layer's
/// input, weight and kept pre-activation `pre`. `needs`: input, weight, bias.
pub fn dense_gelu_backward(
    s: &DenseShape,
    x: &[f32],
    weight: &[f32],
    pre: &[f32],
    grad: &[f32],
    needs: [bool; 3],
) -> LayerGrads {
    let len = s.rows * s.d_out;
    assert_eq!(grad.len(), len, "output gradient of {s:?}");
    assert_eq!(pre.len(), len, "pre-activation of {s:?}");
    const CHUNK: usize = 1 << 14;
    let gpre = written_chunks(len, CHUNK, |ci, dst| {
        let g = &grad[ci * CHUNK..][..dst.len()];
        let z = &pre[ci * CHUNK..][..dst.len()];
        write_each(dst, z.iter().zip(g).map(|(z, g)| gelu_grad(*z, *g)))
    });
    dense_backward_linear(s, x, weight, &gpre, needs)
}

/// The shapes of one 2-D pooling over NHWC input `[batch, in_h, in_w, channels]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2dShape {
    /// Images.
    pub batch: usize,
    /// Input rows.
    pub in_h: usize,
    /// Input columns.
    pub in_w: usize,
    /// Channels.
    pub channels: usize,
    /// Window rows and columns.
    pub kernel: [usize; 2],
    /// Stride along rows and columns.
    pub stride: [usize; 2],
    /// Padding on each side (never part of a maximum; counted or not by average pooling).
    pub padding: [usize; 2],
    /// Spacing between window taps.
    pub dilation: [usize; 2],
    /// Output rows.
    pub out_h: usize,
    /// Output columns.
    pub out_w: usize,
}

impl Pool2dShape {
    /// The pooling of `x` (NHWC dims). Panics, naming the values, if the window does not fit
    /// or the padding is more than half the window (as Burn's pooling requires).
    pub fn new(
        x: [usize; 4],
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Self {
        let [batch, in_h, in_w, channels] = x;
        assert!(
            padding[0] <= kernel[0] / 2 && padding[1] <= kernel[1] / 2,
            "pooling with a {kernel:?} window and padding {padding:?}: padding must be at most \
             half the window"
        );
        let out_h = output_size(in_h, kernel[0], stride[0], padding[0], dilation[0]);
        let out_w = output_size(in_w, kernel[1], stride[1], padding[1], dilation[1]);
        let (Some(out_h), Some(out_w)) = (out_h, out_w) else {
            panic!(
                "pooling of a {in_h}x{in_w} input with a {kernel:?} window (stride {stride:?}, \
                 padding {padding:?}, dilation {dilation:?}): the window does not fit"
            )
        };
        Self {
            batch,
            in_h,
            in_w,
            channels,
            kernel,
            stride,
            padding,
            dilation,
            out_h,
            out_w,
        }
    }

    fn in_image(&self) -> usize {
        self.in_h * self.in_w * self.channels
    }
    fn out_image(&self) -> usize {
        self.out_h * self.out_w * self.channels
    }
    /// Elements of the NHWC output.
    pub fn output_len(&self) -> usize {
        self.batch * self.out_image()
    }

    /// Input positions `(row, column)` of the window at `(oh, ow)` that lie inside the image.
    fn window(&self, oh: usize, ow: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let [kh, kw] = self.kernel;
        (0..kh).flat_map(move |i| {
            (0..kw).filter_map(move |j| {
                let ih =
                    (oh * self.stride[0] + i * self.dilation[0]).checked_sub(self.padding[0])?;
                let iw =
                    (ow * self.stride[1] + j * self.dilation[1]).checked_sub(self.padding[1])?;
                (ih < self.in_h && iw < self.in_w).then_some((ih, iw))
            })
        })
    }
}

/// The input rows (or columns) inside the image that the windows along one axis cover: for
/// each output position, the in-image taps in window order. Computed once per call, so the
/// pooling loops do no index arithmetic or bounds tests per tap.
fn axis_taps(
    out: usize,
    input: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dil: usize,
) -> Vec<Vec<usize>> {
    (0..out)
        .map(|o| {
            (0..kernel)
                .filter_map(|k| {
                    (o * stride + k * dil)
                        .checked_sub(pad)
                        .filter(|&i| i < input)
                })
                .collect()
        })
        .collect()
}

/// One tap of a max-pool window: where `row` beats the running maximum `best` (or is a NaN
/// that `best` is not), it replaces it and `arg` becomes `pos`. Branch-free over fixed groups
/// of eight channels, so that it compiles to vector compares and blends.
#[inline]
fn max_tap(best: &mut [f32], arg: &mut [i32], row: &[f32], pos: i32) {
    #[inline(always)]
    fn one(b: &mut f32, a: &mut i32, v: f32, pos: i32) {
        // `v > b`, or `v` a NaN where `b` is not, as an all-ones mask; the selects are bit
        // operations, which vectorise where `if` selects on floats did not.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let take = (!(v <= *b) & !b.is_nan()) as u32;
        let mask = take.wrapping_neg();
        let bits = b.to_bits();
        *b = f32::from_bits(bits ^ ((bits ^ v.to_bits()) & mask));
        *a ^= (*a ^ pos) & mask as i32;
    }
    let mut b8 = best.chunks_exact_mut(8);
    let mut a8 = arg.chunks_exact_mut(8);
    let mut v8 = row.chunks_exact(8);
    for ((b, a), v) in (&mut b8).zip(&mut a8).zip(&mut v8) {
        for k in 0..8 {
            one(&mut b[k], &mut a[k], v[k], pos);
        }
    }
    let rest = b8.into_remainder().iter_mut().zip(a8.into_remainder());
    for ((b, a), v) in rest.zip(v8.remainder()) {
        one(b, a, *v, pos);
    }
}

/// NHWC max pooling, and for each output the index `row * in_w + column` of its maximum in
/// its image and channel (PyTorch's and Burn's convention). The first maximum of a window
/// wins; a NaN is a maximum (it propagates, as in PyTorch).
pub fn max_pool2d_forward(s: &Pool2dShape, x: &[f32]) -> (Vec<f32>, Vec<i32>) {
    assert_eq!(x.len(), s.batch * s.in_image(), "input of {s:?}");
    let c = s.channels;
    let rows = axis_taps(
        s.out_h,
        s.in_h,
        s.kernel[0],
        s.stride[0],
        s.padding[0],
        s.dilation[0],
    );
    let cols = axis_taps(
        s.out_w,
        s.in_w,
        s.kernel[1],
        s.stride[1],
        s.padding[1],
        s.dilation[1],
    );
    let per = images_per_chunk(s.out_h * s.out_w);
    let chunk = (s.output_len(), per * s.out_image());
    zeroed_chunks2(chunk, chunk, |ci, out: &mut [f32], idx: &mut [i32]| {
        let out_images = out.chunks_exact_mut(s.out_image());
        let idx_images = idx.chunks_exact_mut(s.out_image());
        for (k, (out, idx)) in out_images.zip(idx_images).enumerate() {
            let image = &x[(ci * per + k) * s.in_image()..][..s.in_image()];
            let mut best = out.chunks_exact_mut(c);
            let mut arg = idx.chunks_exact_mut(c);
            for rows in &rows {
                for cols in &cols {
                    let (Some(best), Some(arg)) = (best.next(), arg.next()) else {
                        return;
                    };
                    // The window's first pixel is the maximum until beaten, even in a
                    // window of minus infinities. A window with no pixel of the image
                    // (possible only with dilation) is minus infinity, with index -1:
                    // it passes no gradient back.
                    best.fill(f32::NEG_INFINITY);
                    let first = match (rows.first(), cols.first()) {
                        (Some(ih), Some(iw)) => (ih * s.in_w + iw) as i32,
                        _ => -1,
                    };
                    arg.fill(first);
                    for &ih in rows {
                        for &iw in cols {
                            let pos = ih * s.in_w + iw;
                            max_tap(best, arg, &image[pos * c..][..c], pos as i32);
                        }
                    }
                }
            }
        }
    })
}

/// Gradient of [`max_pool2d_forward`]: each output gradient goes to its maximum's position.
pub fn max_pool2d_backward(s: &Pool2dShape, indices: &[i32], grad: &[f32]) -> Vec<f32> {
    assert_eq!(grad.len(), s.output_len(), "output gradient of {s:?}");
    assert_eq!(indices.len(), s.output_len(), "indices of {s:?}");
    let c = s.channels;
    let dx = zeroed_chunks(s.batch * s.in_image(), s.in_image(), |b, dx| {
        let g = &grad[b * s.out_image()..][..s.out_image()];
        let ix = &indices[b * s.out_image()..][..s.out_image()];
        for (grow, irow) in g.chunks_exact(c).zip(ix.chunks_exact(c)) {
            for (ch, (gv, iv)) in grow.iter().zip(irow).enumerate() {
                // A negative index marks a window without pixels (see the forward pass).
                if let Ok(at) = usize::try_from(*iv) {
                    dx[at * c + ch] += gv;
                }
            }
        }
    });
    dx
}

/// Divisor of the average at window `(oh, ow)`: the whole window when padding counts
/// (`count_include_pad`), else the positions inside the image.
fn avg_divisor(s: &Pool2dShape, oh: usize, ow: usize, count_include_pad: bool) -> f32 {
    if count_include_pad {
        (s.kernel[0] * s.kernel[1]) as f32
    } else {
        s.window(oh, ow).count().max(1) as f32
    }
}

/// NHWC average pooling.
pub fn avg_pool2d_forward(s: &Pool2dShape, x: &[f32], count_include_pad: bool) -> Vec<f32> {
    assert_eq!(x.len(), s.batch * s.in_image(), "input of {s:?}");
    let c = s.channels;
    let out = zeroed_chunks(s.output_len(), s.out_image(), |b, out| {
        let image = &x[b * s.in_image()..][..s.in_image()];
        for oh in 0..s.out_h {
            for ow in 0..s.out_w {
                let acc = &mut out[(oh * s.out_w + ow) * c..][..c];
                for (ih, iw) in s.window(oh, ow) {
                    for (a, v) in acc.iter_mut().zip(&image[(ih * s.in_w + iw) * c..][..c]) {
                        *a += v;
                    }
                }
                let d = avg_divisor(s, oh, ow, count_include_pad);
                for a in acc.iter_mut() {
                    *a /= d;
                }
            }
        }
    });
    out
}

/// Gradient of [`avg_pool2d_forward`].
pub fn avg_pool2d_backward(s: &Pool2dShape, grad: &[f32], count_include_pad: bool) -> Vec<f32> {
    assert_eq!(grad.len(), s.output_len(), "output gradient of {s:?}");
    let c = s.channels;
    let dx = zeroed_chunks(s.batch * s.in_image(), s.in_image(), |b, dx| {
        let g = &grad[b * s.out_image()..][..s.out_image()];
        for oh in 0..s.out_h {
            for ow in 0..s.out_w {
                let d = avg_divisor(s, oh, ow, count_include_pad);
                let grow = &g[(oh * s.out_w + ow) * c..][..c];
                for (ih, iw) in s.window(oh, ow) {
                    for (dv, gv) in dx[(ih * s.in_w + iw) * c..][..c].iter_mut().zip(grow) {
                        *dv += gv / d;
                    }
                }
            }
        }
    });
    dx
}

/// The shape of a causal multi-head self-attention: `qkv` is `[batch, seq, 3 * width]`
/// (queries, keys, values, each `heads` heads of `width / heads` side by side), the output
/// `[batch, seq, width]`, the probabilities `[batch, heads, seq, seq]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Width of the output (and of each of queries, keys and values).
    pub width: usize,
    /// Heads (dividing `width`).
    pub heads: usize,
}

impl AttentionShape {
    fn head(&self) -> usize {
        self.width / self.heads
    }
}

/// Causal attention: per sequence and head, `P = softmax(Q Kᵀ / sqrt(d) + bias)` over the
/// keys at or before each query (the later ones get probability 0), output `P V`; the bias is
/// 0, or ALiBi's `-slope * (i - j)` with `alibi` (one slope per head). Returns the output
/// and `P`. One sequence per chunk (its rows of every buffer are contiguous), the heads in
/// order inside it, so results do not depend on the thread count.
pub fn attention_forward(
    s: &AttentionShape,
    qkv: &[f32],
    alibi: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let (t, w, h) = (s.seq, s.width, s.heads);
    let dh = s.head();
    assert_eq!(
        qkv.len(),
        s.batch * t * 3 * w,
        "queries, keys, values of {s:?}"
    );
    if let Some(slopes) = alibi {
        assert_eq!(slopes.len(), h, "ALiBi slopes for {h} heads");
    }
    let scale = 1.0 / (dh as f32).sqrt();
    zeroed_chunks2(
        (s.batch * t * w, t * w),
        (s.batch * h * t * t, h * t * t),
        |b, out, probs| {
            let x = &qkv[b * t * 3 * w..][..t * 3 * w];
            for head in 0..h {
                let p = &mut probs[head * t * t..][..t * t];
                let slope = alibi.map(|a| a[head]);
                // Queries in blocks of rows: a block's scores and output need only the keys
                // up to its last query (the causal mask's zeros are never computed).
                for (r0, r1) in causal_blocks(t) {
                    let rows = r1 - r0;
                    let q = MatRef::new(&x[r0 * 3 * w + head * dh..], rows, dh, 3 * w, 1);
                    let k_t = MatRef::new(&x[w + head * dh..], dh, r1, 1, 3 * w);
                    matmul(MatMut::new(&mut p[r0 * t..], rows, r1, t, 1), q, k_t);
                    pulp::Arch::new().dispatch(SoftmaxRows {
                        block: &mut p[r0 * t..r1 * t],
                        t,
                        first: r0,
                        scale,
                        slope,
                    });
                    let v = MatRef::new(&x[2 * w + head * dh..], r1, dh, 3 * w, 1);
                    matmul(
                        MatMut::new(&mut out[r0 * w + head * dh..], rows, dh, w, 1),
                        MatRef::new(&p[r0 * t..], rows, r1, t, 1),
                        v,
                    );
                }
            }
        },
    )
}

/// Lanes of the partial sums and maxima of [`lane_sum`], [`lane_max`] and [`lane_dot`]: an
/// AVX-512 register of `f32`.
const LANES: usize = 16;

/// `acc`'s lanes combined pairwise with `op`: lanes `l` and `l + 8`, then `l + 4`, `l + 2`,
/// `l + 1`; a fixed order, so a reduction's result depends on its input alone.
#[inline(always)]
fn fold_lanes(mut acc: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] = op(acc[l], acc[l + w]);
        }
    }
    acc[0]
}

/// The sum of `v`: element `j` goes to lane `j % 16`, then the lanes are folded
/// ([`fold_lanes`]). Sixteen independent sums vectorise where one running sum cannot (each
/// addition would wait for the last); a different order of additions than a left-to-right
/// sum, rounded differently.
#[inline(always)]
pub(crate) fn lane_sum(v: &[f32]) -> f32 {
    lane_sum_zip(v, v, |x, _| x)
}

/// `Σ a[j] b[j]` over the shorter of the two, in lanes as [`lane_sum`].
#[inline(always)]
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    lane_sum_zip(a, b, |x, y| x * y)
}

/// `Σ f(a[j], b[j])` over the shorter of the two, in lanes as [`lane_sum`].
#[inline(always)]
pub(crate) fn lane_sum_zip(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += f(x[l], y[l]);
        }
    }
    for ((s, x), y) in acc.iter_mut().zip(ca.remainder()).zip(cb.remainder()) {
        *s += f(*x, *y);
    }
    fold_lanes(acc, |a, b| a + b)
}

/// The largest value of `v` (`f32::max`: a NaN is passed over), minus infinity for none.
#[inline(always)]
pub(crate) fn lane_max(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    for (a, x) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(*x);
    }
    fold_lanes(acc, f32::max)
}

/// A block of an attention's score rows, turned into probabilities in place: row `r` of
/// `block` (rows of `t` scores) is query `first + r`, whose keys `0..=first + r` get the
/// softmax of their scaled scores (plus ALiBi's biases with a slope) and the later keys 0.
/// Run through `pulp`, so that its loops are compiled for the CPU's widest vector
/// extension (the workspace builds for plain x86-64).
struct SoftmaxRows<'a> {
    block: &'a mut [f32],
    t: usize,
    first: usize,
    scale: f32,
    slope: Option<f32>,
}

impl pulp::WithSimd for SoftmaxRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let (scale, slope) = (self.scale, self.slope);
        for (i, row) in (self.first..).zip(self.block.chunks_exact_mut(self.t)) {
            let (seen, later) = row.split_at_mut(i + 1);
            // Scaled scores plus the biases, in place.
            match slope {
                None => seen.iter_mut().for_each(|v| *v *= scale),
                Some(m) => seen
                    .iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = *v * scale + alibi_bias(m, i, j)),
            }
            let max = lane_max(seen);
            seen.iter_mut().for_each(|v| *v = exp_f32(*v - max));
            let sum = lane_sum(seen);
            seen.iter_mut().for_each(|v| *v /= sum);
            later.fill(0.0);
        }
    }
}

/// The softmax's backward pass on a block of rows, in place: row `r` of `block` holds `dP`
/// of query `first + r` and becomes `dS = P ∘ (dP - rowsum(P ∘ dP)) * scale` over the keys
/// `0..=first + r`, 0 after; `probs` holds the same rows of `P`. Through `pulp` as
/// [`SoftmaxRows`].
struct SoftmaxGradRows<'a> {
    block: &'a mut [f32],
    probs: &'a [f32],
    t: usize,
    first: usize,
    scale: f32,
}

impl pulp::WithSimd for SoftmaxGradRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let scale = self.scale;
        let rows = self
            .block
            .chunks_exact_mut(self.t)
            .zip(self.probs.chunks_exact(self.t));
        for (i, (row, p_row)) in (self.first..).zip(rows) {
            let (seen, later) = row.split_at_mut(i + 1);
            let dot = lane_dot(seen, p_row);
            for (d, p) in seen.iter_mut().zip(p_row) {
                *d = p * (*d - dot) * scale;
            }
            later.fill(0.0);
        }
    }
}

/// Rows per block of a causal attention's queries (and, in the backward pass, keys): with
/// 128 positions, four blocks compute 10 of the 16 blocks of scores, 62.5% of the full
/// products.
const CAUSAL_BLOCK: usize = 32;

/// The `[start, end)` blocks of [`CAUSAL_BLOCK`] positions that cover `0..t`, in order.
fn causal_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(CAUSAL_BLOCK)
        .map(move |r0| (r0, (r0 + CAUSAL_BLOCK).min(t)))
}

/// The gradient of [`attention_forward`] with respect to `qkv`, for the output gradient
/// `grad` and the forward's probabilities `probs`: `dV = Pᵀ dO`, `dP = dO Vᵀ`,
/// `dS = P ∘ (dP - rowsum(P ∘ dP)) / sqrt(d)`, `dQ = dS K`, `dK = dSᵀ Q`.
pub fn attention_backward(
    s: &AttentionShape,
    qkv: &[f32],
    probs: &[f32],
    grad: &[f32],
) -> Vec<f32> {
    let (t, w, h) = (s.seq, s.width, s.heads);
    let dh = s.head();
    assert_eq!(
        qkv.len(),
        s.batch * t * 3 * w,
        "queries, keys, values of {s:?}"
    );
    assert_eq!(probs.len(), s.batch * h * t * t, "probabilities of {s:?}");
    assert_eq!(grad.len(), s.batch * t * w, "output gradient of {s:?}");
    let scale = 1.0 / (dh as f32).sqrt();
    zeroed_chunks(s.batch * t * 3 * w, t * 3 * w, |b, dx| {
        let x = &qkv[b * t * 3 * w..][..t * 3 * w];
        let g = &grad[b * t * w..][..t * w];
        let mut ds = vec![0.0f32; t * t];
        for head in 0..h {
            let p = &probs[(b * h + head) * t * t..][..t * t];
            // Per block of queries `r0..r1`: dP = dO Vᵀ over the keys up to `r1`, then dS in
            // place (zero after each row's query), then dQ = dS K over the same keys.
            for (r0, r1) in causal_blocks(t) {
                let rows = r1 - r0;
                let d_out = MatRef::new(&g[r0 * w + head * dh..], rows, dh, w, 1);
                let v_t = MatRef::new(&x[2 * w + head * dh..], dh, r1, 1, 3 * w);
                matmul(MatMut::new(&mut ds[r0 * t..], rows, r1, t, 1), d_out, v_t);
                pulp::Arch::new().dispatch(SoftmaxGradRows {
                    block: &mut ds[r0 * t..r1 * t],
                    probs: &p[r0 * t..r1 * t],
                    t,
                    first: r0,
                    scale,
                });
                let k = MatRef::new(&x[w + head * dh..], r1, dh, 3 * w, 1);
                matmul(
                    MatMut::new(&mut dx[r0 * 3 * w + head * dh..], rows, dh, 3 * w, 1),
                    MatRef::new(&ds[r0 * t..], rows, r1, t, 1),
                    k,
                );
            }
            // Per block of keys `c0..c1`, over the queries from `c0` on (the earlier ones do
            // not see these keys): dV = Pᵀ dO and dK = dSᵀ Q.
            for (c0, c1) in causal_blocks(t) {
                let (keys, queries) = (c1 - c0, t - c0);
                matmul(
                    MatMut::new(
                        &mut dx[c0 * 3 * w + 2 * w + head * dh..],
                        keys,
                        dh,
                        3 * w,
                        1,
                    ),
                    MatRef::new(&p[c0 * t + c0..], keys, queries, 1, t),
                    MatRef::new(&g[c0 * w + head * dh..], queries, dh, w, 1),
                );
                matmul(
                    MatMut::new(&mut dx[c0 * 3 * w + w + head * dh..], keys, dh, 3 * w, 1),
                    MatRef::new(&ds[c0 * t + c0..], keys, queries, 1, t),
                    MatRef::new(&x[c0 * 3 * w + head * dh..], queries, dh, 3 * w, 1),
                );
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_chunks_hands_every_chunk_zeroed_to_one_call() {
        for (len, chunk) in [
            (0, 4),
            (1, 4),
            (4, 4),
            (10, 4),
            (10, 1),
            (10, 0),
            (1 << 15, 1000),
        ] {
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let out = zeroed_chunks(len, chunk, |ci, c: &mut [f32]| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                assert!(c.iter().all(|v| v.to_bits() == 0), "chunk {ci} not zeroed");
                for (k, v) in c.iter_mut().enumerate() {
                    *v += (ci * chunk.max(1) + k) as f32;
                }
            });
            let expect: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(out, expect, "len {len}, chunk {chunk}");
            assert_eq!(calls.into_inner(), len.div_ceil(chunk.max(1)));
        }
        let (a, b) = zeroed_chunks2((7, 3), (21, 9), |ci, a: &mut [f32], b: &mut [i32]| {
            a.fill(ci as f32 + 1.0);
            b[0] = ci as i32;
        });
        assert_eq!(a, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0]);
        assert_eq!((b[0], b[9], b[18], b[1], b.len()), (0, 1, 2, 0, 21));
    }

    /// The tiled transpose against its definition, on shapes around its tiles and chunks
    /// (16 input rows, 32 output rows), and into a buffer holding old values.
    #[test]
    fn transpose_matches_its_definition() {
        for (rows, cols) in [(0, 3), (3, 0), (1, 1), (1, 40), (40, 1), (17, 33), (33, 70)] {
            let x: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
            let want: Vec<f32> = (0..cols)
                .flat_map(|c| (0..rows).map(move |r| (r, c)))
                .map(|(r, c)| x[r * cols + c])
                .collect();
            assert_eq!(transpose(&x, rows, cols), want, "{rows}x{cols}");
            let mut out = vec![f32::NAN; rows * cols];
            transpose_into(&x, rows, cols, &mut out);
            assert_eq!(out, want, "{rows}x{cols} into a used buffer");
        }
    }

    /// `add_into` adds each part in turn: exact on integer values, against a plain loop.
    #[test]
    fn add_into_adds_every_part() {
        let parts: Vec<Vec<f32>> = (0..5)
            .map(|p| (0..37).map(|i| (i * 3 + p * 7) as f32).collect())
            .collect();
        let mut sum = vec![1.0f32; 37];
        add_into(&mut sum, parts.iter().map(Vec::as_slice));
        for (i, v) in sum.iter().enumerate() {
            let want = 1.0 + (0..5).map(|p| (i * 3 + p * 7) as f32).sum::<f32>();
            assert_eq!(*v, want, "element {i}");
        }
    }

    /// The bias gradient summed with the input gradient's chunks (the fused path, for a
    /// layer whose input needs a gradient) and alone by columns (`column_sums`) agree with
    /// the sums in `f64`, for a small batch (16-row chunks) and a large one (128 rows, and
    /// the weight gradient cut by rows); the other gradients are the same either way.
    #[test]
    fn a_dense_layers_bias_gradient_is_the_same_sum_with_or_without_the_input_gradient() {
        for (rows, d_in, d_out) in [(45, 7, 19), (1100, 9, 70)] {
            let s = DenseShape { rows, d_in, d_out };
            let x: Vec<f32> = (0..rows * d_in)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 40.0)
                .collect();
            let w: Vec<f32> = (0..d_in * d_out)
                .map(|i| ((i * 17 % 23) as f32 - 11.0) / 9.0)
                .collect();
            let g: Vec<f32> = (0..rows * d_out)
                .map(|i| ((i * 13 % 59) as f32 - 29.0) / 30.0)
                .collect();
            let fused = dense_backward(&s, &x, &w, None, &g, [true; 3]);
            let alone = dense_backward(&s, &x, &w, None, &g, [false, false, true]);
            let weight = dense_backward(&s, &x, &w, None, &g, [false, true, false]);
            let input = dense_backward(&s, &x, &w, None, &g, [true, false, false]);
            assert_eq!(fused.x, input.x, "{s:?}: input gradient");
            assert_eq!(fused.weight, weight.weight, "{s:?}: weight gradient");
            for (bias, how) in [
                (fused.bias.unwrap(), "fused"),
                (alone.bias.unwrap(), "alone"),
            ] {
                for (j, b) in bias.iter().enumerate() {
                    let want: f64 = (0..rows).map(|r| f64::from(g[r * d_out + j])).sum();
                    assert!(
                        (f64::from(*b) - want).abs() < 1e-4,
                        "{s:?} {how}: bias {j}: {b} vs {want}"
                    );
                }
            }
        }
    }

    /// The lane reductions against plain loops: exact on integer values (every order of
    /// additions gives the same sum), for lengths around the 16 lanes; `lane_max` passes
    /// NaN over and gives minus infinity for nothing; a 0.1-step sum within rounding of f64's.
    #[test]
    fn lane_reductions_match_plain_loops() {
        for n in [0, 1, 15, 16, 17, 33, 128, 129] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 3) % 5) as f32).collect();
            assert_eq!(lane_sum(&a), a.iter().sum::<f32>(), "sum of {n}");
            let dot: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert_eq!(lane_dot(&a, &b), dot, "dot of {n}");
            let max = a.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(lane_max(&a), max, "max of {n}");
        }
        assert_eq!(lane_dot(&[1.0, 2.0, 3.0], &[4.0, 5.0]), 14.0);
        assert_eq!(lane_max(&[f32::NAN, -3.0, f32::NAN]), -3.0);
        let tenths: Vec<f32> = (0..1000).map(|i| i as f32 * 0.1).collect();
        let want: f64 = tenths.iter().map(|&v| v as f64).sum();
        assert!((lane_sum(&tenths) as f64 - want).abs() < 1e-5 * want);
    }

    #[test]
    #[should_panic(expected = "different numbers of chunks")]
    fn zeroed_chunks2_refuses_buffers_cut_differently() {
        zeroed_chunks2((8, 4), (8, 2), |_, _: &mut [f32], _: &mut [f32]| {});
    }

    /// Direct definition of a convolution, in f64, NHWC.
    fn naive_conv(s: &Conv2dShape, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
        let (cg, og) = (s.cg(), s.og());
        let [kh, kw] = s.kernel;
        let mut out = vec![0.0f64; s.output_len()];
        for n in 0..s.batch {
            for oh in 0..s.out_h {
                for ow in 0..s.out_w {
                    for o in 0..s.out_c {
                        let g = o / og;
                        let mut acc = b.map_or(0.0, |b| b[o] as f64);
                        for c in 0..cg {
                            for i in 0..kh {
                                for j in 0..kw {
                                    if let Some((ih, iw)) = tap(s, oh, ow, i, j) {
                                        let xv = x[((n * s.in_h + ih) * s.in_w + iw) * s.in_c
                                            + g * cg
                                            + c];
                                        let wv = w[((o * cg + c) * kh + i) * kw + j];
                                        acc += xv as f64 * wv as f64;
                                    }
                                }
                            }
                        }
                        out[((n * s.out_h + oh) * s.out_w + ow) * s.out_c + o] = acc;
                    }
                }
            }
        }
        out
    }

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.7311).sin()).collect()
    }

    #[test]
    fn convolution_matches_its_definition_with_groups_stride_padding_and_dilation() {
        let s = Conv2dShape::new([3, 9, 8, 4], [6, 2, 3, 2], [2, 1], [1, 1], [1, 2], 2);
        let x = values(3 * 9 * 8 * 4, 0.5);
        let w = values(6 * 2 * 3 * 2, 1.5);
        let b = values(6, 2.5);
        let got = conv2d_forward(&s, &x, &w, Some(&b), false);
        let want = naive_conv(&s, &x, &w, Some(&b));
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
        }
        let relu = conv2d_forward(&s, &x, &w, Some(&b), true);
        for (r, w) in relu.iter().zip(&want) {
            assert!((*r as f64 - w.max(0.0)).abs() < 1e-5);
        }
    }

    #[test]
    fn convolution_matches_its_definition_with_padding_wider_than_the_kernel() {
        let s = Conv2dShape::new([2, 4, 4, 2], [2, 1, 2, 1], [2, 1], [2, 1], [1, 1], 2);
        let x = values(2 * 4 * 4 * 2, 0.25);
        let w = values(2 * 2, 1.25);
        let b = values(2, 2.25);
        let got = conv2d_forward(&s, &x, &w, Some(&b), false);
        let want = naive_conv(&s, &x, &w, Some(&b));
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    #[test]
    fn weight_packing_round_trips() {
        let s = Conv2dShape::new([1, 5, 5, 6], [4, 3, 3, 2], [1, 1], [0, 0], [1, 1], 2);
        let w = values(4 * 3 * 3 * 2, 0.0);
        assert_eq!(unpack_weight(&s, &pack_weight(&s, &w)), w);
    }

    #[test]
    fn max_pool_takes_the_first_maximum_and_propagates_nan() {
        // One 2x2 image, one channel: window of the whole image.
        let s = Pool2dShape::new([1, 2, 2, 1], [2, 2], [2, 2], [0, 0], [1, 1]);
        let (out, idx) = max_pool2d_forward(&s, &[1.0, 3.0, 3.0, 2.0]);
        assert_eq!((out, idx), (vec![3.0], vec![1]));
        let (out, idx) = max_pool2d_forward(&s, &[1.0, f32::NAN, 3.0, 2.0]);
        assert!(out[0].is_nan());
        assert_eq!(idx, vec![1]);
        let dx = max_pool2d_backward(&s, &[1], &[5.0]);
        assert_eq!(dx, vec![0.0, 5.0, 0.0, 0.0]);
    }

    #[test]
    fn max_pool_over_many_channels_matches_a_direct_search() {
        // 11 channels: one vector group of eight and a remainder of three; minus infinity,
        // ties and NaN in some channels; a padded 3x3 window with stride 2.
        let (h, w, c) = (5, 4, 11);
        let mut x: Vec<f32> = (0..h * w * c)
            .map(|i| ((i * 37) % 23) as f32 - 11.0)
            .collect();
        for i in (0..x.len()).step_by(c) {
            x[i] = f32::NEG_INFINITY;
            x[i + 1] = 2.0;
        }
        x[3 * c + 9] = f32::NAN;
        let s = Pool2dShape::new([1, h, w, c], [3, 3], [2, 2], [1, 1], [1, 1]);
        let (out, idx) = max_pool2d_forward(&s, &x);
        for oh in 0..s.out_h {
            for ow in 0..s.out_w {
                for ch in 0..c {
                    let (mut best, mut arg) = (None::<f32>, 0);
                    for (ih, iw) in s.window(oh, ow) {
                        let v = x[(ih * w + iw) * c + ch];
                        let better = match best {
                            None => true,
                            Some(b) => v > b || (v.is_nan() && !b.is_nan()),
                        };
                        if better {
                            (best, arg) = (Some(v), ih * w + iw);
                        }
                    }
                    let at = (oh * s.out_w + ow) * c + ch;
                    let best = best.unwrap();
                    assert!(
                        out[at] == best || (out[at].is_nan() && best.is_nan()),
                        "{at}"
                    );
                    assert_eq!(idx[at], arg as i32, "index at {at}");
                }
            }
        }
        // The channel of minus infinities takes each window's first pixel.
        assert_eq!(out[0], f32::NEG_INFINITY);
        assert_eq!(idx[0], 0);
    }

    #[test]
    fn a_dilated_window_without_pixels_is_minus_infinity_and_passes_no_gradient() {
        // Two columns, window 2 with dilation 3 and padding 1: the taps fall at -1 and 2.
        let s = Pool2dShape::new([1, 1, 2, 1], [1, 2], [1, 1], [0, 1], [1, 3]);
        assert_eq!((s.out_h, s.out_w), (1, 1));
        let (out, idx) = max_pool2d_forward(&s, &[4.0, 5.0]);
        assert_eq!((out, idx.clone()), (vec![f32::NEG_INFINITY], vec![-1]));
        assert_eq!(max_pool2d_backward(&s, &idx, &[1.0]), vec![0.0, 0.0]);
    }

    #[test]
    fn average_pool_counts_padding_only_when_asked() {
        // A 2x2 image of ones, 2x2 windows with stride 2 and padding 1: the corner windows
        // hold one pixel and three padded zeros.
        let s = Pool2dShape::new([1, 2, 2, 1], [2, 2], [2, 2], [1, 1], [1, 1]);
        assert_eq!(avg_pool2d_forward(&s, &[1.0; 4], true), vec![0.25; 4]);
        assert_eq!(avg_pool2d_forward(&s, &[1.0; 4], false), vec![1.0; 4]);
        assert_eq!(avg_pool2d_backward(&s, &[1.0; 4], true), vec![0.25; 4]);
    }
}
