//! The fuzz runner: for each named target, mutates corpus inputs for a given time, runs each
//! one under `catch_unwind` with the allocation guard watching, keeps inputs that reach an
//! outcome class not seen before, and saves every input that panics or allocates more than
//! its size could justify into `fuzz/findings/<target>/`. Deterministic for a given seed.
//!
//! ```text
//! cargo build --release --workspace      # (building this crate alone would rebuild Burn)
//! target/release/flashover-fuzz --seconds 600 idx manifest   # or: all
//! target/release/flashover-fuzz --save-corpus --seconds 60 time
//! ```
//! Exit status 1 when anything was found.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use flashover_fuzz::guard::{largest, reset_largest, Guard};
use flashover_fuzz::mutate::{mutate, Gen};
use flashover_fuzz::{corpus, name_of, target, Target, TARGETS};

#[global_allocator]
static ALLOCATOR: Guard = Guard;

/// An allocation above this many bytes for an input of at most 64 KiB is a finding.
const ALLOCATION_LIMIT: usize = 256 << 20;
/// Inputs `--save-corpus` adds to a target's corpus.
const CORPUS_KEEP: usize = 40;
/// Inputs kept to mutate from.
const MAX_POOL: usize = 4096;

struct Options {
    seconds: f64,
    seed: u64,
    save_corpus: bool,
    targets: Vec<&'static Target>,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        seconds: 60.0,
        seed: 1,
        save_corpus: false,
        targets: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => {
                let v = args.next().unwrap_or_default();
                o.seconds = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or(format!("--seconds {v:?}: expected a number of seconds > 0"))?;
            }
            "--seed" => {
                let v = args.next().unwrap_or_default();
                o.seed = v
                    .parse()
                    .map_err(|_| format!("--seed {v:?}: expected an unsigned integer"))?;
            }
            "--save-corpus" => o.save_corpus = true,
            "all" => o.targets.extend(TARGETS.iter()),
            name => o.targets.push(target(name).ok_or(format!(
                "unknown target {name:?}; targets: all, {}",
                TARGETS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
            ))?),
        }
    }
    if o.targets.is_empty() {
        return Err("name at least one target (or all)".into());
    }
    Ok(o)
}

fn findings_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("findings")
        .join(name)
}

fn save(dir: &std::path::Path, input: &[u8]) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let path = dir.join(name_of(input));
    let _ = std::fs::write(&path, input);
    path
}

fn fuzz(t: &Target, o: &Options) -> usize {
    let mut pool: Vec<Vec<u8>> = (t.seeds)();
    pool.extend(corpus(t.name).into_iter().map(|(_, b)| b));
    let first_found = pool.len();
    let mut seen = BTreeSet::new();
    for input in pool.clone() {
        seen.insert((t.run)(&input));
    }
    let mut g = Gen::new(o.seed ^ name_of(t.name.as_bytes()).len() as u64 ^ 0x5eed);
    let started = Instant::now();
    let limit = Duration::from_secs_f64(o.seconds);
    let (mut execs, mut found) = (0u64, 0usize);
    let mut new_classes = Vec::new();
    while started.elapsed() < limit {
        for _ in 0..64 {
            let base = pool[g.below(pool.len())].clone();
            let input = mutate(&base, &pool, t.dict, &mut g);
            reset_largest();
            let run = t.run;
            let result = std::panic::catch_unwind(|| run(&input));
            execs += 1;
            let big = largest();
            match result {
                Err(p) => {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    let path = save(&findings_dir(t.name), &input);
                    eprintln!(
                        "FINDING {}: panic: {msg} (input {})",
                        t.name,
                        path.display()
                    );
                    found += 1;
                }
                Ok(_) if big > ALLOCATION_LIMIT => {
                    let path = save(&findings_dir(t.name), &input);
                    eprintln!(
                        "FINDING {}: one allocation of {big} bytes for a {}-byte input (input {})",
                        t.name,
                        input.len(),
                        path.display()
                    );
                    found += 1;
                }
                Ok(class) => {
                    if seen.insert(class.clone()) {
                        new_classes.push(class);
                        // The pool stays bounded: past its size a new input replaces a
                        // random one that was found (never a seed).
                        if pool.len() < MAX_POOL {
                            pool.push(input);
                        } else {
                            let i = first_found + g.below(pool.len() - first_found);
                            pool[i] = input;
                        }
                    }
                }
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{}: {execs} executions in {secs:.0} s ({:.0}/s), {} outcome classes ({} new), {found} findings",
        t.name,
        execs as f64 / secs,
        seen.len(),
        new_classes.len()
    );
    if o.save_corpus {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(t.name);
        // A small corpus: the first inputs that reached new outcomes.
        for input in pool.iter().skip(first_found).take(CORPUS_KEEP) {
            save(&dir, input);
        }
    }
    found
}

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    // Panics are the findings: reported by the runner, not printed by the default hook.
    std::panic::set_hook(Box::new(|_| {}));
    let found: usize = o.targets.iter().map(|t| fuzz(t, &o)).sum();
    std::process::exit(i32::from(found > 0));
}
