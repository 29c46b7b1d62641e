"""Asynchronous checkpoint saves (`checkpoint.async_save`): the background writer copies the state before
training goes on, keeps at most one save in flight, commits a checkpoint only after a step at or past it
is reported, and changes nothing the run computes: its losses are those of the same run without saves and
its checkpoints the schedule's, and a resume continues it bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import tiny_job

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.checkpoint.async_writer import AsyncCheckpointWriter, CheckpointWriteError
from trainctl.spec.job import JobSpecBody

STEPS = 3
INTERVAL = 1
"""Saves at steps 1 and 2 in the background and the final one (3) synchronously: two background saves, the
fewest that show one waiting for the other, in half the steps of interval 2."""


def fsdp_job(corpus: str, async_save: bool) -> JobSpecBody:
    body = tiny_job(corpus, steps=STEPS, dp_shard=2, zero_stage=3)
    body.checkpoint.interval_steps = INTERVAL
    body.checkpoint.keep_last = 3
    body.checkpoint.async_save = async_save
    return body


def train_logged(rank: int, world_size: int, body_json: str, checkpoint_dir: str | None) -> Any:
    """Worker body: `Trainer.run()`; on rank 0 its result and, in order, its events and step reports
    (``(step, checkpoint_bytes)``)."""
    from trainctl.parallelism.engine.trainer import Trainer

    log: list[Any] = []
    result = Trainer(
        JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu",
        checkpoint_dir=checkpoint_dir, on_event=log.append,
        on_step=lambda report: log.append((report.step, report.checkpoint_bytes)),
    ).run()
    return (result, log) if rank == 0 else None


@pytest.fixture(scope="module")
def fsdp_runs(pool, corpus, tmp_path_factory) -> dict[bool, tuple[Any, list[Any], Path | None]]:
    """The same 2-rank FSDP run without checkpoints (False) and with asynchronous saves (True): result, rank 0's
    log, checkpoint root."""
    unsaved, _ = pool.run(train_logged, 2, fsdp_job(corpus, async_save=False).model_dump_json(), None)[0]
    root = tmp_path_factory.mktemp("async") / "ckpt"
    result, log = pool.run(train_logged, 2, fsdp_job(corpus, async_save=True).model_dump_json(), str(root))[0]
    return {False: (unsaved, [], None), True: (result, log, root)}


def test_async_saving_changes_no_loss_and_keeps_the_same_checkpoints(fsdp_runs):
    """The losses of the run that saves in the background are those of the run that never saves, and its
    checkpoints are the schedule's (every INTERVAL steps and the last)."""
    (unsaved, _, _), (asynchronous, _, async_root) = fsdp_runs[False], fsdp_runs[True]
    assert len(asynchronous.losses) == STEPS
    assert asynchronous.losses == unsaved.losses  # bit for bit: same steps, same data positions
    assert [s for s, _ in ckpt.complete_checkpoints(async_root)] == [1, 2, 3]
    assert not list(async_root.glob(".tmp_step_*"))
    assert all(ckpt.checkpoint_problem(path) is None for _, path in ckpt.complete_checkpoints(async_root))


def test_one_save_in_flight_and_commits_after_their_step_is_reported(fsdp_runs):
    _, log, root = fsdp_runs[True]
    events = [entry for entry in log if isinstance(entry, str)]
    started = [int(e.split()[2]) for e in events if e.endswith("writing in the background")]
    assert started == [1, 2], "the final checkpoint (step 3) is written synchronously"
    in_flight = None
    for event in events:  # every save is written by every rank before the next one starts
        if event.endswith("writing in the background"):
            assert in_flight is None, f"{event!r} while step {in_flight} is in flight"
            in_flight = int(event.split()[2])
        elif event.endswith("written by every rank"):
            assert int(event.split()[2]) == in_flight
            in_flight = None
    assert in_flight is None, "the run ends with no save in flight"
    commits = [i for i, entry in enumerate(log) if isinstance(entry, str) and entry.startswith("checkpoint saved at step ")]
    assert [int(log[i].split()[4].rstrip(":")) for i in commits] == [1, 2, 3]
    for i in commits:  # no complete checkpoint ahead of the reported steps
        committed = int(log[i].split()[4].rstrip(":"))
        reported = [entry for entry in log[:i] if isinstance(entry, tuple)]
        assert reported[-1][0] >= committed and reported[-1][1] is not None, log[: i + 1]
    for i, entry in enumerate(log):  # a report with a size comes right before the commit of that checkpoint
        if isinstance(entry, tuple) and entry[1] is not None:
            assert log[i + 1].endswith(f"({entry[1]} bytes)"), log[i : i + 2]
    assert ckpt.checkpoint_size(root / ckpt.step_dir_name(STEPS)) == int(log[commits[-1]].split("(")[-1].split()[0])


def test_resume_from_an_async_checkpoint_continues_bit_for_bit(pool, corpus, fsdp_runs, tmp_path):
    uninterrupted, _, root = fsdp_runs[True]
    resume_dir = tmp_path / "ckpt"
    shutil.copytree(root / "step_00000001", resume_dir / "step_00000001")
    resumed, log = pool.run(train_logged, 2, fsdp_job(corpus, async_save=True).model_dump_json(), str(resume_dir))[0]
    assert resumed.resumed_from_step == 1
    assert resumed.losses == uninterrupted.losses[1:]
    assert "checkpoint step 2 writing in the background" in log  # the resumed run saves in the background too
    assert [s for s, _ in ckpt.complete_checkpoints(resume_dir)] == [1, 2, 3]


def test_the_staged_copy_is_what_is_written_and_one_save_is_in_flight(tmp_path: Path):
    writer = AsyncCheckpointWriter()
    weights = torch.arange(4.0)
    staged = writer.stage({"w": weights})
    weights.add_(100.0)  # the next optimizer step
    writer.start(ckpt.begin_save(tmp_path, 1), 1, staged)
    weights.add_(100.0)  # and the one after, while the save is in flight
    with pytest.raises(RuntimeError, match="the checkpoint save of step 1 is still in flight"):
        writer.stage({"w": weights})
    assert writer.wait() == 1 and writer.in_flight is None
    path = ckpt.commit_checkpoint(tmp_path, 1, keep_last=1)
    loaded = {"w": torch.zeros(4)}
    ckpt.load_checkpoint(path, loaded)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    writer.close()


def test_a_failed_background_save_names_its_step(tmp_path: Path):
    writer = AsyncCheckpointWriter()
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    writer.start(not_a_directory / "inside", 7, writer.stage({"w": torch.ones(2)}))
    with pytest.raises(CheckpointWriteError, match="checkpoint step 7: the asynchronous save failed on rank 0: NotADirectoryError"):
        writer.wait()
    writer.close()


def test_a_failed_background_save_fails_the_run(corpus, tmp_path: Path, monkeypatch):
    from trainctl.parallelism.checkpoint import async_writer
    from trainctl.parallelism.engine.trainer import Trainer

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(async_writer.dcp, "save", disk_full)
    body = tiny_job(corpus, steps=4)
    body.checkpoint.interval_steps = 2
    body.checkpoint.async_save = True
    with pytest.raises(CheckpointWriteError, match="checkpoint step 2: the asynchronous save failed: OSError: No space"):
        Trainer(body, device="cpu", checkpoint_dir=tmp_path / "ckpt").run()
    assert not ckpt.complete_checkpoints(tmp_path / "ckpt")
