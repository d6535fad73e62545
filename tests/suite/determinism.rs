//! Same configuration and seed: bit-identical weights. Another seed: different weights.

use crate::support::*;
use flashover::core::params::params_sha256;
use flashover_examples::MnistRun;

fn digest(run: &MnistRun) -> String {
    params_sha256::<TB, _>(trained(run).model())
}

#[test]
fn same_seed_gives_identical_weights_and_another_seed_does_not() {
    let mut run = short_run(256, 32, 50, "2ep");
    run.microbatch_size = Some(16);
    let a = digest(&run);
    let b = digest(&run);
    assert_eq!(a, b, "two runs with the same seed differ");
    // Loading on the training thread instead of a prefetch thread changes nothing.
    let mut inline = run.clone();
    inline.data.prefetch = 0;
    assert_eq!(digest(&inline), a);
    let mut other = run.clone();
    other.seed = 8;
    assert_ne!(digest(&other), a, "a different seed gave the same weights");
}
