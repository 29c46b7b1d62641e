"""Readiness follows the store: the gRPC health status (the whole server, "", and the TrainingService)
is SERVING while the store's database answers and NOT_SERVING while it does not, so a load balancer
or a Kubernetes gRPC readiness probe stops sending calls that could only be answered UNAVAILABLE.
Once the service is stopping, it leaves the status alone (stop() has set NOT_SERVING for good).

`start_health_server` serves the same health status, and nothing else, on a plaintext port of its
own (`trainctl serve --health-address`): Kubernetes' native gRPC probe speaks no TLS, so it cannot
ask the API port once that serves TLS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.security.hardening import MalformedRequestInterceptor
from trainctl.service.store import JobStore
from trainctl.wire.tls import bind

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
"""How often the store is asked (a `SELECT 1` on its connection)."""


class HealthStatus:
    """The health status a server publishes: grpc_health's asyncio servicer, serving on `server`'s loop
    (no open health watch holds a thread), whose status any thread may `set`."""

    def __init__(self, server: RpcServer):
        self.server = server
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server.aio)

    def set(self, name: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Publish `status` for service `name` ("" is the whole server)."""
        self.server.call(self.servicer.set(name, status))


class StoreReadiness:
    """Sets `names` of `health` from `store.reachable()` every `interval` seconds, in a daemon thread."""

    def __init__(self, store: JobStore, health_status: HealthStatus, names: Sequence[str], *,
                 stopping: threading.Event, interval: float = CHECK_SECONDS):
        self.store = store
        self.health = health_status
        self.names = tuple(names)
        self.stopping = stopping
        self.interval = interval
        self._ready: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Ask the store once and publish the answer; whether it is reachable."""
        ready = self.store.reachable()
        if self.stopping.is_set():
            return ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            self.health.set(name, status)
        if ready != self._ready:
            (log.info if ready else log.warning)("readiness: %s (store %s)", "SERVING" if ready else "NOT_SERVING", self.store.location)
        self._ready = ready
        return ready

    def start(self) -> None:
        self.check()
        self._thread = threading.Thread(target=self._run, name="trainctl-readiness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval * 2)


def start_health_server(status: HealthStatus, address: str) -> tuple[RpcServer, int]:
    """A started plaintext gRPC server on `address` answering only grpc.health.v1.Health from `status`
    (the API server's, on its loop, so both say the same); returns it and its bound port (OSError when
    `address` cannot be bound). Stop it before the API server."""
    server = RpcServer(workers=1, options=(("grpc.so_reuseport", 0),),  # a port in use is an error, not shared
                       interceptors=[MalformedRequestInterceptor()], beside=status.server)
    health_pb2_grpc.add_HealthServicer_to_server(status.servicer, server.aio)
    port = bind(server, address, None)
    server.start()
    return server, port
