"""A stop requested on any rank (`Trainer(stop_requested=...)`, job preemption) ends the run on every rank
at the same step boundary with a checkpoint of that step, and a resume from it continues the uninterrupted
run's losses; without a poll the loop adds no collective."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist
from harness import tiny_job

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.spec.job import JobSpecBody

STEPS = 4
STOP_AT = 2
"""Stopped at step 2 of 4: the two steps after the resume check the parameters (the first loss) and the
optimizer and schedule state (the second)."""


def fsdp_job(corpus: str, async_save: bool = False) -> JobSpecBody:
    """2-rank FSDP; synchronous saves only at the end (so a step-2 checkpoint is the stop's), background
    saves every step (so one is in flight when the stop comes)."""
    body = tiny_job(corpus, steps=STEPS, dp_shard=2, zero_stage=3)
    body.checkpoint.interval_steps = 1 if async_save else STEPS
    body.checkpoint.async_save = async_save
    return body


def train_polled(rank: int, world_size: int, body_json: str, checkpoint_dir: str | None, stop_at: int | None) -> Any:
    """Worker body: `Trainer.run()`, rank 1's poll asking to stop once its trainer reached `stop_at` (no poll
    at all when None); this rank's result, rank 0's events, and how many all-reduces with MAX it issued."""
    from trainctl.parallelism.engine.trainer import Trainer

    events: list[str] = []
    trainer: Trainer | None = None

    def stop_requested() -> bool:
        return rank == 1 and trainer is not None and trainer.step >= stop_at

    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        trainer = Trainer(
            JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu",
            checkpoint_dir=checkpoint_dir, on_event=events.append,
            stop_requested=None if stop_at is None else stop_requested,
        )
        result = trainer.run()
    max_reductions = sum(call.kwargs.get("op") == dist.ReduceOp.MAX for call in all_reduce.call_args_list)
    return result, events, max_reductions


@pytest.fixture(scope="module")
def uninterrupted(pool, corpus) -> list[Any]:
    """Every rank's (result, events, MAX all-reduces) of the job run to the end without a poll."""
    return pool.run(train_polled, 2, fsdp_job(corpus).model_dump_json(), None, None)


@pytest.fixture(scope="module")
def stopped(pool, corpus, tmp_path_factory) -> dict[bool, tuple[list[Any], Path]]:
    """The job stopped at STOP_AT on rank 1's request, with synchronous (False) and background (True)
    saves: every rank's (result, events, MAX all-reduces), and the checkpoint root."""
    runs = {}
    for async_save in (False, True):
        root = tmp_path_factory.mktemp("stopped") / "ckpt"
        body = fsdp_job(corpus, async_save).model_dump_json()
        runs[async_save] = pool.run(train_polled, 2, body, str(root), STOP_AT), root
    return runs


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_stop_on_one_rank_stops_every_rank_at_that_step_with_its_checkpoint(stopped, async_save):
    ranks, root = stopped[async_save]
    for result, _, _ in ranks:
        assert result.stopped_on_request and result.steps_completed == STOP_AT
        assert len(result.losses) == STOP_AT
    assert ckpt.latest_checkpoint(root)[0] == STOP_AT
    assert ranks[0][0].last_checkpoint == str(root / ckpt.step_dir_name(STOP_AT))
    assert not list(root.glob(".tmp_step_*"))
    events = ranks[0][1]
    assert events[-1] == f"stopped at step {STOP_AT} on request; checkpoint step {STOP_AT} saved"
    saved = [step for step, _ in ckpt.complete_checkpoints(root)]
    if async_save:  # the background save of step 1 was committed before step 2 was saved
        assert saved == [1, STOP_AT]
        assert events.index("checkpoint step 1 written by every rank") < events.index(
            f"checkpoint saved at step {STOP_AT}: {root / ckpt.step_dir_name(STOP_AT)}"
            f" ({ckpt.checkpoint_size(root / ckpt.step_dir_name(STOP_AT))} bytes)"
        )
    else:
        assert saved == [STOP_AT]


def test_a_resume_after_the_stop_continues_the_uninterrupted_losses(pool, corpus, stopped, uninterrupted, tmp_path):
    (ranks, root), reference = stopped[False], uninterrupted[0][0]
    assert ranks[0][0].losses == pytest.approx(reference.losses[:STOP_AT], rel=1e-5)
    resume_dir = tmp_path / "ckpt"
    shutil.copytree(root, resume_dir)
    resumed, _, _ = pool.run(train_polled, 2, fsdp_job(corpus).model_dump_json(), str(resume_dir), None)[0]
    assert resumed.resumed_from_step == STOP_AT and not resumed.stopped_on_request
    assert resumed.steps_completed == STEPS
    assert resumed.losses == pytest.approx(reference.losses[STOP_AT:], rel=1e-5)


def test_without_a_poll_nothing_changes_and_no_collective_is_added(uninterrupted, stopped):
    for result, _, max_reductions in uninterrupted:
        assert not result.stopped_on_request and result.steps_completed == STEPS == len(result.losses)
        assert max_reductions == 0
    assert not any("on request" in event for event in uninterrupted[0][1])
    for _, _, max_reductions in stopped[False][0]:  # the same count sees the poll's one all-reduce a step
        assert max_reductions == STOP_AT


@pytest.mark.parametrize(("requested_at", "stopped_at"), [(1, 1), (3, None)], ids=["early", "at-the-end"])
def test_one_process_stops_where_asked_and_a_request_at_the_last_step_is_a_normal_end(corpus, requested_at, stopped_at):
    from trainctl.parallelism.engine.trainer import Trainer

    events: list[str] = []
    trainer = Trainer(tiny_job(corpus, steps=3), device="cpu", on_event=events.append,
                      stop_requested=lambda: trainer.step >= requested_at)
    result = trainer.run()
    assert result.stopped_on_request == (stopped_at is not None)
    assert result.steps_completed == len(result.losses) == (stopped_at or 3)
    stop_events = [event for event in events if "on request" in event]
    assert stop_events == ([f"stopped at step {stopped_at} on request; no checkpoint directory, nothing saved"]
                           if stopped_at else [])
