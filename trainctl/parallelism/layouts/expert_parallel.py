"""Expert parallelism: MoE experts sharded over the EP group, tokens moved by all-to-all.

EP groups come from the rank grid: consecutive blocks of `ep` positions of the flattened
`dp_shard x cp` index (`RankGrid.groups("ep")`), realised as the DeviceMesh view that unflattens
`dp_shard_cp` into `(ep_dp, ep)`. EP rank `r` of a group holds experts
`[r * E/ep, (r + 1) * E/ep)` of every MoE layer as DTensor parameters sharded on dim 0 over the EP
mesh, so DCP checkpoints reshard between EP degrees and the global gradient norm reduces them over
their mesh.

Forward of one MoE layer (`AllToAllDispatcher.run`): the rank's token assignments arrive sorted by
global expert id; (1) the per-expert counts are exchanged with an all-to-all, (2) the tokens with a
variable-split all-to-all (`torch.distributed.nn.functional.all_to_all_single`, differentiable: its
backward is the reverse all-to-all), (3) received tokens are regrouped by local expert and run, (4)
results go back by the reverse all-to-all in the original order. Dropless: every assignment is
computed.

Gradients. Every EP rank sees different tokens, so an expert's gradient on its owner is the sum of
the contributions of the EP group's local objectives. Expert parameters are not data-parallel
parameters: `data_parallel` must leave them alone (`expert_parameters(part)` lists them, to pass as
FSDP's `ignored_params`), and after backward `reduce_expert_gradients(parts)` sums each expert
gradient over its replicas (the `ep_dp` and `dp_replicate` ranks holding the same experts) and
divides by dp_replicate x dp_shard x cp, the ranks every dense gradient is averaged over. TP ranks
hold identical replicas of the experts and compute the same values from the same (replicated)
input, so they need no reduction; PP stages hold disjoint MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard

from trainctl.parallelism.layouts.grid import LayoutError
from trainctl.parallelism.layouts.mesh import ParallelMesh
from trainctl.parallelism.model.moe import GroupedExperts, MoEFeedForward
from trainctl.spec.job import JobSpecBody


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups one rank's experts use."""

    ep_mesh: DeviceMesh
    """1-d mesh of the EP group (experts sharded over it)."""
    replica_groups: tuple[dist.ProcessGroup, ...]
    """Groups whose ranks hold the same experts, over which expert gradients are summed."""
    grad_divisor: int
    """dp_replicate x dp_shard x cp: what every dense gradient is averaged over."""


def expert_groups(pmesh: ParallelMesh) -> ExpertGroups:
    """The EP mesh and replica groups of this rank, checked against the rank grid."""
    grid = pmesh.grid
    ep_dp = grid.dp_shard * grid.cp // grid.ep
    mesh = pmesh["dp_shard_cp"]._unflatten(0, (ep_dp, grid.ep), ("ep_dp", "ep"))
    ep_mesh = mesh["ep"]
    rank = dist.get_rank()
    got = sorted(dist.get_process_group_ranks(ep_mesh.get_group()))
    want = sorted(grid.group("ep", rank))
    if got != want:
        raise LayoutError(f"EP mesh ranks {got} differ from the rank grid's EP group {want} for rank {rank}")
    replicas = [mesh["ep_dp"].get_group()] if ep_dp > 1 else []
    if grid.dp_replicate > 1:
        replicas.append(pmesh.group("dp_replicate"))
    return ExpertGroups(
        ep_mesh=ep_mesh, replica_groups=tuple(replicas), grad_divisor=grid.dp_replicate * grid.dp_shard * grid.cp
    )


class AllToAllDispatcher:
    """Runs routed tokens on the experts' owners across the EP group (see the module docstring)."""

    def __init__(self, groups: ExpertGroups, num_experts: int):
        self.groups = groups
        self.group = groups.ep_mesh.get_group()
        self.ep = groups.ep_mesh.size()
        self.num_local = num_experts // self.ep

    def run(self, experts: GroupedExperts, x_sorted: Tensor, counts: Tensor) -> Tensor:
        ep, local = self.ep, self.num_local
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        from_source = received_counts.view(ep, local)  # [source rank, local expert]
        recv_splits = from_source.sum(dim=1).tolist()

        received = all_to_all_single(
            x_sorted.new_empty(sum(recv_splits), x_sorted.shape[-1]),
            x_sorted,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
        )
        # Received rows are ordered (source, local expert); the experts want (local expert, source).
        segment = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), from_source.reshape(-1))
        order = torch.argsort((segment % local) * ep + segment // local, stable=True)
        out = experts(received[order], from_source.sum(dim=0).tolist())
        restored = out[torch.argsort(order)]
        return all_to_all_single(
            restored.new_empty(sum(send_splits), restored.shape[-1]),
            restored,
            output_split_sizes=send_splits,
            input_split_sizes=recv_splits,
            group=self.group,
        )


def _shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """Keep this EP rank's contiguous block of experts, as DTensors sharded on dim 0."""
    per_rank = experts.num_local // ep_mesh.size()
    start = ep_mesh.get_local_rank() * per_rank
    for name in ("w1", "w2", "w3"):
        local = getattr(experts, name).detach()[start : start + per_rank].clone()
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
    experts.num_local = per_rank


def apply_expert_parallel(part: nn.Module, pmesh: ParallelMesh, job: JobSpecBody) -> nn.Module:
    """Shard the experts of every MoE layer in `part` over this rank's EP group (in place)."""
    grid = pmesh.grid
    moe_layers = [m for m in part.modules() if isinstance(m, MoEFeedForward)]
    if grid.ep == 1 or not moe_layers:
        return part
    groups = expert_groups(pmesh)
    for moe in moe_layers:
        if moe.num_experts % grid.ep:
            raise LayoutError(f"ep={grid.ep} must divide the number of experts ({moe.num_experts})")
        if isinstance(moe.dispatcher, AllToAllDispatcher):
            raise LayoutError("expert parallelism was already applied to this model part")
        _shard_experts(moe.experts, groups.ep_mesh)
        moe.dispatcher = AllToAllDispatcher(groups, moe.num_experts)
    return part


def expert_parameters(part: nn.Module) -> list[nn.Parameter]:
    """Parameters sharded by expert parallelism (to keep out of FSDP / DDP / ZeRO)."""
    return [
        p
        for m in part.modules()
        if isinstance(m, MoEFeedForward) and isinstance(m.dispatcher, AllToAllDispatcher)
        for p in m.experts.parameters()
    ]


@torch.no_grad()
def reduce_expert_gradients(parts: list[nn.Module]) -> None:
    """Sum expert gradients over their replicas and divide by the data-parallel degree (call once
    per step after backward, before clipping)."""
    for part in parts:
        for moe in part.modules():
            if not isinstance(moe, MoEFeedForward) or not isinstance(moe.dispatcher, AllToAllDispatcher):
                continue
            groups = moe.dispatcher.groups
            for param in moe.experts.parameters():
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                for group in groups.replica_groups:
                    dist.all_reduce(grad, group=group)
                grad.div_(groups.grad_divisor)
