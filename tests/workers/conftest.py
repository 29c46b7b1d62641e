"""Shared fixtures for the Ray integration tests: one embedded multi-node Ray per test session."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import ray  # noqa: E402

from trainctl.workers.embedded import FAST_NODE_FAILURE_DETECTION, EmbeddedRay, start_embedded  # noqa: E402

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
