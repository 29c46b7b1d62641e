"""Shared fixtures: one embedded multi-node Ray per test session for the Ray integration tests, and the
environment of a RankWorker built in the test process."""

from __future__ import annotations

import pytest
import ray

from trainctl.workers.embedded import FAST_NODE_FAILURE_DETECTION, EmbeddedRay, start_embedded

NODES = 3
GPUS_PER_NODE = 4


@pytest.fixture(scope="package")
def embedded_ray() -> EmbeddedRay:
    """3 labelled nodes x 4 simulated GPUs on loopback, with the dashboard (ray.util.state needs it) and
    lost nodes declared dead in about 3 s (the node-loss tests);
    the test process is connected in namespace ``trainctl`` until the tests of this package end."""
    if ray.is_initialized():  # a connection another test package left open
        ray.shutdown()
    cluster = start_embedded(NODES, GPUS_PER_NODE, dashboard=True, system_config=FAST_NODE_FAILURE_DETECTION)
    try:
        ray.init(address=cluster.address, namespace="trainctl", log_to_driver=False)
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A RankWorker built in the test process sets CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS in it: both are
    restored after the test (OMP_NUM_THREADS unset for it, as on a node that sets none)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unchanged")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch
