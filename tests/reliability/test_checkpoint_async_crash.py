"""A process SIGKILLed while an asynchronous checkpoint save is in flight (engine level, one CPU process,
no Ray) leaves the previous checkpoint complete; the half-written one is never taken as complete, and
the next run resumes from the previous one with the uninterrupted run's losses."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_crash import STEPS, body, steps_on_disk, train

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.spec.job import JobSpecBody

pytestmark = pytest.mark.timeout(300)

CRASH_TRAINER = Path(__file__).with_name("async_crash_trainer.py")
CRASH_STEP = 4


def async_body() -> JobSpecBody:
    job = body()
    job.checkpoint.async_save = True
    return job


def test_kill_while_an_async_save_is_in_flight_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    job_file = tmp_path / "job.json"
    job_file.write_text(async_body().model_dump_json())
    root = tmp_path / "crashed"
    proc = subprocess.Popen(
        [sys.executable, str(CRASH_TRAINER), str(job_file), str(root), str(CRASH_STEP)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    whole, _ = train(async_body(), tmp_path / "whole")  # the uninterrupted run, while the crash runs
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}\n{stderr[-3000:]}"

    partial = root / f".tmp_{ckpt.step_dir_name(CRASH_STEP)}"
    assert any(partial.glob("*.distcp")) and not (partial / ckpt.COMPLETE).exists(), "a half-finished save"
    assert steps_on_disk(root) == [2], "the previous checkpoint is complete"

    resumed, events = train(async_body(), root)
    assert resumed.resumed_from_step == 2
    assert f"skipped checkpoint {partial}: partial: the save did not finish" in events
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-5)
    assert len(whole.losses) == STEPS and not partial.exists()
    assert steps_on_disk(root) == [4, 6]
