"""Two scheduler replicas on one PostgreSQL store (one scripted runtime plays the shared Ray cluster):
exactly one leads through the database lease, a standby takes over when the leader dies and re-attaches
to its running job, and a lease race (the leader paused past its lease at its worst moments) starts no
job twice (trainctl.service.scheduling.leadership)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from control_plane_fakes import ScriptedRuntime, eventually
from postgres_server import PostgresServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from small_jobs import small_job

from trainctl.planning.pool import GpuPool
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.store import JobStore
from trainctl.workers.events import JobState
from trainctl.workers.topology import simulated_topology

TTL = 1.0
"""Short leases keep the test short; the protocol does not depend on the length."""
PAUSE = 3 * TTL


class PausingStore(JobStore):
    """A store whose replica can be frozen in one chosen write, before or after it commits: the write
    and the lease renewals (the whole replica, as a long GC pause or SIGSTOP would) wait until `resume`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pause_on: tuple[str, Callable[[dict[str, Any]], bool], bool] | None = None
        """(method, which call of it, after its commit)."""
        self.paused = threading.Event()
        self.resume = threading.Event()

    def _pausing(self, method: str, arguments: dict[str, Any], write: Callable[[], Any]) -> Any:
        if self.pause_on is None or self.pause_on[0] != method or not self.pause_on[1](arguments):
            return write()
        after_commit = self.pause_on[2]
        self.pause_on = None
        result = write() if after_commit else None
        self.paused.set()
        self.resume.wait(30)
        return result if after_commit else write()

    def update_status(self, job_id: str, **changes: Any) -> Any:
        return self._pausing("update_status", changes, lambda: super(PausingStore, self).update_status(job_id, **changes))

    def record_step(self, job_id: str, metrics: dict[str, Any], **kwargs: Any) -> int:
        return self._pausing("record_step", metrics, lambda: super(PausingStore, self).record_step(job_id, metrics, **kwargs))

    def acquire_lease(self, *args: Any, **kwargs: Any) -> Any:
        if self.paused.is_set():
            self.resume.wait(30)
        return super().acquire_lease(*args, **kwargs)


def replica(url: str, runtime: ScriptedRuntime, runs: Path, holder: str, registry: CollectorRegistry,
            store_type: type[JobStore] = JobStore) -> Scheduler:
    store = store_type(url)
    scheduler = Scheduler(store, GpuPool(simulated_topology(1, 2), "simulated"), runtime, runs,
                          leadership=Leadership(store, holder=holder, ttl=TTL), interval=0.05,
                          metrics=ServiceMetrics(registry))
    scheduler.leadership.start()
    scheduler.start()
    return scheduler


def shut(*schedulers: Scheduler) -> None:
    for s in schedulers:
        s.stop()
        s.leadership.stop()
        s.store.close()


@dataclass
class Replicas:
    """One scripted cluster and two scheduler replicas on one database, each with its Prometheus registry."""

    runtime: ScriptedRuntime
    a: Scheduler
    b: Scheduler
    frozen: PausingStore
    """`a`'s store, which can freeze it."""
    registries: dict[str, CollectorRegistry]


@pytest.fixture
def replicas(postgres: PostgresServer, tmp_path: Path) -> Iterator[Replicas]:
    """`a` leads, `b` stands by."""
    url = postgres.create_database()
    runtime = ScriptedRuntime()
    registries = {"a": CollectorRegistry(), "b": CollectorRegistry()}
    a = replica(url, runtime, tmp_path / "runs", "a", registries["a"], PausingStore)
    assert isinstance(a.store, PausingStore)
    b: Scheduler | None = None
    try:
        eventually(lambda: a.leading, "a leads")
        b = replica(url, runtime, tmp_path / "runs", "b", registries["b"])
        yield Replicas(runtime, a, b, a.store, registries)
    finally:
        a.store.resume.set()
        shut(a, *([b] if b else []))


def exported(registry: CollectorRegistry, job_id: str) -> tuple[float, int]:
    """(the SCHEDULED jobs gauge, how many series of the job say its state) in a replica's export."""
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    scheduled = next(s.value for f in families for s in f.samples
                     if s.name == "trainctl_jobs" and s.labels == {"state": "SCHEDULED"})
    series = sum(1 for f in families for s in f.samples
                 if s.name == "trainctl_job_state" and s.labels.get("job_id") == job_id and s.value == 1)
    return scheduled, series


def started(runtime: ScriptedRuntime) -> list[str]:
    """Job ids in the order the runtime was asked to start them (one entry per start)."""
    return [job_id for job_id, _ in runtime.started]


def test_one_replica_leads_and_a_standby_takes_over_and_reattaches_when_it_dies(replicas: Replicas) -> None:
    runtime, a, b = replicas.runtime, replicas.a, replicas.b
    job_id = b.store.create_job(small_job("j"))[0].id  # any replica takes API writes
    runtime.wait_started(job_id)
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    runtime.step(job_id, 1, 3.0)
    eventually(lambda: a.store.get_job(job_id).steps_done == 1, "a follows the job")
    assert not b.leading and set(a.pool.holders().values()) == {job_id}
    eventually(lambda: b.pool.holders() == a.pool.holders(), "the standby's pool mirrors the leader's")

    a.stop()  # the leader dies as under SIGKILL: its loop and renewals stop, the lease is not released
    a.leadership._stop.set()
    eventually(lambda: b.leading, "b leads once a's lease lapsed")
    assert job_id in runtime.attached  # re-attached to the supervisor a started, not started again
    runtime.step(job_id, 2, 2.0)
    runtime.state(job_id, JobState.SUCCEEDED, "done")
    eventually(lambda: b.store.get_job(job_id).state == JobState.SUCCEEDED, "b records the end")
    assert [m["step"] for m in b.store.step_metrics(job_id)] == [1, 2]
    assert [e.payload["step"] for e in b.store.events(job_id) if e.type == "step"] == [1, 2]
    assert started(runtime) == [job_id]


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_lease_race_starts_no_job_twice(replicas: Replicas, where: str) -> None:
    """The leader freezes at its admission write past its lease, the standby takes over and starts the
    job; when the old leader resumes, its fenced write is refused ("before": LeaseLost) or it finds too
    little lease left to hand the job to the runtime ("after"), and stands down. The job starts once."""
    r = replicas
    runtime, a, b, frozen = r.runtime, r.a, r.b, r.frozen
    frozen.pause_on = ("update_status", lambda changes: changes.get("state") == JobState.SCHEDULED, where == "after")
    job_id = b.store.create_job(small_job("j"))[0].id
    eventually(frozen.paused.is_set, "a frozen in its admission write")
    eventually(lambda: b.leading, "b leads once a's lease lapsed")
    # b admitted it ("before") or re-synced and started it ("after"; a re-sync attaches before it starts)
    eventually(lambda: job_id in started(runtime), "b starts the job")
    frozen.resume.set()
    eventually(lambda: not a.leading, "a stands down")
    time.sleep(PAUSE)  # both loops keep running: neither starts it again
    assert started(runtime) == [job_id]
    assert set(b.pool.holders().values()) == {job_id}  # its GPUs held once, by the new leader
    eventually(lambda: a.pool.holders() == b.pool.holders(), "the old leader's pool mirrors the new one's")
    # the cluster gauges are the leader's; the old leader zeroed them and dropped the job's series
    eventually(lambda: exported(r.registries["b"], job_id)[0] == 1, "the leader exports the SCHEDULED job")
    assert exported(r.registries["a"], job_id) == (0, 0)
    states = [e.payload["to"] for e in b.store.events(job_id) if e.type == "state"]
    assert states == ["QUEUED", "SCHEDULED"]
    runtime.run(job_id, [2.0])
    eventually(lambda: b.store.get_job(job_id).state == JobState.SUCCEEDED, "b supervises it to the end")


def test_a_deposed_leader_frozen_mid_follow_writes_nothing_twice(replicas: Replicas) -> None:
    """The leader freezes in the write of a step past its lease; the standby takes over, resumes the
    job's log at the stored cursor and records that step; the old leader's write, resumed, is refused
    (its lease is gone) instead of appending the step a second time."""
    r = replicas
    runtime, a, b, frozen = r.runtime, r.a, r.b, r.frozen
    job_id = b.store.create_job(small_job("j"))[0].id
    eventually(lambda: job_id in started(runtime), "a starts the job")
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    runtime.step(job_id, 1, 3.0)
    eventually(lambda: a.store.get_job(job_id).steps_done == 1, "a records step 1")
    frozen.pause_on = ("record_step", lambda metrics: metrics["step"] == 2, False)
    runtime.step(job_id, 2, 2.0)
    eventually(frozen.paused.is_set, "a frozen in the write of step 2")
    eventually(lambda: b.leading, "b leads once a's lease lapsed")
    eventually(lambda: b.store.get_job(job_id).steps_done == 2, "b records step 2")
    frozen.resume.set()
    eventually(lambda: not a.leading, "a stands down")
    runtime.state(job_id, JobState.SUCCEEDED, "done")
    eventually(lambda: b.store.get_job(job_id).state == JobState.SUCCEEDED, "b records the end")
    assert [e.payload["step"] for e in b.store.events(job_id) if e.type == "step"] == [1, 2]
    assert started(runtime) == [job_id]
