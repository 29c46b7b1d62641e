"""How a rank generation ended (`Outcome`) and the reason the job's state gives for it: which failure
a group's errors count as (`root_cause`, `failure_class`: restart, or fail at once), and the one-line
summaries of a finished or preempted generation."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.files import FileRuleError
from trainctl.workers.command.program import ProgramExited
from trainctl.workers.host_memory import HostMemoryExceeded

ROOT_CAUSE_WAIT = 2.0
"""Seconds to wait for the other ranks' outcomes when one fails, to name the rank that died."""
REASON_CHARS = 300
"""Longest cause quoted from an error in a reason."""
MEMORY_NOT_RESTARTED = "not restarted (the same allocation would fail again)"
"""How a reason ends when a rank exceeded its host-memory limit."""


class Outcome(Enum):
    """How a rank generation ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNPLACED = "unplaced"
    """No new plan came in time after a node loss: the job fails without another restart."""
    MISCONFIGURED = "misconfigured"
    """A rank raised a configuration error: the job fails without another restart."""
    PREEMPTED = "preempted"
    """The ranks stopped (or were stopped at the grace period's end) for a preemption."""
    RESIZED = "resized"
    """The ranks stopped with a checkpoint for a change of an elastic job's size: the next generation runs it."""
    HUNG = "hung"
    """No step progress in time: restarted like a failure, on new processes (the ranks are blocked)."""


def root_cause(
    failures: list[tuple[int, BaseException]], pending: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int]
) -> tuple[Outcome, str]:
    """Why a group whose ranks' calls raised ``failures`` (rank, error) failed, and whether restarting can
    help (`failure_class`). A dead rank makes its peers' collectives fail too, often first: wait up to
    `ROOT_CAUSE_WAIT` for the ``pending`` calls (``rank_of`` names their ranks) to name a dead rank before
    a configuration error or any other error. A death already seen outranks anything the others could
    report: no wait then (NCCL peers of a dead rank hang rather than fail, so the wait would run out)."""
    if any(isinstance(exc, RayActorError) for _, exc in failures):
        return failure_class(failures)
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT) if pending else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            failures.append((rank_of[ref], exc))
    return failure_class(failures)


def failure_class(failures: list[tuple[int, BaseException]]) -> tuple[Outcome, str]:
    """The outcome and reason of a generation whose ranks failed with `failures` (rank, error): a dead
    rank first (restart), then a command job's program that exited non-zero (restart; the one that ended
    first is named), then a rank's configuration error (fail at once), then any other error (restart);
    otherwise the lowest rank of the class is named. A rank past its host-memory limit (an engine rank's
    HostMemoryExceeded, a program whose stderr says an allocation failed) fails the job at once too."""
    dead = [(rank, exc) for rank, exc in failures if isinstance(exc, RayActorError)]
    if dead:
        rank, exc = min(dead, key=lambda item: item[0])
        return Outcome.FAILED, f"rank {rank} died: {first_line(exc)}"
    exited = [cause for _, exc in failures if isinstance(cause := getattr(exc, "cause", exc), ProgramExited)]
    if exited:
        first = min(exited, key=lambda cause: (cause.ended_at, cause.rank))
        if first.memory_limit is not None:
            return Outcome.MISCONFIGURED, f"{first}; {MEMORY_NOT_RESTARTED}"
        return Outcome.FAILED, str(first)
    misconfigured = [(rank, cause) for rank, exc in failures if (cause := configuration_error(exc)) is not None]
    if misconfigured:
        rank, cause = min(misconfigured, key=lambda item: item[0])
        if isinstance(cause, HostMemoryExceeded):
            return Outcome.MISCONFIGURED, f"{str(cause)[:REASON_CHARS]}; {MEMORY_NOT_RESTARTED}"
        return Outcome.MISCONFIGURED, (
            f"configuration error on rank {rank}: {str(cause)[:REASON_CHARS]}; not restarted (a restart cannot fix it)"
        )
    rank, exc = min(failures, key=lambda item: item[0])
    return Outcome.FAILED, f"rank {rank} failed: {first_line(exc)}"


def configuration_error(exc: BaseException) -> ConfigurationError | FileRuleError | None:
    """The engine's ConfigurationError, or a FileRuleError, a rank raised (the cause Ray's task error
    carries), or None."""
    cause = getattr(exc, "cause", exc)
    return cause if isinstance(cause, ConfigurationError | FileRuleError) else None


def first_line(exc: BaseException) -> str:
    """A one-line cause: a task error's original "Type: message" line, an actor death's first sentence
    (plus Ray's worker exit type when it gives one)."""
    text = str(exc).strip()
    exit_type = None
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else type(exc).__name__
    else:
        exit_type = re.search(r"Worker exit type: (\w+)", text)
    sentence = text.split(". ", 1)[0].rstrip(".")[:REASON_CHARS]
    return sentence + (f" (worker exit type {exit_type.group(1)})" if exit_type else "")


def stopped_summary(result: dict[str, Any], program: bool) -> str:
    """What a preempted generation saved before it stopped."""
    if program:
        return "the programs exited on SIGTERM; they resume from what they saved in $TRAINCTL_CHECKPOINT_DIR"
    step = result.get("steps_completed")
    return f"stopped at step {step} with a checkpoint; resumes from it when GPUs are free again"


def finished_summary(result: dict[str, Any], ranks: int) -> str:
    """The reason of a job whose ranks all finished: rank 0's result, numbers rounded for a person
    (`wall_seconds=18.24`, not `18.237455856999986`)."""
    details = ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in result.items() if isinstance(value, int | float | str))
    return f"all {ranks} ranks finished" + (f" ({details})" if details else "")
