"""The DeviceMesh built from the RankGrid: one named dimension per grid dimension, plus flattened views.

Dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost, as in `RankGrid`).
Flattened sub-meshes: `dp` = dp_replicate x dp_shard (the batch split), `dp_shard_cp` = dp_shard x cp
(what FSDP / ZeRO shards over: CP ranks hold the same parameters, so they shard and reduce them too),
`dp_cp` = dp_replicate x dp_shard x cp (every rank a gradient is averaged over).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainctl.parallelism.layouts.grid import DIMS, RankGrid

FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened sub-mesh names and the grid dimensions each one spans."""


@dataclass(frozen=True)
class ParallelMesh:
    """The world DeviceMesh and the grid it realises; `mesh[name]` for a dim or flattened view."""

    grid: RankGrid
    world: DeviceMesh

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        return self.world[name]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one named dimension or flattened view."""
        return self.world[name].get_group()

    def size(self, name: str) -> int:
        """Ranks along a dimension or flattened view."""
        if name in FLATTENED:
            return prod(getattr(self.grid, d) for d in FLATTENED[name])
        return getattr(self.grid, name)


def build_mesh(grid: RankGrid, device_type: str) -> ParallelMesh:
    """Create the world mesh (needs an initialised default process group of grid.world_size ranks)."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialised (call init_distributed first)")
    if dist.get_world_size() != grid.world_size:
        raise RuntimeError(
            f"the layout {grid.describe()} needs {grid.world_size} ranks but the process group has {dist.get_world_size()}"
        )
    world = init_device_mesh(device_type, grid.shape, mesh_dim_names=DIMS)
    for name, dims in FLATTENED.items():
        world[dims]._flatten(name)
    return ParallelMesh(grid=grid, world=world)
