//! `cargo test` side of fuzzing: every corpus input and built-in seed of every target runs
//! clean, then a bounded number of mutations of them (fixed seeds, so a failure reproduces),
//! all under the allocation guard.

use flashover_fuzz::guard::{largest, reset_largest, Guard};
use flashover_fuzz::mutate::{mutate, Gen};
use flashover_fuzz::{corpus, TARGETS};

#[global_allocator]
static ALLOCATOR: Guard = Guard;

/// Mutations per target in `cargo test` (the runner does millions).
const CASES: usize = 3000;
const ALLOCATION_LIMIT: usize = 256 << 20;

#[test]
fn the_corpus_and_its_mutations_run_clean() {
    for t in TARGETS {
        let mut pool: Vec<Vec<u8>> = (t.seeds)();
        let files = corpus(t.name);
        assert!(!files.is_empty(), "fuzz/corpus/{} is empty", t.name);
        pool.extend(files.into_iter().map(|(_, b)| b));
        let mut g = Gen::new(0x00c0_ffee);
        for i in 0..pool.len() + CASES {
            let input = if i < pool.len() {
                pool[i].clone()
            } else {
                mutate(&pool[g.below(pool.len())], &pool, t.dict, &mut g)
            };
            reset_largest();
            let result = std::panic::catch_unwind(|| (t.run)(&input));
            assert!(
                result.is_ok(),
                "{} panicked on input #{i} ({} bytes): {:?}",
                t.name,
                input.len(),
                String::from_utf8_lossy(&input[..input.len().min(200)])
            );
            assert!(
                largest() <= ALLOCATION_LIMIT,
                "{} allocated {} bytes at once for input #{i} ({} bytes)",
                t.name,
                largest(),
                input.len()
            );
        }
    }
}
