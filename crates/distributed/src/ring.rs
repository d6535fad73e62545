//! The ring all-reduce's plan: how a buffer is cut into one chunk per rank, and in which
//! order each step sends and receives them. Pure arithmetic, shared by the MPI transport and
//! its tests, so the summation order the crate documents is the one that runs.
//!
//! With `W` ranks and chunks `0..W`:
//! - reduce-scatter, steps `s = 0..W-1`: rank `r` sends chunk `(r - s) mod W` to rank `r+1`
//!   and receives chunk `(r - s - 1) mod W` from rank `r-1`, which it adds to its own (the
//!   received partial sum first, its own value second). After it, rank `r` holds the whole
//!   sum of chunk `(r + 1) mod W`, summed in the order `c, c+1, ..., c-1` (mod `W`) for chunk
//!   `c`.
//! - all-gather, steps `s = 0..W-1`: rank `r` sends chunk `(r + 1 - s) mod W` and receives
//!   chunk `(r - s) mod W`, which it copies. Every rank ends with the same bits.

/// The half-open element range of chunk `c` of a buffer of `len` elements cut into `parts`
/// nearly equal chunks (the first `len % parts` chunks one longer).
pub fn chunk_bounds(len: usize, parts: usize, c: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let base = len / parts;
    let extra = len % parts;
    let start = c * base + c.min(extra);
    let size = base + usize::from(c < extra);
    start..start + size
}

/// `(x - k) mod w` for ring arithmetic.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn back(x: usize, k: usize, w: usize) -> usize {
    (x + w * (k / w + 1) - k) % w
}

/// The chunks rank `rank` sends and receives at reduce-scatter step `step`.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn scatter_step(rank: usize, step: usize, world: usize) -> (usize, usize) {
    (back(rank, step, world), back(rank, step + 1, world))
}

/// The chunks rank `rank` sends and receives at all-gather step `step`.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn gather_step(rank: usize, step: usize, world: usize) -> (usize, usize) {
    (back(rank + 1, step, world), back(rank, step, world))
}

/// How many segments of at most `size` elements a chunk of `len` travels in. Every rank
/// sends and receives as many messages per step as the largest chunk (chunk 0) needs, some
/// of them empty, so the counts on both ends of a link always match.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn segments(len: usize, size: usize) -> usize {
    len.div_ceil(size.max(1))
}

/// Segment `i` (of at most `size` elements) of `chunk`; empty past its end.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn segment(
    chunk: &std::ops::Range<usize>,
    i: usize,
    size: usize,
) -> std::ops::Range<usize> {
    let start = (chunk.start + i * size).min(chunk.end);
    start..(start + size).min(chunk.end)
}

/// The pieces (index, range within it) that the buffer range `range` spans, where piece `k`
/// covers `starts[k]..starts[k + 1]`; empty pieces and an empty range give nothing. Both ends
/// of a message cut a range this way, so their messages match one for one.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn locate(
    starts: &[usize],
    range: std::ops::Range<usize>,
) -> Vec<(usize, std::ops::Range<usize>)> {
    if range.is_empty() {
        return Vec::new();
    }
    // The last piece starting at or before the range's start.
    let first = starts
        .partition_point(|&s| s <= range.start)
        .saturating_sub(1);
    let mut out = Vec::new();
    for k in first..starts.len().saturating_sub(1) {
        let (a, b) = (starts[k], starts[k + 1]);
        if a >= range.end {
            break;
        }
        let (lo, hi) = (range.start.max(a), range.end.min(b));
        if lo < hi {
            out.push((k, lo - a..hi - a));
        }
    }
    out
}

/// The ring's reduce-scatter half as the MPI transport runs it over a buffer in pieces
/// (`cuts`: the pieces' lengths, the same on every rank), each chunk in segments of `size`:
/// what each rank holds afterwards, concatenated. Used to test that cutting and segmenting
/// change no bits.
#[cfg(test)]
#[allow(clippy::needless_range_loop)]
pub(crate) fn simulate_pieces(inputs: &[Vec<f32>], cuts: &[usize], size: usize) -> Vec<Vec<f32>> {
    let w = inputs.len();
    let mut starts = vec![0];
    for c in cuts {
        starts.push(starts.last().unwrap() + c);
    }
    let len = *starts.last().unwrap();
    let mut pieces: Vec<Vec<Vec<f32>>> = inputs
        .iter()
        .map(|v| starts.windows(2).map(|s| v[s[0]..s[1]].to_vec()).collect())
        .collect();
    for step in 0..w.saturating_sub(1) {
        for i in 0..segments(chunk_bounds(len, w, 0).len(), size) {
            // Every rank's messages of this segment, as sent.
            let sent: Vec<Vec<Vec<f32>>> = (0..w)
                .map(|r| {
                    let s = segment(&chunk_bounds(len, w, scatter_step(r, step, w).0), i, size);
                    locate(&starts, s)
                        .into_iter()
                        .map(|(p, part)| pieces[r][p][part].to_vec())
                        .collect()
                })
                .collect();
            for r in 0..w {
                let left = back(r, 1, w);
                let t = segment(&chunk_bounds(len, w, scatter_step(r, step, w).1), i, size);
                let parts = locate(&starts, t);
                assert_eq!(parts.len(), sent[left].len(), "messages match one for one");
                for ((p, part), msg) in parts.into_iter().zip(&sent[left]) {
                    assert_eq!(part.len(), msg.len());
                    for (mine, theirs) in pieces[r][p][part].iter_mut().zip(msg) {
                        *mine += *theirs;
                    }
                }
            }
        }
    }
    pieces.into_iter().map(|p| p.concat()).collect()
}

/// The whole ring all-reduce run in one process over `inputs` (one buffer per rank): what
/// the MPI transport computes, step for step, used to test its plan and order.
#[cfg(test)]
#[allow(clippy::needless_range_loop)] // ranks are indices into the per-rank buffers
pub(crate) fn simulate(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let w = inputs.len();
    let len = inputs[0].len();
    let mut bufs = inputs.to_vec();
    for step in 0..w.saturating_sub(1) {
        let sent: Vec<Vec<f32>> = (0..w)
            .map(|r| bufs[r][chunk_bounds(len, w, scatter_step(r, step, w).0)].to_vec())
            .collect();
        for r in 0..w {
            let left = back(r, 1, w);
            let (_, recv) = scatter_step(r, step, w);
            assert_eq!(scatter_step(left, step, w).0, recv);
            for (mine, theirs) in bufs[r][chunk_bounds(len, w, recv)]
                .iter_mut()
                .zip(&sent[left])
            {
                // IEEE addition commutes: the order of the chunks' terms is what matters.
                *mine += *theirs;
            }
        }
    }
    for step in 0..w.saturating_sub(1) {
        let sent: Vec<Vec<f32>> = (0..w)
            .map(|r| bufs[r][chunk_bounds(len, w, gather_step(r, step, w).0)].to_vec())
            .collect();
        for r in 0..w {
            let left = back(r, 1, w);
            let (_, recv) = gather_step(r, step, w);
            assert_eq!(gather_step(left, step, w).0, recv);
            bufs[r][chunk_bounds(len, w, recv)].copy_from_slice(&sent[left]);
        }
    }
    bufs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `w` buffers of `len` values whose sum depends on the order in f32 (1e8 + 1 - 1e8 is 0
    /// or 1), the pattern shifting by `stride` along a buffer.
    fn order_sensitive(w: usize, len: usize, stride: usize) -> Vec<Vec<f32>> {
        (0..w)
            .map(|r| {
                (0..len)
                    .map(|i| {
                        let v = match (r + stride * i) % 3 {
                            0 => 1e8,
                            1 => 1.0,
                            _ => -1e8,
                        };
                        v * (1.0 + i as f32 * 0.001)
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for len in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for c in 0..parts {
                    let b = chunk_bounds(len, parts, c);
                    assert_eq!(b.start, next);
                    next = b.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn every_rank_gets_the_sum_in_the_documented_order() {
        for w in 1..6 {
            let len = 13;
            let inputs = order_sensitive(w, len, 1);
            let out = simulate(&inputs);
            for c in 0..w {
                for i in chunk_bounds(len, w, c) {
                    // Chunk c is summed starting at rank c, then c+1, ... around the ring.
                    let mut acc = inputs[c][i];
                    for k in 1..w {
                        acc += inputs[(c + k) % w][i];
                    }
                    for (r, buf) in out.iter().enumerate() {
                        assert_eq!(
                            buf[i].to_bits(),
                            acc.to_bits(),
                            "world {w} rank {r} item {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn locate_cuts_a_range_at_piece_boundaries_in_order() {
        let cuts = [3usize, 0, 5, 1, 4];
        let mut starts = vec![0];
        for c in cuts {
            starts.push(starts.last().unwrap() + c);
        }
        let len = *starts.last().unwrap();
        for a in 0..=len {
            for b in a..=len {
                let parts = locate(&starts, a..b);
                let mut at = a;
                for (p, part) in &parts {
                    assert!(!part.is_empty() && part.end <= cuts[*p]);
                    assert_eq!(starts[*p] + part.start, at, "{a}..{b}");
                    at = starts[*p] + part.end;
                }
                assert_eq!(at, b, "{a}..{b}: {parts:?}");
            }
        }
    }

    #[test]
    fn segments_cover_a_chunk_and_no_more() {
        for size in 1..6 {
            for len in 0..20 {
                let chunk = 7..7 + len;
                let n = segments(len, size);
                let mut at = chunk.start;
                for i in 0..n + 2 {
                    let s = segment(&chunk, i, size);
                    if i < n {
                        assert_eq!(s.start, at);
                        assert!(!s.is_empty() && s.len() <= size);
                        at = s.end;
                    } else {
                        assert!(s.is_empty());
                    }
                }
                assert_eq!(at, chunk.end);
            }
        }
    }

    #[test]
    fn cutting_into_pieces_and_segments_keeps_every_bit_of_the_ring() {
        for w in 1..5 {
            let len = 23;
            let inputs = order_sensitive(w, len, 2);
            let whole = simulate(&inputs);
            for (cuts, size) in [
                (vec![23], 100),
                (vec![1; 23], 1),
                (vec![5, 0, 7, 2, 9], 3),
                (vec![11, 12], 2),
                (vec![0, 23, 0], 4),
            ] {
                let out = simulate_pieces(&inputs, &cuts, size);
                for r in 0..w {
                    // Rank r holds the whole sum of chunk (r + 1) mod w.
                    for i in chunk_bounds(len, w, (r + 1) % w) {
                        assert_eq!(
                            out[r][i].to_bits(),
                            whole[r][i].to_bits(),
                            "world {w} cuts {cuts:?} segment {size} rank {r} item {i}"
                        );
                    }
                }
            }
        }
    }
}
