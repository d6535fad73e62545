"""Reads an experiment back from an MLflow tracking server with MLflow's own Python client
and prints, as JSON, every run: its id, name, status, params, tags, every metric's full
history as [step, value, timestamp] triples, and every artifact's path with its size.
Usage: read_mlflow.py <tracking uri> <experiment name>. Exits with 3 when the `mlflow`
package is not installed (`pip install mlflow`)."""
import json
import math
import sys

try:
    from mlflow.tracking import MlflowClient
except ImportError as e:
    print(f"mlflow is not installed: {e}", file=sys.stderr)
    sys.exit(3)

uri, name = sys.argv[1], sys.argv[2]
client = MlflowClient(tracking_uri=uri)
experiment = client.get_experiment_by_name(name)
out = {"experiment_id": experiment.experiment_id if experiment else None, "runs": []}


def number(v):
    # JSON has no NaN or infinity: as strings, the way Flashover's JSONL writes them.
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def artifacts(run_id, path=None):
    for a in client.list_artifacts(run_id, path):
        if a.is_dir:
            yield from artifacts(run_id, a.path)
        else:
            yield [a.path, a.file_size]


if experiment is not None:
    for run in client.search_runs([experiment.experiment_id], max_results=1000):
        metrics = {}
        for key in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, key)
            metrics[key] = [[m.step, number(m.value), m.timestamp] for m in history]
        out["runs"].append(
            {
                "run_id": run.info.run_id,
                "name": run.info.run_name,
                "status": run.info.status,
                "artifact_uri": run.info.artifact_uri,
                "params": run.data.params,
                "tags": run.data.tags,
                "metrics": metrics,
                "artifacts": list(artifacts(run.info.run_id)),
            }
        )
json.dump(out, sys.stdout)
