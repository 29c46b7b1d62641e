"""Named cluster presets: the topology maps of common fleets by name and size, for offline planning.

`cluster_topology("hgx-h100:16")` is the map of 16 HGX H100 nodes, built by the same generators as
the example maps (builders.py), so a preset plans exactly like the same map loaded from a file.
A preset's `gpu_model` is the name the sizing tables know (trainctl.parallelism.sizing: `peak_flops`,
`gpu_memory_bytes`), so plans on it get that GPU's peak FLOP rate and memory.

| preset | unit | per unit | fabric |
|---|---|---|---|
| `hgx-h100` | node | 8 x H100 SXM5 80 GB, one NVSwitch NVLink domain (450 GB/s) | 8 x 400G NDR InfiniBand rails, 32-node scalable units |
| `gb200-nvl72` | rack | 18 trays x 4 GB200 GPUs, one 72-GPU NVLink domain (900 GB/s) | a 400G NIC per GPU on 4 rails, 8-rack scalable units |
| `pcie-h100-nvl` | node | 8 x H100 NVL (PCIe Gen5, ~50 GB/s), NVLink-bridged in pairs | a 400G NIC per GPU pair on 4 rails, 32-node scalable units |

`pcie-h100-nvl` has no NVLink domain: each node lists its bridged pairs (`nvlink_pairs`, NV12 at
25 GB/s per link) and the PCIe path class of every other pair (`pcie_paths`: PIX under one switch,
PXB within a socket, SYS across), each priced on its own, and each GPU's NIC at PIX (`nic_paths`, the
NIC behind the pair's PCIe switch; docs/placement.md).
Sizes are capped at the largest fleets the placement benchmark runs (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainctl.workers.topology.builders import bridged_pcie_fleet, nvl72_fleet, rail_optimized_fleet
from trainctl.workers.topology.model import TopologyError, TopologyMap


@dataclass(frozen=True)
class ClusterPreset:
    """A fleet by name: `build(n)` is the map of `n` units (nodes or racks)."""

    name: str
    unit: str
    """What N counts: "node" or "rack"."""
    gpus_per_unit: int
    gpu_model: str
    """GPU name as the sizing tables match it."""
    max_units: int
    description: str
    build: Callable[[int], TopologyMap]


CLUSTER_PRESETS: tuple[ClusterPreset, ...] = (
    ClusterPreset(
        "hgx-h100", "node", 8, "H100-SXM5-80GB", 1024,
        "HGX H100 nodes: 8 GPUs on NVSwitch per node, 8 InfiniBand NDR rails",
        lambda n: rail_optimized_fleet(n, name="hgx-h100", gpu_model="H100-SXM5-80GB"),
    ),
    ClusterPreset(
        "gb200-nvl72", "rack", 72, "GB200", 128,
        "GB200 NVL72 racks: 72 GPUs in one NVLink domain per rack, 4 InfiniBand rails",
        lambda n: nvl72_fleet(n, name="gb200-nvl72"),
    ),
    ClusterPreset(
        "pcie-h100-nvl", "node", 8, "H100 NVL", 1024,
        "PCIe servers: 8 H100 NVL per node, NVLink-bridged in pairs, a 400G NIC per pair",
        lambda n: bridged_pcie_fleet(n, name="pcie-h100-nvl", gpu_model="H100 NVL"),
    ),
)


def cluster_preset(name: str) -> ClusterPreset:
    """The preset called `name`; TopologyError listing the known presets when there is none."""
    for preset in CLUSTER_PRESETS:
        if preset.name == name:
            return preset
    known = ", ".join(p.name for p in CLUSTER_PRESETS)
    raise TopologyError(f"no cluster preset {name!r}; known presets: {known}")


def cluster_topology(text: str) -> TopologyMap:
    """The map of `PRESET:N` (N units of the preset); TopologyError naming what is wrong."""
    name, sep, count = text.partition(":")
    if not sep or not name:
        raise TopologyError(f"expected PRESET:N (for example hgx-h100:4), got {text!r}")
    preset = cluster_preset(name)
    units = int(count) if count.isascii() and count.isdigit() and len(count) <= 9 else 0
    if not 1 <= units <= preset.max_units:
        raise TopologyError(
            f"N={count!r}: {preset.name} takes a whole number of {preset.unit}s from 1 to {preset.max_units}"
        )
    return preset.build(units)
