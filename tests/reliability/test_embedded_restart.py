"""A default `trainctl serve` (its own embedded Ray, which stops with it) stopped while a job runs past a
checkpoint, once by SIGTERM and once by SIGKILL: each start on the same --data-dir relaunches the job
from its newest complete checkpoint, recorded as a restart that says why; the job SUCCEEDS with every
step's loss equal to an uninterrupted run's, and no process of any of the services is left.

One job lives through both stops (each service start costs seconds of Ray start-up, so they share it).
The decisions themselves are unit-tested in tests/service/scheduling/test_relaunch.py."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_support import kind
from process_trees import alive, descendants, gone
from serve_process import ServeProcess
from small_jobs import restartable_job, single_process_losses

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.checkpoint.layout import complete_checkpoints
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.v1 import training_pb2 as pb

pytestmark = pytest.mark.timeout(480)

STEPS = 60
INTERVAL = 4
"""Steps between checkpoints."""
WAIT = 240.0
"""Seconds a job may take to reach a point the test waits for (Ray and torch start-up on 2 busy cores)."""


def newest_checkpoint(run: RunDirectory) -> int:
    """The newest complete checkpoint's step (0: none yet)."""
    return max((step for step, _ in complete_checkpoints(run.checkpoints)), default=0)


def wait_for_checkpoint_after(client: TrainctlClient, job_id: str, run: RunDirectory, step: int) -> int:
    """Wait until the running job has saved a complete checkpoint after `step`; returns its step."""
    deadline = time.monotonic() + WAIT
    while (saved := newest_checkpoint(run)) <= step:
        status = client.get_job(job_id).status
        assert status.state in (pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.RESTARTING), status
        assert time.monotonic() < deadline, f"no checkpoint after step {step} within {WAIT:g} s: {status}"
        time.sleep(0.05)
    return saved


def stop_and_reap(serve: ServeProcess, how: signal.Signals) -> None:
    """Stop the service with `how` and make sure every process it had started is gone. SIGTERM: it stops
    gracefully, exits 0 and leaves nothing. SIGKILL: what is still alive 10 s later (the embedded Ray's,
    which a killed service cannot stop) is killed by PID."""
    assert serve.proc is not None
    tree = sorted(descendants(serve.proc.pid))
    if how is signal.SIGTERM:
        assert serve.stop() == 0, serve.log_path.read_text()[-3000:]
        assert gone(tree), f"processes of the stopped service still alive: {[p for p in tree if alive(p)]}"
        return
    serve.kill()
    if not gone(tree):
        survivors = [pid for pid in tree if alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert gone(survivors), f"processes of the killed service still alive: {survivors}"


def test_a_job_resumes_from_its_checkpoint_after_the_default_service_is_stopped_and_killed(tmp_path: Path) -> None:
    job = restartable_job("survivor", STEPS, max_restarts=0, interval=INTERVAL, labels={"suite": "embedded-restart"})
    serve = ServeProcess(None, None, tmp_path / "data", "--gpus-per-node=2")
    try:
        with ThreadPoolExecutor(1) as background:
            uninterrupted = background.submit(single_process_losses, job)  # the reference, while the service starts
            serve.start()
            reference = uninterrupted.result()
        client = TrainctlClient(serve.target)
        job_id = client.create_job(job).id
        run = RunDirectory.of_job(serve.data_dir / "runs", job_id)
        saved = 0
        resumed_from: list[int] = []
        for how in (signal.SIGTERM, signal.SIGKILL):
            passed = wait_for_checkpoint_after(client, job_id, run, saved)
            client.close()
            stop_and_reap(serve, how)
            if how is signal.SIGTERM:
                notice = f"stopping with 1 active job(s) ({job_id}): they stop with the service's embedded Ray and resume"
                assert notice in serve.log_path.read_text()
            saved = newest_checkpoint(run)
            assert passed <= saved < STEPS, (passed, saved)
            resumed_from.append(saved)
            serve.start()
            client = TrainctlClient(serve.target)

        deadline = time.monotonic() + WAIT
        while (status := client.get_job(job_id).status).state != pb.SUCCEEDED:
            assert status.state in (pb.RUNNING, pb.RESTARTING, pb.SCHEDULED), status
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status.restarts == 2, status

        events = list(client.watch(job_id, follow=False))
        restarts = [e.state_change.reason for e in events if kind(e) == "state_change" and e.state_change.to_state == pb.RESTARTING]
        assert len(restarts) == 2, restarts
        for count, (reason, step) in enumerate(zip(restarts, resumed_from, strict=True), start=1):
            assert reason.startswith("the service restarted on a new Ray cluster"), reason
            assert f"resuming from checkpoint step {step} (service relaunch {count}, not counted against" in reason, reason
        losses = [(e.step.step, e.step.loss) for e in events if kind(e) == "step"]
        assert sorted({step for step, _ in losses}) == list(range(1, STEPS + 1)), "every step ran"
        for step, loss in losses:  # each generation's steps, the replayed ones too
            assert loss == pytest.approx(reference[step - 1], rel=1e-5), (step, loss, reference[step - 1])
        client.close()
        stop_and_reap(serve, signal.SIGTERM)
    finally:
        if serve.proc is not None and serve.proc.poll() is None:
            stop_and_reap(serve, signal.SIGKILL)
