"""What the store's tables hold, as Python: the records of jobs, queued jobs, events, sweeps and trials,
the states of sweeps and trials (a job's, `JobState`, is the workers' own), the event types, the fence
that proves leadership, and the store's errors (besides `StoreError` and `StoreUnavailable`, the
database's own, in `db`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainctl.service.store.db import StoreError
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep
from trainctl.workers.events import JobState

EVENT_STATE, EVENT_STEP, EVENT_LOG = "state", "step", "log"


@dataclass(frozen=True)
class Fence:
    """Proof of leadership for writes (`JobStore.fenced`): they commit only while `holder` holds lease
    `name` at `epoch`, unexpired by the database's clock."""

    name: str
    holder: str
    epoch: int


class LeaseLost(StoreError):
    """A fenced write found its lease lapsed or held by another replica; nothing was written."""


class JobNotFound(KeyError):
    """No job with that id."""


class RequestReused(Exception):
    """A request id came again with a request other than the one that first used it; the argument is
    the id of the job or sweep the first request created. Nothing was written."""


class AdmissionRefused(Exception):
    """`create_job`'s admission check refused the job; the message says why. Nothing was written."""


class SweepNotFound(KeyError):
    """No sweep with that id."""


class SweepState(StrEnum):
    """A sweep's life: RUNNING until its last trial is settled (SUCCEEDED when one completed, FAILED when
    none did), or CANCELLED by request."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self is not SweepState.RUNNING


class TrialState(StrEnum):
    """A trial's outcome: RUNNING while its job may still report; COMPLETE with an objective; PRUNED by
    early stopping; FAILED (its job failed, or reported no objective); CANCELLED with its sweep."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclass
class TrialRecord:
    """One row of `sweep_trials`: trial `number` of a sweep, its parameters (path -> value) and outcome."""

    sweep_id: str
    number: int
    job_id: str | None
    params: dict[str, Any]
    state: TrialState
    objective: float | None
    objective_step: int | None
    reason: str
    create_time: float
    end_time: float | None


@dataclass
class SweepRecord:
    """One row of `sweeps`, with its spec parsed and its trials in number order."""

    id: str
    seq: int
    tenant: str
    name: str
    sweep: Sweep
    state: SweepState
    reason: str
    create_time: float
    update_time: float
    end_time: float | None
    trials: list[TrialRecord] = field(default_factory=list)


@dataclass(frozen=True)
class QueuedJob:
    """A QUEUED job as the admission pass walks the queue: its place in it, its tenant and spec, and why it
    waits (the rest of its record is read only for a job that starts)."""

    id: str
    seq: int
    priority: int
    tenant: str
    reason: str
    job: TrainingJob


@dataclass
class JobRecord:
    """One row of `jobs`, with its spec parsed and labels attached."""

    id: str
    seq: int
    tenant: str
    name: str
    job: TrainingJob
    priority: int
    state: JobState
    reason: str
    create_time: float
    update_time: float
    total_steps: int
    schedule_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    steps_done: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    restarts: int = 0
    tokens_per_second: float = 0.0
    mfu: float | None = None
    """MFU of the newest step, Megatron's convention (causal attention halved); None where unknown."""
    mfu_full_attention: float | None = None
    """MFU of the newest step, torchtitan's convention (attention counted unmasked); None where unknown."""
    last_eval_loss: float | None = None
    """The eval loss of the newest step that evaluated; None before the first."""
    placement: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    runtime_cursor: str = ""
    preemptions: int = 0
    """Times the job was preempted (stopped for a job of higher priority and queued again)."""
    preempt_time: float | None = None
    """When the job was last preempted; None if never."""
    version: int = 0
    """How many times the row was written since CreateJob (every write adds one)."""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True)
class Event:
    """One entry of the append-only event log."""

    sequence: int
    job_id: str
    time: float
    type: str
    payload: dict[str, Any]
