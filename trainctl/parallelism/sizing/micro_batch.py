"""Micro-batch sizes of a job: the ones that keep its global batch, and the job with one of them set.
Pure spec arithmetic (no torch), shared by the engine's `auto` choice and the service's plans."""

from __future__ import annotations

from trainctl.spec.job import JobSpecBody


def with_micro_batch_size(job: JobSpecBody, micro: int) -> JobSpecBody:
    """`job` with `training.micro_batch_size` set to `micro` (validated)."""
    data = job.model_dump()
    data["training"]["micro_batch_size"] = micro
    return JobSpecBody.model_validate(data)


def micro_batch_candidates(job: JobSpecBody) -> list[int]:
    """Divisors of the per-rank batch, largest first: the micro-batch sizes that keep the global batch."""
    per_rank = job.training.global_batch_size // job.parallelism.dp
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
