"""Tied input/output embeddings across pipeline stages (Megatron's "embedding group").

With `tie_embeddings` one matrix is both `tok_embeddings.weight` (first stage) and `output.weight`
(last stage). Under pipeline parallelism those stages run on different ranks, so each keeps a copy:
they start equal (the model is built and initialised whole, then cut, and a stage keeps the tied
Parameter object), their gradients are summed after every backward, so the two copies receive the
same gradient, hence the same update, and stay equal. The sum runs between the first and the last
pipeline rank of each (dp_replicate, dp_shard, cp, tp) coordinate, on local gradient shards, which
match because both copies are sharded alike. The last stage's copy is a duplicate for the global
gradient norm (`duplicates`), which counts the matrix once, as in a single process.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainctl.parallelism.layouts.mesh import ParallelMesh

FIRST, LAST = "tok_embeddings.weight", "output.weight"


class TiedEmbeddingSync:
    """Sums the gradients of the tied embedding copies of the first and the last pipeline stage."""

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], pmesh: ParallelMesh):
        owned = dict(named_parameters)
        self.params = [owned[name] for name in (FIRST, LAST) if name in owned]
        self.duplicates = [owned[LAST]] if LAST in owned else []
        self.group = _first_last_group(pmesh)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """All-reduce (sum) this rank's copy's gradient with its twin's (call after backward, on every rank)."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=self.group)


def _first_last_group(pmesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The group {first pipeline rank, last pipeline rank} of this rank's coordinate, or None for a middle
    stage (every rank creates every group, in one order, as `new_group` requires)."""
    ranks = pmesh.world.mesh  # [pp, dp_replicate, dp_shard, cp, tp]
    if ranks.shape[0] == 2:
        return pmesh.group("pp")
    mine = None
    for coordinate in itertools.product(*(range(n) for n in ranks.shape[1:])):
        pair = [int(ranks[(0, *coordinate)]), int(ranks[(-1, *coordinate)])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
