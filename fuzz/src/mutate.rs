//! Input mutation: a small deterministic generator and the byte-level edits a mutation-based
//! fuzzer makes (bit flips, interesting integers, insertions, deletions, duplications, splices
//! with other corpus entries, dictionary tokens). Deterministic from its seed, so a finding is
//! reproduced by running again with the same seed and corpus.

/// SplitMix64: tiny, fast, and good enough to choose edits.
#[derive(Debug, Clone)]
pub struct Gen(u64);

impl Gen {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Gen(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` at least 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// Integers that break size arithmetic and bounds checks.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    16,
    28,
    255,
    256,
    0x7fff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MAX as u64,
    u64::MAX,
];

/// `input` after 1 to 8 random edits; `others` are corpus entries to splice from, `dict`
/// tokens to insert.
pub fn mutate(input: &[u8], others: &[Vec<u8>], dict: &[&[u8]], g: &mut Gen) -> Vec<u8> {
    let mut v = input.to_vec();
    let edits = 1 + g.below(8);
    for _ in 0..edits {
        let len = v.len();
        match g.below(10) {
            0 if len > 0 => {
                let i = g.below(len);
                v[i] ^= 1 << g.below(8);
            }
            1 if len > 0 => {
                let i = g.below(len);
                v[i] = [0u8, 0xff, 0x7f, 0x80, b'0', b'9', b'-', b'.'][g.below(8)];
            }
            2 if len >= 4 => {
                // An interesting integer, big- or little-endian, 1 to 8 bytes wide.
                let x = INTERESTING[g.below(INTERESTING.len())];
                let width = [1usize, 2, 4, 8][g.below(4)].min(len);
                let at = g.below(len - width + 1);
                let bytes = if g.below(2) == 0 {
                    x.to_be_bytes()[8 - width..].to_vec()
                } else {
                    x.to_le_bytes()[..width].to_vec()
                };
                v[at..at + width].copy_from_slice(&bytes);
            }
            3 => {
                let at = g.below(len + 1);
                let n = 1 + g.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| g.next_u64() as u8).collect();
                v.splice(at..at, bytes);
            }
            4 if len > 0 => {
                let at = g.below(len);
                let n = 1 + g.below((len - at).min(64));
                v.drain(at..at + n);
            }
            5 if len > 0 => {
                let at = g.below(len);
                let n = 1 + g.below((len - at).min(64));
                let copy = v[at..at + n].to_vec();
                let to = g.below(len + 1);
                v.splice(to..to, copy);
            }
            6 if !others.is_empty() => {
                let other = &others[g.below(others.len())];
                if !other.is_empty() {
                    let from = g.below(other.len());
                    let n = 1 + g.below(other.len() - from);
                    let at = g.below(len + 1);
                    let end = (at + n).min(len);
                    v.splice(at..end, other[from..from + n].iter().copied());
                }
            }
            7 | 8 if !dict.is_empty() => {
                let token = dict[g.below(dict.len())];
                let at = g.below(len + 1);
                if g.below(2) == 0 || len == 0 {
                    v.splice(at..at, token.iter().copied());
                } else {
                    let end = (at + token.len()).min(len);
                    v.splice(at..end, token.iter().copied());
                }
            }
            9 if len > 1 => {
                v.truncate(g.below(len));
            }
            _ => {}
        }
    }
    // Inputs stay small: the point is the parser's logic, not the machine's memory.
    v.truncate(64 << 10);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutation_is_deterministic_and_changes_inputs() {
        let input = b"6ep".to_vec();
        let a: Vec<Vec<u8>> = {
            let mut g = Gen::new(7);
            (0..100)
                .map(|_| mutate(&input, &[], &[b"tok"], &mut g))
                .collect()
        };
        let b: Vec<Vec<u8>> = {
            let mut g = Gen::new(7);
            (0..100)
                .map(|_| mutate(&input, &[], &[b"tok"], &mut g))
                .collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().filter(|m| **m != input).count() > 80);
    }
}
