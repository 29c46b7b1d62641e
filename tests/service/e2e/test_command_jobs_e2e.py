"""Command jobs through the service (issue 15), on the embedded 2-node Ray with CPU ranks and gloo:
programs nobody here wrote (a PyTorch-tutorial DDP script, also as examples/command-job.yaml ships it,
a `transformers.Trainer` script) run to
SUCCEEDED with the world size and rank order placement chose; their output streams while they run and
`trainctl logs --rank` shows one rank's lines; their `trainctl.report` calls reach the step path
(`get -o json`, eval losses included) and the Prometheus gauges. A cancelled program that ignores SIGTERM and left a `setsid`
daemon is stopped with it, and the cancel logs no error."""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path

import pytest
from process_trees import DAEMON, alive, daemon_of, gone

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import main
from trainctl.service.server import Service
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "command"


def command_job(name: str, *args: str) -> TrainingJob:
    """Two CPU ranks running ``python args`` in examples/command."""
    spec = {
        "command": {"program": "python", "args": list(args), "working_dir": str(EXAMPLES)},
        "resources": {"gpus": 2, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }
    return TrainingJob.model_validate({"metadata": {"name": name}, "spec": spec})


def exported(service: Service, gauge: str, job_id: str) -> float:
    """The value the service's Prometheus registry exports for ``gauge`` of ``job_id``."""
    collector = getattr(service.metrics, gauge)
    [value] = [s.value for family in collector.collect() for s in family.samples if s.labels.get("job_id") == job_id]
    return value


def test_pytorch_ddp_script_streams_its_logs_and_reports_its_loss(
    client: TrainctlClient, service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    created = client.create_job(command_job("ddp-tutorial", "ddp_train.py", "--steps", "8", "--step-seconds", "0.5",
                                            "--eval-interval", "4"))
    events, state_at_first_line = [], None
    for event in client.watch(created.id):
        events.append(event)
        if state_at_first_line is None and event.WhichOneof("payload") == "log" and "step 1 loss" in event.log.message:
            state_at_first_line = client.get_job(created.id).status.state
    final = client.get_job(created.id, full=True)
    assert final.status.state == pb.SUCCEEDED, final.status.reason
    assert state_at_first_line == pb.RUNNING, "the program's output streams while it runs"
    logs = [e.log for e in events if e.WhichOneof("payload") == "log" and e.log.HasField("rank")]
    assert {log.rank for log in logs if "of 2 (restart 0) starts at step 1" in log.message} == {0, 1}
    assert [m.step for m in final.metrics] == list(range(1, 9))
    printed = {int(log.message.split()[1]): float(log.message.split()[3]) for log in logs if log.message.startswith("step ")}
    assert [round(m.loss, 4) for m in final.metrics] == [printed[step] for step in range(1, 9)]
    assert final.status.steps_done == 8 and final.status.total_steps == 0
    assert exported(service, "job_loss", created.id) == pytest.approx(final.metrics[-1].loss)
    assert exported(service, "job_step", created.id) == 8
    evals = {int(log.message.split()[2]): float(log.message.split()[4]) for log in logs if log.message.startswith("eval ")}
    assert [(m.step, round(m.eval_loss, 4)) for m in final.metrics if m.HasField("eval_loss")] == [
        (4, evals[4]), (8, evals[8])]  # issue 37: trainctl.report(eval_loss=...) on the steps that evaluated
    assert exported(service, "job_eval_loss", created.id) == pytest.approx(final.metrics[-1].eval_loss)
    assert sorted(p.node for p in final.status.placement) == ["node-0", "node-1"]

    capsys.readouterr()
    assert main(["--server", service.target, "logs", created.id, "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 INFO: rank 1 of 2 (restart 0) starts at step 1" in out
    assert "rank 0 " not in out and "step 1 loss" not in out  # rank 0's lines only
    assert main(["--server", service.target, "get", created.id, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["status"]["steps_done"] == 8
    assert document["status"]["last_eval_loss"] == final.metrics[-1].eval_loss
    assert [m["step"] for m in document["metrics"] if "eval_loss" in m] == [4, 8]


def test_the_command_job_example_runs_as_shipped_from_another_directory(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`trainctl submit examples/command-job.yaml --watch` as shipped: its `working_dir: command` is
    examples/command/ (relative to the spec file, not to the current directory), where ddp_train.py
    trains its 20 steps on the 2 ranks."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["--server", service.target, "submit", str(EXAMPLES.parent / "command-job.yaml"), "--watch"]) == 0
    job_id = capsys.readouterr().out.split()[1]  # "job <id> QUEUED"
    with TrainctlClient(service.target) as client:
        final = client.get_job(job_id, full=True)
    assert final.status.state == pb.SUCCEEDED, final.status.reason
    assert final.spec.command.working_dir == str(EXAMPLES)
    assert final.status.steps_done == 20 and [m.step for m in final.metrics] == list(range(1, 21))


def test_transformers_trainer_script_runs_with_ddp_and_reports_through_a_callback(
    client: TrainctlClient, service: Service
) -> None:
    created = client.create_job(command_job("hf-trainer", "hf_trainer.py", "--steps", "4"))
    events = list(client.watch(created.id))
    final = client.get_job(created.id, full=True)
    assert final.status.state == pb.SUCCEEDED, final.status.reason
    assert [m.step for m in final.metrics] == [1, 2, 3, 4]
    assert all(m.loss > 0 and m.lr > 0 and m.grad_norm > 0 for m in final.metrics)
    assert exported(service, "job_loss", created.id) == pytest.approx(final.metrics[-1].loss)
    lines = [e.log.message for e in events if e.WhichOneof("payload") == "log" and e.log.HasField("rank")]
    assert any("train_runtime" in line for line in lines), "the Trainer's own output is in the logs"
    assert {line for line in lines if line.startswith("process ")} == {
        f"process {rank} of 2 (distributed)" for rank in (0, 1)
    }, "DDP over the 2 ranks placement chose"


def test_a_cancelled_program_that_ignores_sigterm_is_stopped_with_its_daemon_and_no_error_is_logged(
    client: TrainctlClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    spec = {
        "command": {"program": sys.executable, "args": ["-c", DAEMON, str(tmp_path / "daemon"), "stay"]},
        "resources": {"gpus": 1, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }
    created = client.create_job(TrainingJob.model_validate({"metadata": {"name": "stubborn"}, "spec": spec}))
    started: list[str] = []
    for event in client.watch(created.id):
        if event.WhichOneof("payload") == "log" and event.log.message.startswith("program started"):
            started.append(event.log.message)
        if event.WhichOneof("payload") == "log" and event.log.message == "daemon started":
            break
    program = int(started[0].split("(pid ")[1].split(")")[0])
    daemon, _ = daemon_of(tmp_path / "daemon")
    assert alive(program) and alive(daemon)
    client.cancel_job(created.id)
    list(client.watch(created.id))
    assert client.get_job(created.id).status.state == pb.CANCELLED
    assert gone([program, daemon], within=1.0), "stopped (SIGKILL after the grace) before the job ended"
    for thread in [t for t in threading.enumerate() if t.name == f"cancel-{created.id}"]:
        thread.join(60)  # the scheduler's cancel call has answered
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


def test_a_program_writing_nul_to_stderr_fails_with_its_exit_code_and_stderr(client: TrainctlClient) -> None:
    """PostgreSQL's text refuses NUL: the reason and the log line are recorded escaped (both stores:
    tests/service/hostile/test_text_safety.py), so the exit code and stderr are never lost."""
    program = "import sys; sys.stderr.write('boom\\x00nul\\n'); sys.exit(3)"
    spec = {"command": {"program": sys.executable, "args": ["-c", program]}, "resources": {"gpus": 1, "device": "cpu"},
            "scheduling": {"max_restarts": 0}}
    created = client.create_job(TrainingJob.model_validate({"metadata": {"name": "nul-stderr"}, "spec": spec}))
    events = list(client.watch(created.id))
    final = client.get_job(created.id)
    assert final.status.state == pb.FAILED, final.status.reason
    assert final.status.reason.startswith("rank 0 exited with code 3; last stderr lines:\nboom\\x00nul"), final.status.reason
    assert "stderr: boom\\x00nul" in [e.log.message for e in events if e.WhichOneof("payload") == "log"]


def test_a_program_reporting_every_5_steps_gets_its_own_rates_and_no_metric_it_never_reported(
    client: TrainctlClient, service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34, point 5: step time and tokens/s from the steps and wall time between reports (within
    10 % of what the program measures itself), none for the run's first report, and lr, grad norm, peak
    memory and MFU, which it never reports, absent from `get -o json` and from the exported gauges."""
    program = Path(__file__).with_name("reporting_program.py")
    spec = {
        "command": {"program": "python", "args": [str(program), "--steps", "20", "--every", "5",
                                                  "--step-seconds", "0.1", "--tokens", "256"]},
        "resources": {"gpus": 1, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }
    created = client.create_job(TrainingJob.model_validate({"metadata": {"name": "every-5"}, "spec": spec}))
    events = list(client.watch(created.id))
    assert client.get_job(created.id).status.state == pb.SUCCEEDED, client.get_job(created.id).status.reason
    measured = {}
    for e in events:  # "measured step 10: 0.100213 s/step 2554.5 tokens/s"
        if e.WhichOneof("payload") == "log" and e.log.message.startswith("measured step "):
            words = e.log.message.split()
            measured[int(words[2].rstrip(":"))] = (float(words[3]), float(words[5]))
    assert sorted(measured) == [10, 15, 20]

    capsys.readouterr()
    assert main(["--server", service.target, "get", created.id, "-o", "json"]) == 0
    steps = json.loads(capsys.readouterr().out)["metrics"]
    assert [m["step"] for m in steps] == [5, 10, 15, 20]
    assert all(m["tokens"] == 256 for m in steps)
    assert "step_time_seconds" not in steps[0] and "tokens_per_second" not in steps[0]  # no report before it
    for m in steps[1:]:
        seconds, rate = measured[m["step"]]
        assert m["step_time_seconds"] == pytest.approx(seconds, rel=0.1), m
        assert m["tokens_per_second"] == pytest.approx(rate, rel=0.1), m
    assert not any({"lr", "grad_norm", "peak_memory_bytes", "mfu", "mfu_full_attention"} & set(m) for m in steps), steps

    assert exported(service, "job_tps", created.id) == pytest.approx(steps[-1]["tokens_per_second"])
    for gauge in ("job_lr", "job_grad_norm", "job_peak_memory", "job_mfu", "job_mfu_full_attention"):
        collector = getattr(service.metrics, gauge)
        assert not [s for f in collector.collect() for s in f.samples if s.labels.get("job_id") == created.id], gauge
