"""Command jobs through the service (issue 15), on the embedded 2-node Ray with CPU ranks and gloo:
programs nobody here wrote (a PyTorch-tutorial DDP script, a `transformers.Trainer` script) run to
SUCCEEDED with the world size and rank order placement chose; their output streams while they run and
`trainctl logs --rank` shows one rank's lines; their `trainctl.report` calls reach the step path
(`get -o json`) and the Prometheus gauges. A cancelled program that ignores SIGTERM and left a `setsid`
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

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "command"


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
    created = client.create_job(command_job("ddp-tutorial", "ddp_train.py", "--steps", "8", "--step-seconds", "0.5"))
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
    assert sorted(p.node for p in final.status.placement) == ["node-0", "node-1"]

    capsys.readouterr()
    assert main(["--server", service.target, "logs", created.id, "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 INFO: rank 1 of 2 (restart 0) starts at step 1" in out
    assert "rank 0 " not in out and "step 1 loss" not in out  # rank 0's lines only
    assert main(["--server", service.target, "get", created.id, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["status"]["steps_done"] == 8


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
    tests/service/test_text_safety.py), so the exit code and stderr are never lost."""
    program = "import sys; sys.stderr.write('boom\\x00nul\\n'); sys.exit(3)"
    spec = {"command": {"program": sys.executable, "args": ["-c", program]}, "resources": {"gpus": 1, "device": "cpu"},
            "scheduling": {"max_restarts": 0}}
    created = client.create_job(TrainingJob.model_validate({"metadata": {"name": "nul-stderr"}, "spec": spec}))
    events = list(client.watch(created.id))
    final = client.get_job(created.id)
    assert final.status.state == pb.FAILED, final.status.reason
    assert final.status.reason.startswith("rank 0 exited with code 3; last stderr lines:\nboom\\x00nul"), final.status.reason
    assert "stderr: boom\\x00nul" in [e.log.message for e in events if e.WhichOneof("payload") == "log"]
