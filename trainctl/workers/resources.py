"""How trainctl names its nodes and GPUs to Ray: the node label and the per-GPU slot resources.

Every node trainctl schedules on carries the label ``trainctl.io/node: <name>`` (the node's name in the
topology map) and one custom resource per GPU, ``trainctl_gpu_<i>: 1`` for local GPU index ``i``. A
rank's placement-group bundle asks for exactly the slot the plan names and selects the node by label,
so Ray can only reserve the planned GPU of the planned node; two jobs can never hold the same slot.
Simulated GPUs (CPU-only machines) are slots without Ray ``GPU`` resources, so torch never sees CUDA.
The head node also offers ``trainctl_control``, which keeps job supervisors off the GPU nodes.
"""

from __future__ import annotations

import re

NODE_LABEL = "trainctl.io/node"
"""Ray node label holding the node's name in the topology map (e.g. node-0)."""

GPU_SLOT_PREFIX = "trainctl_gpu_"

CONTROL_RESOURCE = "trainctl_control"
"""Custom resource of the node(s) meant for job supervisors (the head); each supervisor takes
`SUPERVISOR_SHARE` of it, so it never lands on (and dies with) a GPU node when such a node exists."""
CONTROL_CAPACITY = 1000.0
"""Amount of `CONTROL_RESOURCE` a control node advertises."""
SUPERVISOR_SHARE = 0.01
"""Amount of `CONTROL_RESOURCE` one supervisor takes (100,000 supervisors per control node)."""
RANK_OPENMP_THREADS = "1"
"""OMP_NUM_THREADS of every rank (model or command job) whose environment sets none: torchrun's default
with several ranks per node. torch otherwise gives each rank one intra-op thread per core, so the ranks of
a node contend for every core: on the 2-core dev machine a 2-rank tensor-parallel step took 3.5 times as
long, and an FSDP step 1.15 times (bench/rank_threads.py)."""
_SLOT_PATTERN = re.compile(rf"^{GPU_SLOT_PREFIX}(\d+)$")


def gpu_slot(index: int) -> str:
    """The custom resource that stands for local GPU ``index`` of a node."""
    if index < 0:
        raise ValueError(f"GPU index must be >= 0, got {index}")
    return f"{GPU_SLOT_PREFIX}{index}"


def slot_index(resource: str) -> int | None:
    """The GPU index of a slot resource name, or None when ``resource`` is not a slot."""
    match = _SLOT_PATTERN.match(resource)
    return int(match.group(1)) if match else None


def slot_resources(gpus: int) -> dict[str, float]:
    """The custom resources a node with ``gpus`` GPUs advertises (``ray start --resources``)."""
    if gpus < 0:
        raise ValueError(f"a node's GPU count must be >= 0, got {gpus}")
    return {gpu_slot(i): 1.0 for i in range(gpus)}


def slots_of(resources: dict[str, float]) -> list[int]:
    """Sorted GPU indices among a resource map's slot resources (whole units only)."""
    return sorted(i for name, amount in resources.items() if (i := slot_index(name)) is not None and amount >= 1)
