"""What trainctl asks Ray's autoscaler for, and the node types the autoscaler launches from the map.

A topology map may name nodes that have no Ray node yet: the hosts an autoscaler can bring up. Each
such host is one autoscaler node type (`node_types`): its GPU slot resources and the Ray labels of its
entry in the map (name, NVLink reach, leaf switch, GPU model), so the node that joins is the one the
map describes and the placement solver places on it as the map says. `request_nodes` asks for a set of
map nodes: one bundle per node (its slots) with a label selector naming it, a persistent request
(`ray.autoscaler.sdk.request_resources`) that replaces the previous one; an empty set withdraws it, so
idle nodes go after the autoscaler's idle timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.autoscaler.sdk import request_resources

from trainctl.workers.embedded import topology_labels
from trainctl.workers.resources import NODE_LABEL, slot_resources
from trainctl.workers.topology.model import TopologyMap


def node_bundle(topology: TopologyMap, name: str) -> dict[str, float]:
    """The resources of map node `name`: one slot per GPU it lists (usable or not: the node offers them)."""
    return slot_resources(len(topology.node(name).gpus))


def node_types(topology: TopologyMap, names: Sequence[str], *, cpus: int = 0) -> dict[str, dict[str, Any]]:
    """Autoscaler `available_node_types` for the map nodes `names`: one type per node, named after it,
    with its slots (and `cpus` CPUs), its map labels, at most one worker."""
    return {
        name: {
            "resources": {"CPU": cpus, **node_bundle(topology, name)},
            "labels": topology_labels(topology, name),
            "node_config": {},
            "min_workers": 0,
            "max_workers": 1,
        }
        for name in names
    }


def request_nodes(topology: TopologyMap, names: Sequence[str]) -> None:
    """Ask the autoscaler for the map nodes `names` (replacing the last request; none withdraws it)."""
    request_resources(
        bundles=[node_bundle(topology, name) for name in names],
        bundle_label_selectors=[{NODE_LABEL: name} for name in names],
    )
