"""The real service (`Service`, as `trainctl serve --store postgresql://...` runs it) on a real PostgreSQL
store with the real RayRuntime on an embedded 2-node Ray: it takes the scheduler lease, reports SERVING,
runs a 2-rank job to SUCCEEDED with every step recorded once, and gives the lease up when it stops."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from postgres_server import PostgresServer
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.service.scheduling.leadership import SCHEDULER_LEASE
from trainctl.service.server import Service, ServiceConfig
from trainctl.service.store import JobStore
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pg_service(cluster: EmbeddedRay, postgres: PostgresServer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    url = postgres.create_database()
    config = ServiceConfig(address="127.0.0.1:0", data_dir=tmp_path_factory.mktemp("service"), store=url,
                           metrics_port=0, ray_address=cluster.address)
    service = Service(config, topology=cluster.topology).start()
    try:
        yield service, url
    finally:
        service.stop()


def test_a_service_on_postgresql_leads_serves_and_runs_a_job(pg_service: tuple[Service, str]) -> None:
    service, url = pg_service
    assert service.store.backend == "postgresql" and service.scheduler.leading
    assert service.leadership is not None and service.leadership.current() is not None
    with grpc.insecure_channel(service.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    with TrainctlClient(service.target) as client:
        created = client.create_job(small_job("on-postgres", gpus=2, steps=4), request_id="pg-1")
        assert client.create_job(small_job("on-postgres", gpus=2, steps=4), request_id="pg-1").id == created.id
        events = list(client.watch(created.id))
        final = client.get_job(created.id, full=True)
    assert final.status.state == pb.SUCCEEDED
    assert [e.step.step for e in events if e.WhichOneof("payload") == "step"] == [1, 2, 3, 4]
    assert [m.step for m in final.metrics] == [1, 2, 3, 4]
    other = JobStore(url)  # another replica's view: the same job, and the lease is held
    try:
        assert other.get_job(created.id).state == "SUCCEEDED"
        assert other.acquire_lease(SCHEDULER_LEASE, "standby", ttl=5) is None
    finally:
        other.close()
