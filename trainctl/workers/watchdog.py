"""When a running rank generation counts as hung, and when a preemption's grace period is over: the
supervisor's clocks of progress (step reports), output (log lines), a preemption asked and the time the
job's generations have trained."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainctl.spec.job import TrainingJob


@dataclass
class Watchdog:
    """The clocks of the current generation (`started` resets them) and of the job's preemption."""

    job: TrainingJob
    startup_grace: float
    """Seconds an engine generation may take to its first step before it counts as hung."""
    progress_at: float = field(default_factory=time.monotonic)
    output_at: float = field(default_factory=time.monotonic)
    stepping: bool = False
    """Whether the generation reported a step yet."""
    preemption: tuple[float, float] | None = None
    """When a preemption was asked (monotonic) and its grace period in seconds; None: none asked."""
    trained: float = 0.0
    """Seconds the generations ended so far ran, from `started` to `ended`."""
    started_at: float | None = None
    """When the current generation's ranks started (None between generations)."""

    def started(self) -> None:
        """A new generation's ranks start: no step yet, the clocks from now."""
        self.progress_at = self.output_at = self.started_at = time.monotonic()
        self.stepping = False

    def ended(self) -> None:
        """The current generation's ranks are done: its time counts in `trained`."""
        if self.started_at is not None:
            self.trained += time.monotonic() - self.started_at
            self.started_at = None

    def trained_by(self, seconds: float) -> float:
        """When (monotonic) the job will have trained ``seconds`` in all, counting the current generation."""
        return (self.started_at or time.monotonic()) + max(0.0, seconds - self.trained)

    def spares_due(self, spare_after: float) -> bool:
        """Whether the job's spares should start now: it has trained ``spare_after`` seconds in all and the
        current generation has stepped (before its first step, a spare's imports would take the CPU from its
        ranks' start, or their restore after a warm restart)."""
        return self.stepping and time.monotonic() >= self.trained_by(spare_after)

    def stepped(self) -> None:
        self.progress_at = time.monotonic()
        self.stepping = True

    def printed(self) -> None:
        self.output_at = time.monotonic()

    def hung(self) -> str | None:
        """Why the running ranks count as hung, or None: no step progress for the step timeout once steps
        are reported; before that, no first step within the start-up grace (engine), or no report and
        no output line for ``spec.command.no_progress_timeout_seconds`` (a command job, when set)."""
        now = time.monotonic()
        idle = now - self.progress_at
        step_timeout = self.job.spec.scheduling.step_timeout_seconds
        command = self.job.spec.command
        if self.stepping:
            if idle > step_timeout:
                return f"no step progress for {idle:.0f}s (scheduling.step_timeout_seconds={step_timeout:g}); ranks hung"
            return None
        if command is None:
            if idle > max(step_timeout, self.startup_grace):
                return f"no first step within {idle:.0f}s of starting the ranks; ranks hung"
            return None
        quiet = now - max(self.progress_at, self.output_at)
        limit = command.no_progress_timeout_seconds
        if limit is not None and quiet > limit:
            return (
                f"no report and no output line for {quiet:.0f}s "
                f"(spec.command.no_progress_timeout_seconds={limit:g}); program hung"
            )
        return None

    def preemption_overdue(self) -> str | None:
        """Why the ranks are stopped without their checkpoint: the preemption's grace period is over."""
        if self.preemption is None:
            return None
        asked, grace = self.preemption
        if time.monotonic() - asked <= grace:
            return None
        return f"the ranks did not stop within the {grace:g}s grace period; stopped, resuming from the newest complete checkpoint"
