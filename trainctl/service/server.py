"""The trainctl service process: store, Ray runtime, scheduler, gRPC server and metrics endpoint.

`Service(config).start()` brings everything up in this process (what `trainctl serve` and
`trainctl demo` run); health is SERVING while the store's database answers (trainctl.service.readiness);
`stop()` takes it down gracefully: health goes NOT_SERVING, watch streams end,
in-flight RPCs get `grace` seconds, the scheduler loop stops, and whatever the service started (the
embedded Ray, the metrics endpoint) is stopped. On an external Ray (`ray_address`) running jobs keep
running (their supervisors are detached Ray actors) and are re-attached by the next start; with the
embedded Ray they stop with it (their supervisors first, so none records the end of its ranks as the
job's failure) and the next start on the same data relaunches them from their newest checkpoint
(trainctl.service.scheduling.relaunch).
"""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from trainctl.planning.pool import GpuPool
from trainctl.service.api.rpc_calls import TrainingServiceCalls
from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.metrics import MetricsServer, ServiceMetrics, start_metrics_server
from trainctl.service.readiness import HealthStatus, StoreReadiness, start_health_server
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.scheduling.state import PreemptionPolicy
from trainctl.service.scheduling.sweeps import SweepDriver
from trainctl.service.security.auth import Authenticator, check_exposure
from trainctl.service.security.hardening import MalformedRequestInterceptor, MessageLimits, StreamLimiter
from trainctl.service.security.paths import JobPathPolicy, check_confinement
from trainctl.service.store import JobStore
from trainctl.service.tracking.policy import TrackingPolicy
from trainctl.service.tracking.tracker import JobTracker
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.tls import TlsConfig, bind

if TYPE_CHECKING:
    from trainctl.workers.warm_pool import WarmPool

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_DATA_DIR = ".trainctl"
DEFAULT_METRICS_PORT = 9464
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrainingService"].full_name
EMBEDDED_NODES = 1
EMBEDDED_GPUS_PER_NODE = 8
"""Simulated GPUs per node of the embedded Ray `trainctl serve` starts with no --ray-address: one
8-GPU node holds every example the README runs (ranks take no CPU, so 8 slots fit a 2-core machine)."""
DEFAULT_WORKERS = 16
DEFAULT_STREAMS_PER_TENANT = 256


@dataclass
class ServiceConfig:
    """What `trainctl serve` takes; the defaults are the embedded, loopback-only set-up."""

    address: str = DEFAULT_ADDRESS
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    """Run directories, and the SQLite store unless `store` names a database."""
    store: str | None = None
    """A `postgresql://` URL for the job store (trainctl.service.store.db); None: SQLite in `data_dir`.
    Replicas on one PostgreSQL store all serve the API; one leads the scheduler (a lease in the database)."""
    metrics_port: int = DEFAULT_METRICS_PORT
    """0 turns the Prometheus endpoint off."""
    metrics_host: str = "127.0.0.1"
    ray_address: str | None = None
    """None starts an embedded Ray on loopback (`embedded_nodes` x `embedded_gpus_per_node` simulated GPUs)."""
    embedded_nodes: int = EMBEDDED_NODES
    embedded_gpus_per_node: int = EMBEDDED_GPUS_PER_NODE
    topology: Path | None = None
    """Topology map file; None uses a simulated map of the Ray cluster."""
    tokens_file: Path | None = None
    """Access file (tokens, tenants, quotas); None turns authentication off (loopback only)."""
    tls: TlsConfig | None = None
    data_roots: list[Path] = field(default_factory=list)
    """Directories every path a job names must lie in; empty: no confinement to roots (single-user,
    embedded use; with authentication on only with `allow_any_data_path`)."""
    allow_any_data_path: bool = False
    """Serve with authentication on and no data roots (logged as a WARNING at start)."""
    workers: int = DEFAULT_WORKERS
    """Threads for the calls' blocking work (writes and their commits, calls to Ray, sweep reads). Reads
    and open streams need none: they run on the server's event loop (trainctl.service.api.rpc_server)."""
    streams_per_tenant: int = DEFAULT_STREAMS_PER_TENANT
    """Most server streams (following WatchJobs, WatchSweeps) one tenant may hold open at once; more are
    answered RESOURCE_EXHAUSTED. An open stream is a suspended coroutine (tens of KiB); a service many
    dashboards follow may raise it (docs/benchmarks.md, Watch fan-out: 1,000 followers of one job)."""
    health_address: str | None = None
    """HOST:PORT of a plaintext port serving only gRPC health (readiness.start_health_server), for
    probes that speak no TLS; None: health only on `address`."""
    mlflow_tracking_uri: str | None = None
    """The MLflow server jobs' runs are logged to unless a job names another allowed one (None: none;
    trainctl.service.tracking). Its credentials come from this process's environment (MLFLOW_TRACKING_TOKEN...)."""
    mlflow_allow: list[str] = field(default_factory=list)
    """Further MLflow servers a job may name in `spec.tracking.mlflow_tracking_uri`."""
    warm_pool: bool = False
    """Keep an engine-loaded rank process on every free GPU slot, so jobs start without the imports
    (about 300 MB of host memory per slot)."""
    preemption: PreemptionPolicy = field(default_factory=PreemptionPolicy)
    """Whether, and with what grace period and cooldown, queued jobs preempt running ones of lower priority
    (trainctl.service.capacity.preemption)."""
    autoscaling: bool = False
    """Ask Ray's autoscaler for the map nodes Ray lacks that a blocked queued job needs, and withdraw the
    request when none does (trainctl.service.capacity.autoscaling); the Ray cluster must run the
    autoscaler (KubeRay: enableInTreeAutoscaling), which lets idle nodes go after its idle timeout."""


def build_grpc_server(
    servicer: TrainingServicer,
    authenticator: Authenticator,
    observer: ServiceMetrics | None,
    *,
    workers: int = DEFAULT_WORKERS,
    streams_per_tenant: int = DEFAULT_STREAMS_PER_TENANT,
    limits: MessageLimits | None = None,
) -> tuple[RpcServer, HealthStatus]:
    """The unbound gRPC server (trainctl.service.api.rpc_server): the TrainingService's calls
    (trainctl.service.api.rpc_calls: metrics, auth, the per-tenant stream cap, decoding, errors), health
    checking and reflection (their undecodable requests answered INVALID_ARGUMENT), message limits.
    Tests build the same server. `workers`, `streams_per_tenant`: see ServiceConfig."""
    server = RpcServer(
        workers=workers, options=(limits or MessageLimits()).server_options(), interceptors=[MalformedRequestInterceptor()],
    )
    server.add_generic_rpc_handlers([TrainingServiceCalls(servicer, authenticator, observer, StreamLimiter(streams_per_tenant))])
    status = HealthStatus(server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server.aio)
    return server, status


FULL_COLLECTION_EVERY = 100
"""Collections of the middle generation between two full ones in a serving process (Python's default 10)."""


def settle_heap_for_serving() -> None:
    """Set the garbage collector for a process that serves until it exits; called once it serves.

    A full collection walks every object the process holds while the event loop waits: the modules and
    the started service (about 30 ms), and the jobs the store and the answers keep built (about 10 ms per
    1,000 jobs). Start-up's objects are frozen out of it (what is frozen is never collected as a cycle,
    so a test process that starts many services must not call this), and a full collection comes after
    FULL_COLLECTION_EVERY younger ones instead of Python's 10, so its pause is seconds apart rather than
    one every few seconds while the kept jobs grow. Cyclic garbage is rare here; the rest is freed as
    soon as it is dropped, whatever the collector does.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


class Service:
    """One running service. `topology` and `ray_address` may also come from an embedded cluster the
    caller started (the demo and the tests do)."""

    def __init__(self, config: ServiceConfig, *, topology: Any = None):
        self.config = config
        self._topology = topology
        self._stopping = threading.Event()
        self._embedded: Any = None
        self._runtime: Any = None
        self._metrics_server: MetricsServer | None = None
        self._server: RpcServer | None = None
        self.leadership: Leadership | None = None
        self._readiness: StoreReadiness | None = None
        self._health_server: RpcServer | None = None
        self._servicer: TrainingServicer | None = None
        self.port: int = 0
        self.health_port: int | None = None
        """The bound port of `config.health_address` (None without one)."""
        self.metrics_port: int | None = None

    @property
    def warm_pool(self) -> WarmPool | None:
        """The runtime's pool of engine-loaded rank processes (None unless ``config.warm_pool``)."""
        return self._runtime.warm_pool if self._runtime is not None else None

    @property
    def target(self) -> str:
        """host:port clients connect to."""
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self) -> Service:
        from trainctl.workers.ray_environment import prepare_ray_environment

        prepare_ray_environment()  # before this process first imports Ray (below)
        from trainctl.workers.autoscaler import request_nodes
        from trainctl.workers.embedded import start_embedded
        from trainctl.workers.runtime import RayRuntime

        config = self.config
        authenticator = Authenticator.from_file(config.tokens_file)
        check_exposure(config.address, authenticator)
        check_confinement(authenticator.enabled, config.data_roots, config.allow_any_data_path)
        tracking = TrackingPolicy.of_service(config.mlflow_tracking_uri, config.mlflow_allow)
        runs_dir = Path(config.data_dir).resolve() / "runs"
        paths = JobPathPolicy(config.data_roots, runs_dir)
        registry = CollectorRegistry()
        self.metrics = ServiceMetrics(registry)
        self.store = JobStore(config.store or config.data_dir, metrics=self.metrics)  # before Ray: a bad store starts nothing
        ray_address = config.ray_address
        if ray_address is None:
            self._embedded = start_embedded(config.embedded_nodes, config.embedded_gpus_per_node)
            ray_address = self._embedded.address
            self._topology = self._topology or self._embedded.topology
        self._runtime = RayRuntime(ray_address, warm_pool=config.warm_pool)
        topology, source = self._load_topology()

        if config.metrics_port:
            self._metrics_server = start_metrics_server(registry, config.metrics_host, config.metrics_port)
            self.metrics_port = self._metrics_server.port
        self.pool = GpuPool(topology, source)
        if self.store.backend == "postgresql":  # replicas may share it: the scheduler runs where the lease is
            self.leadership = Leadership(self.store)
            self.leadership.start()
        self._tracker = JobTracker(tracking, self.store).start()
        self.scheduler = Scheduler(
            self.store, self.pool, self._runtime, runs_dir,
            metrics=self.metrics, quota_of=authenticator.quota, leadership=self.leadership, paths=paths,
            tracker=self._tracker, preemption=config.preemption,
            request_nodes=partial(request_nodes, topology) if config.autoscaling else None,
        )
        self.sweeps = SweepDriver(self.store, self.scheduler)
        servicer = self._servicer = TrainingServicer(
            self.store, self.scheduler, self.pool, authenticator, paths=paths, stopping=self._stopping,
            ray_nodes=self._ray_nodes, sweeps=self.sweeps, tracking=tracking,
        )

        server, self._health = build_grpc_server(
            servicer, authenticator, self.metrics, workers=config.workers, streams_per_tenant=config.streams_per_tenant,
        )
        self.port = bind(server, config.address, config.tls)
        self.scheduler.start()
        self.sweeps.start()
        server.start()
        self._server = server
        self._readiness = StoreReadiness(self.store, self._health, ("", SERVICE_NAME), stopping=self._stopping)
        self._readiness.start()  # SERVING while the store's database answers
        if self.config.health_address is not None:
            self._health_server, self.health_port = start_health_server(self._health, self.config.health_address)
        log.info("trainctl serving on %s (data %s, store %s, %s)", self.target, config.data_dir, self.store.location, source)
        return self

    def _load_topology(self) -> tuple[Any, str]:
        from trainctl.workers.topology import load_topology, simulated_topology

        if self.config.topology is not None:
            return load_topology(self.config.topology), str(self.config.topology)
        if self._topology is not None:
            return self._topology, "simulated (embedded cluster)"
        named = [n for n in self._runtime.cluster_nodes() if n.name is not None and n.alive]
        if not named:
            raise RuntimeError(
                "the Ray cluster has no node labelled trainctl.io/node; pass --topology or label the nodes"
            )
        gpus = max(len(n.gpus) for n in named)
        return simulated_topology(len(named), gpus), f"simulated ({len(named)} Ray nodes x {gpus} GPUs)"

    def _ray_nodes(self) -> dict[str, bool]:
        return self._runtime.node_liveness()

    def wait(self) -> None:
        """Block until the server stops."""
        server = self._server
        if server is not None:
            server.wait_for_termination()

    def stop(self, grace: float = 5.0) -> None:
        """Graceful shutdown (see the module docstring); safe to call twice."""
        if self._server is None:
            return
        self._stopping.set()
        if self._readiness is not None:
            self._readiness.stop()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._servicer is not None:
            self._servicer.watch_hub.wake_all()
        if self._health_server is not None:  # it serves on the API server's loop
            self._health_server.stop(0)
        self._server.stop(grace)
        self._server = None
        self.sweeps.stop()
        self.scheduler.stop()
        self._tracker.close()  # after the loop: nothing hands it more
        if self.leadership is not None:
            self.leadership.stop()  # a standby takes over on its next try
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.store.close()
        if self._embedded is not None:  # its jobs stop with it; the next start relaunches them (service.relaunch)
            self._runtime.stop_supervisors()
        self._runtime.close()
        if self._embedded is not None:
            self._embedded.shutdown()
        log.info("trainctl service stopped")

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
