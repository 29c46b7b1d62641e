"""Per-rank step times of a job's recent steps, and the straggler statistics and log line drawn from them
(the supervisor keeps one `StepStats` per rank generation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainctl.workers.events import StragglerStats

STEP_HISTORY = 16
"""Steps of per-rank step times kept for straggler statistics."""
STRAGGLER_LOG_RATIO = 1.3
"""Slowest over fastest rank step time from which a log line names the slowest rank (the
TrainctlJobStraggler alert's threshold); only the ratio is a metric."""


@dataclass
class StepStats:
    """Per-rank step times of recent steps, for straggler statistics."""

    times: dict[int, dict[int, float]] = field(default_factory=dict)
    reporters: set[int] = field(default_factory=set)
    last_emitted: int = -1
    named: int | None = None
    """The slowest rank the last straggler log line named (None while the ranks are even)."""

    def add(self, rank: int, step: int, seconds: float | None) -> None:
        self.reporters.add(rank)
        if seconds is None:
            return
        if step not in self.times:  # a new step: the oldest beyond the history go
            self.times[step] = {}
            for old in sorted(self.times)[:-STEP_HISTORY]:
                del self.times[old]
        if step in self.times:
            self.times[step][rank] = float(seconds)

    def latest_complete(self, before: int) -> StragglerStats | None:
        """Straggler stats of the newest step before ``before`` that every reporting rank has timed."""
        for step in sorted(self.times, reverse=True):
            per_rank = self.times[step]
            if step < before and len(per_rank) >= 2 and self.reporters <= per_rank.keys():
                return StragglerStats.of(step, per_rank)
        return None

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
