"""Experiment tracking through a real `trainctl serve` (on the module's embedded Ray) and a real MLflow
tracking server (issue 37): a job run while the MLflow server is down (not yet up on its port) still
SUCCEEDS, says the server is unreachable, and its run (parameters, tags, every step's train and eval
metrics, the run report as report.png and report.html and the steps as report.json, FINISHED) arrives
once the server is up on that port; its TensorBoard event files in the run directory hold every metric
of every step; a 2-trial sweep then logs a parent run with its trials as child runs. The server starts
once: the outage comes first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServer
from reliability.serve_process import ServeProcess, free_port
from small_jobs import small_job
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.sweep import parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(900)

STEPS = 4
TRIALS = 2
WAIT = 240.0


def wait_until(what: str, condition, timeout: float = WAIT):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)
    return value


def run_of(tracking: MlflowClient, experiment: str, tag: str, value: str):  # noqa: ANN201
    found = tracking.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = tracking.search_runs([found.experiment_id], filter_string=f"tags.`{tag}` = '{value}'")
    return runs[0] if runs else None


def test_runs_outage_tensorboard_and_sweeps(tmp_path: Path, cluster: EmbeddedRay) -> None:
    mlflow = MlflowServer(tmp_path, free_port())  # started once the job has run without it
    topology = tmp_path / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml())
    serve = ServeProcess(cluster.address, topology, tmp_path / "data", f"--mlflow-tracking-uri={mlflow.uri}")
    tracking = MlflowClient(tracking_uri=mlflow.uri)
    try:
        serve.start()
        client = TrainctlClient(serve.target)

        # a job naming a server the service does not allow is refused, naming the field
        with pytest.raises(Exception, match="spec.tracking.mlflow_tracking_uri"):
            client.create_job(small_job("elsewhere", gpus=1, steps=STEPS, tracking={"mlflow_tracking_uri": "http://127.0.0.1:1"}))

        # the tracker is down; the job still succeeds, and says so
        job = small_job("tracked", gpus=1, steps=STEPS, evaluation={"holdout_fraction": 0.2, "interval_steps": 2},
                        tracking={"tensorboard": True, "mlflow_experiment": "issue-37"})
        job_id = client.create_job(job).id
        for _ in client.watch(job_id):
            pass
        done = client.get_job(job_id, full=True)
        assert done.status.state == pb.SUCCEEDED, done.status.reason
        # the tracker's own thread writes the notice at its first failed call, which may come after the job ended
        wait_until("the notice that the tracker is unreachable", lambda: any(
            "is unreachable" in e.log.message for e in client.watch(job_id, follow=False) if e.HasField("log")))

        # up on its port: the run arrives
        mlflow.start()
        run = wait_until("the job's run to end", lambda: (
            (r := run_of(tracking, "issue-37", "trainctl.job_id", job_id)) and r.info.status == "FINISHED" and r))
        logs = [e.log.message for e in client.watch(job_id, follow=False) if e.HasField("log")]
        assert any("is back; no step was lost" in m for m in logs), logs
        assert any(f"MLflow run {run.info.run_id}" in m for m in logs), logs
        tags, params = run.data.tags, run.data.params
        assert tags["trainctl.job_id"] == job_id and tags["trainctl.tenant"] == "default"
        assert tags["trainctl.layout"] == "single rank (1 ranks)" and tags["trainctl.placement"].endswith(":1")
        assert tags["trainctl.reason"] == done.status.reason and run.info.run_name == f"tracked ({job_id})"
        assert params["spec.training.steps"] == str(STEPS) and params["spec.evaluation.holdout_fraction"] == "0.2"
        recorded = {m.step: m for m in done.metrics}
        for name in ("loss", "grad_norm", "lr", "tokens_per_second", "step_time_seconds"):
            history = tracking.get_metric_history(run.info.run_id, name)
            assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), name
        losses = {m.step: m.value for m in tracking.get_metric_history(run.info.run_id, "loss")}
        assert losses == pytest.approx({step: m.loss for step, m in recorded.items()})
        evals = {m.step: m.value for m in tracking.get_metric_history(run.info.run_id, "eval_loss")}
        assert sorted(evals) == [2, 4]
        assert sorted(a.path for a in tracking.list_artifacts(run.info.run_id)) == ["report.html", "report.json", "report.png"]
        png = Path(tracking.download_artifacts(run.info.run_id, "report.png", str(tmp_path)))
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # the run report, as `trainctl report` draws it
        page = Path(tracking.download_artifacts(run.info.run_id, "report.html", str(tmp_path))).read_text()
        assert f"tracked ({job_id})" in page and "<h2>Evaluation</h2>" in page and "data:image/png;base64," in page
        artifact = Path(tracking.download_artifacts(run.info.run_id, "report.json", str(tmp_path)))
        assert f'"job_id": "{job_id}"' in artifact.read_text() and artifact.read_text().count('"step"') == STEPS

        # TensorBoard's reader finds every metric of every step in the run directory
        reader = EventAccumulator(str(RunDirectory.of_job(serve.data_dir / "runs", job_id).tensorboard))
        reader.Reload()
        for name in ("loss", "grad_norm", "lr", "tokens_per_second", "step_time_seconds"):
            assert [e.step for e in reader.Scalars(name)] == list(range(1, STEPS + 1)), name
        assert [e.step for e in reader.Scalars("eval_loss")] == [2, 4]

        # a sweep: one parent run, its trials child runs
        sweep = client.create_sweep(parse_sweep_object({
            "metadata": {"name": "tracked-sweep"},
            "spec": {
                "template": small_job("t", gpus=1, steps=2).spec.model_dump(exclude_unset=True),
                "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2, "log": True}],
                "trials": TRIALS, "parallel_trials": 2, "algorithm": "random", "seed": 1,
            },
        }))
        for _ in client.watch_sweep(sweep.id):
            pass
        assert client.get_sweep(sweep.id).status.state == pb.SWEEP_STATE_SUCCEEDED
        parent = wait_until("the sweep's run to end", lambda: (
            (r := run_of(tracking, "trainctl/default", "trainctl.sweep_id", sweep.id)) and r.info.status == "FINISHED" and r))
        trials = wait_until("every trial's run to end", lambda: (
            len(rs := tracking.search_runs([parent.info.experiment_id],
                                            filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")) == TRIALS
            and all(r.info.status == "FINISHED" for r in rs) and rs))
        assert sorted(r.data.tags["trainctl.trial"] for r in trials) == [str(n) for n in range(TRIALS)]
        assert all(len(tracking.get_metric_history(r.info.run_id, "loss")) == 2 for r in trials)
        client.close()
    finally:
        serve.stop()
        mlflow.stop()
