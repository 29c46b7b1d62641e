"""Per-rank step times of a job's recent steps, and the straggler statistics and log line drawn from them
(the supervisor keeps one `StepStats` per rank generation); and `StepTimeBatcher`, which sends a rank's
step times to the supervisor in one call per `STEP_TIME_INTERVAL` seconds rather than one call per step.

Costs (bench/scale/rank_path.py): every Ray call into the supervisor costs it 0.4-0.6 ms of CPU, taken in
its single ``reports`` thread, so one call per rank per step cannot scale (4,095 calls a second at 4,096
ranks and a 1 s step: more than a core, and rank 0's StepReport queued seconds behind them). Batched, the
calls per second are ranks / `STEP_TIME_INTERVAL` whatever the step time, and the supervisor's work per time
is O(1) (a slot in a per-step array); a step's statistics are computed once, when its last rank's time comes.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainctl.workers.events import StragglerStats

STEP_HISTORY = 16
"""Steps of per-rank step times kept for straggler statistics."""
STRAGGLER_LOG_RATIO = 1.3
"""Slowest over fastest rank step time from which a log line names the slowest rank (the
TrainctlJobStraggler alert's threshold); only the ratio is a metric."""
STEP_TIME_INTERVAL = 120.0
"""Seconds of wall clock between a rank's calls carrying its step times (`StepTimeBatcher`): ranks / 120 calls a
second to the supervisor (34 a second at 4,096 ranks, about 13 ms of its CPU), and the straggler statistics
at most about two minutes behind the newest step (the TrainctlJobStraggler alert waits 15 minutes)."""
BATCH_STEPS = 4
"""Step times one call carries: the newest steps a rank reported before an interval began."""
SPREAD_STEPS = 8
"""Rank r sends its batch r % SPREAD_STEPS steps after the interval began, so the supervisor takes a
1/SPREAD_STEPS share of the ranks' calls per step rather than all at once ahead of rank 0's next report.
BATCH_STEPS + SPREAD_STEPS < STEP_HISTORY: the batch's steps are still in the supervisor's history."""

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
    (`StepTimeBatcher`) complete a step once per STEP_TIME_INTERVAL."""

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


class StepTimeBatcher:
    """A rank's ``on_step_time``: at the first step it reports in each ``interval`` seconds of wall clock it
    takes the times of the `BATCH_STEPS` steps it reported before (at its very first step: that step's) as
    its next batch, and hands it to ``send`` (``{step: seconds}``) ``rank % SPREAD_STEPS`` steps later.
    Ranks train in lockstep and their nodes' clocks agree, so every rank's batch holds the same steps, which
    the supervisor then finds complete, while their calls spread over SPREAD_STEPS steps."""

    def __init__(
        self,
        send: Callable[[dict[int, float]], Any],
        rank: int,
        interval: float = STEP_TIME_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self._send = send
        self._delay = rank % SPREAD_STEPS
        self._interval = interval
        self._clock = clock
        self._recent: dict[int, float] = {}
        self._batch: dict[int, float] | None = None
        self._wait = 0
        self._period: int | None = None

    def __call__(self, step: int, seconds: float) -> None:
        period = math.floor(self._clock() / self._interval)
        first = self._period is None
        if period != self._period:
            self._period = period
            self._batch, self._recent = ({step: float(seconds)} if first else self._recent), {}
            self._wait = self._delay
        if not first:
            self._recent[step] = float(seconds)
            while len(self._recent) > BATCH_STEPS:
                del self._recent[min(self._recent)]
        if self._batch is not None:
            if self._wait > 0:
                self._wait -= 1
            else:
                batch, self._batch = self._batch, None
                if batch:
                    self._send(batch)
