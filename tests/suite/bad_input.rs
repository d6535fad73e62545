//! Bad configurations are typed errors that name the value; none panics.

use crate::support::*;
use flashover::core::data::Sampler;
use flashover::core::error::CoreError;
use flashover::core::time::Time;
use flashover_examples::{mnist_loaders, MnistRun};

fn build_err(run: &MnistRun, lr: f64) -> CoreError {
    match run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .and_then(|b| b.lr(lr).build())
    {
        Ok(_) => panic!("expected an error for {run:?}"),
        Err(e) => e,
    }
}

#[test]
fn microbatch_size_zero_or_above_the_batch_is_rejected() {
    for (size, batch) in [(0, 8), (9, 8)] {
        let mut run = short_run(16, batch, 10, "1ep");
        run.microbatch_size = Some(size);
        let err = build_err(&run, 0.01);
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                CoreError::InvalidConfig {
                    name: "microbatch_size",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("value {size} ")) && msg.contains("from 1 to the batch size (8)"),
            "{msg}"
        );
    }
}

/// `--microbatch-size` takes a positive number or `auto`; anything else is refused by name.
#[test]
fn the_example_takes_auto_or_a_positive_microbatch_size() {
    let args = |size| {
        [
            "--train-limit",
            "64",
            "--test-limit",
            "50",
            "--batch-size",
            "32",
            "--warmup",
            "0ba",
            "--max-duration",
            "2ba",
            "--microbatch-size",
            size,
        ]
    };
    let out = run_mnist(&args("auto"));
    assert!(out.status.success(), "{}", out.stderr);
    for bad in ["0", "half"] {
        let out = run_mnist(&args(bad));
        assert!(!out.status.success());
        assert!(
            out.stderr.contains(&format!(
                "invalid microbatch size \"{bad}\": expected a positive number of samples or `auto`"
            )),
            "{}",
            out.stderr
        );
    }
}

#[test]
fn zero_batch_size_and_empty_datasets_are_rejected() {
    let err = Sampler::new(10, 0, true, 0).unwrap_err();
    assert!(err.to_string().contains("batch_size"), "{err}");
    let run = short_run(0, 8, 10, "1ep");
    let err = mnist_loaders::<TB>(&run.data, &device())
        .err()
        .expect("an empty training set is an error");
    assert!(
        matches!(err, CoreError::EmptyDataset { ref name } if name == "train"),
        "{err}"
    );
    let run = short_run(16, 0, 10, "1ep");
    let err = build_err(&run, 0.01);
    assert!(err.to_string().contains("batch_size"), "{err}");
}

#[test]
fn bad_durations_and_rates_are_rejected() {
    let mut run = short_run(16, 8, 10, "1ep");
    run.max_duration = Time::Duration(0.5);
    let err = build_err(&run, 0.01);
    assert!(
        err.to_string().contains("max_duration") && err.to_string().contains("0.5dur"),
        "{err}"
    );
    let run = short_run(16, 8, 10, "1ep");
    let err = build_err(&run, f64::NAN);
    assert!(
        err.to_string().contains("lr") && err.to_string().contains("NaN"),
        "{err}"
    );
    for s in ["3 parsecs", "1.5ep", "-2ba", "ep"] {
        let err = s.parse::<Time>().unwrap_err();
        assert!(
            matches!(err, CoreError::InvalidTime { .. }) && err.to_string().contains(s),
            "{err}"
        );
    }
}

#[test]
fn a_missing_data_directory_names_the_files_it_looked_for() {
    let mut run = short_run(16, 8, 10, "1ep");
    run.data.dir = std::env::temp_dir().join("flashover-no-such-dir");
    let err = mnist_loaders::<TB>(&run.data, &device())
        .err()
        .expect("missing data is an error");
    let msg = err.to_string();
    assert!(
        msg.contains("flashover-no-such-dir") && msg.contains("train-images-idx3-ubyte.gz"),
        "{msg}"
    );
}
