"""The environment a command job's rank runs its program with: what `torchrun` gives, from the placement.

Ranks are numbered by the placement (`RankAssignment.rank`), never by Ray's bundle order. Nodes are
numbered (``GROUP_RANK``) in the order of their lowest rank, and the ranks of one node are its local
ranks in rank order. On CUDA, ``CUDA_VISIBLE_DEVICES`` lists the node's planned GPUs of this job in local
rank order, so a program that does ``torch.cuda.set_device(LOCAL_RANK)`` (the torchrun convention) uses
the GPU placement chose for it; on CPU it is empty. trainctl's own variables carry the job id, the
checkpoint directory and the declared layout (docs/command-jobs.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainctl.parallelism.layouts.grid import DIMS, RankGrid
from trainctl.workers.placement.plan import RankAssignment

JOB_ID_ENV = "TRAINCTL_JOB_ID"
CHECKPOINT_DIR_ENV = "TRAINCTL_CHECKPOINT_DIR"
LAYOUT_ENV = "TRAINCTL_LAYOUT"
"""The declared layout, outermost dimension first: ``pp=1,dp_replicate=2,dp_shard=1,cp=1,tp=4``."""
COORDS_ENV = "TRAINCTL_RANK_COORDS"
"""This rank's coordinates in the layout, same order: ``pp=0,dp_replicate=1,dp_shard=0,cp=0,tp=3``."""


def rank_environment(
    slots: Sequence[RankAssignment],
    rank: int,
    *,
    grid: RankGrid,
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    job_id: str,
    checkpoint_dir: str,
    use_gpu: bool,
) -> dict[str, str]:
    """The torchrun and trainctl variables of ``rank`` in the group placed on ``slots``."""
    ordered = sorted(slots, key=lambda slot: slot.rank)
    nodes = list(dict.fromkeys(slot.node for slot in ordered))
    mine = next(slot for slot in ordered if slot.rank == rank)
    local = [slot for slot in ordered if slot.node == mine.node]
    coords = grid.coords(rank)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(ordered)),
        "LOCAL_RANK": str(local.index(mine)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "GROUP_RANK": str(nodes.index(mine.node)),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(len(ordered)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "CUDA_VISIBLE_DEVICES": ",".join(str(slot.gpu) for slot in local) if use_gpu else "",
        JOB_ID_ENV: job_id,
        CHECKPOINT_DIR_ENV: checkpoint_dir,
        LAYOUT_ENV: ",".join(f"{dim}={getattr(grid, dim)}" for dim in DIMS),
        COORDS_ENV: ",".join(f"{dim}={coords[dim]}" for dim in DIMS),
    }
