"""Checkpoint shards written in the background while training goes on, at most one save at a time.

`stage` copies the state (DCP's `DefaultStager`: every tensor, DTensor shards included, into CPU
memory of the writer's own), so later optimizer steps cannot change what is written; `start` has a
background thread `dcp.save` the copy into the save's temporary directory and waits at a barrier until
every rank has written its shards. Its collectives (DCP's planning and the barrier) run over a
process group of their own (gloo, created collectively with the writer), so they never interleave
with the training loop's collectives on the default group. The writer never commits: once `wait` or
`poll` returns a step, every rank has written it, and rank 0 commits it (`dcp.commit_checkpoint`).
A save that failed on any rank raises `CheckpointWriteError` naming its step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainctl.parallelism.checkpoint import dcp as ckpt

WRITER_THREAD_PREFIX = "checkpoint-writer"
"""Name prefix of a save's background thread (a rank kept for its job's next generation waits for it)."""


class CheckpointWriteError(RuntimeError):
    """A background checkpoint save failed; the message names its step."""


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _write(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    """The background part of a save: write this rank's shards, then wait for every rank's."""
    if group is None:
        with ckpt.quiet_single_process():
            dcp.save(state, checkpoint_id=str(directory), no_dist=True)
        return
    dcp.save(state, checkpoint_id=str(directory), process_group=group)
    dist.barrier(group=group)


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer. Construct it on every rank at the same point (it creates
    a process group when the default one exists)."""

    def __init__(self) -> None:
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._stager = DefaultStager(StagingOptions(False, False, False, False))  # synchronous copy to CPU
        self._in_flight: tuple[int, Future[None]] | None = None

    @property
    def in_flight(self) -> int | None:
        """Step of the save being written (or written and not yet collected by `wait` / `poll`)."""
        return self._in_flight[0] if self._in_flight is not None else None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state` for `start` (it reuses the previous save's buffers, so it is refused while a
        save is in flight: `wait` for it first)."""
        if self._in_flight is not None:
            raise RuntimeError(f"the checkpoint save of step {self._in_flight[0]} is still in flight")
        return self._stager.stage(state)

    def start(self, directory: Path, step: int, staged: dict[str, Any]) -> None:
        """Write `staged` (from `stage`) into `directory` (made by `dcp.begin_save`) in the background."""
        if self._in_flight is not None:
            raise RuntimeError(f"checkpoint step {step}: the save of step {self._in_flight[0]} is still in flight")
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WRITER_THREAD_PREFIX)
        self._in_flight = (step, thread.submit(_write, staged, directory, self._group))
        thread.shutdown(wait=False)  # the thread ends with this save

    def poll(self) -> int | None:
        """The step of the save in flight if every rank has written it (it is no longer in flight), else None."""
        if self._in_flight is None or not self._in_flight[1].done():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Block until the save in flight is written by every rank; its step (None if none was in flight)."""
        if self._in_flight is None:
            return None
        step, future = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except CheckpointException as exc:  # DCP's: a BaseException holding every failed rank's error
            failures = "; ".join(f"rank {rank}: {_describe(error)}" for rank, (error, _) in sorted(exc.failures.items()))
            raise CheckpointWriteError(f"checkpoint step {step}: the asynchronous save failed on {failures}") from exc
        except Exception as exc:
            raise CheckpointWriteError(f"checkpoint step {step}: the asynchronous save failed: {_describe(exc)}") from exc
        return step

    def close(self) -> None:
        """Release the staging buffers; a save still in flight is abandoned (its thread finishes writing,
        nothing commits it)."""
        self._in_flight = None
        self._stager.close()
