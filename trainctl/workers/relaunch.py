"""`Relaunch`: what a supervisor started again for a job is told, when the job's previous supervisor
ended with the Ray cluster it ran on (the service's embedded Ray stops with the service; an external
cluster may have been restarted), or ended PREEMPTED and the job was placed again. The service decides it
(trainctl.service.scheduling.relaunch, trainctl.service.scheduling.launching); the runtime starts the
supervisor with it (`RayRuntime.start_job`), which records the restart with its `reason` and resumes from
the newest complete checkpoint in a new generation. The job's event log is the record of its relaunches
(`is_relaunch`, `is_resume_after_preemption`; an elastic job's changes of size too, `is_resize`): they are restarts, but not the job's fault, so they do not
count against ``scheduling.max_restarts``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.workers.events import Event, EventKind, JobState

REASON_PREFIX = "the service restarted on a new Ray cluster"
"""How the reason of every relaunch after a cluster loss begins (and no other reason does)."""
PREEMPTION_PREFIX = "resuming after preemption"
"""How the reason of every resume after a preemption begins (and no other reason does)."""
RESIZE_PREFIX = "resized: "
"""How the reason of the RESTARTING state an elastic job's change of size records begins (trainctl.workers.job_plan);
not the job's fault either."""


@dataclass(frozen=True)
class Relaunch:
    """Why the job's supervisor is started again, and how often the service has done so."""

    resume: str
    """Where the job resumes, in words ("resuming from checkpoint step 10")."""
    count: int
    """The service's relaunches of this job for the same cause, this one included."""
    after_preemption: bool = False
    """The job's previous supervisor ended PREEMPTED (else: with the Ray cluster it ran on)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a relaunch count starts at 1, got {self.count}")

    @property
    def reason(self) -> str:
        """The reason of the job's RESTARTING state."""
        if self.after_preemption:
            return f"{PREEMPTION_PREFIX} {self.count}; {self.resume} (not counted against scheduling.max_restarts)"
        return (
            f"{REASON_PREFIX} and the job's supervisor and ranks ended with the old one; {self.resume} "
            f"(service relaunch {self.count}, not counted against scheduling.max_restarts)"
        )


def is_relaunch(event: Event) -> bool:
    """Whether `event` is the RESTARTING state a supervisor relaunched after a cluster loss recorded."""
    return event.kind is EventKind.STATE and event.state is JobState.RESTARTING and event.reason.startswith(REASON_PREFIX)


def is_resize(event: Event) -> bool:
    """Whether `event` is the RESTARTING state of an elastic job's change of size."""
    return event.kind is EventKind.STATE and event.state is JobState.RESTARTING and event.reason.startswith(RESIZE_PREFIX)


def is_resume_after_preemption(event: Event) -> bool:
    """Whether `event` is the RESTARTING state a supervisor resuming a preempted job recorded."""
    return (
        event.kind is EventKind.STATE and event.state is JobState.RESTARTING and event.reason.startswith(PREEMPTION_PREFIX)
    )
