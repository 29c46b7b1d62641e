"""Priority preemption on the embedded Ray, end to end through the service: a priority-0 job that fills
the pool (2 ranks, a checkpoint every 50 steps) is preempted by a priority-10 job: it saves a checkpoint
at its next step and stops, is queued again, the high job runs and SUCCEEDS, then the low job resumes
from that checkpoint and SUCCEEDS with every step trained once and each step's loss equal to an
uninterrupted run's. The scheduler's choices are unit-tested in tests/service/capacity/test_preemption.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb

pytestmark = pytest.mark.timeout(300)

STEPS = 16


def job(name: str, gpus: int, steps: int, priority: int = 0) -> TrainingJob:
    return small_job(name, gpus=gpus, steps=steps, labels={"suite": "preemption"}, training={"lr": 0.005},
                     checkpoint={"interval_steps": 50}, scheduling={"priority": priority})


def payload(event: pb.JobEvent) -> str | None:
    return event.WhichOneof("payload")


def watch_until_step(client: TrainctlClient, job_id: str, step: int) -> tuple[Iterator[pb.JobEvent], list[pb.JobEvent]]:
    """The job's event stream, read until it reported `step`, and the events read."""
    stream, seen = client.watch(job_id), []
    for event in stream:
        seen.append(event)
        if payload(event) == "step" and event.step.step >= step:
            break
    return stream, seen


def test_a_preempted_job_checkpoints_resumes_and_trains_every_step_once(client: TrainctlClient) -> None:
    low = client.create_job(job("low", gpus=2, steps=STEPS))
    stream, seen = watch_until_step(client, low.id, 3)
    arrival = time.time()
    high = client.create_job(job("high", gpus=2, steps=3, priority=10))
    seen += list(stream)

    states = [e.state_change.to_state for e in seen if payload(e) == "state_change"]
    assert states == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.PREEMPTED, pb.QUEUED, pb.SCHEDULED, pb.RESTARTING,
                      pb.RUNNING, pb.SUCCEEDED], [e.state_change.reason for e in seen if payload(e) == "state_change"]
    reasons = [e.state_change.reason for e in seen if payload(e) == "state_change"]
    assert reasons[3] == f"preempted by job {high.id} (priority 10): checkpointing at its next step boundary"
    steps = [e.step.step for e in seen if payload(e) == "step"]
    assert steps == list(range(1, STEPS + 1)), "every step trained once: none lost, none repeated"
    first_queued_again = next(i for i, e in enumerate(seen) if payload(e) == "state_change" and i and
                              e.state_change.to_state == pb.QUEUED and e.state_change.reason.startswith("queued again"))
    stopped_at = max(e.step.step for e in seen[:first_queued_again] if payload(e) == "step")
    assert reasons[4] == f"queued again after a preemption: stopped at step {stopped_at} with a checkpoint; resumes from it when GPUs are free again"
    assert reasons[6].startswith(f"resuming after preemption 1; resuming from checkpoint step {stopped_at}")
    logs = [e.log.message for e in seen if payload(e) == "log"]
    assert any(line.endswith(f"(step {stopped_at})") and line.startswith("resumed from checkpoint") for line in logs), logs

    done_low, done_high = client.get_job(low.id, full=True), client.get_job(high.id, full=True)
    assert done_high.status.state == pb.SUCCEEDED, done_high.status.reason
    assert done_low.status.preemptions == 1 and done_low.status.preempt_time.seconds
    assert done_low.status.restarts == 1  # the resume, not counted against max_restarts (0 here)
    assert done_high.status.schedule_time.ToNanoseconds() <= done_low.status.end_time.ToNanoseconds()
    assert done_high.status.end_time.ToNanoseconds() <= done_low.status.end_time.ToNanoseconds()
    first_step = min(m.time.ToNanoseconds() for m in done_high.metrics) / 1e9
    print(f"high job: {first_step - arrival:.2f} s from its arrival to its first step (with a preemption)")

    reference = client.create_job(job("reference", gpus=2, steps=STEPS))
    for _ in client.watch(reference.id):
        pass
    uninterrupted = client.get_job(reference.id, full=True)
    assert uninterrupted.status.state == pb.SUCCEEDED, uninterrupted.status.reason
    assert [m.step for m in done_low.metrics] == [m.step for m in uninterrupted.metrics] == list(range(1, STEPS + 1))
    for resumed, expected in zip(done_low.metrics, uninterrupted.metrics, strict=True):
        assert resumed.loss == pytest.approx(expected.loss, rel=1e-5), resumed.step


SIGTERM_SAVING_PROGRAM = """
import os, signal, sys, time
from pathlib import Path
import trainctl
steps = int(sys.argv[1])
saved = Path(os.environ["TRAINCTL_CHECKPOINT_DIR"]) / "step"
rank = int(os.environ["RANK"])
start = int(saved.read_text()) if saved.exists() else 0
print(f"restart count {os.environ['TORCHELASTIC_RESTART_COUNT']}, from step {start}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
for step in range(start + 1, steps + 1):
    time.sleep(0.2)
    if rank == 0:
        trainctl.report(step=step, loss=1.0 / step)
    if stop:
        if rank == 0:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(str(step))
        sys.exit(0)
"""
"""A torchrun-style program that saves its step in $TRAINCTL_CHECKPOINT_DIR on SIGTERM and resumes from it."""


def test_a_command_job_saves_on_sigterm_is_preempted_and_resumes_from_what_it_saved(client: TrainctlClient) -> None:
    spec = {
        "command": {"program": "python", "args": ["-c", SIGTERM_SAVING_PROGRAM, str(STEPS)]},
        "resources": {"gpus": 2, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }
    program = client.create_job(TrainingJob.model_validate({"metadata": {"name": "torchrun-style"}, "spec": spec}))
    stream, seen = watch_until_step(client, program.id, 3)
    high = client.create_job(job("high-over-program", gpus=2, steps=2, priority=10))
    seen += list(stream)
    states = [e.state_change.to_state for e in seen if payload(e) == "state_change"]
    assert states == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.PREEMPTED, pb.QUEUED, pb.SCHEDULED, pb.RESTARTING,
                      pb.RUNNING, pb.SUCCEEDED]
    assert [e.step.step for e in seen if payload(e) == "step"] == list(range(1, STEPS + 1))
    lines = [e.log.message for e in seen if payload(e) == "log" and e.log.rank == 0]
    started = [line for line in lines if line.startswith("restart count")]
    assert started[0] == "restart count 0, from step 0" and started[1].startswith("restart count 1, from step "), started
    assert int(started[1].rsplit(" ", 1)[1]) >= 3, "resumed from what it saved on SIGTERM"
    assert client.get_job(high.id).status.state == pb.SUCCEEDED
    assert client.get_job(program.id).status.preemptions == 1
