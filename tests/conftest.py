"""What every test directory shares: the Ray environment guard, the embedded cluster and the served
service of a test module, and the `slow` marker on every test that uses them.

Shapes: a module's `pytestmark = pytest.mark.cluster(nodes=2, gpus_per_node=4, fast_node_failure=True)`
changes its cluster (default: 2 nodes x 1 simulated GPU, the dashboard on for `ray.util.state`), and
`pytest.mark.service(warm_pool=True)` adds ServiceConfig fields to its service. The workers tests share one
connected 3-node cluster for their whole directory instead (`embedded_ray`, tests/workers/conftest.py).
Job builders: small_jobs.py.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from trainctl.cli.client import TrainctlClient
    from trainctl.service.server import Service
    from trainctl.workers.embedded import EmbeddedRay

RAY_FIXTURES = ("cluster", "embedded_ray")
"""A test that uses one of these starts or shares a Ray cluster: it is `slow` (not in `make test-fast`)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster(nodes, gpus_per_node, fast_node_failure): the module's cluster shape")
    config.addinivalue_line("markers", "service(**fields): ServiceConfig fields of the module's service")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in RAY_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[EmbeddedRay]:
    """An embedded Ray on loopback for one test module, shaped by the module's `cluster` marker."""
    from trainctl.workers.embedded import FAST_NODE_FAILURE_DETECTION, start_embedded

    marker = request.node.get_closest_marker("cluster")
    shape = dict(marker.kwargs) if marker else {}
    fast = shape.pop("fast_node_failure", False)
    nodes, gpus = shape.pop("nodes", 2), shape.pop("gpus_per_node", 1)
    assert not shape, f"unknown cluster marker arguments: {sorted(shape)}"
    system_config = FAST_NODE_FAILURE_DETECTION if fast else None
    with start_embedded(nodes, gpus, dashboard=True, system_config=system_config) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def service(request: pytest.FixtureRequest, cluster: EmbeddedRay,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The real service in this process on the module's cluster and its simulated map, on a free port."""
    from trainctl.service.server import Service, ServiceConfig

    marker = request.node.get_closest_marker("service")
    config = ServiceConfig(address="127.0.0.1:0", data_dir=tmp_path_factory.mktemp("service"), metrics_port=0,
                           ray_address=cluster.address, **(marker.kwargs if marker else {}))
    with Service(config, topology=cluster.topology) as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[TrainctlClient]:
    """A client of the module's `service`."""
    from trainctl.cli.client import TrainctlClient

    with TrainctlClient(service.target) as c:
        yield c
