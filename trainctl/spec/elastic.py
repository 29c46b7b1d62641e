"""Elastic data parallel (`spec.scheduling.elastic`): the smaller layouts a job may train on after losing GPUs.

A shrunk layout changes the data-parallel degree and nothing else: the model-parallel degrees (pp, cp, tp, ep),
the global batch, the micro-batch size and every other setting stay, so each remaining replica accumulates more
micro-batches and a step trains the same sequences in the same order (the engine's data position is exact
across data-parallel sizes). FSDP and ZeRO shrink `dp_shard`, DDP `dp_replicate`, HSDP whole shard groups
(`dp_replicate`). This module only does the arithmetic; `trainctl.spec.validate.elastic_layouts` keeps the
candidates every rule of the spec accepts.
"""

from __future__ import annotations

from collections.abc import Iterator

from trainctl.spec.job import JobSpecBody, ParallelismSpec


def model_parallel_size(parallelism: ParallelismSpec) -> int:
    """GPUs of one data-parallel replica: pp x cp x tp."""
    return parallelism.pp * parallelism.cp * parallelism.tp


def shrunk_parallelism(parallelism: ParallelismSpec, dp: int) -> ParallelismSpec | None:
    """`parallelism` with `dp` data-parallel ranks (None when its data-parallel mode cannot take that many:
    HSDP keeps its shard groups whole)."""
    replicate, shard = parallelism.dp_replicate, parallelism.dp_shard
    if replicate == 1:
        return parallelism.model_copy(update={"dp_shard": dp})
    if shard == 1:
        return parallelism.model_copy(update={"dp_replicate": dp})
    if dp % shard:
        return None
    return parallelism.model_copy(update={"dp_replicate": dp // shard})


def shrunk_candidates(spec: JobSpecBody, max_gpus: int) -> Iterator[JobSpecBody]:
    """Bodies of `spec` on fewer data-parallel ranks, on at most `max_gpus` and at least
    `scheduling.elastic.min_gpus` GPUs, largest first, whose global batch splits evenly over their replicas
    (the spec's other rules unchecked), each without `scheduling.elastic` (a shrunk job does not shrink again
    from its own minimum: the submitted one's stays). None for a job that is not elastic."""
    elastic = spec.scheduling.elastic
    if elastic is None:
        return
    par, train = spec.parallelism, spec.training
    unit = model_parallel_size(par)
    smallest = -(-elastic.min_gpus // unit)
    for dp in range(min(par.dp - 1, max_gpus // unit), smallest - 1, -1):
        if dp < 1 or train.global_batch_size % dp:
            continue
        if train.micro_batch_size != "auto" and (train.global_batch_size // dp) % train.micro_batch_size:
            continue
        parallelism = shrunk_parallelism(par, dp)
        if parallelism is None:
            continue
        yield spec.model_copy(update={
            "parallelism": parallelism,
            "resources": spec.resources.model_copy(update={"gpus": parallelism.world_size}),
            "scheduling": spec.scheduling.model_copy(update={"elastic": None}),
        })
