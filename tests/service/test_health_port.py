"""`trainctl serve --health-address`: a plaintext port that answers gRPC health, with the API server's
own status, and nothing else (trainctl.service.readiness.start_health_server), for Kubernetes' gRPC
readiness probe, which speaks no TLS."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.readiness import HealthStatus, start_health_server
from trainctl.service.server import SERVICE_NAME
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def api_server():
    """An (unstarted) API server, whose loop the health port serves on."""
    server = RpcServer(workers=1)
    yield server
    server.stop(0)


def test_the_health_port_follows_the_api_servers_status_and_serves_nothing_else(api_server: RpcServer) -> None:
    status = HealthStatus(api_server)  # the API server's status, which StoreReadiness sets
    status.set("", NOT_SERVING)
    status.set(SERVICE_NAME, NOT_SERVING)
    server, port = start_health_server(status, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == NOT_SERVING
            status.set("", SERVING)  # the database answers again
            assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
            assert check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status == NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.TrainingServiceStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0).wait()


def test_a_health_address_it_cannot_bind_is_an_error(api_server: RpcServer) -> None:
    server, port = start_health_server(HealthStatus(api_server), "127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=rf"cannot bind gRPC port 127\.0\.0\.1:{port}: in use"):
            start_health_server(HealthStatus(RpcServer(workers=1, beside=api_server)), f"127.0.0.1:{port}")
    finally:
        server.stop(0).wait()
