//! Tokenizers for the language-model example: the character tokenizer (one token per
//! distinct byte of the training text) and a byte-level BPE (byte-pair encoding, Sennrich,
//! Haddow and Birch, 2016, on bytes as GPT-2 does: the 256 byte values are the first tokens,
//! so any text encodes), trained on the training split, and [`Tokenizer`], either of them with
//! the file format saved beside checkpoints.
//!
//! **BPE training.** The text is cut into pieces (a run of letters, of digits, of other
//! visible bytes, each with at most one leading space, or a run of whitespace; merges never
//! cross a piece, as in GPT-2); then, until the vocabulary has `vocab_size` tokens, the most
//! frequent adjacent pair of tokens over all pieces becomes a new token. Ties go to the pair
//! with the smallest ids, and a pair seen fewer than twice is never merged. **Encoding**
//! applies the merges to each piece in the order they were learned (the lowest-ranked pair
//! present first), as GPT-2 does.
//!
//! Written here rather than taken from the `tokenizers` crate: that crate pulls in a C regex
//! library and a parallel trainer, while this one needs a few lines of pre-tokenization, a
//! trainer whose result is defined to the tie (the vocabulary must come out the same on every
//! machine, since a checkpoint is refused with any other), and a saved form this program
//! reads back and compares.

use std::collections::HashMap;
use std::path::Path;

use flashover::core::error::CoreError;
use flashover::core::Result;
use serde::{Deserialize, Serialize};

/// A character (byte) tokenizer: one token per distinct byte of the text it was fitted on,
/// ids in byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    /// The distinct bytes, sorted; a token id indexes this.
    pub vocab: Vec<u8>,
}

impl CharTokenizer {
    /// The tokenizer of `text`'s distinct bytes.
    pub fn fit(text: &[u8]) -> Self {
        let mut seen = [false; 256];
        text.iter().for_each(|&b| seen[b as usize] = true);
        Self {
            vocab: (0..=255u8).filter(|&b| seen[b as usize]).collect(),
        }
    }

    /// `text` as token ids; the first byte outside the vocabulary is an error naming it and
    /// its offset.
    pub fn encode(&self, text: &[u8]) -> std::result::Result<Vec<u16>, String> {
        let mut id = [u16::MAX; 256];
        self.vocab
            .iter()
            .enumerate()
            .for_each(|(i, &b)| id[b as usize] = i as u16);
        text.iter()
            .enumerate()
            .map(|(at, &b)| match id[b as usize] {
                u16::MAX => Err(format!(
                    "byte {b:#04x} ({:?}) at offset {at} is not in the tokenizer's {} characters",
                    b as char,
                    self.vocab.len()
                )),
                t => Ok(t),
            })
            .collect()
    }

    /// Token ids back to text (ids outside the vocabulary become `?`).
    pub fn decode(&self, tokens: &[u16]) -> String {
        tokens
            .iter()
            .map(|&t| self.vocab.get(t as usize).map_or('?', |&b| b as char))
            .collect()
    }
}

/// A byte-level BPE tokenizer: the 256 bytes, then one token per merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpeTokenizer {
    /// The merges in the order learned: merge `i` makes token `256 + i` from the pair.
    pub merges: Vec<(u16, u16)>,
    /// Each token's bytes.
    bytes: Vec<Vec<u8>>,
    /// Each merged pair's rank.
    ranks: HashMap<(u16, u16), usize>,
}

/// How a byte starts or continues a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(b: u8) -> Class {
    if b.is_ascii_alphabetic() || b >= 0x80 {
        Class::Letter
    } else if b.is_ascii_digit() {
        Class::Digit
    } else if b.is_ascii_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// `text` cut into pieces (see the module docs), in order; their concatenation is `text`.
pub fn pieces(text: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let n = text.len();
    while start < n {
        let mut end = start;
        // One leading space joins the run after it, unless more whitespace follows.
        let lead = text[start] == b' ' && start + 1 < n && class(text[start + 1]) != Class::Space;
        if lead {
            end += 1;
        }
        let c = class(text[end]);
        end += 1;
        while end < n && class(text[end]) == c {
            // A run of whitespace stops before a space that leads the next word.
            if c == Class::Space
                && text[end] == b' '
                && end + 1 < n
                && class(text[end + 1]) != Class::Space
            {
                break;
            }
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

impl BpeTokenizer {
    /// The tokenizer of `merges` (each pair's tokens must exist before it). Errors name the
    /// first merge that refers to a token not yet made.
    pub fn from_merges(merges: Vec<(u16, u16)>) -> std::result::Result<Self, String> {
        let mut bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut ranks = HashMap::new();
        for (i, &(a, b)) in merges.iter().enumerate() {
            let known = bytes.len();
            if a as usize >= known || b as usize >= known {
                return Err(format!(
                    "merge {i} ({a}, {b}) uses a token that is not among the {known} made before it"
                ));
            }
            let mut joined = bytes[a as usize].clone();
            joined.extend_from_slice(&bytes[b as usize]);
            bytes.push(joined);
            ranks.insert((a, b), i);
        }
        if bytes.len() > u16::MAX as usize {
            return Err(format!("{} tokens do not fit 16-bit ids", bytes.len()));
        }
        Ok(Self {
            merges,
            bytes,
            ranks,
        })
    }

    /// Learns merges on `text` until there are `vocab_size` tokens (at least 256), or until
    /// no pair occurs twice.
    pub fn train(text: &[u8], vocab_size: usize) -> std::result::Result<Self, String> {
        if !(256..=u16::MAX as usize).contains(&vocab_size) {
            return Err(format!(
                "a byte-level BPE vocabulary of {vocab_size} tokens: expected 256 (the bytes) to 65535"
            ));
        }
        let mut counts: HashMap<&[u8], u64> = HashMap::new();
        for p in pieces(text) {
            *counts.entry(p).or_default() += 1;
        }
        let mut words: Vec<(Vec<u16>, u64)> = counts
            .into_iter()
            .map(|(p, c)| (p.iter().map(|&b| b as u16).collect(), c))
            .collect();
        words.sort();
        Self::from_merges(learn_merges(words, vocab_size - 256))
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// The bytes of `token`.
    pub fn token_bytes(&self, token: u16) -> &[u8] {
        &self.bytes[token as usize]
    }

    /// `text` as tokens (every text encodes).
    pub fn encode(&self, text: &[u8]) -> Vec<u16> {
        let mut cache: HashMap<&[u8], Vec<u16>> = HashMap::new();
        let mut out = Vec::with_capacity(text.len() / 2);
        for p in pieces(text) {
            let tokens = cache.entry(p).or_insert_with(|| self.encode_piece(p));
            out.extend_from_slice(tokens);
        }
        out
    }

    fn encode_piece(&self, piece: &[u8]) -> Vec<u16> {
        let mut w: Vec<u16> = piece.iter().map(|&b| b as u16).collect();
        loop {
            let best = w
                .windows(2)
                .filter_map(|p| self.ranks.get(&(p[0], p[1])).map(|&r| (r, (p[0], p[1]))))
                .min();
            let Some((rank, pair)) = best else { break };
            merge_in(&mut w, pair, (256 + rank) as u16);
        }
        w
    }

    /// Tokens back to text (ids outside the vocabulary become `?`; invalid UTF-8 is
    /// replaced).
    pub fn decode(&self, tokens: &[u16]) -> String {
        let mut bytes = Vec::new();
        for &t in tokens {
            match self.bytes.get(t as usize) {
                Some(b) => bytes.extend_from_slice(b),
                None => bytes.push(b'?'),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Replaces every occurrence of `pair` in `w` (left to right) by `id`.
fn merge_in(w: &mut Vec<u16>, pair: (u16, u16), id: u16) {
    let mut out = Vec::with_capacity(w.len());
    let mut i = 0;
    while i < w.len() {
        if i + 1 < w.len() && (w[i], w[i + 1]) == pair {
            out.push(id);
            i += 2;
        } else {
            out.push(w[i]);
            i += 1;
        }
    }
    *w = out;
}

/// Up to `wanted` merges learned on `words` (each piece's tokens with its count), in order:
/// the most frequent adjacent pair (the smallest ids on a tie) while one occurs at least
/// twice. Incremental, as BPE trainers are: the pair counts are kept up to date by
/// re-counting only the words a merge changed (found through an index of the words each pair
/// occurs in), and the most frequent pair comes off a heap whose stale entries (a count that
/// has changed since) are skipped. Recounting every pair of every word after each merge
/// took minutes for a 28,000-token vocabulary, with nothing shown.
fn learn_merges(mut words: Vec<(Vec<u16>, u64)>, wanted: usize) -> Vec<(u16, u16)> {
    use std::cmp::Reverse;
    use std::collections::{BTreeSet, BinaryHeap};
    type Pair = (u16, u16);
    let mut counts: HashMap<Pair, u64> = HashMap::new();
    let mut holders: HashMap<Pair, BTreeSet<usize>> = HashMap::new();
    for (i, (w, c)) in words.iter().enumerate() {
        for p in w.windows(2) {
            *counts.entry((p[0], p[1])).or_default() += c;
            holders.entry((p[0], p[1])).or_default().insert(i);
        }
    }
    // Max-heap on (count, smallest pair first).
    let mut heap: BinaryHeap<(u64, Reverse<Pair>)> =
        counts.iter().map(|(&p, &c)| (c, Reverse(p))).collect();
    let mut merges = Vec::new();
    while merges.len() < wanted {
        let Some((count, Reverse(pair))) = heap.pop() else {
            break;
        };
        if counts.get(&pair).copied().unwrap_or(0) != count {
            continue; // stale: the pair's count changed after this entry was pushed
        }
        if count < 2 {
            break;
        }
        let id = (256 + merges.len()) as u16;
        merges.push(pair);
        let mut touched: BTreeSet<Pair> = BTreeSet::new();
        for i in holders.remove(&pair).unwrap_or_default() {
            let (w, c) = &mut words[i];
            let before = w.clone();
            merge_in(w, pair, id);
            if *w == before {
                continue;
            }
            for p in before.windows(2) {
                let key = (p[0], p[1]);
                if let Some(n) = counts.get_mut(&key) {
                    *n -= *c;
                }
                touched.insert(key);
            }
            for p in w.windows(2) {
                let key = (p[0], p[1]);
                *counts.entry(key).or_default() += *c;
                holders.entry(key).or_default().insert(i);
                touched.insert(key);
            }
        }
        for key in touched {
            match counts.get(&key).copied() {
                Some(0) | None => {
                    counts.remove(&key);
                }
                Some(n) => heap.push((n, Reverse(key))),
            }
        }
    }
    merges
}

/// The example's tokenizer, either kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per distinct byte of the training text.
    Char(CharTokenizer),
    /// Byte-level BPE trained on the training text.
    Bpe(BpeTokenizer),
}

/// The saved form of a [`Tokenizer`] (`tokenizer.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Saved {
    Char { vocab: Vec<u8> },
    Bpe { merges: Vec<(u16, u16)> },
}

/// The name of the tokenizer file beside a run's checkpoints.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

impl Tokenizer {
    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(t) => t.vocab.len(),
            Tokenizer::Bpe(t) => t.vocab_size(),
        }
    }

    /// `text` as tokens; with the character tokenizer a byte it does not know is an error
    /// naming it and its offset.
    pub fn encode(&self, text: &[u8]) -> std::result::Result<Vec<u16>, String> {
        match self {
            Tokenizer::Char(t) => t.encode(text),
            Tokenizer::Bpe(t) => Ok(t.encode(text)),
        }
    }

    /// Tokens back to text.
    pub fn decode(&self, tokens: &[u16]) -> String {
        match self {
            Tokenizer::Char(t) => t.decode(tokens),
            Tokenizer::Bpe(t) => t.decode(tokens),
        }
    }

    /// Bytes of text `token` stands for.
    pub fn token_len(&self, token: u16) -> usize {
        match self {
            Tokenizer::Char(_) => 1,
            Tokenizer::Bpe(t) => t.token_bytes(token).len(),
        }
    }

    /// A short description: kind and size.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Char(t) => format!("char ({} tokens)", t.vocab.len()),
            Tokenizer::Bpe(t) => format!("bpe ({} tokens)", t.vocab_size()),
        }
    }

    fn saved(&self) -> Saved {
        match self {
            Tokenizer::Char(t) => Saved::Char {
                vocab: t.vocab.clone(),
            },
            Tokenizer::Bpe(t) => Saved::Bpe {
                merges: t.merges.clone(),
            },
        }
    }

    /// The saved form, as JSON.
    pub fn to_json(&self) -> String {
        // Invariant: vectors of integers always serialise.
        serde_json::to_string(&self.saved()).expect("a tokenizer serialises")
    }

    /// Reads a saved tokenizer; a malformed file is an error naming it.
    pub fn read(path: &Path) -> Result<Self> {
        let malformed = |reason: String| CoreError::MalformedData {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let saved: Saved = serde_json::from_str(&text)
            .map_err(|e| malformed(format!("not a saved tokenizer: {e}")))?;
        Ok(match saved {
            Saved::Char { vocab } => Tokenizer::Char(CharTokenizer { vocab }),
            Saved::Bpe { merges } => {
                Tokenizer::Bpe(BpeTokenizer::from_merges(merges).map_err(malformed)?)
            }
        })
    }

    /// Keeps this tokenizer with the checkpoints in `folder`: writes `tokenizer.json` there
    /// if the folder has none, and otherwise refuses to go on when the one there differs
    /// (its checkpoints hold a model of another vocabulary), naming both.
    pub fn keep_beside(&self, folder: &Path) -> Result<()> {
        let path = folder.join(TOKENIZER_FILE);
        if path.exists() {
            return self.check_against(&path);
        }
        std::fs::create_dir_all(folder).map_err(|source| CoreError::Io {
            path: folder.to_path_buf(),
            source,
        })?;
        flashover::checkpoint::write_atomic(&path, self.to_json().as_bytes()).map_err(|e| {
            CoreError::External {
                component: "tokenizer".into(),
                source: Box::new(e),
            }
        })
    }

    /// An error naming both tokenizers unless the one saved at `path` is this one.
    pub fn check_against(&self, path: &Path) -> Result<()> {
        let saved = Self::read(path)?;
        if &saved == self {
            return Ok(());
        }
        Err(CoreError::MalformedData {
            path: path.to_path_buf(),
            reason: format!(
                "the checkpoints beside it were trained with the {} tokenizer, and this run's is the {} one (another --tokenizer, --bpe-vocab or corpus): use the same, or another folder",
                saved.describe(),
                self.describe()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_and_keep_one_leading_space() {
        let text = b"ROMEO. Nay,  gentle 42 Romeo!\n\nAy";
        let p = pieces(text);
        assert_eq!(p.concat(), text);
        let s: Vec<&str> = p.iter().map(|x| std::str::from_utf8(x).unwrap()).collect();
        assert_eq!(
            s,
            ["ROMEO", ".", " Nay", ",", " ", " gentle", " 42", " Romeo", "!", "\n\n", "Ay"]
        );
    }

    #[test]
    fn training_merges_the_most_frequent_pair_first_with_ties_by_id() {
        // "ab" occurs 3 times, "bc" twice: ab first, then (ab, c) twice.
        let t = BpeTokenizer::train(b"abc abc abc", 258).unwrap();
        assert_eq!(t.merges, [(b'a' as u16, b'b' as u16), (256, b'c' as u16)]);
        assert_eq!(t.token_bytes(257), b"abc");
        // Nothing occurs twice: no merge, whatever the size asked.
        assert!(BpeTokenizer::train(b"xyz", 300).unwrap().merges.is_empty());
        assert!(BpeTokenizer::train(b"x", 100).unwrap_err().contains("256"));
    }

    /// The definition, written the slow way: recount every pair after each merge.
    fn naive_merges(text: &[u8], vocab_size: usize) -> Vec<(u16, u16)> {
        let mut counts: HashMap<&[u8], u64> = HashMap::new();
        for p in pieces(text) {
            *counts.entry(p).or_default() += 1;
        }
        let mut words: Vec<(Vec<u16>, u64)> = counts
            .into_iter()
            .map(|(p, c)| (p.iter().map(|&b| b as u16).collect(), c))
            .collect();
        let mut merges = Vec::new();
        while 256 + merges.len() < vocab_size {
            let mut pairs: HashMap<(u16, u16), u64> = HashMap::new();
            for (w, c) in &words {
                for pair in w.windows(2) {
                    *pairs.entry((pair[0], pair[1])).or_default() += c;
                }
            }
            let best = pairs
                .into_iter()
                .max_by(|(pa, ca), (pb, cb)| ca.cmp(cb).then(pb.cmp(pa)));
            let Some((pair, count)) = best else { break };
            if count < 2 {
                break;
            }
            let id = (256 + merges.len()) as u16;
            merges.push(pair);
            for (w, _) in &mut words {
                merge_in(w, pair, id);
            }
        }
        merges
    }

    #[test]
    fn incremental_training_learns_the_definitions_merges() {
        let text =
            crate::shakespeare::read_text(&crate::shakespeare::bundled_shakespeare()).unwrap();
        // Runs of one byte (overlapping pairs), ties, and a real text.
        for (sample, vocab) in [
            (&b"aaaa aaa aa a bbbb abab"[..], 300),
            (&b"the cat the hat the bat"[..], 262),
            (&text[..60_000], 700),
        ] {
            let fast = BpeTokenizer::train(sample, vocab).unwrap();
            assert_eq!(fast.merges, naive_merges(sample, vocab), "{vocab}");
        }
    }

    #[test]
    fn encoding_round_trips_and_shortens_the_text() {
        let text =
            crate::shakespeare::read_text(&crate::shakespeare::bundled_shakespeare()).unwrap();
        let train = &text[..400_000];
        let t = BpeTokenizer::train(train, 512).unwrap();
        assert_eq!(t.vocab_size(), 512);
        let held_out = &text[1_000_000..1_050_000];
        let tokens = t.encode(held_out);
        assert_eq!(t.decode(&tokens).as_bytes(), held_out);
        let ratio = held_out.len() as f64 / tokens.len() as f64;
        // 1.90 measured: 256 merges learned on 400 kB.
        assert!(ratio > 1.7, "{ratio} bytes per token");
        // Any bytes encode, even ones the training text never had.
        let odd = [0u8, 255, 7, b'a'];
        assert_eq!(
            t.decode(&t.encode(&odd)).as_bytes(),
            String::from_utf8_lossy(&odd).as_bytes()
        );
        // Trained again, the same merges.
        assert_eq!(BpeTokenizer::train(train, 512).unwrap(), t);
    }

    #[test]
    fn saved_tokenizers_read_back_and_a_different_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        // "at", "he", "the", " the"; then no pair occurs twice: 260 tokens of the 262 asked.
        let bpe = Tokenizer::Bpe(BpeTokenizer::train(b"the cat the hat the bat", 262).unwrap());
        assert_eq!(bpe.vocab_size(), 260);
        bpe.keep_beside(dir.path()).unwrap();
        let path = dir.path().join(TOKENIZER_FILE);
        assert_eq!(Tokenizer::read(&path).unwrap(), bpe);
        bpe.keep_beside(dir.path()).unwrap();
        let chars = Tokenizer::Char(CharTokenizer::fit(b"the cat"));
        let e = chars.keep_beside(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("bpe (260 tokens)") && e.contains("char (6 tokens)"),
            "{e}"
        );
        std::fs::write(&path, r#"{"kind":"bpe","merges":[[300,1]]}"#).unwrap();
        let e = Tokenizer::read(&path).unwrap_err().to_string();
        assert!(e.contains("merge 0") && e.contains("tokenizer.json"), "{e}");
    }
}
