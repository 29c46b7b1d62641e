"""Single-device efficiency knobs the Trainer applies: `micro_batch_size: auto` and `empty_cache_steps`.

`micro_batch_size: auto` picks the largest divisor of the per-rank batch (global_batch_size / dp)
whose estimated peak memory (`estimator.estimate_memory`, the worst rank) fits a budget:
`MEMORY_FRACTION` of the CUDA device's total memory, or of the host's available memory on CPU.
Gradient accumulation then keeps the global batch. On CUDA the choice is confirmed by a probe step
(`probe_micro_batch`): one forward/backward of a micro-batch of that size without gradient
synchronisation; an out-of-memory error halves it (to the next smaller divisor) until one fits,
and ranks agree on the smallest. With FSDP/ZeRO-2/3 the forward itself communicates, so there the
estimator's choice is used without a probe (a rank that ran out of memory alone would stall its peers),
and so it is under pipeline parallelism (a stage's forward needs its neighbours').

`empty_cache_steps: N` releases the CUDA caching allocator's unused blocks every N steps
(`torch.cuda.empty_cache`) and `allocator_report` reads its retry and fragmentation counters; on CPU
there is no caching allocator and both are no-ops (the report says so).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainctl.parallelism.layouts.parallelize import ParallelModel
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.estimator import estimate_all
from trainctl.parallelism.sizing.micro_batch import micro_batch_candidates, with_micro_batch_size
from trainctl.spec.job import JobSpecBody

MEMORY_FRACTION = 0.85
"""Share of the device memory `auto` lets the estimate fill (the rest: allocator slack, workspace)."""


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(device: torch.device) -> int:
    """Bytes `auto` may plan for on `device`."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_available_bytes()
    return int(total * MEMORY_FRACTION)


def peak_estimate(job: ResolvedJob) -> int:
    """The largest per-rank estimated memory of `job` (bytes)."""
    return max(m.total_bytes for m in estimate_all(job))


def choose_micro_batch_size(job: ResolvedJob, budget: int) -> int:
    """The largest candidate micro-batch whose estimate fits `budget`; ValueError when none does."""
    candidates = micro_batch_candidates(job.spec)
    for micro in candidates:
        if peak_estimate(job.with_spec(with_micro_batch_size(job.spec, micro))) <= budget:
            return micro
    need = peak_estimate(job.with_spec(with_micro_batch_size(job.spec, 1)))
    raise ValueError(
        f"spec.training.micro_batch_size: auto found no micro-batch that fits: even 1 sequence needs an estimated "
        f"{need / 2**30:.2f} GiB per rank, the budget is {budget / 2**30:.2f} GiB; shard more (dp_shard, tp, pp) "
        "or enable activation_checkpointing"
    )


def resolve_micro_batch_size(job: ResolvedJob, device: torch.device) -> ResolvedJob:
    """`job` with `micro_batch_size: auto` replaced by the estimator's choice (unchanged otherwise)."""
    if job.spec.training.micro_batch_size != "auto":
        return job
    return job.with_spec(with_micro_batch_size(job.spec, choose_micro_batch_size(job, memory_budget(device))))


def probe_micro_batch(try_step: Callable[[int], None], candidates: list[int], start: int) -> int:
    """The largest of `candidates` (descending), from `start` down, for which `try_step(m)` does not run
    out of CUDA memory; ranks agree on the smallest (collective when a process group exists)."""
    chosen = candidates[-1]
    for micro in [m for m in candidates if m <= start]:
        try:
            try_step(micro)
            chosen = micro
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    if dist.is_initialized():
        agreed = torch.tensor([chosen], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        chosen = int(agreed)
    return chosen


@dataclass(frozen=True)
class AllocatorReport:
    """The CUDA caching allocator's state (None fields on CPU)."""

    allocated_bytes: int | None
    reserved_bytes: int | None
    fragmentation: float | None
    """1 - allocated / reserved: the share of reserved memory not holding tensors."""
    alloc_retries: int | None
    """cudaMalloc retries after freeing cached blocks (a sign of fragmentation or a too-large batch)."""
    ooms: int | None
    note: str = ""

    def as_breakdown(self) -> dict[str, float]:
        """The numeric fields, for a StepReport's breakdown."""
        if self.reserved_bytes is None:
            return {}
        return {
            "allocator_reserved_bytes": float(self.reserved_bytes),
            "allocator_fragmentation": float(self.fragmentation or 0.0),
            "allocator_retries": float(self.alloc_retries or 0),
        }


def allocator_report(device: torch.device) -> AllocatorReport:
    """Retries and fragmentation of the CUDA caching allocator; a note on devices without one."""
    if device.type != "cuda":
        return AllocatorReport(None, None, None, None, None, note=f"{device.type} has no caching allocator; nothing to report")
    stats = torch.cuda.memory_stats(device)
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    return AllocatorReport(
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        fragmentation=1.0 - allocated / reserved if reserved else 0.0,
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
    )


def after_step(step: int, empty_cache_steps: int, device: torch.device) -> AllocatorReport | None:
    """Every `empty_cache_steps` steps on CUDA: empty the allocator cache and return its report."""
    if not empty_cache_steps or step % empty_cache_steps or device.type != "cuda":
        return None
    report = allocator_report(device)
    torch.cuda.empty_cache()
    return report


PROBE_MODES = ("none", "ddp", "zero1")
"""Data-parallel modes whose forward/backward can run without communication (the probe's requirement)."""


def confirm_micro_batch(
    job: JobSpecBody,
    model: ParallelModel,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]],
    *,
    requested_auto: bool,
) -> JobSpecBody:
    """`job` after the CUDA probe of an `auto` micro-batch on `model`, each forward inside
    `autocast()`; unchanged when the size was given, on CPU, under FSDP/ZeRO-2/3 or under pipeline
    parallelism (whose forward communicates between stages). Runs before the loader is built."""
    if not requested_auto or device.type != "cuda" or model.dp_mode not in PROBE_MODES or model.chunks:
        return job
    (part,) = model.parts
    seq_len = job.data.seq_len

    def try_step(micro: int) -> None:
        tokens = torch.zeros(micro, seq_len, dtype=torch.long, device=device)
        sync = part.no_sync() if isinstance(part, DistributedDataParallel) else contextlib.nullcontext()
        try:
            with sync, autocast():
                part(tokens).float().logsumexp(-1).mean().backward()
        finally:
            part.zero_grad(set_to_none=True)

    micro = probe_micro_batch(try_step, micro_batch_candidates(job), job.training.micro_batch_size)
    torch.cuda.reset_peak_memory_stats(device)
    return job if micro == job.training.micro_batch_size else with_micro_batch_size(job, micro)
