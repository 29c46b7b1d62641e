"""Process-group set-up and teardown, identical under torchrun, torch.multiprocessing and a RankWorker."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_device(device: str | torch.device, rank: int = 0) -> torch.device:
    """`auto` -> cuda:<local index> when CUDA is available, else cpu; `cuda`/`cpu`/a torch.device as given."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("resources.device is 'cuda' but CUDA is not available on this node")
        return torch.device("cuda", rank % torch.cuda.device_count())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {device!r}; expected 'auto', 'cuda' or 'cpu'")


def default_backend(device: torch.device) -> str:
    """nccl for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    *,
    device: str | torch.device = "auto",
    timeout_seconds: float = 600.0,
) -> torch.device:
    """Join the default process group over a TCPStore at master_addr:master_port; returns this rank's device.

    `backend` None picks nccl for CUDA and gloo for CPU. A CUDA rank is bound to its device first.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call teardown() first")
    dev = resolve_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend=backend or default_backend(dev),
        init_method=f"tcp://{master_addr}:{int(master_port)}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_seconds),
    )
    return dev


def teardown() -> None:
    """Destroy the default process group (and every sub-group) if one exists.

    DTensor caches sharding decisions keyed by meshes that compare equal by shape and names alone; a
    cached entry would hand a later process group's DTensors a mesh whose groups are gone ("Could not
    resolve the process group"), so a process that joins another group after this starts clean.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding propagation and redistribution plans (this thread's), and the
    mesh topologies its collectives cache (they hold the meshes, and so their process groups and gloo
    threads, alive after the groups are destroyed)."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's own cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def world_info() -> tuple[int, int]:
    """(rank, world_size) of the default group, or (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
