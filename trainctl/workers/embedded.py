"""An embedded Ray cluster on loopback: N simulated nodes x G simulated GPUs in this machine.

Each node is a real Ray node (its own raylet) started with ``ray.cluster_utils.Cluster``, bound to
127.0.0.1, labelled ``trainctl.io/node: node-<i>`` plus the topology labels of its entry in the
simulated topology map, and offering one ``trainctl_gpu_<i>`` slot resource per simulated GPU (no
Ray ``GPU`` resource, so torch never touches CUDA). The first node is the head; it also offers the
``trainctl_control`` resource job supervisors run on. ``trainctl serve``
with no --ray-address starts one (``--nodes`` x ``--gpus-per-node``, 1 x 8 by default).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from trainctl.workers.command.launcher import live, tree
from trainctl.workers.rank_worker import free_port
from trainctl.workers.resources import CONTROL_CAPACITY, CONTROL_RESOURCE, NODE_LABEL, slot_resources
from trainctl.workers.topology.model import TopologyMap, simulated_topology

LOOPBACK = "127.0.0.1"
LABEL_PREFIX = "trainctl.io/"
OBJECT_STORE_BYTES = 100 * 1024 * 1024
START_ATTEMPTS = 2
"""Times `start_embedded` starts the cluster before giving up (a node rarely fails to register in time)."""
RAY_PACKAGE = str(Path(ray.__file__).parent)
"""Where Ray's daemons, dashboard and worker scripts run from (in each such process's command line)."""
RAY_TITLE = b"ray::"
"""How the processes Ray renames (agents, workers) begin their command line."""


def node_name(index: int) -> str:
    """Name of the ``index``-th simulated node (node-0, node-1, ...)."""
    return f"node-{index}"


log = logging.getLogger(__name__)


@dataclass
class EmbeddedRay:
    """A running embedded cluster. Call `shutdown` (or use it as a context manager)."""

    address: str
    """GCS address to pass to ``ray.init`` / `RayRuntime`."""
    gpus_per_node: int
    topology: TopologyMap
    """The simulated topology map the node labels come from."""
    labels: dict[str, dict[str, str]]
    """Labels of each node, by node name."""
    _cluster: Cluster
    _nodes: dict[str, Any] = field(default_factory=dict)

    @property
    def node_names(self) -> list[str]:
        """Names of the nodes still in the cluster, in start order."""
        return list(self._nodes)

    def add_node(self, name: str, gpus: int, labels: dict[str, str] | None = None) -> None:
        """Start one more node (outside the topology map): ``name`` label, ``gpus`` simulated GPUs."""
        if name in self._nodes:
            raise ValueError(f"node {name!r} is already in the embedded cluster")
        node_labels = {**(labels or {}), NODE_LABEL: name}
        self._nodes[name] = self._cluster.add_node(
            node_ip_address=LOOPBACK,
            dashboard_agent_listen_port=None,
            num_cpus=0,
            num_gpus=0,
            resources=slot_resources(gpus),
            labels=node_labels,
            object_store_memory=OBJECT_STORE_BYTES,
        )
        self.labels[name] = node_labels

    def remove_node(self, name: str) -> None:
        """Kill every process of a (non-head) node, as if the machine died."""
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(f"no node {name!r} in the embedded cluster (nodes: {', '.join(self._nodes)})")
        if node is self._cluster.head_node:
            raise ValueError(f"{name} is the head node; removing it would end the cluster")
        self._cluster.remove_node(node, allow_graceful=False)
        del self._nodes[name]
        del self.labels[name]

    def shutdown(self) -> None:
        """Disconnect this process and stop every node (only this cluster's processes)."""
        if ray.is_initialized():
            ray.shutdown()
        self._cluster.shutdown()
        self._nodes.clear()

    def __enter__(self) -> EmbeddedRay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


FAST_NODE_FAILURE_DETECTION: Mapping[str, Any] = MappingProxyType({
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 3000,
    "health_check_failure_threshold": 3,
})
"""Ray system config that declares a killed node dead in about 3 s instead of Ray's default of about
15 s (a check every 3 s, 5 misses); for node-loss tests, where that wait is most of the test."""


def start_embedded(
    nodes: int = 2,
    gpus_per_node: int = 4,
    *,
    head_cpus: int = 1,
    dashboard: bool = False,
    system_config: Mapping[str, Any] | None = None,
) -> EmbeddedRay:
    """Start ``nodes`` labelled Ray nodes with ``gpus_per_node`` simulated GPUs each, on loopback.

    ``head_cpus`` CPUs go to the head node (for Ray's own tasks; trainctl's actors take none).
    ``dashboard`` starts Ray's dashboard on the head (the ``ray.util.state`` API needs it).
    ``system_config`` is Ray's internal configuration for the cluster (for example
    `FAST_NODE_FAILURE_DETECTION`).
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if head_cpus < 0:
        raise ValueError(f"head_cpus must be >= 0, got {head_cpus}")
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported, so the embedded cluster binds 127.0.0.1 only"
        )
    topology = simulated_topology(nodes, gpus_per_node)
    labels = {node_name(i): topology_labels(topology, node_name(i)) for i in range(nodes)}
    for attempt in range(1, START_ATTEMPTS + 1):
        cluster = Cluster(shutdown_at_exit=True)
        running = ray_processes()
        try:
            nodes_by_name = _add_nodes(cluster, labels, gpus_per_node, head_cpus, dashboard, system_config)
            break
        except BaseException as exc:
            cluster.shutdown()
            # A node whose start timed out is not the cluster's, so `shutdown` leaves the processes it
            # started (GCS, raylet, dashboard, monitor, agents): they would run on beside the next attempt.
            for pid in ray_processes() - running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Ray's "node timed out during startup" (a raylet that never registered) is seen rarely on a
            # loaded machine: start the whole cluster again once.
            if attempt == START_ATTEMPTS or not isinstance(exc, Exception):
                raise
            log.warning("embedded Ray did not start (%s); starting it again", exc)
    return EmbeddedRay(
        address=cluster.address,
        gpus_per_node=gpus_per_node,
        topology=topology,
        labels=labels,
        _cluster=cluster,
        _nodes=nodes_by_name,
    )


def ray_processes() -> set[int]:
    """The live processes below this one that are Ray's: those that run from its package (GCS, raylets,
    dashboard, monitor) and those that took a `ray::` title (each raylet's dashboard and runtime-env agents,
    its idle workers), which outlive a killed raylet: they share its pipe, so none of them sees it close."""
    found = set()
    for pid in live(tree(os.getpid())):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue  # gone meanwhile
        if command.startswith(RAY_TITLE) or RAY_PACKAGE.encode() in command:
            found.add(pid)
    return found


def _add_nodes(
    cluster: Cluster,
    labels: dict[str, dict[str, str]],
    gpus_per_node: int,
    head_cpus: int,
    dashboard: bool,
    system_config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Start the head and the other nodes on loopback; the Ray node of each name."""
    started = {}
    for index, (name, node_labels) in enumerate(labels.items()):
        extra: dict[str, Any] = {"num_cpus": 0, "resources": slot_resources(gpus_per_node)}
        if index == 0:
            extra = {
                "num_cpus": head_cpus,
                "include_dashboard": dashboard,
                "resources": {**slot_resources(gpus_per_node), CONTROL_RESOURCE: CONTROL_CAPACITY},
                # Ray's log monitor only forwards worker output to drivers that ask for it, and
                # trainctl's never do (log_to_driver=False); it rescans every worker's log file each
                # second, a few percent of a core on a busy cluster.
                "include_log_monitor": False,
            }
            if system_config:
                extra["_system_config"] = dict(system_config)
            if dashboard:  # never Ray's fixed default port: other clusters may run on this machine
                extra["dashboard_port"] = free_port(LOOPBACK)
        started[name] = cluster.add_node(
            node_ip_address=LOOPBACK,
            dashboard_agent_listen_port=None,  # a free port, not the fixed default
            num_gpus=0,
            labels=node_labels,
            object_store_memory=OBJECT_STORE_BYTES,
            **extra,
        )
    cluster.wait_for_nodes()
    return started


def topology_labels(topology: TopologyMap, name: str) -> dict[str, str]:
    """The Ray labels of a node's entry in the map: its name, NVLink reach, leaf switch and GPUs."""
    node = topology.node(name)
    labels = {NODE_LABEL: name, f"{LABEL_PREFIX}gpus": str(len(node.gpus))}
    nvlink = topology.nvlink_group_of(name)
    if nvlink is not None:
        labels[f"{LABEL_PREFIX}nvlink-domain"] = _label_value(nvlink)
    leaves = sorted({nic.leaf for nic in node.nics if nic.leaf})
    if leaves:
        labels[f"{LABEL_PREFIX}leaf"] = _label_value(leaves[0])
    if node.gpu_model:
        labels[f"{LABEL_PREFIX}gpu-model"] = _label_value(node.gpu_model)
    return labels


def _label_value(text: str) -> str:
    """``text`` with characters Ray label values do not allow replaced by '.' (at most 63 characters)."""
    value = re.sub(r"[^A-Za-z0-9_.-]", ".", text).strip("._-")
    return value[:63].rstrip("._-") or "none"
