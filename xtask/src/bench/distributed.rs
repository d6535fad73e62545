//! The bench's multi-process section: the main job on 1 and 2 processes under `mpirun`.

use anyhow::Result;

use super::*;
use crate::backend::Backend;

/// The main job on one process and on two (through mpirun, one thread each), interleaved:
/// training throughput of the whole data-parallel batch, its ratio, the share of a step
/// spent in the gradient all-reduce, and (full mode) the training seconds to 97% test
/// accuracy. `None` where mpirun is missing. Returns the JSON section and a Markdown table.
pub(crate) fn distributed_bench(
    b: Backend,
    quick: bool,
) -> Result<Option<(serde_json::Value, String)>> {
    if !have_mpirun() {
        eprintln!("mpirun not found: the multi-process rows are skipped (install OpenMPI)");
        return Ok(None);
    }
    let bin = build_mpi_example(b, "mnist")?;
    let run = |world: usize, extra: &[&str]| -> Result<serde_json::Value> {
        let mut a = strings(&["--no-progress"]);
        a.extend(strings(extra));
        if world == 1 {
            return last_json(&run_binary(b, &bin, &a)?);
        }
        let mut m = mpirun_args(world, None, &bin);
        m.extend(strings(&[
            "--processes",
            &world.to_string(),
            "--backend",
            b.name(),
        ]));
        m.extend(a);
        mpirun_summary(&m)
    };
    // Throughput: 100 batches of the default global batch (64), no evaluation inside the
    // timed fit; repetitions interleaved so that both sizes see the same machine.
    let reps = if quick { 1 } else { 5 };
    let (mut ratio, mut one, mut two, mut share, mut ms) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let s1 = run(1, &["--max-duration", "100ba"])?;
        let s2 = run(2, &["--max-duration", "100ba"])?;
        let sps = |s: &serde_json::Value| s["samples_per_second"].as_f64().unwrap_or(f64::NAN);
        one.push(sps(&s1));
        two.push(sps(&s2));
        ratio.push(sps(&s2) / sps(&s1));
        let train = s2["train_seconds"].as_f64().unwrap_or(f64::NAN);
        let reduce = s2["allreduce_seconds"].as_f64().unwrap_or(f64::NAN);
        share.push(reduce / train);
        ms.push(reduce * 1000.0 / 100.0);
    }
    let (r_med, r_min, r_max) = median_range(&mut ratio);
    let (o_med, o_min, o_max) = median_range(&mut one);
    let (t_med, t_min, t_max) = median_range(&mut two);
    let (f_med, f_min, f_max) = median_range(&mut share);
    let (m_med, m_min, m_max) = median_range(&mut ms);
    // Time to accuracy: the default run (6 epochs), evaluated about every half epoch (63 of
    // an epoch's 125 batches: epochs are whole numbers on the command line); full mode.
    let target = 0.97;
    let mut tta = serde_json::Map::new();
    if !quick {
        for world in [1usize, 2] {
            let s = run(world, &["--eval-interval", "63ba"])?;
            let seconds = s["accuracy_curve"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["value"].as_f64().unwrap_or(0.0) >= target)
                .and_then(|p| p["train_seconds"].as_f64());
            tta.insert(
                format!("world{world}"),
                serde_json::json!({"seconds_to_target": seconds, "final_accuracy": s["test_accuracy"]}),
            );
        }
    }
    let json = serde_json::json!({
        "reps": reps,
        "global_batch_size": 64,
        "world1_samples_per_second": {"median": o_med, "min": o_min, "max": o_max},
        "world2_samples_per_second": {"median": t_med, "min": t_min, "max": t_max},
        "world2_over_world1": r_med,
        "world2_over_world1_range": [r_min, r_max],
        "allreduce_fraction": f_med,
        "allreduce_fraction_range": [f_min, f_max],
        "allreduce_ms_per_step": m_med,
        "allreduce_ms_per_step_range": [m_min, m_max],
        "target_accuracy": target,
        "time_to_accuracy": tta,
    });
    let mut md = format!(
        "{reps} interleaved repetitions of 100 batches of 64 (one thread per process); median (min-max)\n\n| processes | samples/s | scaling | all-reduce ms/step | all-reduce share of a step |\n|---|---|---|---|---|\n| 1 | {o_med:.0} ({o_min:.0}-{o_max:.0}) | 1.00 | - | - |\n| 2 | {t_med:.0} ({t_min:.0}-{t_max:.0}) | {r_med:.2}x ({r_min:.2}-{r_max:.2}); efficiency {:.0}% | {m_med:.2} ({m_min:.2}-{m_max:.2}) | {:.1}% ({:.1}-{:.1}%) |\n",
        r_med / 2.0 * 100.0,
        f_med * 100.0,
        f_min * 100.0,
        f_max * 100.0
    );
    if !tta.is_empty() {
        md.push_str(&format!(
            "\nTraining seconds to {:.0}% test accuracy (default run, evaluated every half epoch):",
            target * 100.0
        ));
        for (k, v) in &tta {
            md.push_str(&format!(
                " {k}: {} s (final {});",
                v["seconds_to_target"], v["final_accuracy"]
            ));
        }
        md.push('\n');
    }
    Ok(Some((json, md)))
}
