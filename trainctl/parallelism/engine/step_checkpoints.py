"""A run's checkpoints step by step: which step saves, how (synchronously, or in the background under
`checkpoint.async_save`), and when each save is committed relative to the report of its step.

The invariant both ways keep: no complete checkpoint is ever ahead of the steps the job has reported.
Synchronously, rank 0 reports a saving step from `before_commit`, after every rank has written and before
the checkpoint becomes complete. In the background (`async_writer`), a save is committed at a later step,
the first after every rank has written it: rank 0 reports that step (with the checkpoint's size) and then
commits. The run's last step saves synchronously (the run ends there anyway), after committing the save
still in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.checkpoint.async_writer import AsyncCheckpointWriter

Report = Callable[[int | None], Any]
"""Reports the step with a checkpoint's size in bytes (None on the ranks that did not commit it)."""


class StepCheckpoints:
    """One rank's checkpoints of a run under `root`. Construct it on every rank at the same point (the
    background writer creates a process group); `close` it when the run ends."""

    def __init__(
        self,
        root: Path,
        keep_last: int,
        rank: int,
        state: Callable[[], dict[str, Any]],
        event: Callable[[str], Any],
        async_save: bool = False,
    ) -> None:
        self.root, self.keep_last, self.rank = root, keep_last, rank
        self._state, self._event = state, event
        self.writer = AsyncCheckpointWriter() if async_save else None

    def save(self, step: int, before_commit: Report | None = None) -> Path:
        """Collectively save the state as checkpoint `step` now (``before_commit``: see
        `checkpoint.dcp.save_checkpoint`); its final path."""
        path = ckpt.save_checkpoint(self.root, step, self._state(), self.keep_last, before_commit)
        if self.rank == 0:  # the rank that wrote the COMPLETE manifest
            self._event(f"checkpoint saved at step {step}: {path} ({ckpt.checkpoint_size(path)} bytes)")
        return path

    def after_step(
        self, step: int, *, save_due: bool, last: bool, report_due: bool, report: Report, plain: Callable[[], Any]
    ) -> Path | None:
        """Save, commit and report what step `step` calls for (``report``: the step with a checkpoint's
        size, ``plain()``: without, when only ``report_due``); the path of a checkpoint this rank
        committed, if any."""
        if self.writer is not None and not last:
            return self._in_background(step, save_due, report_due, report, plain)
        if save_due:
            written = self._collect_written(wait=True) if self.writer is not None else None
            return self._save_synchronously(step, report, written)
        if report_due:
            plain()
        return None

    def close(self) -> None:
        """Release the background writer (a save still in flight is abandoned, never committed)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _commit(self, step: int, before_commit: Report | None = None) -> Path:
        """Rank 0: commit background save `step`, which every rank has written."""
        path = ckpt.commit_checkpoint(self.root, step, self.keep_last, before_commit)
        self._event(f"checkpoint saved at step {step}: {path} ({ckpt.checkpoint_size(path)} bytes)")
        return path

    def _collect_written(self, wait: bool) -> int | None:
        """The step of the background save every rank has written, if any (``wait``: block for the one
        in flight); it is no longer in flight, and rank 0 must commit it."""
        assert self.writer is not None
        written = self.writer.wait() if wait else self.writer.poll()
        if written is not None:
            self._event(f"checkpoint step {written} written by every rank")
        return written

    def _in_background(
        self, step: int, save_due: bool, report_due: bool, report: Report, plain: Callable[[], Any]
    ) -> Path | None:
        """A step but the last under `checkpoint.async_save`. In order: a save due now waits for the one
        in flight (a finished one is collected either way); the new save's state is copied; rank 0 reports
        the step (with the size of the checkpoint it is about to commit) and commits the finished one;
        only then does the new save begin (a barrier), so no rank writes a new save while the previous one
        is uncommitted."""
        assert self.writer is not None
        written = self._collect_written(wait=save_due)
        staged = self.writer.stage(self._state()) if save_due else None
        committed = None
        if written is not None and self.rank == 0:
            committed = self._commit(written, before_commit=report)
        elif written is not None or save_due:
            report(None)
        elif report_due:
            plain()
        if staged is not None:
            self.writer.start(ckpt.begin_save(self.root, step), step, staged)
            self._event(f"checkpoint step {step} writing in the background")
        return committed

    def _save_synchronously(self, step: int, report: Report, written: int | None) -> Path:
        """Save checkpoint `step` now, reporting the step before the first commit. With a background save
        `written` still to commit, the report carries that save's size and precedes both commits, and
        this checkpoint's size is not reported."""
        if written is not None:
            if self.rank == 0:
                self._commit(written, before_commit=report)
            else:
                report(None)
            return self.save(step)
        path = self.save(step, before_commit=report)
        if self.rank != 0:
            report(None)
        return path
