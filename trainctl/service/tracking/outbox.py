"""A job's work waiting for a tracker that may be away: its steps, bounded (the oldest dropped and
counted when full), and its end."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trainctl.service.tracking.run import RunEnd, StepPoint, TrackedRun

STEP_BUFFER = 10_000
"""Steps one job may have waiting for its tracker; beyond it the oldest are dropped (and counted)."""


@dataclass
class Outbox:
    """One job's pending steps and end for one sink. Not thread-safe: the sink's lock guards it."""

    run: TrackedRun
    capacity: int = STEP_BUFFER
    steps: deque[StepPoint] = field(default_factory=deque)
    end: RunEnd | None = None
    dropped: int = 0
    """Steps dropped since the tracker was last reached."""
    run_id: str | None = None
    """The tracker's id of the run, once opened or found."""
    unreachable: bool = False
    """Whether the job was told its tracker is unreachable (and not yet that it is back)."""
    artifacts: dict[str, bytes] | None = None
    """The run's artifacts once built (`end.artifacts()`, once: kept while the tracker is retried)."""

    def add(self, point: StepPoint) -> None:
        """Queue a step, dropping the oldest when full."""
        if len(self.steps) >= self.capacity:
            self.steps.popleft()
            self.dropped += 1
        self.steps.append(point)

    def take(self, most: int) -> list[StepPoint]:
        """Remove and return up to `most` of the oldest steps (`give_back` returns them if sending fails)."""
        return [self.steps.popleft() for _ in range(min(most, len(self.steps)))]

    def give_back(self, points: list[StepPoint]) -> None:
        """Put steps that could not be sent back in front, in order, within the capacity (the oldest of
        them dropped first)."""
        for point in reversed(points):
            if len(self.steps) >= self.capacity:
                self.dropped += 1
                continue
            self.steps.appendleft(point)

    @property
    def done(self) -> bool:
        """Whether the job ended and every step before its end was sent."""
        return self.end is not None and not self.steps
