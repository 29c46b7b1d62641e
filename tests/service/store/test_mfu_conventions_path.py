"""Issue 31: MFU travels in both conventions wherever it is shown: `mfu` (Megatron's, causal attention
counted as half the score/value FLOPs) and `mfu_full_attention` (torchtitan's, attention unmasked). The
API and `get -o json` carry both (status and steps), the progress line and the engine's own printout show
both, trackers log both, a sweep may optimise either, and a command job reports neither."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from trainctl.cli.job_cmd import job_document
from trainctl.cli.progress import Tracker
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.launch import _progress
from trainctl.service.api.job_messages import JobMessages
from trainctl.service.store import JobStore
from trainctl.service.tracking.run import StepPoint
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import parse_sweep_object, sweep_violations
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.command.report_channel import step_report_of


def job() -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "j"}, "spec": {}})


def test_the_api_and_get_json_carry_both_conventions(tmp_path) -> None:
    store = JobStore(str(tmp_path / "data"))
    record, _ = store.create_job(job())
    message = JobMessages().message(store.get_job(record.id))
    assert not message.status.HasField("mfu") and not message.status.HasField("mfu_full_attention")
    assert job_document(message)["status"]["mfu_full_attention"] is None
    store.record_step(record.id, {"step": 1, "loss": 2.0})  # CPU: no peak, no MFU
    store.record_step(record.id, {"step": 2, "loss": 1.5, "mfu": 0.4, "mfu_full_attention": 0.42})
    message = JobMessages().message(store.get_job(record.id), store.step_metrics(record.id))
    assert (message.status.mfu, message.status.mfu_full_attention) == (0.4, 0.42)
    assert [m.HasField("mfu_full_attention") for m in message.metrics] == [False, True]
    document = job_document(message)
    assert (document["status"]["mfu"], document["status"]["mfu_full_attention"]) == (0.4, 0.42)
    assert "mfu_full_attention" not in document["metrics"][0]
    assert (document["metrics"][1]["mfu"], document["metrics"][1]["mfu_full_attention"]) == (0.4, 0.42)


def test_the_progress_line_shows_both_conventions_megatrons_first() -> None:
    tracker = Tracker(total_steps=10)
    tracker.on_step(pb.StepMetrics(step=1, loss=2.0, tokens_per_second=1000.0, mfu=0.4, mfu_full_attention=0.42), 1.0)
    assert "MFU 40.0% (full-attn 42.0%)" in tracker.line()
    tracker.on_step(pb.StepMetrics(step=2, loss=2.0, tokens_per_second=1000.0, mfu=0.4), 2.0)  # an old job's step
    assert "MFU 40.0%  ETA" in tracker.line()
    tracker.on_step(pb.StepMetrics(step=3, loss=2.0, tokens_per_second=1000.0), 3.0)
    assert "MFU n/a" in tracker.line() and "full-attn" not in tracker.line()


def test_the_engines_printout_shows_both_conventions() -> None:
    report = StepReport(step=3, loss=1.5, grad_norm=0.5, lr=1e-3, tokens=64, tokens_per_second=1e4, mfu=0.4,
                        step_time_seconds=0.1, mfu_full_attention=0.42)
    out = io.StringIO()
    with redirect_stdout(out):
        _progress(10)(report)
    assert "mfu 40.0% (full-attn 42.0%)" in out.getvalue()


def test_trackers_log_both_conventions() -> None:
    point = StepPoint.of({"step": 4, "loss": 1.0, "mfu": 0.4, "mfu_full_attention": 0.42}, 1.0)
    assert point.values == {"loss": 1.0, "mfu": 0.4, "mfu_full_attention": 0.42}


def test_a_sweep_of_built_in_jobs_may_optimise_either_convention_a_command_sweep_neither() -> None:
    def sweep(objective: str, template: dict) -> dict:
        return {"metadata": {"name": "s"}, "spec": {
            "template": template, "trials": 2, "objective": {"metric": objective, "direction": "maximize"},
            "parameters": [{"path": "spec.command.env.LR" if "command" in template else "spec.training.lr",
                            "type": "float", "low": 1e-4, "high": 1e-2}]}}

    assert sweep_violations(parse_sweep_object(sweep("mfu_full_attention", {}))) == []
    command = {"command": {"program": "python"}, "resources": {"device": "cpu"}}
    found = sweep_violations(parse_sweep_object(sweep("mfu_full_attention", command)))
    assert [v.field for v in found] == ["spec.objective.metric"]


def test_a_command_job_reports_no_mfu_in_either_convention() -> None:
    report = step_report_of({"step": 1, "loss": 2.0, "tokens": 10}, 0.5)
    assert (report.mfu, report.mfu_full_attention) == (None, None)
