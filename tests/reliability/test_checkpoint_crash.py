"""Checkpoints survive crashes (engine level, one CPU process, no Ray).

A process SIGKILLed while it saves a checkpoint leaves the previous one loadable: the next run
resumes from it, says which partial save it skipped, and its losses equal an uninterrupted run's. A
checkpoint damaged after it was written (a shard truncated, DCP's metadata gone) is skipped with an
event in favour of the one before. Retention keeps the newest `keep_last`."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.engine.trainer import Trainer, TrainResult
from trainctl.spec.job import JobSpecBody

pytestmark = pytest.mark.timeout(300)

CRASH_TRAINER = Path(__file__).with_name("crash_trainer.py")
STEPS = 6


def body() -> JobSpecBody:
    return JobSpecBody.model_validate({
        "model": {"preset": "debug"},
        "data": {"max_files": 10, "seq_len": 32, "seed": 3},
        "training": {"steps": STEPS, "global_batch_size": 2, "micro_batch_size": 1, "warmup_steps": 1,
                     "lr": 3e-3, "seed": 5},
        "checkpoint": {"interval_steps": 2, "keep_last": 2},
        "resources": {"gpus": 1, "device": "cpu"},
    })


def train(job: JobSpecBody, checkpoint_dir: Path) -> tuple[TrainResult, list[str]]:
    """Trainer.run() in this process on one torch thread; its result and its events."""
    events: list[str] = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = Trainer(job, device="cpu", checkpoint_dir=checkpoint_dir, on_event=events.append).run()
    finally:
        torch.set_num_threads(before)
    return result, events


def steps_on_disk(root: Path) -> list[int]:
    return [step for step, _ in ckpt.complete_checkpoints(root)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainResult, Path]:
    root = tmp_path_factory.mktemp("whole") / "ckpt"
    result, _ = train(body(), root)
    assert result.resumed_from_step is None and len(result.losses) == STEPS
    return result, root


def test_retention_keeps_the_newest_n_intact_checkpoints(uninterrupted: tuple[TrainResult, Path]) -> None:
    _, root = uninterrupted
    assert steps_on_disk(root) == [4, 6]  # saved at 2, 4, 6 with keep_last=2
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000004", "step_00000006"]
    assert all(ckpt.checkpoint_problem(path) is None for _, path in ckpt.complete_checkpoints(root))


CRASH_POINTS = ("shards-written", "before-commit")


@pytest.fixture(scope="module")
def crashed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoint directories of runs SIGKILLed while saving step 4, one per crash point (the two
    processes run side by side: importing torch dominates their time)."""
    base = tmp_path_factory.mktemp("crashed")
    job_file = base / "job.json"
    job_file.write_text(body().model_dump_json())
    procs = {
        point: subprocess.Popen(
            [sys.executable, str(CRASH_TRAINER), str(job_file), str(base / point), point, "4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for point in CRASH_POINTS
    }
    for point, proc in procs.items():
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == -signal.SIGKILL, f"{point}: exit {proc.returncode}\n{stderr[-3000:]}"
    return {point: base / point for point in CRASH_POINTS}


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_kill_mid_save_resumes_from_the_previous_checkpoint(
    point: str, uninterrupted: tuple[TrainResult, Path], crashed_runs: dict[str, Path]
) -> None:
    whole, _ = uninterrupted
    root = crashed_runs[point]
    partial = root / ".tmp_step_00000004"
    assert partial.is_dir() and any(partial.glob("*.distcp")), "the crash left a half-finished save"
    assert (partial / ckpt.COMPLETE).is_file() == (point == "before-commit")
    assert steps_on_disk(root) == [2], "the previous checkpoint is still there, complete"

    resumed, events = train(body(), root)
    assert resumed.resumed_from_step == 2
    assert f"skipped checkpoint {partial}: partial: the save did not finish" in events
    assert any(e.startswith(f"resumed from checkpoint {root / 'step_00000002'}") for e in events)
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-5)
    assert not partial.exists(), "the next save removes the partial one"
    assert steps_on_disk(root) == [4, 6]


@pytest.mark.parametrize("damage", ["truncated-shard", "metadata-gone"])
def test_damaged_checkpoint_is_skipped_with_an_event(
    damage: str, uninterrupted: tuple[TrainResult, Path], tmp_path: Path
) -> None:
    whole, saved = uninterrupted
    root = tmp_path / "ckpt"
    for step in (4, 6):
        name = ckpt.step_dir_name(step)
        (root / name).mkdir(parents=True)
        for file in (saved / name).iterdir():
            (root / name / file.name).write_bytes(file.read_bytes())
    newest = root / "step_00000006"
    if damage == "truncated-shard":
        shard = next(newest.glob("*.distcp"))
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[: size // 2])
        why = f"file {shard.name} has {size // 2} bytes, {size} were written"
    else:
        (newest / ckpt.METADATA).unlink()
        why = f"file {ckpt.METADATA} is missing"
    assert ckpt.checkpoint_problem(newest) == why
    resumed, events = train(body(), root)  # the newest is the final step: resuming from it would train nothing
    assert f"skipped checkpoint {newest}: {why}" in events
    assert resumed.resumed_from_step == 4
    assert resumed.losses == pytest.approx(whole.losses[4:], rel=1e-5)
