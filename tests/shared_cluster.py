"""The `cluster` fixture's embedded Ray, kept from one test module to the next that asks for the same
shape: starting one costs 15-20 s on 2 busy cores, and most modules ask for the default one.

One cluster runs at a time. A module gets the kept cluster only when it has the module's shape, still
has exactly the nodes it started with and holds no live actor or placement group (each module starts
on an empty cluster, as with a cluster of its own); otherwise the kept one stops and a fresh one starts.
After a module, the cluster is kept only when the next module of the run asks for the same shape, so no
idle cluster runs beside other tests; `grouped_by_shape` (called at collection) runs the modules of one
shape one after another. Each cluster's ranks cache token shards in a directory of its own
(TRAINCTL_DATA_CACHE, set in this process while the cluster runs, and so inherited by its nodes).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

if TYPE_CHECKING:
    from trainctl.workers.embedded import EmbeddedRay


class ClusterShape(NamedTuple):
    """What a module's `pytest.mark.cluster(...)` asks for (defaults: 2 nodes x 1 simulated GPU)."""

    nodes: int = 2
    gpus_per_node: int = 1
    fast_node_failure: bool = False


CONFTEST = Path(__file__).with_name("conftest.py")
"""Where the shared `cluster` fixture is defined."""


def uses_shared_cluster(item: pytest.Item) -> bool:
    """Whether a test's `cluster` is the shared one (not a module's own `cluster` fixture that starts
    its own; one that wraps the shared one, such as test_node_loss.py's, counts)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.get("cluster", ()) if info is not None else ()
    for definition in reversed(definitions):
        if Path(inspect.getfile(definition.func)) == CONFTEST:
            return True
        if "cluster" not in definition.argnames:
            return False
    return False


def cluster_shape(item: pytest.Item) -> ClusterShape | None:
    """The shape of the shared `cluster` a test uses (None: it uses none), from its `cluster` marker."""
    if not uses_shared_cluster(item):
        return None
    marker = item.get_closest_marker("cluster")
    arguments = dict(marker.kwargs) if marker else {}
    unknown = sorted(set(arguments) - set(ClusterShape._fields))
    assert not unknown, f"unknown cluster marker arguments: {unknown}"
    return ClusterShape(**arguments)


def module_shape(items: list[pytest.Item], module: object) -> ClusterShape | None:
    """The cluster shape the tests of `module` among `items` use (None: they use no `cluster`)."""
    shapes = (cluster_shape(item) for item in items if item.module is module)
    return next((shape for shape in shapes if shape is not None), None)


def next_module_shape(items: list[pytest.Item], module: object) -> ClusterShape | None:
    """The cluster shape of the module that runs after `module` among `items` (None: none, or no cluster)."""
    last = max(index for index, item in enumerate(items) if item.module is module)
    return module_shape(items, items[last + 1].module) if last + 1 < len(items) else None


def grouped_by_shape(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each module on the shared cluster moved up to just after the modules already there
    of its shape (every module's tests in their order, the other modules where they were), so that
    modules of one shape run one after another on one cluster."""
    modules: dict[object, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    first_of_shape: dict[ClusterShape, int] = {}
    placed = []
    for position, (module, its) in enumerate(modules.items()):
        shape = module_shape(its, module)
        placed.append((position if shape is None else first_of_shape.setdefault(shape, position), position, its))
    return [item for _, _, its in sorted(placed, key=lambda entry: entry[:2]) for item in its]


class SharedCluster:
    """The session's one running `cluster` (see the module docstring); `close` stops it."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._shape: ClusterShape | None = None
        self._running: EmbeddedRay | None = None
        self._cache_env: pytest.MonkeyPatch | None = None

    def get(self, shape: ClusterShape) -> EmbeddedRay:
        """The kept cluster when it fits a fresh module of `shape`, else a newly started one."""
        import ray

        if self._running is not None and self._shape == shape and self._untouched(self._running):
            if ray.is_initialized():  # a module's own connection: the next one starts disconnected
                ray.shutdown()
            return self._running
        self.close()
        return self._start(shape)

    def after_module(self, next_shape: ClusterShape | None) -> None:
        """Keep the cluster for the next module when it asks for the same shape, else stop it."""
        if next_shape is None or next_shape != self._shape:
            self.close()

    def close(self) -> None:
        if self._running is not None:
            self._running.shutdown()
            self._running = self._shape = None
        if self._cache_env is not None:
            self._cache_env.undo()
            self._cache_env = None

    def _start(self, shape: ClusterShape) -> EmbeddedRay:
        from trainctl.parallelism.data.dataset import CACHE_ENV
        from trainctl.workers.embedded import FAST_NODE_FAILURE_DETECTION, start_embedded

        self._cache_env = pytest.MonkeyPatch()
        self._cache_env.setenv(CACHE_ENV, str(self._tmp_path_factory.mktemp("data-cache")))
        system_config = FAST_NODE_FAILURE_DETECTION if shape.fast_node_failure else None
        self._running = start_embedded(shape.nodes, shape.gpus_per_node, dashboard=True, system_config=system_config)
        self._shape = shape
        return self._running

    def _untouched(self, cluster: EmbeddedRay) -> bool:
        """Whether the cluster has its starting nodes and no live actor or placement group."""
        from ray.util.state import list_actors, list_placement_groups

        from trainctl.workers.embedded import node_name

        assert self._shape is not None
        if cluster.node_names != [node_name(i) for i in range(self._shape.nodes)]:
            return False
        actors = list_actors(address=cluster.address, filters=[("state", "!=", "DEAD")], limit=10_000)
        groups = list_placement_groups(address=cluster.address, filters=[("state", "!=", "REMOVED")], limit=10_000)
        return not actors and not groups
