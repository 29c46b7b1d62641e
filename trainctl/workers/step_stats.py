"""Per-rank step times of a job's recent steps, and the straggler statistics and log line drawn from them
(the supervisor keeps one `StepStats` per rank generation). The ranks send their times in batches
(`trainctl.workers.step_time_sending`); the supervisor's work per time is O(1) (a slot in a per-step array),
and a step's statistics are computed once, when its last rank's time comes.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from trainctl.workers.events import StragglerStats

STEP_HISTORY = 16
"""Steps of per-rank step times kept for straggler statistics."""
STRAGGLER_LOG_RATIO = 1.3
"""Slowest over fastest rank step time from which a log line names the slowest rank (the
TrainctlJobStraggler alert's threshold); only the ratio is a metric."""
_MISSING = math.nan


class StepTimes(Mapping[int, float]):
    """One step's times by rank: an array of 8-byte floats indexed by rank (NaN: not reported yet), so a
    step of 4,096 ranks holds 32 KiB rather than a dict entry, a float and an int per rank."""

    __slots__ = ("_seconds", "_count")

    def __init__(self) -> None:
        self._seconds = array("d")
        self._count = 0

    def set(self, rank: int, seconds: float) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if rank >= len(self._seconds):
            self._seconds.extend([_MISSING] * (rank + 1 - len(self._seconds)))
        if math.isnan(self._seconds[rank]):
            self._count += 1
        self._seconds[rank] = seconds

    def __getitem__(self, rank: int) -> float:
        if 0 <= rank < len(self._seconds) and not math.isnan(self._seconds[rank]):
            return self._seconds[rank]
        raise KeyError(rank)

    def __iter__(self) -> Iterator[int]:
        return (rank for rank, seconds in enumerate(self._seconds) if not math.isnan(seconds))

    def __len__(self) -> int:
        return self._count


@dataclass
class StepStats:
    """Per-rank step times of recent steps, for straggler statistics."""

    times: dict[int, StepTimes] = field(default_factory=dict)
    reporters: set[int] = field(default_factory=set)
    last_emitted: int = -1
    named: int | None = None
    """The slowest rank the last straggler log line named (None while the ranks are even)."""
    _complete: dict[int, StragglerStats] = field(default_factory=dict)
    """Statistics of steps found complete, computed once per step (the reporters of a generation only grow,
    so a step that was complete stays so unless a new rank reports: then it is dropped here)."""
    _newest: StragglerStats | None = None
    """The newest complete step's statistics, kept when its times leave the history: batched ranks
    (`StepTimeBatcher`) complete a step once per `STEP_TIME_INTERVAL`."""

    def add(self, rank: int, step: int, seconds: float | None) -> None:
        if rank not in self.reporters:
            self.reporters.add(rank)
            self._complete.clear()  # one more rank to wait for
            self._newest = None
        if seconds is None:
            return
        if step not in self.times:  # a new step: the oldest beyond the history go
            self.times[step] = StepTimes()
            for old in sorted(self.times)[:-STEP_HISTORY]:
                del self.times[old]
                self._complete.pop(old, None)
        if step in self.times:
            self.times[step].set(rank, float(seconds))
            self._complete.pop(step, None)

    def add_many(self, rank: int, times: Mapping[int, float]) -> None:
        """A rank's times of several steps (one `StepTimeBatcher` call)."""
        for step, seconds in sorted(times.items()):
            self.add(rank, int(step), seconds)

    def latest_complete(self, before: int) -> StragglerStats | None:
        """Straggler stats of the newest step before ``before`` that every reporting rank has timed."""
        everyone = len(self.reporters)
        for step in sorted(self.times, reverse=True):
            per_rank = self.times[step]
            # The ranks of a step are reporters, so counting them is the subset check.
            if step < before and len(per_rank) >= 2 and len(per_rank) >= everyone:
                stats = self._complete.get(step)
                if stats is None:
                    stats = self._complete[step] = StragglerStats.of(step, per_rank)
                if self._newest is None or stats.step > self._newest.step:
                    self._newest = stats
                if stats.step >= self._newest.step:
                    return stats
                break
        return self._newest if self._newest is not None and self._newest.step < before else None

    def straggler_line(self, stats: StragglerStats | None) -> str | None:
        """A log line naming the slowest rank when the ranks start straggling or the slowest one changes."""
        if stats is None or stats.ratio is None:
            return None
        if stats.ratio < STRAGGLER_LOG_RATIO:
            self.named = None
            return None
        if stats.slowest_rank == self.named:
            return None
        self.named = stats.slowest_rank
        return (
            f"straggler at step {stats.step}: rank {stats.slowest_rank} took {stats.slowest_seconds:.3f}s, "
            f"{stats.ratio:.2f}x rank {stats.fastest_rank} ({stats.fastest_seconds:.3f}s)"
        )
