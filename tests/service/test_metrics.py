"""ServiceMetrics: the exposition is promtool-clean, labels are bounded, finished jobs expire."""

from __future__ import annotations

import math
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from control_plane_fakes import ScriptedRuntime
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainctl.parallelism.engine.step_report import StepReport
from trainctl.planning.pool import GpuPool
from trainctl.service.metrics import NodeGpus, ServiceMetrics, start_metrics_server
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.tenancy import TenantShare
from trainctl.service.store import JobNotFound, JobStore
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import EventKind, JobState
from trainctl.workers.topology import simulated_topology


def step_report(step: int, **fields: Any) -> StepReport:
    """A StepReport with typical values, overridden by ``fields``."""
    typical: dict[str, Any] = dict(
        loss=2.5, grad_norm=1.0, lr=3e-4, tokens=1024, tokens_per_second=5000.0, mfu=0.4, step_time_seconds=0.2,
        breakdown={"forward_backward": 0.15, "optimizer": 0.05}, peak_memory_bytes=1 << 30, mfu_full_attention=0.42,
    )
    return StepReport(step=step, **{**typical, **fields})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, frozenset(labels.items())))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry, clock: Clock) -> ServiceMetrics:
    return ServiceMetrics(registry, version="1.2.3", finished_job_ttl_seconds=60, clock=clock)


def populate(m: ServiceMetrics) -> None:
    m.observe_rpc("CreateJob", "OK", 0.01)
    m.observe_rpc("GetJob", "NOT_FOUND", 0.002)
    m.set_queue(3, oldest_queued_at=999_990.0)
    m.set_jobs_by_state({"QUEUED": 3, "RUNNING": 1})
    m.observe_scheduling("started", solver_seconds=0.02)
    m.observe_scheduling("no_capacity")
    m.observe_store("create_job", 0.003)
    m.set_gpu_inventory([NodeGpus("node-0", "nvl-0", 8, 8), NodeGpus("node-1", "nvl-0", 8, 0)])
    m.set_job_state("job-a", "team-a", "RUNNING")
    m.set_job_placement("job-a", "team-a", {("node-0", "nvl-0"): 8})
    m.record_step("job-a", "team-a", step_report(step=10, breakdown={"forward_backward": 0.15, "checkpoint": 2.5},
                                                 eval_loss=2.75))
    m.record_step("job-a", "team-a", step_report(step=11))
    m.record_checkpoint_size("job-a", "team-a", 123456)
    m.record_restart("job-a", "team-a")
    m.record_resize("job-a", "team-a")
    m.record_preemption("job-a", "team-a")
    m.set_tenant_shares([TenantShare("team-a", 8, 4)])
    m.set_straggler_ratio("job-a", "team-a", 1.25)


def test_exposition_passes_promtool(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool missing: `make test` installs Debian's prometheus package (make promtool)")
    populate(metrics)
    out = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(registry),
                         capture_output=True, check=False)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_a_jobs_counters_start_at_zero_so_increase_sees_the_first(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    metrics.set_job_state("fresh", "t", JobState.RUNNING)
    for counter in ("trainctl_job_restarts_total", "trainctl_job_resizes_total", "trainctl_job_preemptions_total",
                    "trainctl_job_tokens_total"):
        assert value(registry, counter, job_id="fresh", tenant="t") == 0, counter


def test_values_and_names(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    populate(metrics)
    job = {"job_id": "job-a", "tenant": "team-a"}
    assert value(registry, "trainctl_build_info", version="1.2.3", ray_version="2.60.0",
                 python_version=__import__("platform").python_version()) == 1
    assert value(registry, "trainctl_grpc_requests_total", method="GetJob", code="NOT_FOUND") == 1
    assert value(registry, "trainctl_queue_oldest_age_seconds") == 10
    for state in JobState:  # every state is exported, zeros included
        assert value(registry, "trainctl_jobs", state=state) == {"QUEUED": 3, "RUNNING": 1}.get(state, 0)
    assert value(registry, "trainctl_job_state", state="RUNNING", **job) == 1
    assert value(registry, "trainctl_job_state", state="QUEUED", **job) == 0
    assert value(registry, "trainctl_job_step_phase_seconds", phase="optimizer", **job) == 0.05
    assert value(registry, "trainctl_job_checkpoint_duration_seconds_count", **job) == 1
    assert value(registry, "trainctl_job_checkpoint_duration_seconds_sum", **job) == 2.5
    assert value(registry, "trainctl_job_checkpoint_size_bytes", **job) == 123456
    assert value(registry, "trainctl_job_mfu_ratio", **job) == 0.4  # Megatron's convention (causal halved)
    assert value(registry, "trainctl_job_mfu_full_attention_ratio", **job) == 0.42  # torchtitan's (unmasked)
    assert value(registry, "trainctl_job_gpus", node="node-0", nvlink_domain="nvl-0", **job) == 8
    assert value(registry, "trainctl_cluster_gpus_used", node="node-1", nvlink_domain="nvl-0") == 0
    assert value(registry, "trainctl_job_restarts_total", **job) == 1
    assert value(registry, "trainctl_job_preemptions_total", **job) == 1
    assert value(registry, "trainctl_tenant_gpus", tenant="team-a", kind="borrowed") == 4
    names = {name for name, _ in samples(registry)}
    assert all(n.startswith("trainctl_") for n in names)


def test_queue_age_grows_between_updates(metrics: ServiceMetrics, registry: CollectorRegistry, clock: Clock) -> None:
    metrics.set_queue(1, oldest_queued_at=clock.now)
    clock.now += 42
    assert value(registry, "trainctl_queue_oldest_age_seconds") == 42
    metrics.set_queue(0, None)
    assert value(registry, "trainctl_queue_oldest_age_seconds") == 0


def test_tokens_counter_counts_steps_between_reports(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    job = {"job_id": "j", "tenant": "t"}
    metrics.record_step("j", "t", step_report(step=1, tokens=100))
    metrics.record_step("j", "t", step_report(step=5, tokens=100))  # log_interval 4: 4 steps of 100 tokens
    assert value(registry, "trainctl_job_tokens_total", **job) == 500
    metrics.record_step("j", "t", step_report(step=3, tokens=100))  # resumed from an earlier checkpoint
    assert value(registry, "trainctl_job_tokens_total", **job) == 600
    metrics.record_step("j", "t", step_report(step=4, tokens=100, mfu=None, mfu_full_attention=None))  # unknown peak:
    assert value(registry, "trainctl_job_mfu_ratio", **job) == 0.4  # MFU keeps its last value, in both conventions
    assert value(registry, "trainctl_job_mfu_full_attention_ratio", **job) == 0.42


def test_finished_jobs_expire_after_ttl(metrics: ServiceMetrics, registry: CollectorRegistry, clock: Clock) -> None:
    populate(metrics)
    metrics.set_job_state("job-b", "team-b", "RUNNING")
    metrics.set_job_state("job-a", "team-a", "SUCCEEDED")
    clock.now += 59
    assert metrics.expire_finished_jobs() == []
    clock.now += 1
    metrics.set_jobs_by_state({"SUCCEEDED": 1, "RUNNING": 1})  # the scheduler's periodic call expires too
    remaining = {dict(labels).get("job_id") for _, labels in samples(registry)}
    assert "job-a" not in remaining and "job-b" in remaining
    metrics.forget_job("job-b")
    assert {dict(labels).get("job_id") for _, labels in samples(registry)} == {None}


def test_restarted_job_does_not_expire(metrics: ServiceMetrics, clock: Clock) -> None:
    metrics.set_job_state("j", "t", "FAILED")
    metrics.set_job_state("j", "t", "QUEUED")  # resubmitted / recovered
    clock.now += 3600
    assert metrics.expire_finished_jobs() == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.observe_rpc("CreateJob", "BOGUS", 0.1), "code must be one of"),
        (lambda m: m.observe_rpc("/trainctl.v1.Jobs/CreateJob", "OK", 0.1), "method must be"),
        (lambda m: m.set_jobs_by_state({"DONE": 1}), "state must be one of"),
        (lambda m: m.observe_scheduling("maybe"), "decision must be one of"),
        (lambda m: m.observe_store("Create Job", 0.1), "op must be a snake_case"),
        (lambda m: m.set_queue(-1, None), "queue depth must be >= 0"),
        (lambda m: m.set_gpu_inventory([NodeGpus("n", "d", 4, 5)]), "need 0 <= used <= total"),
        (lambda m: m.record_step("j", "t", step_report(step=1, breakdown={"rank 3": 1.0})), "breakdown key"),
        (lambda m: m.set_straggler_ratio("j", "t", 0.5), "must be >= 1"),
        (lambda m: m.record_checkpoint_size("j", "t", -1), "checkpoint size"),
        (lambda m: m.record_restart("", "t"), "job_id must be a non-empty"),
    ],
)
def test_bad_input_is_named(metrics: ServiceMetrics, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(metrics)


def test_job_cannot_change_tenant(metrics: ServiceMetrics) -> None:
    metrics.record_restart("j", "t1")
    with pytest.raises(ValueError, match="belongs to tenant 't1'"):
        metrics.record_restart("j", "t2")


def test_registries_are_independent(clock: Clock) -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ServiceMetrics(a, clock=clock).record_restart("j", "t")
    ServiceMetrics(b, clock=clock)
    assert value(a, "trainctl_job_restarts_total", job_id="j", tenant="t") == 1
    assert value(b, "trainctl_job_restarts_total", job_id="j", tenant="t") is None


def test_metrics_server_serves_registry(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    populate(metrics)
    server = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        server.close()
    assert 'trainctl_job_step{job_id="job-a",tenant="team-a"} 11.0' in body
    with pytest.raises(ValueError, match="metrics port"):
        start_metrics_server(registry, "127.0.0.1", 70000)


def test_time_store_observes_failures_too(metrics: ServiceMetrics, registry: CollectorRegistry) -> None:
    with metrics.time_store("get_job"):
        pass
    with pytest.raises(KeyError), metrics.time_store("get_job"):
        raise KeyError("missing")
    assert value(registry, "trainctl_store_operation_duration_seconds_count", op="get_job") == 2
    with pytest.raises(ValueError, match="op must be a snake_case"), metrics.time_store("Get Job"):
        pass


STORE_OPERATIONS = {
    "create_job", "get_job", "list_jobs", "update_status", "append_event", "record_step", "count_by_state",
    "step_metrics", "events",
}


def store_ops(registry: CollectorRegistry) -> dict[str, float]:
    """Observations of trainctl_store_operation_duration_seconds by `op`."""
    return {dict(labels)["op"]: v for (name, labels), v in samples(registry).items()
            if name == "trainctl_store_operation_duration_seconds_count"}


def test_store_times_each_operation_under_its_name(
    metrics: ServiceMetrics, registry: CollectorRegistry, tmp_path: Path, store_location: str
) -> None:
    store = JobStore(store_location, metrics=metrics)
    record, _ = store.create_job(TrainingJob.model_validate({"metadata": {"name": "timed"}}))
    store.get_job(record.id)
    store.list_jobs(states=["QUEUED"])
    store.update_status(record.id, reason="waiting")
    store.append_event(record.id, "log", {"message": "hello"})
    store.record_step(record.id, {"step": 1, "loss": 2.0})
    store.count_by_state()
    store.step_metrics(record.id)
    store.events(record.id)
    with pytest.raises(JobNotFound):
        store.get_job("no-such-job")
    assert store_ops(registry) == {op: 2 if op == "get_job" else 1 for op in STORE_OPERATIONS}  # failures too
    untimed = JobStore(tmp_path / "untimed")  # a store without metrics works the same
    untimed.create_job(TrainingJob.model_validate({"metadata": {"name": "plain"}}))
    assert untimed.count_by_state() == {"QUEUED": 1} and store_ops(registry)["create_job"] == 1


def running_job(metrics: ServiceMetrics, location: str | Path, runs: Path) -> tuple[Scheduler, ScriptedRuntime, str]:
    """A scheduler feeding `metrics`, its store at `location`, and a job it started, now RUNNING."""
    runtime = ScriptedRuntime()
    store = JobStore(location, metrics=metrics)
    scheduler = Scheduler(store, GpuPool(simulated_topology(1, 2), "simulated"), runtime, runs, metrics=metrics)
    job_id = store.create_job(TrainingJob.model_validate({"metadata": {"name": "fed"}}))[0].id
    scheduler.tick()
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    return scheduler, runtime, job_id


def test_scheduler_feeds_straggler_ratio_and_checkpoint_size_and_time(
    metrics: ServiceMetrics, registry: CollectorRegistry, tmp_path: Path
) -> None:
    scheduler, runtime, job_id = running_job(metrics, tmp_path, tmp_path / "runs")
    report = {"step": 1, "loss": 3.0, "step_time_seconds": 0.5, "breakdown": {"optimizer": 0.1}, "straggler": None}
    runtime.logs[job_id].append(EventKind.STEP, step=report)
    runtime.logs[job_id].append(EventKind.STEP, step={
        **report, "step": 2, "breakdown": {"optimizer": 0.1, "checkpoint": 2.0}, "checkpoint_bytes": 4096,
        "straggler": {"step": 1, "rank_step_times": {"0": 0.5, "1": 0.75}, "slowest_rank": 1, "fastest_rank": 0,
                      "ratio": 1.5},
    })
    scheduler.tick()
    labels = {"job_id": job_id, "tenant": "default"}
    assert value(registry, "trainctl_job_straggler_ratio", **labels) == 1.5
    assert value(registry, "trainctl_job_checkpoint_size_bytes", **labels) == 4096
    assert value(registry, "trainctl_job_checkpoint_duration_seconds_sum", **labels) == 2.0
    assert value(registry, "trainctl_job_checkpoint_duration_seconds_count", **labels) == 1
    assert not any("rank" in name for _, key in samples(registry) for name, _ in key)  # the slowest rank is no label
    assert {"create_job", "get_job", "list_jobs", "record_step"} <= set(store_ops(registry))


def test_a_nan_step_reaches_the_store_and_the_loss_gauge(
    metrics: ServiceMetrics, registry: CollectorRegistry, tmp_path: Path, store_location: str
) -> None:
    """A diverged step (NaN loss and grad_norm) is recorded on either store and exported as NaN."""
    scheduler, runtime, job_id = running_job(metrics, store_location, tmp_path / "runs")
    runtime.logs[job_id].append(EventKind.STEP, step={"step": 1, "loss": math.nan, "grad_norm": math.nan})
    scheduler.tick()
    labels = {"job_id": job_id, "tenant": "default"}
    assert math.isnan(value(registry, "trainctl_job_loss", **labels))
    assert math.isnan(value(registry, "trainctl_job_grad_norm", **labels))
    record = scheduler.store.get_job(job_id)
    assert math.isnan(record.last_loss) and record.steps_done == 1
