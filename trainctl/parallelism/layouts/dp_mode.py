"""Which data-parallel implementation a spec selects, and ZeRO-1's partition of parameters among owners:
pure arithmetic (no torch), shared by the data-parallel layout and the memory estimator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from trainctl.spec.job import ParallelismSpec

DPMode = Literal["none", "ddp", "zero1", "zero2", "fsdp", "hsdp"]


def select_mode(par: ParallelismSpec) -> DPMode:
    """Which data-parallel implementation the spec's degrees and zero_stage select."""
    shard = par.dp_shard * par.cp
    if par.dp_replicate * shard == 1:
        return "none"
    if shard == 1 or par.zero_stage == 0:
        return "ddp"
    if par.zero_stage == 1:
        return "zero1"
    if par.dp_replicate > 1:
        return "hsdp"
    return "zero2" if par.zero_stage == 2 else "fsdp"


def effective_mode(par: ParallelismSpec, dtensor_params: bool) -> DPMode:
    """`select_mode`, with ZeRO-1 upgraded to ZeRO-2 when dense parameters are DTensors (TP): DDP
    cannot hold them, and ZeRO-2 shards a superset of what ZeRO-1 shards."""
    mode = select_mode(par)
    return "zero2" if mode == "zero1" and dtensor_params else mode


def gathers_parameters(par: ParallelismSpec) -> bool:
    """Whether the engine runs FSDP2 on the job's parts: ZeRO-2, ZeRO-3, HSDP, and DDP or ZeRO-1 over
    tensor-parallel (DTensor) parameters, which DDP cannot hold (data_parallel.apply_ddp)."""
    mode = effective_mode(par, dtensor_params=par.tp > 1)
    return mode in ("zero2", "fsdp", "hsdp") or (mode == "ddp" and par.tp > 1)


def partition_sizes(sizes: Sequence[int], n: int) -> list[int]:
    """Owner (0..n-1) of each parameter for ZeRO-1: largest first, each to the least-loaded owner
    (ties to the lowest index). Deterministic, so the estimator computes the same partition."""
    if n < 1:
        raise ValueError("partition needs at least one owner")
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        best = min(range(n), key=lambda r: (load[r], r))
        owner[i] = best
        load[best] += sizes[i]
    return owner
