"""In-memory snapshots (`checkpoint.memory_interval_steps`, checkpoint/memory_snapshots.py) on the engine's
side: a restart resumes from the newest snapshot every rank holds when it is newer than the newest complete
checkpoint, with the losses of the run that never stopped; a rank with no copy, or a snapshot of another
layout, sends every rank to the checkpoint instead. The stores here keep each rank's snapshots in files
(two directories standing for its two copies); the Ray keepers that hold them in host memory across
nodes are tested in tests/workers/test_memory_snapshots.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import tiny_job

from trainctl.parallelism.checkpoint.memory_snapshots import (
    SnapshotMismatch,
    restore_payload,
    snapshot_payload,
)
from trainctl.parallelism.checkpoint.snapshot_format import SnapshotFormatError, unpack
from trainctl.spec.job import JobSpecBody, TrainingJob
from trainctl.spec.validate import semantic_violations

STEPS = 6
CRASH_AFTER = 5
"""Every rank fails after step 5's snapshot; the checkpoint of step 4 is the newest durable one."""
COPIES = ("own", "peer")


class DirectorySnapshots:
    """A `SnapshotStore` for one rank whose two copies are files under ``root/own`` and ``root/peer``."""

    def __init__(self, root: str, rank: int) -> None:
        self.dirs = [Path(root) / copy / f"rank{rank}" for copy in COPIES]
        for directory in self.dirs:
            directory.mkdir(parents=True, exist_ok=True)

    def put(self, step: int, payload: bytes) -> None:
        for directory in self.dirs:
            (directory / str(step)).write_bytes(payload)

    def steps(self) -> set[int]:
        return {int(path.name) for directory in self.dirs for path in directory.iterdir()}

    def fetch(self, step: int) -> tuple[bytes, str] | None:
        for directory in self.dirs:
            if (directory / str(step)).is_file():
                return (directory / str(step)).read_bytes(), f"{directory.parent.name} copy"
        return None

    def discard_after(self, step: int) -> None:
        for directory in self.dirs:
            for path in directory.iterdir():
                if int(path.name) > step:
                    path.unlink()


class Crash(RuntimeError):
    """What the test raises on every rank after a snapshot, standing for the ranks' deaths."""


def train_with_snapshots(
    rank: int, world_size: int, body_json: str, checkpoint_dir: str, store_root: str, crash_after: int | None
) -> Any:
    """Worker body: `Trainer.run()` with a `DirectorySnapshots` store; with ``crash_after``, every rank raises
    `Crash` once that step's snapshot is kept. This rank's (result or None, rank 0's events)."""
    from trainctl.parallelism.engine.trainer import Trainer

    store = DirectorySnapshots(store_root, rank)
    events: list[str] = []
    if crash_after is not None:
        put = store.put

        def put_then_crash(step: int, payload: bytes) -> None:
            put(step, payload)
            if step == crash_after:
                raise Crash(f"rank {rank} after step {step}")

        store.put = put_then_crash  # type: ignore[method-assign]
    trainer = Trainer(
        JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu",
        checkpoint_dir=checkpoint_dir, on_event=events.append, snapshots=store,
    )
    try:
        return trainer.run(), events
    except Crash:
        return None, events


def snapshot_job(corpus: str, **parallelism: Any) -> JobSpecBody:
    """A 2-rank job with a snapshot every step and a checkpoint every 4 (``parallelism``: FSDP by default)."""
    body = tiny_job(corpus, steps=STEPS, **(parallelism or {"dp_shard": 2, "zero_stage": 3}))
    body.checkpoint.interval_steps = 4
    body.checkpoint.memory_interval_steps = 1
    return body


@pytest.fixture(scope="module")
def uninterrupted(pool, corpus, tmp_path_factory) -> list[float]:
    """The losses of the job run to the end without a failure."""
    root = tmp_path_factory.mktemp("uninterrupted")
    body = snapshot_job(corpus).model_dump_json()
    (result, _), _ = pool.run(train_with_snapshots, 2, body, str(root / "ckpt"), str(root / "snap"), None)
    return result.losses


def crashed(pool, corpus: str, root: Path, **parallelism: Any) -> None:
    """Run the job until every rank fails after step CRASH_AFTER (checkpoint 4 complete, snapshots 1-5 kept)."""
    body = snapshot_job(corpus, **parallelism).model_dump_json()
    ranks = pool.run(train_with_snapshots, 2, body, str(root / "ckpt"), str(root / "snap"), CRASH_AFTER)
    assert [result for result, _ in ranks] == [None, None]


def restarted(pool, corpus: str, root: Path, **parallelism: Any) -> tuple[Any, list[str]]:
    """Rank 0's (result, events) of the job run again to the end on the same checkpoints and snapshots."""
    body = snapshot_job(corpus, **parallelism).model_dump_json()
    return pool.run(train_with_snapshots, 2, body, str(root / "ckpt"), str(root / "snap"), None)[0]


def test_a_restart_resumes_from_the_newest_snapshot_every_rank_holds(pool, corpus, tmp_path, uninterrupted):
    crashed(pool, corpus, tmp_path)
    result, events = restarted(pool, corpus, tmp_path)
    assert result.resumed_from_step == CRASH_AFTER
    assert any(e.startswith(f"resumed from in-memory snapshot step {CRASH_AFTER} (rank 0: own copy; rank 1: own copy)")
               for e in events), events
    assert not any(e.startswith("resumed from checkpoint") for e in events)
    assert result.steps_completed == STEPS
    assert result.losses == pytest.approx(uninterrupted[CRASH_AFTER:], rel=1e-5)


def test_a_rank_that_lost_its_own_copy_reads_its_peer_copy(pool, corpus, tmp_path, uninterrupted):
    crashed(pool, corpus, tmp_path)
    shutil.rmtree(tmp_path / "snap" / "own" / "rank1")
    result, events = restarted(pool, corpus, tmp_path)
    assert any(e.startswith(f"resumed from in-memory snapshot step {CRASH_AFTER} (rank 0: own copy; rank 1: peer copy)")
               for e in events), events
    assert result.losses == pytest.approx(uninterrupted[CRASH_AFTER:], rel=1e-5)


def test_a_rank_with_no_copy_sends_every_rank_to_the_checkpoint(pool, corpus, tmp_path, uninterrupted):
    crashed(pool, corpus, tmp_path)
    for copy in COPIES:
        (tmp_path / "snap" / copy / "rank1" / str(CRASH_AFTER)).unlink()
    result, events = restarted(pool, corpus, tmp_path)
    # Rank 1 still holds step 4's snapshot, as old as the checkpoint: the checkpoint is read.
    assert result.resumed_from_step == 4
    assert any(e.startswith("resumed from checkpoint") and e.endswith("(step 4)") for e in events), events
    assert result.losses == pytest.approx(uninterrupted[4:], rel=1e-5)


def test_snapshots_after_the_step_resumed_from_are_dropped(pool, corpus, tmp_path):
    crashed(pool, corpus, tmp_path)
    for copy in COPIES:
        (tmp_path / "snap" / copy / "rank1" / str(CRASH_AFTER)).unlink()
    body = snapshot_job(corpus)
    body.training.steps = 4  # resumed from checkpoint 4, the run trains no step and takes no snapshot
    pool.run(train_with_snapshots, 2, body.model_dump_json(), str(tmp_path / "ckpt"), str(tmp_path / "snap"), None)
    held = {int(p.name) for p in (tmp_path / "snap").rglob("*") if p.is_file()}
    assert max(held) == 4, "rank 0's snapshot of step 5 belonged to the run before the restart"


def test_a_snapshot_of_another_layout_is_not_restored_and_the_checkpoint_is(pool, corpus, tmp_path, uninterrupted):
    crashed(pool, corpus, tmp_path)
    result, events = restarted(pool, corpus, tmp_path, tp=2)  # same 2 ranks, other shards
    [refused] = [e for e in events if e.startswith(f"in-memory snapshot of step {CRASH_AFTER} not restored")]
    assert refused.startswith(f"in-memory snapshot of step {CRASH_AFTER} not restored: a rank could not read or fit its "
                              "copy (SnapshotMismatch: state.model.")
    assert refused.endswith("; resuming from checkpoint step 4"), refused
    assert result.resumed_from_step == 4
    assert result.losses == pytest.approx(uninterrupted[4:], rel=1e-5)


def test_a_snapshot_that_does_not_fit_changes_nothing():
    model = torch.nn.Linear(3, 2)
    state = {"model": dict(model.state_dict()), "train": {"step": 7}}
    payload = snapshot_payload({"model": {"weight": torch.ones(2, 3), "bias": torch.ones(3)}, "train": {"step": 9}})
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(SnapshotMismatch, match=r"state\.model\.bias: the snapshot has \(3,\) torch.float32, this layout \(2,\)"):
        restore_payload(payload, state)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert state["train"]["step"] == 7
    good = snapshot_payload({"model": {"weight": torch.ones(2, 3), "bias": torch.ones(2)}, "train": {"step": 9}})
    restore_payload(good, state)
    assert torch.equal(model.weight, torch.ones(2, 3)) and state["train"]["step"] == 9


def test_snapshots_need_resume_and_the_engine():
    with pytest.raises(ValueError, match="memory_interval_steps needs spec.checkpoint.resume"):
        JobSpecBody.model_validate({"checkpoint": {"memory_interval_steps": 5, "resume": False}})
    command = TrainingJob.model_validate({"metadata": {"name": "c"}, "spec": {
        "command": {"program": "python", "args": ["train.py"]}, "checkpoint": {"memory_interval_steps": 5}}})
    assert [str(v) for v in semantic_violations(command, check_data=False)] == [
        "spec.checkpoint.memory_interval_steps: in-memory snapshots are the built-in engine's; a command job saves "
        "its state in its own program"
    ]


def test_a_payload_holds_tensors_and_plain_values_and_nothing_else():
    state = {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "b": torch.ones(3, dtype=torch.bfloat16),
                  "empty": torch.zeros(0, 4), "rng": torch.tensor([1, 2, 255], dtype=torch.uint8)},
        "optim": {"param_groups.w.betas": (0.9, 0.95), "param_groups.w.lr": 1e-3, "state.w.step": torch.tensor(4.0)},
        "train": {"step": 9, "name": "x", "flag": None, "lambdas": [None], "inf": float("inf")},
    }
    saved = unpack(snapshot_payload(state))
    assert torch.equal(saved["model"]["w"], state["model"]["w"])  # a transposed (non-contiguous) shard
    assert saved["model"]["b"].dtype == torch.bfloat16 and torch.equal(saved["model"]["b"], state["model"]["b"])
    assert saved["model"]["empty"].shape == (0, 4) and torch.equal(saved["model"]["rng"], state["model"]["rng"])
    assert saved["optim"]["param_groups.w.betas"] == [0.9, 0.95] and saved["train"]["inf"] == float("inf")
    assert saved["train"] == {"step": 9, "name": "x", "flag": None, "lambdas": [None], "inf": float("inf")}
    with pytest.raises(TypeError, match="cannot hold a object"):
        snapshot_payload({"x": object()})


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: b"not a snapshot" + p[14:], "not a trainctl snapshot"),
    (lambda p: p[: len(p) // 2], "past the end"),
    (lambda p: p[:40] + b"{" + p[41:], "header is not JSON"),
])
def test_a_damaged_payload_is_refused_naming_what_is_wrong(damage, message):
    payload = bytes(snapshot_payload({"w": torch.ones(64)}))
    with pytest.raises(SnapshotFormatError, match=message):
        unpack(damage(payload))


def test_the_next_snapshot_of_the_same_tensors_is_written_into_the_previous_payload():
    first = snapshot_payload({"w": torch.zeros(1000), "train": {"step": 1, "lr": 0.1}})
    second = snapshot_payload({"w": torch.ones(1000), "train": {"step": 100000, "lr": 0.123456789}}, first)
    assert second is first
    saved = unpack(second)
    assert torch.equal(saved["w"], torch.ones(1000)) and saved["train"] == {"step": 100000, "lr": 0.123456789}
    other = snapshot_payload({"w": torch.ones(999)}, second)  # another layout: a new buffer
    assert other is not second and torch.equal(unpack(other)["w"], torch.ones(999))
