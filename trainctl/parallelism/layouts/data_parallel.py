"""Data parallelism: DDP, ZeRO-1, ZeRO-2, ZeRO-3 / FSDP2 and HSDP, selected by the spec.

Gradients are averaged over every rank that sees different tokens: dp_replicate x dp_shard x cp
(CP ranks split each sequence, so their gradients are partial too). State is sharded over
dp_shard x cp (`dp_shard_cp`) and replicated over dp_replicate.

| mode   | when                                             | implementation                                         |
|--------|--------------------------------------------------|--------------------------------------------------------|
| none   | dp_replicate = dp_shard = cp = 1                 | nothing                                                |
| ddp    | shard group (dp_shard x cp) of 1, or zero_stage 0 | `DistributedDataParallel` over dp_cp (HSDP with a      |
|        |                                                  | 1-way shard when parameters are DTensors, e.g. TP)     |
| zero1  | zero_stage 1                                     | DDP over dp_cp + `ZeroOneSharding` over dp_shard_cp    |
|        |                                                  | (ZeRO-2 instead when parameters are DTensors, e.g. TP) |
| zero2  | zero_stage 2                                     | `fully_shard(reshard_after_forward=False)`             |
| fsdp   | zero_stage 3                                     | `fully_shard` (parameters resharded after forward)     |
| hsdp   | zero_stage 2/3 with dp_replicate > 1             | `fully_shard` on the 2-D (dp_replicate, dp_shard_cp)   |
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainctl.parallelism.layouts.dp_mode import DPMode, effective_mode, partition_sizes
from trainctl.parallelism.layouts.mesh import ParallelMesh
from trainctl.spec.job import ParallelismSpec


def has_dtensor_params(module: nn.Module, ignored: Collection[nn.Parameter] = ()) -> bool:
    """Whether any parameter outside `ignored` is already a DTensor (TP applied)."""
    skip = {id(p) for p in ignored}
    return any(isinstance(p, DTensor) for p in module.parameters() if id(p) not in skip)


def fsdp_mesh(pmesh: ParallelMesh):
    """(dp_replicate, dp_shard_cp) for HSDP, else dp_shard_cp."""
    if pmesh.grid.dp_replicate > 1:
        return pmesh[("dp_replicate", "dp_shard_cp")]
    return pmesh["dp_shard_cp"]


def apply_fsdp(
    part: nn.Module,
    mesh,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    ignored: Collection[nn.Parameter] = (),
) -> nn.Module:
    """`fully_shard` each decoder block, then the root (embedding, final norm and output stay with it).

    bf16: parameters are all-gathered in bf16 and gradients reduced in fp32 (fp32 master weights).
    `ignored` parameters (expert-parallel experts) are left alone.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ignored_set = set(ignored) or None
    layers = getattr(part, "layers", None)
    if layers is not None:
        for block in layers.values():
            fully_shard(
                block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, ignored_params=ignored_set
            )
    fully_shard(part, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, ignored_params=ignored_set)
    return part


def apply_ddp(
    part: nn.Module, pmesh: ParallelMesh, *, param_dtype: torch.dtype | None, ignored: Collection[nn.Parameter] = ()
) -> nn.Module:
    """Replicate `part` over dp_cp with torch DDP. DDP cannot hold DTensor parameters (TP), so those
    parts get FSDP2 over (dp_replicate, dp_shard_cp) instead: pure replication when dp_shard x cp is 1
    (HSDP with a one-way shard), ZeRO-2-style sharding over CP ranks otherwise."""
    if has_dtensor_params(part, ignored):
        mesh = pmesh[("dp_replicate", "dp_shard_cp")]
        return apply_fsdp(part, mesh, reshard_after_forward=False, param_dtype=param_dtype, ignored=ignored)
    if ignored:
        skip = {id(p) for p in ignored}
        names = [n for n, p in part.named_parameters() if id(p) in skip]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, names)
    return DistributedDataParallel(
        part,
        process_group=pmesh.group("dp_cp"),
        gradient_as_bucket_view=True,
        broadcast_buffers=False,
        device_ids=None,
    )


def apply_data_parallel(
    parts: Sequence[nn.Module],
    pmesh: ParallelMesh,
    par: ParallelismSpec,
    *,
    param_dtype: torch.dtype | None,
    ignored: Sequence[Collection[nn.Parameter]] | None = None,
) -> tuple[list[nn.Module], DPMode]:
    """Wrap or shard every model part (pipeline chunk) for the selected mode; last step of parallelize.

    `ignored[i]` are parameters of part i that data parallelism must not touch (expert-parallel
    experts, whose gradients expert_parallel reduces itself).
    """
    ignored = ignored or [() for _ in parts]
    mode = effective_mode(par, any(has_dtensor_params(p, ig) for p, ig in zip(parts, ignored, strict=True)))
    if mode == "none":
        return list(parts), mode
    if mode in ("ddp", "zero1"):
        return [apply_ddp(p, pmesh, param_dtype=param_dtype, ignored=ig) for p, ig in zip(parts, ignored, strict=True)], mode
    mesh = fsdp_mesh(pmesh)
    reshard = mode == "fsdp" or (mode == "hsdp" and par.zero_stage == 3)
    return [
        apply_fsdp(p, mesh, reshard_after_forward=reshard, param_dtype=param_dtype, ignored=ig)
        for p, ig in zip(parts, ignored, strict=True)
    ], mode


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroOneSharding:
    """ZeRO-1: each rank of the shard group keeps optimizer state only for the parameters it owns.

    Gradients are already averaged (DDP). The rank's optimizer steps its own parameters; then every
    parameter is broadcast from its owner (one coalesced broadcast per owner). `private` parameters
    (expert-parallel experts, different on every rank) are always stepped locally and never broadcast.
    """

    def __init__(
        self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, private: Collection[nn.Parameter] = ()
    ):
        params = list(params)
        skip = {id(p) for p in private}
        self.private = [p for p in params if id(p) in skip]
        self.params = [p for p in params if p.requires_grad and id(p) not in skip]
        self.group = group
        self.group_ranks = dist.get_process_group_ranks(group)
        n = len(self.group_ranks)
        if len(self.params) < n:
            raise ValueError(
                f"ZeRO-1 over {n} ranks needs at least {n} parameter tensors, the model has {len(self.params)}"
            )
        self.owner = partition_sizes([_local(p).numel() for p in self.params], n)
        self.local_index = self.group_ranks.index(dist.get_rank())

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank's optimizer steps: its share of the replicated ones, then the private."""
        return [p for p, o in zip(self.params, self.owner, strict=True) if o == self.local_index] + self.private

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """After the owner's step: every parameter from its owner to the whole shard group."""
        for index, src in enumerate(self.group_ranks):
            tensors = [_local(p) for p, o in zip(self.params, self.owner, strict=True) if o == index]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=src, group=self.group)
            if index != self.local_index:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
