"""The embedded cluster's start survives Ray's rare "node timed out during startup": the failed
attempt is shut down, the processes its timed-out node had started are killed, and the whole cluster is
started again, once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ray.cluster_utils import Cluster

from trainctl.workers import embedded

TIMED_OUT = "The current node timed out during startup."


def titled(process: subprocess.Popen, timeout: float = 10.0) -> subprocess.Popen:
    """``process`` once it runs under its `ray::` title (until bash has exec'd, it is `bash -c ...`, which
    nobody would take for Ray's)."""
    deadline = time.monotonic() + timeout
    while not Path(f"/proc/{process.pid}/cmdline").read_bytes().startswith(embedded.RAY_TITLE):
        assert time.monotonic() < deadline, "the planted process never took its ray:: title"
        time.sleep(0.005)
    return process


def flaky_add_nodes(failures: int, started: list[Cluster], *, orphans: list[subprocess.Popen] | None = None) -> Any:
    """`_add_nodes` that times out on its first ``failures`` calls: after starting the nodes, or, with
    ``orphans``, after starting only a process that runs from Ray's package and that the cluster does not
    know (as a node whose start timed out leaves its GCS and dashboard) and one titled as Ray titles a raylet's
    agents."""
    real = embedded._add_nodes

    def add_nodes(cluster: Cluster, *args: Any) -> dict[str, Any]:
        started.append(cluster)
        if orphans is None:
            nodes = real(cluster, *args)
        else:
            orphans.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", embedded.RAY_PACKAGE]))
            # and one Ray renamed, as it does a raylet's agents: they outlive the raylet
            orphans.append(titled(subprocess.Popen(["bash", "-c", "exec -a ray::DashboardAgent sleep 300"])))
            nodes = {}
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


def test_a_second_time_out_is_raised_and_leaves_no_process_of_either_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attempts time out before a node is up (that a started attempt is shut down is proven above);
    what each had started is killed, and a process from Ray's package that was running before stays."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", embedded.RAY_PACKAGE])
    started: list[Cluster] = []
    orphans: list[subprocess.Popen] = []
    monkeypatch.setattr(embedded, "_add_nodes", flaky_add_nodes(2, started, orphans=orphans))
    try:
        with pytest.raises(Exception, match=TIMED_OUT):
            embedded.start_embedded(1, 1)
        assert len(started) == len(orphans) // 2 == embedded.START_ATTEMPTS
        assert [orphan.wait(timeout=10) for orphan in orphans] == [-9] * len(orphans)
        assert bystander.poll() is None
    finally:
        for process in (bystander, *orphans):
            process.kill()
            process.wait()
