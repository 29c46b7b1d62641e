"""The embedded cluster's start survives Ray's rare "node timed out during startup": the failed
attempt is shut down and the whole cluster is started again, once."""

from __future__ import annotations

from typing import Any

import pytest
from ray.cluster_utils import Cluster

from trainctl.workers import embedded

TIMED_OUT = "The current node timed out during startup."


def flaky_add_nodes(failures: int, started: list[Cluster], *, start_nodes: bool = True) -> Any:
    """`_add_nodes` that starts the nodes (unless ``start_nodes`` is false), then times out on its first
    ``failures`` calls."""
    real = embedded._add_nodes

    def add_nodes(cluster: Cluster, *args: Any) -> dict[str, Any]:
        started.append(cluster)
        nodes = real(cluster, *args) if start_nodes else {}
        if len(started) <= failures:
            raise Exception(TIMED_OUT)  # what ray._private.node.Node raises
        return nodes

    return add_nodes


def test_a_start_that_times_out_is_retried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Cluster] = []
    monkeypatch.setattr(embedded, "_add_nodes", flaky_add_nodes(1, started))
    with embedded.start_embedded(1, 1) as cluster:
        assert len(started) == 2
        assert started[0].head_node is None, "the failed attempt was shut down"
        assert cluster.address == started[1].address
        assert cluster.node_names == ["node-0"]


def test_a_second_time_out_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attempts time out before a node is up (that a started attempt is shut down is proven above)."""
    started: list[Cluster] = []
    monkeypatch.setattr(embedded, "_add_nodes", flaky_add_nodes(2, started, start_nodes=False))
    with pytest.raises(Exception, match=TIMED_OUT):
        embedded.start_embedded(1, 1)
    assert len(started) == embedded.START_ATTEMPTS
