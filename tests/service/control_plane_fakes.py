"""A scripted runtime and an in-process API server for control-plane unit tests (no Ray).

`ScriptedRuntime` keeps one real `trainctl.workers.events.EventLog` per started job, so polls go
through the same cursor logic as the supervisor's; a test plays the supervisor by appending events.
End-to-end tests (e2e/test_e2e.py) use the real RayRuntime instead.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import GpuPool
from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.readiness import HealthStatus
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.scheduling.sweeps import SweepDriver
from trainctl.service.security.auth import Authenticator
from trainctl.service.server import DEFAULT_STREAMS_PER_TENANT, build_grpc_server
from trainctl.service.store import JobStore
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import EventKind, EventLog, JobState, JobStatus, status_of
from trainctl.workers.relaunch import Relaunch
from trainctl.workers.topology import TopologyMap, simulated_topology


@dataclass
class ScriptedRuntime:
    """Implements the scheduler's Runtime protocol over in-memory event logs."""

    logs: dict[str, EventLog] = field(default_factory=dict)
    started: list[tuple[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    attached: list[str] = field(default_factory=list)
    alive: set[str] = field(default_factory=set)
    fail_start: bool = False
    nodes: set[str] = field(default_factory=lambda: {f"node-{i}" for i in range(8)})
    """Names of the Ray nodes alive (a test removes one to play a node loss)."""
    plans: list[tuple[str, Any]] = field(default_factory=list)
    """(job id, placement) of every plan handed over by replace_plan."""
    node_envs: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    """Job id -> the per-node environment it was started with."""
    file_rules: dict[str, FileRule] = field(default_factory=dict)
    """Job id -> the FileRule its ranks were to open its files under."""
    relaunches: dict[str, Relaunch] = field(default_factory=dict)
    """Job id -> the Relaunch it was last started with (jobs started again after a cluster loss)."""
    lost_clusters: set[str] = field(default_factory=set)
    """Jobs whose supervisor ended with the Ray cluster it ran on (`lost_with_cluster`)."""
    preempted: list[tuple[str, str, float]] = field(default_factory=list)
    """(job id, reason, grace) of every preemption sent."""
    resizes: list[tuple[str, Any]] = field(default_factory=list)
    """(job id, placement) of every plan of another size handed over by resize (taken while the job runs)."""

    def start_job(
        self, job_id: str, job: TrainingJob, placement: Any, run_dir: RunDirectory, *, node_env: dict, file_rule: FileRule,
        relaunch: Relaunch | None = None,
    ) -> None:
        if self.fail_start:
            raise RuntimeError("no Ray today")
        if relaunch is not None:
            self.relaunches[job_id] = relaunch
        self.started.append((job_id, placement))
        self.node_envs[job_id] = node_env
        self.file_rules[job_id] = file_rule
        if relaunch is None or job_id not in self.logs:  # a relaunched supervisor continues the job's log
            self.logs[job_id] = EventLog()
        self.alive.add(job_id)

    def attach(self, job_id: str, run_dir: RunDirectory) -> None:
        self.attached.append(job_id)
        self.logs.setdefault(job_id, EventLog())

    def running_jobs(self) -> list[str]:
        return sorted(self.alive)

    def lost_with_cluster(self, job_id: str) -> bool:
        return job_id in self.lost_clusters

    def poll(self, job_id: str, cursor: int) -> JobStatus:
        return status_of(self.logs[job_id].all(), cursor, 1000)

    def replace_plan(self, job_id: str, job: TrainingJob, placement: Any) -> bool:
        """Adopt the plan (a PLAN event) when the job's log has a pending REPLAN, as the supervisor does."""
        lost = status_of(self.logs[job_id].all(), 0, 1).replan
        if not lost:
            return False
        self.plans.append((job_id, placement))
        rows = [{"rank": a.rank, "node": a.node, "gpu": a.gpu} for a in placement.assignments]
        self.logs[job_id].append(EventKind.PLAN, lost_nodes=list(lost), placement=rows, message="re-placed")
        return True

    def resize(self, job_id: str, job: TrainingJob, placement: Any) -> bool:
        """Take the plan (a LOG line, as the supervisor's) while the job's log says RUNNING."""
        if status_of(self.logs[job_id].all(), 0, 1).state is not JobState.RUNNING:
            return False
        self.resizes.append((job_id, placement))
        self.logs[job_id].append(EventKind.LOG, message=f"resizing to {len(placement.assignments)} GPUs")
        return True

    def live_nodes(self) -> set[str]:
        return set(self.nodes)

    def preempt(self, job_id: str, reason: str, grace: float) -> JobStatus:
        self.preempted.append((job_id, reason, grace))
        self.logs[job_id].append(EventKind.LOG, message=f"{reason}; stopping at the next step boundary")
        return status_of(self.logs[job_id].all(), 0, 1)

    def cancel(self, job_id: str) -> JobStatus:
        self.cancelled.append(job_id)
        self.state(job_id, JobState.CANCELLED, "cancelled by request")
        return status_of(self.logs[job_id].all(), 0, 1)

    # ---- playing the supervisor ----------------------------------------------------------------------
    def wait_started(self, job_id: str, timeout: float = 10.0) -> None:
        """Block until the scheduler has called start_job for `job_id`."""
        deadline = time.monotonic() + timeout
        while job_id not in self.logs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} was not started within {timeout} s")
            time.sleep(0.01)

    def state(self, job_id: str, state: JobState, reason: str = "") -> None:
        self.logs[job_id].append(EventKind.STATE, state=state, reason=reason)
        if state.ends_run:
            self.alive.discard(job_id)

    def lose_node(self, job_id: str, node: str) -> None:
        """The node leaves the cluster; the job's supervisor restarts and asks for a plan without it."""
        self.nodes.discard(node)
        self.state(job_id, JobState.RESTARTING, f"rank died on {node}")
        self.logs[job_id].append(EventKind.REPLAN, lost_nodes=[node], message=f"node(s) {node} left the Ray cluster")

    def step(self, job_id: str, step: int, loss: float, eval_loss: float | None = None) -> None:
        self.logs[job_id].append(
            EventKind.STEP,
            step={"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 256,
                  "tokens_per_second": 1000.0 + step, "mfu": None, "step_time_seconds": 0.25,
                  "breakdown": {"forward_backward": 0.2}, "peak_memory_bytes": 1 << 20, "eval_loss": eval_loss},
        )

    def run(self, job_id: str, losses: list[float], end: JobState = JobState.SUCCEEDED) -> None:
        """A whole run: RUNNING, one step per loss, then `end`."""
        self.state(job_id, JobState.RUNNING, "ranks up")
        for i, loss in enumerate(losses, start=1):
            self.step(job_id, i, loss)
        self.state(job_id, end, "done")


def make_scheduler(
    data_dir: Path, runtime: ScriptedRuntime, nodes: int = 2, gpus: int = 4, topology: TopologyMap | None = None,
    store: str | None = None,
) -> Scheduler:
    """A scheduler over a fresh store (SQLite in `data_dir`, or the PostgreSQL URL `store`) and a pool of
    `topology`, or by default a simulated `nodes` x `gpus` one (loop not started)."""
    pool = GpuPool(topology or simulated_topology(nodes, gpus), "simulated" if topology is None else topology.metadata.name)
    return Scheduler(JobStore(store or data_dir), pool, runtime, data_dir / "runs")


@dataclass
class ApiServer:
    """A real gRPC server on loopback over a scheduler whose loop runs."""

    scheduler: Scheduler
    server: RpcServer
    target: str
    sweeps: SweepDriver
    health: HealthStatus
    servicer: TrainingServicer

    def stop(self) -> None:
        self.server.stop(0).wait()
        self.sweeps.stop()
        self.scheduler.stop()
        if self.scheduler.leadership is not None:
            self.scheduler.leadership.stop()
        self.scheduler.store.close()


def start_api_server(
    data_dir: Path, runtime: ScriptedRuntime, nodes: int = 2, gpus: int = 4, topology: TopologyMap | None = None,
    store: str | None = None, lease_ttl: float | None = None, *, workers: int = 8,
    streams_per_tenant: int = DEFAULT_STREAMS_PER_TENANT,
) -> ApiServer:
    """The server over a fresh scheduler; `workers` and `streams_per_tenant` as in ServiceConfig. With
    `lease_ttl`, the scheduler works only while it holds the database lease (a replica)."""
    scheduler = make_scheduler(data_dir, runtime, nodes, gpus, topology, store)
    if lease_ttl is not None:
        scheduler.leadership = Leadership(scheduler.store, ttl=lease_ttl)
        scheduler.leadership.start()
    authenticator = Authenticator(None)
    sweeps = SweepDriver(scheduler.store, scheduler, interval=0.05)
    servicer = TrainingServicer(scheduler.store, scheduler, scheduler.pool, authenticator, sweeps=sweeps)
    server, health_servicer = build_grpc_server(
        servicer, authenticator, None, workers=workers, streams_per_tenant=streams_per_tenant
    )
    port = server.add_insecure_port("127.0.0.1:0")
    scheduler.interval = 0.05
    scheduler.start()
    sweeps.start()
    server.start()
    from grpc_health.v1 import health_pb2

    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return ApiServer(scheduler, server, f"127.0.0.1:{port}", sweeps, health_servicer, servicer)


def eventually(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """`check()`'s first true result, asked every 20 ms; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.02)
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bad_spec_catalogue() -> list[Any]:
    """tests/spec/bad_specs.catalogue(), loaded by path (tests/spec is not a package)."""
    path = Path(__file__).resolve().parents[1] / "spec" / "bad_specs.py"
    spec = importlib.util.spec_from_file_location("trainctl_tests_bad_specs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.catalogue()


SWEEP_DOCUMENT: dict[str, Any] = {
    "metadata": {"name": "api-sweep"},
    "spec": {
        "template": {
            "data": {"seq_len": 32, "max_files": 10},
            "training": {"steps": 4, "global_batch_size": 4},
            "resources": {"gpus": 1, "device": "cpu"},
        },
        "parameters": [
            {"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-1, "log": True},
            {"path": "spec.training.micro_batch_size", "type": "choice", "values": [1, 2, 4]},
            {"path": "spec.training.warmup_steps", "type": "int", "low": 0, "high": 3},
        ],
        "trials": 3, "parallel_trials": 2,
    },
}
"""A small valid sweep (3 trials of the debug model on CPU, 2 at a time) the API and CLI tests submit."""
