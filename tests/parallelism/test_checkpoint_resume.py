"""Checkpoints: atomic layout on disk, retention, and resuming under a different layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import run_training, tiny_job

from trainctl.parallelism.checkpoint import dcp as ckpt


def test_save_is_atomic_and_keeps_the_newest(tmp_path: Path):
    state = {"w": torch.arange(4.0), "train": {"step": 0}}
    for step in (1, 2, 3):
        state["train"]["step"] = step
        ckpt.save_checkpoint(tmp_path, step, state, keep_last=2)
    (tmp_path / ".tmp_step_00000009").mkdir()  # a save that died half-way
    (tmp_path / "step_00000010").mkdir()  # no COMPLETE marker: not a checkpoint
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2, 3]
    step, path = ckpt.latest_checkpoint(tmp_path)
    assert step == 3 and (path / ckpt.COMPLETE).is_file()
    loaded = {"w": torch.zeros(4), "train": {"step": -1}}
    ckpt.load_checkpoint(path, loaded)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["train"]["step"] == 3
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step_00000010", loaded)


RESUME_LAYOUTS = {
    "fsdp-dp2": {"dp_shard": 2, "zero_stage": 3},
    "zero1-dp2": {"dp_shard": 2, "zero_stage": 1},
}


@pytest.mark.parametrize("layout", RESUME_LAYOUTS.values(), ids=RESUME_LAYOUTS.keys())
def test_resume_under_another_layout_continues_the_run(pool, corpus, tmp_path, dense_dp4_run, layout):
    """The FSDP dp4 run's step-2 checkpoint (conftest `dense_dp4_run`) resumed under 2 ranks continues its losses."""
    saved, uninterrupted = dense_dp4_run
    assert [s for s, _ in ckpt.complete_checkpoints(saved)] == [2, 4]
    resume_dir = tmp_path / "ckpt"
    shutil.copytree(saved / "step_00000002", resume_dir / "step_00000002")
    body = tiny_job(corpus, steps=4, **layout)
    body.checkpoint.interval_steps = 2
    resumed = run_training(pool, body, str(resume_dir))
    assert resumed.resumed_from_step == 2 and resumed.steps_completed == 4
    assert resumed.losses == pytest.approx(uninterrupted.losses[2:], rel=1e-5)
