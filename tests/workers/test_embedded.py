"""The embedded loopback cluster: labelled nodes, GPU slots, the topology labels."""

from __future__ import annotations

import pytest
import ray

from trainctl.workers.embedded import start_embedded, topology_labels
from trainctl.workers.resources import CONTROL_RESOURCE, NODE_LABEL, gpu_slot
from trainctl.workers.topology.model import simulated_topology


def test_nodes_are_labelled_and_offer_gpu_slots(embedded_ray):
    ours = set(embedded_ray.node_names)  # other tests may add (and remove) spare nodes
    by_name = {n["Labels"][NODE_LABEL]: n for n in ray.nodes() if n["Alive"] and n["Labels"][NODE_LABEL] in ours}
    assert sorted(by_name) == ["node-0", "node-1", "node-2"]
    for name, info in by_name.items():
        assert info["NodeManagerAddress"] == "127.0.0.1"
        assert {key: info["Labels"][key] for key in embedded_ray.labels[name]} == embedded_ray.labels[name]
        assert info["Labels"]["trainctl.io/nvlink-domain"] == f"nvl-{name}"
        assert all(info["Resources"].get(gpu_slot(i)) == 1.0 for i in range(4))
        assert gpu_slot(4) not in info["Resources"]
        assert "GPU" not in info["Resources"]  # simulated GPUs are slots only: torch never sees CUDA
        assert (CONTROL_RESOURCE in info["Resources"]) == (name == "node-0")  # supervisors go to the head
    assert [n.name for n in embedded_ray.topology.nodes] == ["node-0", "node-1", "node-2"]


def test_topology_labels_are_valid_ray_label_values():
    topology = simulated_topology(2, 8)
    labels = topology_labels(topology, "node-1")
    assert labels[NODE_LABEL] == "node-1"
    assert labels["trainctl.io/gpus"] == "8"
    assert labels["trainctl.io/leaf"] == "leaf-0"
    with pytest.raises(KeyError, match="node-9"):
        topology_labels(topology, "node-9")


@pytest.mark.parametrize(("nodes", "gpus", "message"), [(0, 4, "nodes must be >= 1"), (2, 0, "gpus_per_node must be >= 1")])
def test_bad_sizes_are_rejected(nodes, gpus, message):
    with pytest.raises(ValueError, match=message):
        start_embedded(nodes, gpus)
