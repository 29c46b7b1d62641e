"""Stored jobs as the API's `Job` message, with each job's spec converted once.

A job's spec never changes after CreateJob, but converting it (`convert.job_to_proto`, a walk of the
pydantic model) is most of what a GetJob or a ListJobs page costs. `JobMessages` keeps the serialized
spec part of each recently answered job (api_version, kind, metadata, spec) and builds each answer from
it plus the record's status, which is cheap and always read fresh from the store.
"""

from __future__ import annotations

import threading
from typing import Any

from trainctl.service.convert import job_to_proto, timestamp
from trainctl.service.store import JobRecord
from trainctl.v1 import training_pb2 as pb

DEFAULT_CAPACITY = 20_000
"""Specs kept (a small job's is about 0.5 KiB serialized): a ListJobs walk over the newest jobs of every
tenant stays converted."""


class JobMessages:
    """Job messages of stored records; the specs' serialized form is kept for the `capacity` most recently
    used jobs. Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._specs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._specs)

    def _spec_bytes(self, record: JobRecord) -> bytes:
        with self._lock:
            cached = self._specs.pop(record.id, None)
            if cached is not None:
                self._specs[record.id] = cached  # most recently used last
                return cached
        serialized = job_to_proto(record.job).SerializeToString(deterministic=True)
        with self._lock:
            self._specs[record.id] = serialized
            while len(self._specs) > self._capacity:
                del self._specs[next(iter(self._specs))]
        return serialized

    def message(self, record: JobRecord, metrics: list[dict[str, Any]] | None = None) -> pb.Job:
        """`record` as the API's Job message, with `metrics` (step rows) when given."""
        message = pb.Job.FromString(self._spec_bytes(record))
        message.id = record.id
        fill_status(message.status, record)
        for row in metrics or ():
            step_to_proto(row, message.metrics.add())
        return message


def fill_status(status: pb.JobStatus, record: JobRecord) -> None:
    """The record's status columns as a JobStatus."""
    status.state = pb.JobState.Value(record.state)
    status.reason = record.reason
    for name in ("create_time", "schedule_time", "start_time", "end_time", "update_time"):
        timestamp(getattr(status, name), getattr(record, name))
    status.steps_done = record.steps_done
    status.total_steps = record.total_steps
    if record.first_loss is not None:
        status.first_loss = record.first_loss
    if record.last_loss is not None:
        status.last_loss = record.last_loss
    if record.mfu is not None:
        status.mfu = record.mfu
    status.restarts = record.restarts
    status.tokens_per_second = record.tokens_per_second
    status.run_dir = record.run_dir
    for row in record.placement:
        status.placement.add(rank=int(row["rank"]), node=str(row["node"]), gpu=int(row["gpu"]), coords=row.get("coords", {}))


def step_to_proto(row: dict[str, Any], out: pb.StepMetrics) -> pb.StepMetrics:
    """One step's metrics (a store row or a step event payload) as StepMetrics."""
    out.step = int(row["step"])
    out.loss = float(row["loss"])
    for name in ("grad_norm", "lr", "tokens_per_second", "step_time_seconds"):
        if row.get(name) is not None:
            setattr(out, name, float(row[name]))
    for name in ("tokens", "peak_memory_bytes"):
        if row.get(name) is not None:
            setattr(out, name, int(row[name]))
    if row.get("mfu") is not None:
        out.mfu = float(row["mfu"])
    out.breakdown.update({str(k): float(v) for k, v in (row.get("breakdown") or {}).items()})
    timestamp(out.time, row.get("time"))
    return out
