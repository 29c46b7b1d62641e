"""Fixtures shared by the service's end-to-end tests: an embedded cluster, and a client of the module's
``service``."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service  # noqa: E402
from trainctl.workers.embedded import EmbeddedRay, start_embedded  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedRay]:
    """An embedded 2-node Ray on loopback, one simulated GPU per node, for one test module (a module
    that needs another shape defines its own ``cluster``)."""
    with start_embedded(2, 1, dashboard=True) as embedded:  # ray.util.state needs the dashboard
        yield embedded


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[TrainctlClient]:
    """A client of the module's ``service`` fixture."""
    with TrainctlClient(service.target) as c:
        yield c
