//! `cargo xtask build` and `test`: per backend, each non-default one in its own target
//! directory; on a GPU backend the test runs a representative subset (`GPU_SUBSET`).

use anyhow::Result;

use crate::backend::Backend;
use crate::process::*;

pub(crate) fn build(backend: Backend, check: bool) -> Result<()> {
    let verb = if check { "check" } else { "build" };
    for b in backend.each() {
        let mut args = strings(&[verb, "--release", "--all-targets"]);
        args.extend(b.cargo_args(&["--workspace"], &[]));
        cargo(&args)?;
    }
    Ok(())
}

/// The cross-crate tests a GPU backend runs by default: one or two of each kind whose result
/// depends on the backend's kernels and device buffers (numerics, determinism, exact
/// resumption, every algorithm's tensor code in float32 and in a half type, device memory,
/// the collective's device-host round trip, through two ranks in threads). The rest of the
/// suite checks host code (files, parsing, locks, messages, timing, the source tree,
/// asynchronous checkpoint writes, the MPI transport, which moves host buffers whatever the
/// backend) that is the same on every backend, or repeats these on more configurations
/// (every algorithm under mixed float16, whose casts and loss scaling the precision tests
/// here cover; the optimizers other than AdamW, which are Burn's tensor ops that AdamW
/// uses); `cargo xtask test --backend wgpu --all` runs everything. On Mesa's software Vulkan
/// the subset took 8 minutes of an Ice Lake machine's two cores and over 40 of a 2-core EPYC
/// without AVX-512 (2026-12-07), so CI type-checks the GPU backends instead of running it.
///
/// Every test here runs inside the test process: none starts an example program, so the
/// subset builds the test binary alone (each example program monomorphises the trainer for
/// the backend anew, minutes of CI's two cores), and without MPI. The exact-resumption tests
/// are in-process forms (`resume::in_process::resumes`) of the flex suite's example-program
/// ones: the stateful algorithms' (float32 with five algorithms' state, a superset of the
/// plain run's `resume::in_process::mid_epoch`) and each mixed precision's.
pub(crate) const GPU_SUBSET: &[&str] = &[
    "determinism::",
    "microbatch::",
    "events::short_run_trace_matches_the_snapshot",
    "trainer::eval_and_predict_report_sane_values",
    "trainer::non_finite_batches_can_be_skipped_and_counted",
    "algorithms::every_algorithm_trains_and_changes_the_run",
    "algorithms::the_stateful_algorithms_together_resume_in_one_process",
    "seams::two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch",
    "seams::sam_steps_alike_on_every_rank",
    "observe::device_memory_is_read_where_the_backend_reports_it",
    "observe::nan_monitor_names_the_batch_of_a_bad_loss_or_gradient",
    "precision::every_precision_trains_the_cnn_about_as_well_as_float32",
    "precision::mixed_precision_keeps_float32_weights_and_pure_precision_the_half_type",
    "precision::an_overflow_skips_the_step_lowers_the_scale_and_leaves_the_weights",
    "precision::the_scale_doubles_after_each_interval_of_clean_steps",
    "precision::runs_in_each_kind_of_precision_resume_bit_for_bit_in_one_process",
    "precision::every_algorithm_trains_in_pure_half_precision",
    "precision::sams_second_pass_gradients_are_unscaled_under_loss_scaling",
    "precision::an_overflow_in_sams_second_pass_skips_the_step_and_lowers_the_scale",
];

pub(crate) fn test(backend: Backend, all: bool) -> Result<()> {
    for b in backend.each() {
        if b == Backend::Flex {
            cargo(&strings(&["test", "--release", "--workspace"]))?;
            continue;
        }
        // The same packages and features as `build`, so a build followed by a test compiles
        // nothing twice (the subset below leaves MPI out).
        if all {
            let mut args = strings(&["test", "--release"]);
            args.extend(b.cargo_args(&[], &[]));
            // Everything but the long accuracy run and the SIGKILL test, whose kill times
            // are tuned to the CPU backend's speed.
            args.extend(strings(&[
                "--",
                "--skip",
                "accuracy::",
                "--skip",
                "crash::",
            ]));
            cargo(&args)?;
            continue;
        }
        // The subset needs only the cross-crate test binary, without MPI: the example
        // programs and the unit tests of the examples would double the build on a GPU
        // backend, where each program monomorphises the trainer anew.
        let mut args = strings(&["test", "--release", "--test", "tests"]);
        args.extend(b.cargo_args_mpi(&[], &[], false));
        args.push("--".into());
        args.extend(strings(GPU_SUBSET));
        cargo(&args)?;
    }
    Ok(())
}
