"""A run's in-memory snapshots step by step (`checkpoint.memory_interval_steps`, checkpoint/memory_snapshots.py):
taking one after every K-th step, and restoring the newest one every rank holds when a run starts.

Both are collective where they must be: every rank takes its snapshot after the same steps (no collective),
and a restore is decided by every rank together (the newest common step, then whether every rank could
read and fit its copy), so either every rank restores it or none does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainctl.parallelism.checkpoint.memory_snapshots import (
    SnapshotStore,
    agreed_snapshot_step,
    every_rank_agrees,
    restore_payload,
    snapshot_payload,
)

MAX_SOURCES_SHOWN = 8
"""Ranks whose snapshot source a resume event names (the rest are counted)."""

State = tuple[Any, dict[str, Any]]
"""What a Trainer's state function gives: its templates (to apply the state with) and the state built from them."""


class StepSnapshots:
    """One rank's in-memory snapshots of a run. ``state`` builds the Trainer's checkpoint state now,
    ``event`` records a message of rank 0."""

    def __init__(
        self, store: SnapshotStore, interval: int, device: torch.device,
        state: Callable[[], State], event: Callable[[str], Any],
    ) -> None:
        self.store, self.interval, self.device = store, interval, device
        self._state, self._event = state, event
        self._buffer: bytearray | None = None
        """The last snapshot's payload, which the next one is written into (`snapshot_format.pack`)."""

    def after_step(self, step: int, last: bool) -> None:
        """Hand this rank's state to the store when a snapshot is due after ``step`` (never after the last:
        the run's final checkpoint is written then)."""
        if not last and step % self.interval == 0:
            self._buffer = snapshot_payload(self._state()[1], self._buffer)
            self.store.put(step, self._buffer)

    def restore(self, durable_step: int | None, apply: Callable[[Any, dict[str, Any]], None]) -> int | None:
        """Collectively restore the newest snapshot every rank holds, if newer than ``durable_step``
        (``apply(templates, state)`` sets it); its step, or None (nothing newer, or a rank could not read or
        fit its copy: then no rank changes)."""
        step = agreed_snapshot_step(self.store.steps(), durable_step)
        if step is None:
            return None
        templates, state = self._state()
        fetched = self.store.fetch(step)
        problem = "no copy answered" if fetched is None else None
        if fetched is not None:
            try:
                restore_payload(fetched[0], state)
            except (ValueError, RuntimeError) as exc:  # SnapshotMismatch, SnapshotFormatError, a torch error
                problem = f"{type(exc).__name__}: {exc}"
        if not every_rank_agrees(problem is None, self.device):
            fallback = f"checkpoint step {durable_step}" if durable_step is not None else "the start (no checkpoint)"
            self._event(f"in-memory snapshot of step {step} not restored: a rank could not read or fit its copy"
                        + (f" ({problem})" if problem else "") + f"; resuming from {fallback}")
            return None
        assert fetched is not None
        apply(templates, state)
        self._event(f"resumed from in-memory snapshot step {step} ({_sources(fetched[1])})")
        return step

    def discard_after(self, step: int) -> None:
        """Drop this rank's snapshots after ``step``, the step the run resumed from (or 0)."""
        self.store.discard_after(step)


def _sources(mine: str) -> str:
    """Collectively: where each rank read its snapshot from, for rank 0's event (the first few ranks)."""
    sources: list[str | None] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        sources = [None] * dist.get_world_size()
        dist.all_gather_object(sources, mine)
    shown = "; ".join(f"rank {rank}: {where}" for rank, where in enumerate(sources[:MAX_SOURCES_SHOWN]))
    more = len(sources) - MAX_SOURCES_SHOWN
    return shown + (f"; {more} more ranks" if more > 0 else "")
