//! What every example program does around `fit`, written once: the run flags' callbacks and
//! loggers ([`attach`]), the logs and the resume ([`observe`]), fitting unless the run is
//! already at its end ([`fit_unless_done`]), the final evaluation ([`final_metrics`]), and,
//! once the summary is made, the outputs that come last ([`Outputs::finish`], [`print`]).

use std::collections::BTreeMap;

use anyhow::Context;
use flashover::callbacks::{ConsoleLogger, ProgressBar, StopAt, TrainingPlot};
use flashover::checkpoint::remote::LogSync;
use flashover::checkpoint::CheckpointRestore;
use flashover::core::setup::{DeviceOf, Setup};
use flashover::core::trainer::{FitReport, Trainer, TrainerBuilder};

use crate::cli::{RunArgs, RunDefaults};

/// Adds what the run flags ask of any trainer: the console logger and, unless
/// --no-progress, the progress bar; --stop-after; the checkpoint saver; and the backend and
/// optimizer as hyperparameters.
pub fn attach<S: Setup, D: RunDefaults>(
    run: &RunArgs<D>,
    mut builder: TrainerBuilder<S>,
) -> anyhow::Result<TrainerBuilder<S>> {
    builder = builder
        .logger(ConsoleLogger::new(run.log_every))
        .hyperparameter("backend", run.backend.clone())
        .hyperparameter("optimizer", run.optimizer.name());
    if !run.no_progress {
        builder = builder.logger(ProgressBar::new());
    }
    if let Some(at) = run.stop_after {
        builder = builder.callback(StopAt::new(at));
    }
    if let Some(saver) = run.checkpoint.saver()? {
        builder = builder.callback(saver);
    }
    Ok(builder)
}

/// What is written after the run's summary: the training plot, the last upload of the logs,
/// and the MLflow run's files and end.
pub struct Outputs {
    plot: Option<TrainingPlot>,
    log_sync: Option<LogSync>,
    mlflow: Option<flashover::callbacks::MlflowRun>,
}

/// Adds the logs the flags ask for (`LogArgs::observe`, after --upload-logs brought back what
/// the log folder lacks) and the checkpoint to start from, if any. `main`: the process that
/// writes files; `resuming`: the run continues an earlier one (its logs are appended to);
/// `plot_dir`: where the plot goes (else the log folder).
pub fn observe<S: Setup, D: RunDefaults>(
    run: &RunArgs<D>,
    builder: TrainerBuilder<S>,
    device: &DeviceOf<S>,
    plot_dir: Option<&std::path::Path>,
    restore: Option<CheckpointRestore>,
    resuming: bool,
    main: bool,
) -> anyhow::Result<(TrainerBuilder<S>, Outputs)>
where
    DeviceOf<S>: 'static,
{
    let log_sync = run
        .logs
        .start_log_sync(main, run.checkpoint.save_location()?.as_ref())?;
    let mlflow = run.logs.mlflow(main, run.checkpoint.local_folder()?)?;
    let mlflow_run = mlflow.as_ref().map(|m| m.handle());
    let (mut builder, plot) = run.logs.observe(
        builder,
        run.log_every,
        device,
        plot_dir,
        resuming,
        main,
        mlflow,
    )?;
    if let Some(restore) = restore {
        builder = builder.restore(restore);
    }
    Ok((
        builder,
        Outputs {
            plot,
            log_sync,
            mlflow: mlflow_run,
        },
    ))
}

/// Fits to `max_duration`, or, for a run resumed from its final checkpoint, does nothing
/// (`None`): there is nothing left to train, only to evaluate.
pub fn fit_unless_done<S: Setup>(trainer: &mut Trainer<S>) -> anyhow::Result<Option<FitReport>> {
    if trainer.is_finished() {
        tracing::info!(at = %trainer.state().timestamp(), "max_duration already reached; evaluating only");
        return Ok(None);
    }
    Ok(Some(trainer.fit()?))
}

/// The metrics of the final weights: the last evaluation's when it saw them and `reuse`
/// allows, else a fresh evaluation.
pub fn final_metrics<S: Setup>(
    trainer: &mut Trainer<S>,
    reuse: bool,
) -> anyhow::Result<BTreeMap<String, BTreeMap<String, f64>>> {
    let state = trainer.state();
    if reuse && state.last_eval_batch() == Some(state.timestamp().batch) {
        return Ok(state.eval_metrics().clone());
    }
    Ok(trainer.eval()?)
}

impl Outputs {
    /// Draws the plot (last, so that everything before is written even if it cannot be
    /// drawn), lets the trainer and its loggers write their last lines, then uploads the
    /// logs a last time. With --mlflow, uploads the plot, the summary and the files of `out`
    /// (the final weights) to the run and ends it.
    pub fn finish<S: Setup>(
        self,
        trainer: Trainer<S>,
        summary: &serde_json::Value,
        out: Option<&std::path::Path>,
    ) -> anyhow::Result<()> {
        let drawn = self
            .plot
            .as_ref()
            .filter(|plot| plot.draw_or_warn())
            .map(|plot| plot.path().to_path_buf());
        drop(trainer);
        if let Some(run) = &self.mlflow {
            if let Some(plot) = &drawn {
                run.upload_file("training.png", plot);
            }
            run.upload_json("summary.json", summary);
            for name in ["model.safetensors"] {
                if let Some(path) = out.map(|o| o.join(name)).filter(|p| p.is_file()) {
                    run.upload_file(name, &path);
                }
            }
            let report = run.finish();
            tracing::info!(
                run = ?report.run_id,
                metrics = report.metrics_sent,
                files = report.artifacts_sent,
                ended_as = ?report.ended_as,
                "MLflow"
            );
        }
        if let Some(sync) = self.log_sync {
            sync.finish().context("--upload-logs: the final upload")?;
        }
        Ok(())
    }
}

/// Prints `text` (if any) and the summary line on stdout; a closed stdout is reported (and
/// the exit status says so), not a panic.
pub fn print(text: Option<&str>, summary: &serde_json::Value) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Some(text) = text {
        writeln!(stdout, "{text}").context("writing the generated text to stdout")?;
    }
    writeln!(stdout, "{summary}")
        .and_then(|_| stdout.flush())
        .context("writing the summary to stdout")
}
