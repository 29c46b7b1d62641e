"""Stored jobs as the API's `Job` message, each answer kept serialized until its job changes.

Converting a job (`convert.job_to_proto`, a walk of the pydantic model, then its status) is most of what a
GetJob or a ListJobs page would cost. `JobMessages` keeps, for the most recently answered jobs, the spec
part serialized (api_version, kind, metadata, spec: it never changes) and the whole answer serialized as
one entry of `ListJobsResponse.jobs`: serialized messages concatenate (a repeated field's entries add
up), so a ListJobs answer is its jobs' entries joined and goes out without being built or converted. An
answer is good while the job's record has the version it was built from: every write of a job's row
adds one to its version (`JobRecord.version`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

from trainctl.service.newest_kept import NewestKept
from trainctl.service.store import JobRecord
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_to_proto, timestamp

T = TypeVar("T")

DEFAULT_CAPACITY = 20_000
"""Jobs kept (a small job's spec part and answer together are about 0.7 KiB): a ListJobs walk over the
newest jobs of every tenant stays converted."""
FULL_VIEW_STEPS = 10_000
"""Steps a JOB_VIEW_FULL answer holds at most: a longer run's are thinned evenly, its first and last
kept (a million steps would pass the 16 MiB answer limit); WatchJob streams every step. GetJob has the
store thin them (`JobStore.thinned_step_metrics`: evenly over the step numbers, read by index lookups, so
its cost does not grow with the run); `thinned_steps` thins a list already read (the run report's)."""


class _Kept(NamedTuple):
    spec: bytes
    """The spec part of the Job message, serialized."""
    version: int
    """The version of the job's record that `listed` was built from."""
    listed: bytes
    """The whole Job message as one serialized entry of `ListJobsResponse.jobs`."""


class JobMessages:
    """Job messages of stored records, kept serialized for the `capacity` most recently answered jobs.
    Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._kept: NewestKept[_Kept] = NewestKept(capacity)

    def __len__(self) -> int:
        return len(self._kept)

    def listed(self, record: JobRecord) -> bytes:
        """`record` as one serialized entry of `ListJobsResponse.jobs`."""
        kept = self._kept.get(record.id)
        if kept is not None and kept.version == record.version:
            return kept.listed
        spec = kept.spec if kept is not None else job_to_proto(record.job).SerializeToString(deterministic=True)
        message = pb.Job.FromString(spec)
        message.id = record.id
        fill_status(message.status, record)
        listed = pb.ListJobsResponse(jobs=[message]).SerializeToString(deterministic=True)
        return self._kept.add(record.id, _Kept(spec, record.version, listed)).listed

    def page(self, records: list[JobRecord]) -> bytes:
        """A serialized ListJobsResponse holding `records`, in order (and nothing else: the caller may
        append other fields, serialized)."""
        return b"".join(self.listed(record) for record in records)

    def message(self, record: JobRecord, metrics: list[dict[str, Any]] | None = None) -> pb.Job:
        """`record` as the API's Job message, with `metrics` (step rows) when given."""
        message = pb.Job()
        message.MergeFrom(pb.ListJobsResponse.FromString(self.listed(record)).jobs[0])
        for row in metrics or ():
            step_to_proto(row, message.metrics.add())
        return message


def full_view(messages: JobMessages, record: JobRecord, steps: list[dict[str, Any]]) -> pb.Job:
    """The job as GetJob(JOB_VIEW_FULL) answers it (and the service's run report draws it): its message with
    its step rows `steps`, at most FULL_VIEW_STEPS of them (`thinned_steps`)."""
    return messages.message(record, thinned_steps(steps, FULL_VIEW_STEPS))


def thinned_steps(steps: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` of the step rows `steps` in step order: the steps that evaluated (an eval curve has
    far fewer points than the training curve) evenly thinned to half of `limit` at most, the others evenly
    thinned to the rest."""
    if len(steps) <= limit:
        return steps
    evaluated = evenly_thinned([row for row in steps if row.get("eval_loss") is not None], max(2, limit // 2))
    kept = {id(row) for row in evaluated}
    others = evenly_thinned([row for row in steps if id(row) not in kept and row.get("eval_loss") is None],
                            max(2, limit - len(evaluated)))
    return sorted(evaluated + others, key=lambda row: row["step"])


def evenly_thinned(items: list[T], limit: int) -> list[T]:
    """At most `limit` (at least 2) of `items`, evenly spaced, the first and the last among them."""
    if len(items) <= limit:
        return items
    last = len(items) - 1
    return [items[i] for i in sorted({round(k * last / (limit - 1)) for k in range(limit)})]


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
    if record.mfu_full_attention is not None:
        status.mfu_full_attention = record.mfu_full_attention
    if record.last_eval_loss is not None:
        status.last_eval_loss = record.last_eval_loss
    status.restarts = record.restarts
    status.preemptions = record.preemptions
    timestamp(status.preempt_time, record.preempt_time)
    status.tokens_per_second = record.tokens_per_second
    status.run_dir = record.run_dir
    for row in record.placement:
        status.placement.add(rank=int(row["rank"]), node=str(row["node"]), gpu=int(row["gpu"]), coords=row.get("coords", {}))


def step_to_proto(row: dict[str, Any], out: pb.StepMetrics) -> pb.StepMetrics:
    """One step's metrics (a store row or a step event payload) as StepMetrics."""
    out.step = int(row["step"])
    out.loss = float(row["loss"])
    for name in ("grad_norm", "lr", "tokens_per_second", "step_time_seconds", "eval_loss"):
        if row.get(name) is not None:
            setattr(out, name, float(row[name]))
    for name in ("tokens", "peak_memory_bytes"):
        if row.get(name) is not None:
            setattr(out, name, int(row[name]))
    for name in ("mfu", "mfu_full_attention"):  # Megatron's convention, torchtitan's
        if row.get(name) is not None:
            setattr(out, name, float(row[name]))
    out.breakdown.update({str(k): float(v) for k, v in (row.get("breakdown") or {}).items()})
    timestamp(out.time, row.get("time"))
    return out
