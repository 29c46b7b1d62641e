"""Text safe end to end (issue 32): NUL and lone surrogates are refused at submit in every string of a job
or sweep spec, naming the field, from YAML (the CLI) and over the API; and what the service records
(reasons, log lines, stderr tails, event payloads) is stored escaped alike on SQLite and PostgreSQL, so a
program that writes NUL to stderr still FAILS with its exit code and stderr as the reason."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from control_plane_fakes import ScriptedRuntime, eventually, start_api_server
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import EXIT_INVALID, main
from trainctl.service.store import EVENT_LOG, EVENT_STATE, JobNotFound, JobStore, SweepNotFound, TrialState
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto
from trainctl.wire.errors import field_violations
from trainctl.wire.sweep_convert import sweep_to_proto
from trainctl.workers.command.output import RankOutput, rank_log_path
from trainctl.workers.events import EventKind, JobState

STDERR_REASON = "rank 0 exited with code 3; last stderr lines:\nboom\x00nul"
STORED_REASON = "rank 0 exited with code 3; last stderr lines:\nboom\\x00nul"


def command_job(name: str, **command: object) -> TrainingJob:
    """A one-rank CPU command job running `python` with `command`'s fields, never restarted."""
    spec = {"command": {"program": "python", **command}, "resources": {"gpus": 1, "device": "cpu"},
            "scheduling": {"max_restarts": 0}}
    return TrainingJob.model_validate({"metadata": {"name": name}, "spec": spec})


def refused_fields(call: Callable[[], object]) -> list[str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "\x00" not in info.value.details()
    return [v.field for v in field_violations(info.value)]


# ---- refused at submit -----------------------------------------------------------------------------------


def test_nul_in_any_string_is_refused_over_the_api_naming_the_field(tmp_path: Path) -> None:
    api = start_api_server(tmp_path, ScriptedRuntime())
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    program = job_to_proto(command_job("nul"))
    program.spec.command.program = "pyth\x00on"
    args = job_to_proto(command_job("nul", args=["-c", "pass"]))
    args.spec.command.args.values[0] = "-\x00c"
    env = job_to_proto(command_job("nul", env={"X": "1"}))
    env.spec.command.env["X"] = "1\x00"
    text_field = job_to_proto(small_job("nul", data={"format": "jsonl"}))
    text_field.spec.data.text_field = "te\x00xt"
    sweep = sweep_to_proto(parse_sweep_object({"metadata": {"name": "s"}, "spec": {
        "template": {"training": {"steps": 10, "global_batch_size": 4}, "resources": {"device": "cpu"}},
        "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2}],
    }}))
    sweep.spec.parameters[0].path = "spec.training.l\x00r"
    try:
        for message, field in ((program, "spec.command.program"), (args, "spec.command.args[0]"),
                               (env, "spec.command.env.X"), (text_field, "spec.data.text_field")):
            assert refused_fields(lambda m=message: stub.CreateJob(pb.CreateJobRequest(job=m))) == [field]
        assert refused_fields(lambda: stub.CreateSweep(pb.CreateSweepRequest(sweep=sweep))) == ["spec.parameters[0].path"]
        assert not api.scheduler.store.list_jobs() and not api.scheduler.store.list_sweeps()
    finally:
        api.stop()


@pytest.mark.parametrize(("yaml_value", "field"), [
    ('program: "py\\0thon"', "spec.command.program"),
    ('program: python\n    args: ["-c", "a\\x00"]', "spec.command.args[1]"),
    ('program: python\n    env: {X: "\\0"}', "spec.command.env.X"),
    ('program: "python\\uDC80"', "spec.command.program"),
])
def test_nul_in_a_yaml_spec_is_refused_by_validate_submit_and_plan(
    tmp_path: Path, yaml_value: str, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"metadata:\n  name: nul\nspec:\n  command:\n    {yaml_value}\n")
    for command in (["validate", str(path)], ["--server", "127.0.0.1:9", "submit", str(path)],
                    ["--server", "127.0.0.1:9", "plan", str(path)]):
        assert main(command) == EXIT_INVALID, command
        err = capsys.readouterr().err
        assert f"{field}: contains a " in err and "trainctl cannot store one" in err, err
        assert "\x00" not in err and "Traceback" not in err


# ---- recorded escaped, alike on both stores ------------------------------------------------------------


def test_the_store_records_unstorable_text_escaped_alike_on_both_backends(store_location: str) -> None:
    store = JobStore(store_location)
    try:
        record, _ = store.create_job(small_job("text"))
        store.update_status(record.id, state=JobState.RUNNING, reason="ranks up")
        store.append_event(record.id, EVENT_LOG, {"level": "INFO", "message": "stderr: boom\x00nul \udc80", "rank": 0})
        failed = store.update_status(record.id, state=JobState.FAILED, reason=STDERR_REASON)
        assert failed is not None and failed.reason == STORED_REASON
        assert store.get_job(record.id).reason == STORED_REASON
        events = store.events(record.id)
        assert [e.payload["message"] for e in events if e.type == EVENT_LOG] == ["stderr: boom\\x00nul \ufffd"]
        assert events[-1].type == EVENT_STATE and events[-1].payload["reason"] == STORED_REASON
        with pytest.raises(JobNotFound):
            store.get_job("text\x00")
        assert store.events("text\x00") == []

        sweep, _ = store.create_sweep(parse_sweep_object({"metadata": {"name": "s"}, "spec": {
            "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2}],
        }}))
        trial = store.create_trial(sweep.id, 0, {"spec.command.env.X": "a\x00"}, None, reason="bad\x00job")
        assert trial is not None and (trial.params, trial.reason) == ({"spec.command.env.X": "a\\x00"}, "bad\\x00job")
        assert store.get_sweep(sweep.id).trials[0].state == TrialState.FAILED
        with pytest.raises(SweepNotFound):
            store.get_sweep("s\x00")
    finally:
        store.close()


def test_a_failure_reason_quoting_nul_reaches_the_api_on_both_stores(tmp_path: Path, store_location: str) -> None:
    """The supervisor's reason and log line, as a program writing NUL to stderr gives them, through the
    scheduler: the job FAILS at once with the reason, escaped, instead of failing its writes."""
    runtime = ScriptedRuntime()
    api = start_api_server(tmp_path, runtime, store=store_location)
    try:
        with TrainctlClient(api.target, token="") as client:
            job = client.create_job(small_job("stderr"))
            runtime.wait_started(job.id)
            runtime.state(job.id, JobState.RUNNING, "ranks up")
            runtime.logs[job.id].append(EventKind.LOG, message="stderr: boom\x00nul", rank=0)
            runtime.state(job.id, JobState.FAILED, STDERR_REASON)
            eventually(lambda: client.get_job(job.id).status.state == pb.FAILED, "the job failed", timeout=15)
            events = list(client.watch(job.id))
            final = client.get_job(job.id)
    finally:
        api.stop()
    assert final.status.reason == STORED_REASON
    assert [e.log.message for e in events if e.WhichOneof("payload") == "log" and e.log.HasField("rank")] == ["stderr: boom\\x00nul"]
    assert [e.state_change.reason for e in events if e.WhichOneof("payload") == "state_change"][-1] == STORED_REASON


def test_a_rank_forwards_and_keeps_its_stderr_escaped_and_logs_it_as_written(tmp_path: Path) -> None:
    forwarded: list[str] = []
    output = RankOutput(tmp_path, 0, forwarded.append)
    output.line("boom\x00nul", stderr=True)
    output.close()
    assert forwarded == ["stderr: boom\\x00nul"] and output.stderr_tail() == ["boom\\x00nul"]
    assert rank_log_path(tmp_path, 0).read_text(encoding="utf-8") == "stderr: boom\x00nul\n"
