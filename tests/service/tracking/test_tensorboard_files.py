"""The TensorBoard sink writes a scalar per metric per step into the run directory's `tensorboard/`, read
back by TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.tracking.run import StepPoint, TrackedRun
from trainctl.service.tracking.tensorboard_sink import TensorBoardSink


def test_every_metric_of_every_step_is_in_the_event_files(tmp_path: Path) -> None:
    run_dir = RunDirectory.of_job(tmp_path, "job-1").create()
    sink = TensorBoardSink()
    run = TrackedRun(job_id="job-1", name="job", tenant="t", run_dir=str(run_dir.root), mlflow_uri=None,
                     experiment="e", tensorboard=True)
    sink.open(run)
    steps = [StepPoint(1, 10.0, {"loss": 2.0, "lr": 0.1}), StepPoint(2, 11.0, {"loss": 1.5, "lr": 0.1, "eval_loss": 1.7})]
    for point in steps:
        sink.step("job-1", point)
    sink.end("job-1")
    reader = EventAccumulator(str(run_dir.tensorboard))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["eval_loss", "loss", "lr"]
    assert [(e.step, e.value) for e in reader.Scalars("loss")] == [(1, 2.0), (2, 1.5)]
    assert [(e.step, round(e.value, 5)) for e in reader.Scalars("eval_loss")] == [(2, 1.7)]


def test_a_job_without_tensorboard_writes_no_files(tmp_path: Path) -> None:
    run_dir = RunDirectory.of_job(tmp_path, "job-2").create()
    sink = TensorBoardSink()
    sink.open(TrackedRun(job_id="job-2", name="job", tenant="t", run_dir=str(run_dir.root), mlflow_uri=None,
                         experiment="e", tensorboard=False))
    sink.step("job-2", StepPoint(1, 10.0, {"loss": 2.0}))
    assert not run_dir.tensorboard.exists() and not sink.is_open("job-2")
