"""The service's Prometheus metrics: the catalogue, and the endpoint that exports it.

Every metric lives on the `CollectorRegistry` handed to `ServiceMetrics` (never the process-global
default registry), so several services (tests) can live in one process. Names follow DESIGN.md:
`trainctl_` prefix, base units (seconds, bytes, ratios 0..1), `_total` on counters.

Labels are bounded. Code-chosen labels (`method`, `code`, `op`, `decision`, `phase`, `state`) come from
fixed sets; per-job series carry `job_id` and `tenant` and are removed `finished_job_ttl_seconds`
after the job reaches a terminal state (`forget_job` removes them at once). Nothing is labelled by
step or rank. The per-job label is `job_id`, not `job`: `job` is the scrape job label Prometheus
attaches to every target, and an exported `job` label would be renamed to `exported_job`.

`docs/observability.md` lists every metric with its type, labels and meaning.
"""

from __future__ import annotations

import math
import platform
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from trainctl.parallelism.engine.step_report import StepReport
from trainctl.workers.events import TERMINAL_STATES, JobState

if TYPE_CHECKING:
    from trainctl.service.security.tenancy import TenantShare

GRPC_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)
"""grpc.StatusCode names: the values of the `code` label."""

SCHEDULING_DECISIONS = ("started", "no_capacity", "preempting", "scaling_up", "quota", "infeasible")
"""What one scheduling pass did with the job at the head of the queue: started it; left it queued for
lack of free GPUs; left it queued while the jobs preempted for it stop; left it queued while the nodes
asked of the autoscaler for it join; left it queued by the tenant's quota; or found no placement that
could ever fit."""

_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
"""Code-chosen label values (`op`, `phase`): snake_case identifiers, so a caller cannot pass data."""

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
SOLVER_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)

_JOB = ("job_id", "tenant")
CHECKPOINT_PHASE = "checkpoint"
"""The step-time breakdown key under which the engine reports a checkpoint save."""


@dataclass(frozen=True)
class NodeGpus:
    """One Ray node's GPUs as the scheduler sees them: `total` in the pool, `used` by placed jobs."""

    node: str
    nvlink_domain: str
    total: int
    used: int


def _check(value: str, allowed: Iterable[str], what: str) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _identifier(value: str, what: str) -> str:
    if not _IDENTIFIER.match(value):
        raise ValueError(f"{what} must be a snake_case identifier (^[a-z][a-z0-9_]*$, <= 63 chars); got {value!r}")
    return value


def _non_empty(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string; got {value!r}")
    return value


@dataclass
class _JobSeries:
    tenant: str
    last_step: int | None = None
    finished_at: float | None = None


class ServiceMetrics:
    """The metric catalogue of one service, and the methods the service calls to update it.

    Thread-safe: the gRPC servicer, the scheduler loop and job pollers call it concurrently.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        version: str | None = None,
        finished_job_ttl_seconds: float = 900.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if finished_job_ttl_seconds < 0:
            raise ValueError(f"finished_job_ttl_seconds must be >= 0; got {finished_job_ttl_seconds}")
        self._ttl = finished_job_ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobSeries] = {}
        self._finished: deque[tuple[float, str]] = deque()
        """(finished_at, job id) in the order jobs finished: what `expire_finished_jobs` walks."""
        self._oldest_queued_at: float | None = None
        self._scale_up_since: float | None = None
        r = registry
        # The metric catalogue: one declaration per metric, a deliberate table (rows look alike by design).

        self.build_info = Info("trainctl_build", "Version of the running trainctl service.", registry=r)
        self.build_info.info({
            "version": version or metadata.version("trainctl"),
            "ray_version": metadata.version("ray"),
            "python_version": platform.python_version(),
        })

        # --- API
        self.grpc_requests = Counter(
            "trainctl_grpc_requests_total", "gRPC requests handled, by method and status code.",
            ["method", "code"], registry=r)
        self.grpc_duration = Histogram(
            "trainctl_grpc_request_duration_seconds", "gRPC request handling time (streams: until closed).",
            ["method"], buckets=DURATION_BUCKETS, registry=r)

        # --- queue, scheduler, store
        self.queue_depth = Gauge("trainctl_queue_depth", "Jobs waiting in the queue (state QUEUED).", registry=r)
        self.queue_oldest_age = Gauge(
            "trainctl_queue_oldest_age_seconds", "Age of the oldest queued job (0 when the queue is empty).",
            registry=r)
        self.queue_oldest_age.set_function(self._oldest_age)
        self.jobs = Gauge("trainctl_jobs", "Jobs known to the store, by state.", ["state"], registry=r)
        for state in JobState:
            self.jobs.labels(state).set(0)
        self.scheduling_decisions = Counter(
            "trainctl_scheduling_decisions_total", "Scheduling decisions, by outcome.", ["decision"], registry=r)
        self.solver_duration = Histogram(
            "trainctl_placement_solver_duration_seconds", "Time the placement solver took for one job.",
            buckets=SOLVER_BUCKETS, registry=r)
        self.store_duration = Histogram(
            "trainctl_store_operation_duration_seconds", "Store (SQLite) operation latency, by operation.",
            ["op"], buckets=DURATION_BUCKETS, registry=r)

        # --- cluster
        self.gpus = Gauge(
            "trainctl_cluster_gpus", "GPUs in the pool, by node and NVLink domain.",
            ["node", "nvlink_domain"], registry=r)
        self.gpus_used = Gauge(
            "trainctl_cluster_gpus_used", "GPUs reserved by placed jobs, by node and NVLink domain.",
            ["node", "nvlink_domain"], registry=r)
        self.scale_up_nodes = Gauge(
            "trainctl_scale_up_pending_nodes", "Map nodes asked of Ray's autoscaler for a queued job and not "
            "placed on yet (0: no scale-up pending).", registry=r)
        self.scale_up_age = Gauge(
            "trainctl_scale_up_pending_age_seconds", "How long the pending scale-up has been asked for (0: none).",
            registry=r)
        self.scale_up_age.set_function(self._scale_up_age)
        self.tenant_gpus = Gauge(
            "trainctl_tenant_gpus", "Each tenant's GPUs held by its active jobs (used), its guaranteed share "
            "(guaranteed, when it has one) and what it holds beyond it (borrowed).", ["tenant", "kind"], registry=r)

        # --- per job
        self.job_state = Gauge(
            "trainctl_job_state", "1 for the job's current state, 0 for the others.", [*_JOB, "state"], registry=r)
        self.job_last_progress = Gauge(
            "trainctl_job_last_progress_timestamp_seconds",
            "Unix time of the job's last step report, or of its entering RUNNING if later.", _JOB, registry=r)
        self.job_step = Gauge("trainctl_job_step", "Last optimizer step reported.", _JOB, registry=r)
        self.job_loss = Gauge("trainctl_job_loss", "Training loss at the last reported step.", _JOB, registry=r)
        self.job_eval_loss = Gauge(
            "trainctl_job_eval_loss", "Loss on the evaluation data at the last step that evaluated.", _JOB, registry=r)
        self.job_grad_norm = Gauge(
            "trainctl_job_grad_norm", "Gradient norm (before clipping) at the last reported step.", _JOB, registry=r)
        self.job_lr = Gauge("trainctl_job_learning_rate", "Learning rate at the last reported step.", _JOB, registry=r)
        self.job_tokens = Counter(
            "trainctl_job_tokens_total", "Tokens trained on (each reported step's tokens times the steps since "
            "the previous report).", _JOB, registry=r)
        self.job_tps = Gauge(
            "trainctl_job_tokens_per_second", "Training throughput at the last reported step.", _JOB, registry=r)
        self.job_mfu = Gauge(
            "trainctl_job_mfu_ratio", "Model FLOPs utilisation (0..1) at the last reported step, Megatron's "
            "convention (causal attention counted as half the score/value FLOPs).", _JOB, registry=r)
        self.job_mfu_full_attention = Gauge(
            "trainctl_job_mfu_full_attention_ratio", "Model FLOPs utilisation (0..1) at the last reported step, "
            "torchtitan's convention (attention counted unmasked, every query against every key).", _JOB, registry=r)
        self.job_step_duration = Histogram(
            "trainctl_job_step_duration_seconds", "Duration of reported optimizer steps.", _JOB,
            buckets=STEP_BUCKETS, registry=r)
        self.job_phase = Gauge(
            "trainctl_job_step_phase_seconds", "Step time by phase at the last reported step (data, "
            "forward_backward, optimizer, exposed communication, pipeline idle, as the engine measures).",
            [*_JOB, "phase"], registry=r)
        self.job_peak_memory = Gauge(
            "trainctl_job_peak_memory_bytes", "Peak accelerator (or host) memory, max over ranks.", _JOB, registry=r)
        self.job_checkpoint_duration = Histogram(
            "trainctl_job_checkpoint_duration_seconds", "Checkpoint save time (from the step report of the step that saved it).", _JOB,
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.job_checkpoint_size = Gauge(
            "trainctl_job_checkpoint_size_bytes", "Size of the last saved checkpoint.", _JOB, registry=r)
        self.job_restarts = Counter(
            "trainctl_job_restarts_total", "Rank-group restarts from a checkpoint.", _JOB, registry=r)
        self.job_resizes = Counter(
            "trainctl_job_resizes_total", "Changes of an elastic job's size: shrunk to the GPUs left after a node loss, "
            "grown back.", _JOB, registry=r)
        self.job_preemptions = Counter(
            "trainctl_job_preemptions_total", "Times the job was preempted for a job of higher priority.", _JOB, registry=r)
        self.job_straggler = Gauge(
            "trainctl_job_straggler_ratio", "Slowest over fastest rank (or pipeline stage) step time; 1 is even.",
            _JOB, registry=r)
        self.job_gpus = Gauge(
            "trainctl_job_gpus", "GPUs the job's ranks occupy, by node and NVLink domain.",
            [*_JOB, "node", "nvlink_domain"], registry=r)
        self._job_metrics = (
            self.job_state, self.job_last_progress, self.job_step, self.job_loss, self.job_eval_loss,
            self.job_grad_norm, self.job_lr,
            self.job_tokens, self.job_tps, self.job_mfu, self.job_mfu_full_attention, self.job_step_duration, self.job_phase,
            self.job_peak_memory, self.job_checkpoint_duration, self.job_checkpoint_size, self.job_restarts,
            self.job_resizes, self.job_preemptions, self.job_straggler, self.job_gpus,
        )

    # ------------------------------------------------------------------ service

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC: `method` the proto method name (e.g. "CreateJob"), `code` a grpc.StatusCode name."""
        _check(code, GRPC_CODES, "code")
        if not re.fullmatch(r"[A-Z][A-Za-z0-9]{0,62}", method):
            raise ValueError(f"method must be a proto method name like 'CreateJob'; got {method!r}")
        self.grpc_requests.labels(method, code).inc()
        self.grpc_duration.labels(method).observe(seconds)

    def set_queue(self, depth: int, oldest_queued_at: float | None) -> None:
        """Queue length and the Unix time the oldest queued job was enqueued (None: age 0).

        The age is computed at scrape time, so it keeps growing between scheduler passes.
        """
        if depth < 0:
            raise ValueError(f"queue depth must be >= 0; got {depth}")
        self.queue_depth.set(depth)
        with self._lock:
            self._oldest_queued_at = oldest_queued_at

    def _oldest_age(self) -> float:
        with self._lock:
            return self._age(self._oldest_queued_at)

    def set_scale_up(self, nodes: Collection[str], since: float | None) -> None:
        """The pending scale-up: the map nodes asked of Ray's autoscaler and the Unix time they were (no
        nodes: none pending); its age is computed at scrape time."""
        self.scale_up_nodes.set(len(nodes))
        with self._lock:
            self._scale_up_since = since if nodes else None

    def _scale_up_age(self) -> float:
        with self._lock:
            return self._age(self._scale_up_since)

    def _age(self, since: float | None) -> float:
        """Seconds from the Unix time `since` to now (0 for None)."""
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def set_jobs_by_state(self, counts: Mapping[str, int]) -> None:
        """Job counts by state from the store; states not named are set to 0. Also expires finished jobs."""
        for state in counts:
            _check(state, JobState, "state")
        for state in JobState:
            self.jobs.labels(state).set(counts.get(state, 0))
        self.expire_finished_jobs()

    def observe_scheduling(self, decision: str, solver_seconds: float | None = None) -> None:
        """One scheduling decision (see SCHEDULING_DECISIONS), with the solver's time if it ran."""
        _check(decision, SCHEDULING_DECISIONS, "decision")
        self.scheduling_decisions.labels(decision).inc()
        if solver_seconds is not None:
            self.solver_duration.observe(solver_seconds)

    def observe_store(self, op: str, seconds: float) -> None:
        """One store operation (`op` a snake_case name such as "create_job") and its latency."""
        self.store_duration.labels(_identifier(op, "op")).observe(seconds)

    @contextmanager
    def time_store(self, op: str) -> Iterator[None]:
        """`with metrics.time_store("create_job"): ...` observes the block's duration, failed or not."""
        _identifier(op, "op")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe_store(op, time.perf_counter() - started)

    def set_gpu_inventory(self, nodes: Iterable[NodeGpus]) -> None:
        """Replace the GPU inventory: nodes no longer listed disappear from the export."""
        nodes = list(nodes)
        for n in nodes:
            if n.total < 0 or not 0 <= n.used <= n.total:
                raise ValueError(f"node {n.node!r}: need 0 <= used <= total; got used={n.used} total={n.total}")
            _non_empty(n.node, "node")
            _non_empty(n.nvlink_domain, "nvlink_domain")
        with self._lock:
            self.gpus.clear()
            self.gpus_used.clear()
            for n in nodes:
                self.gpus.labels(n.node, n.nvlink_domain).set(n.total)
                self.gpus_used.labels(n.node, n.nvlink_domain).set(n.used)

    def set_tenant_shares(self, shares: Iterable[TenantShare]) -> None:
        """Replace the tenants' shares: tenants no longer holding GPUs disappear from the export."""
        with self._lock:
            self.tenant_gpus.clear()
            for share in shares:
                self.tenant_gpus.labels(share.tenant, "used").set(share.used_gpus)
                self.tenant_gpus.labels(share.tenant, "borrowed").set(share.borrowed_gpus)
                if share.guaranteed_gpus is not None:
                    self.tenant_gpus.labels(share.tenant, "guaranteed").set(share.guaranteed_gpus)

    # ------------------------------------------------------------------ jobs

    def _job(self, job_id: str, tenant: str) -> _JobSeries:
        _non_empty(job_id, "job_id")
        _non_empty(tenant, "tenant")
        series = self._jobs.get(job_id)
        if series is None:
            series = self._jobs[job_id] = _JobSeries(tenant=tenant)
            # Counters and the checkpoint histogram start at 0, so increase() and rate() also see a
            # job's first restart, first resize, first preemption, first tokens and first checkpoint.
            self.job_restarts.labels(job_id, tenant)
            self.job_resizes.labels(job_id, tenant)
            self.job_preemptions.labels(job_id, tenant)
            self.job_tokens.labels(job_id, tenant)
            self.job_checkpoint_duration.labels(job_id, tenant)
        elif series.tenant != tenant:
            raise ValueError(f"job {job_id!r} belongs to tenant {series.tenant!r}, not {tenant!r}")
        return series

    def set_job_state(self, job_id: str, tenant: str, state: str) -> None:
        """The job entered `state`. Terminal states start the series' expiry clock."""
        _check(state, JobState, "state")
        now = self._clock()
        with self._lock:
            series = self._job(job_id, tenant)
            series.finished_at = now if state in TERMINAL_STATES else None
            if series.finished_at is not None:
                self._finished.append((now, job_id))
            for s in JobState:
                self.job_state.labels(job_id, tenant, s).set(1 if s == state else 0)
            if state == JobState.RUNNING:
                self.job_last_progress.labels(job_id, tenant).set(now)

    def set_job_placement(self, job_id: str, tenant: str, gpus: Mapping[tuple[str, str], int]) -> None:
        """The job's GPUs by (node, nvlink_domain); replaces the previous placement (restarts may move it)."""
        with self._lock:
            self._job(job_id, tenant)
            self.job_gpus.remove_by_labels({"job_id": job_id})
            for (node, domain), count in gpus.items():
                if count <= 0:
                    raise ValueError(f"job {job_id!r}: GPU count on node {node!r} must be > 0; got {count}")
                self.job_gpus.labels(job_id, tenant, _non_empty(node, "node"), _non_empty(domain, "nvlink_domain")).set(
                    count)

    def record_step(self, job_id: str, tenant: str, report: StepReport) -> None:
        """One step report from the job's supervisor (rank 0 of the reporting group)."""
        for key in report.breakdown:
            _identifier(key, "breakdown key")
        labels = (job_id, tenant)
        with self._lock:
            series = self._job(job_id, tenant)
            if series.last_step is not None and report.step > series.last_step:
                steps = report.step - series.last_step
            else:
                steps = 1  # first report, or a resume from an earlier checkpoint
            series.last_step = report.step
            self.job_step.labels(*labels).set(report.step)
            self.job_loss.labels(*labels).set(report.loss)
            # A metric the job does not report (a command job's program may pass only step and loss)
            # exports no sample at all, rather than a 0 that reads as measured; the eval loss keeps the
            # value of the newest step that evaluated.
            for gauge, value in ((self.job_eval_loss, report.eval_loss), (self.job_grad_norm, report.grad_norm),
                                 (self.job_lr, report.lr), (self.job_tps, report.tokens_per_second),
                                 (self.job_peak_memory, report.peak_memory_bytes)):
                if value is not None:
                    gauge.labels(*labels).set(value)
            if report.tokens is not None:
                self.job_tokens.labels(*labels).inc(report.tokens * steps)
            for gauge, value in ((self.job_mfu, report.mfu), (self.job_mfu_full_attention, report.mfu_full_attention)):
                if value is not None and math.isfinite(value):
                    gauge.labels(*labels).set(value)
            if report.step_time_seconds is not None:
                self.job_step_duration.labels(*labels).observe(report.step_time_seconds)
            for phase, seconds in report.breakdown.items():
                self.job_phase.labels(*labels, phase).set(seconds)
            if CHECKPOINT_PHASE in report.breakdown:  # the engine times a save inside the step that made it
                self.job_checkpoint_duration.labels(*labels).observe(report.breakdown[CHECKPOINT_PHASE])
            self.job_last_progress.labels(*labels).set(self._clock())

    def record_checkpoint_size(self, job_id: str, tenant: str, size_bytes: int) -> None:
        """Size on disk of the job's newest checkpoint (its save time comes with the step report)."""
        if size_bytes < 0:
            raise ValueError(f"checkpoint size must be >= 0 bytes; got {size_bytes}")
        with self._lock:  # under the lock: a concurrent forget_job cannot leave an orphan series
            self._job(job_id, tenant)
            self.job_checkpoint_size.labels(job_id, tenant).set(size_bytes)

    def record_restart(self, job_id: str, tenant: str) -> None:
        """The job's rank group was restarted from its last checkpoint."""
        with self._lock:  # under the lock: a concurrent forget_job cannot leave an orphan series
            self._job(job_id, tenant)
            self.job_restarts.labels(job_id, tenant).inc()

    def record_resize(self, job_id: str, tenant: str) -> None:
        """An elastic job's layout changed size (its plan's GPU count)."""
        with self._lock:
            self._job(job_id, tenant)
            self.job_resizes.labels(job_id, tenant).inc()

    def record_preemption(self, job_id: str, tenant: str) -> None:
        """The scheduler preempted the job (it checkpoints, stops and is queued again)."""
        with self._lock:
            self._job(job_id, tenant)
            self.job_preemptions.labels(job_id, tenant).inc()

    def set_straggler_ratio(self, job_id: str, tenant: str, ratio: float) -> None:
        """Slowest over fastest rank (or stage) step time; the slowest rank itself goes in an event."""
        if not ratio >= 1.0:
            raise ValueError(f"straggler ratio is slowest/fastest and must be >= 1; got {ratio}")
        with self._lock:  # under the lock: a concurrent forget_job cannot leave an orphan series
            self._job(job_id, tenant)
            self.job_straggler.labels(job_id, tenant).set(ratio)

    def forget_job(self, job_id: str) -> None:
        """Remove every series of the job now (unknown jobs are ignored)."""
        with self._lock:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        for metric in self._job_metrics:
            metric.remove_by_labels({"job_id": job_id})

    def expire_finished_jobs(self) -> list[str]:
        """Remove the series of jobs finished more than `finished_job_ttl_seconds` ago; returns their ids."""
        now = self._clock()
        expired = []
        with self._lock:
            while self._finished and now - self._finished[0][0] >= self._ttl:
                finished_at, job_id = self._finished.popleft()
                series = self._jobs.get(job_id)
                if series is not None and series.finished_at == finished_at:  # not restarted or re-ended since
                    self._forget(job_id)
                    expired.append(job_id)
        return expired


class MetricsServer:
    """A running /metrics HTTP endpoint; `port` is the bound port (useful with port 0)."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics in a daemon thread (port 0 picks a free port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in 0..65535; got {port}")
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)
