"""The records the tracker hands its sinks: a job's run as the trackers name it, one step's metrics, and
the run's end with its artifacts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

METRICS = (
    "loss", "eval_loss", "grad_norm", "lr", "tokens_per_second", "mfu", "mfu_full_attention", "step_time_seconds",
)
"""The step metrics logged to trackers (those a step reports; a metric it leaves out is not logged). `mfu` is
Megatron's convention (causal attention halved), `mfu_full_attention` torchtitan's (attention unmasked)."""


@dataclass(frozen=True)
class TrackedRun:
    """A job's run: where it is logged and what describes it."""

    job_id: str
    name: str
    """The run's name: the job's name and id."""
    tenant: str
    run_dir: str
    mlflow_uri: str | None
    """The MLflow server the run is logged to (None: not to MLflow)."""
    experiment: str
    tensorboard: bool
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    """The resolved spec, flattened (trainctl.service.tracking.flatten)."""
    sweep_id: str | None = None
    """The sweep this job is a trial of (its run is a child of the sweep's run), or None."""


@dataclass(frozen=True)
class StepPoint:
    """One step's metrics (name -> value, only those reported) at `time` (seconds since the epoch)."""

    step: int
    time: float
    values: dict[str, float]

    @classmethod
    def of(cls, step: dict[str, Any], time: float) -> StepPoint:
        """The tracked metrics of a step event's payload."""
        values = {name: float(step[name]) for name in METRICS if isinstance(step.get(name), int | float)}
        return cls(int(step["step"]), time, values)


@dataclass(frozen=True)
class RunEnd:
    """How the job ended: its terminal state, the reason, and the run's artifacts (file name -> content:
    the run report), built when the sink logs them (on the sink's thread, never the scheduler's)."""

    state: str
    reason: str
    artifacts: Callable[[], dict[str, bytes]]
