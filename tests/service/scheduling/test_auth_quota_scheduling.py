"""The running-GPU quota in the scheduler: a tenant over quota waits (with the reason), its later jobs
wait behind the one its quota holds, and other tenants do not wait, however many of its jobs are queued
ahead of theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from secure_service import POOL_GPUS_PER_NODE, POOL_NODES
from small_jobs import small_job

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import GpuPool
from trainctl.service.scheduling.admission import QUEUE_PAGE
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.tenancy import Quota
from trainctl.service.store import JobStore
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState, JobStatus
from trainctl.workers.topology import simulated_topology


class FakeRuntime:
    """Starts nothing; a job runs until the test marks it finished."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: set[str] = set()

    def start_job(
        self, job_id: str, job: Any, placement: Any, run_dir: RunDirectory, *, node_env: dict, file_rule: Any,
        relaunch: Any = None,
    ) -> None:
        self.started.append(job_id)

    def attach(self, job_id: str, run_dir: RunDirectory) -> None:
        raise AssertionError("nothing to re-attach in this test")

    def running_jobs(self) -> list[str]:
        return []

    def poll(self, job_id: str, cursor: int) -> JobStatus:
        phase = JobState.SUCCEEDED if job_id in self.finished else JobState.RUNNING
        return JobStatus(events=[], cursor=cursor, state=phase, reason="test", restarts=0, last_seq=cursor)

    def cancel(self, job_id: str) -> JobStatus:
        raise AssertionError("no cancel in this test")

    def live_nodes(self) -> set[str]:
        return {f"node-{i}" for i in range(POOL_NODES)}


def job(name: str, gpus: int) -> TrainingJob:
    return small_job(name, gpus=gpus)


def quota_scheduler(tmp_path: Path, quotas: dict[str, Quota]) -> tuple[Scheduler, JobStore, FakeRuntime]:
    """A scheduler over a fresh store and the simulated pool, with these tenants' quotas (others unlimited)."""
    store = JobStore(tmp_path)
    runtime = FakeRuntime()
    pool = GpuPool(simulated_topology(POOL_NODES, POOL_GPUS_PER_NODE), "simulated")
    return Scheduler(store, pool, runtime, tmp_path / "runs", quota_of=lambda t: quotas.get(t, Quota())), store, runtime


def test_a_tenant_over_its_gpu_quota_waits_without_blocking_others(tmp_path: Path) -> None:
    scheduler, store, runtime = quota_scheduler(tmp_path, {"vision": Quota(running_gpus=4)})
    try:
        first, _ = store.create_job(job("first", 4), tenant="vision")
        second, _ = store.create_job(job("second", 2), tenant="vision")
        other, _ = store.create_job(job("other", 2), tenant="nlp")
        scheduler.tick()
        assert runtime.started == [first.id, other.id]
        waiting = store.get_job(second.id)
        assert waiting.state == JobState.QUEUED
        assert "quota running_gpus of tenant 'vision'" in waiting.reason and "4 of 4 GPUs in use" in waiting.reason

        runtime.finished.add(first.id)
        scheduler.tick()  # the first job ends, its GPUs leave the tenant's count
        scheduler.tick()
        assert store.get_job(first.id).state == JobState.SUCCEEDED
        assert runtime.started == [first.id, other.id, second.id]
        assert store.get_job(second.id).state == JobState.SCHEDULED
    finally:
        store.close()


def test_the_admission_pass_walks_past_a_page_of_over_quota_jobs_and_marks_the_rest_in_one_write(tmp_path: Path) -> None:
    """The pass reads the queue a page at a time (QUEUE_PAGE): more than a page of one tenant's jobs held
    by its quota do not hide the next tenant's job, and every job behind the first that does not fit
    gets its reason."""
    scheduler, store, runtime = quota_scheduler(tmp_path, {"vision": Quota(running_gpus=0)})
    try:
        held = [store.create_job(job(f"held{i}", 1), tenant="vision")[0].id for i in range(QUEUE_PAGE + 6)]
        fits = store.create_job(job("fits", 2), tenant="nlp")[0].id
        too_big = store.create_job(job("too-big", POOL_NODES * POOL_GPUS_PER_NODE), tenant="nlp")[0].id
        behind = [store.create_job(job(f"behind{i}", 1), tenant="nlp")[0].id for i in range(QUEUE_PAGE + 1)]
        scheduler.tick()
        assert runtime.started == [fits]
        assert "quota running_gpus of tenant 'vision'" in store.get_job(held[0]).reason
        assert {store.get_job(j).reason for j in held[1:]} == {f"waiting behind {held[0]}, held by tenant 'vision''s quota"}
        assert store.get_job(too_big).reason.startswith("waiting for")
        assert {store.get_job(j).reason for j in behind} == {f"waiting behind {too_big} (priority 0), first in the queue"}
    finally:
        store.close()


def test_a_tenants_small_jobs_wait_behind_its_job_held_by_the_quota(tmp_path: Path) -> None:
    """The queue is strict within a tenant: a small job that fits the quota's remainder does not start
    before the tenant's higher-priority job the quota holds (a stream of them would starve it), while
    another tenant's job behind both starts."""
    scheduler, store, runtime = quota_scheduler(tmp_path, {"vision": Quota(running_gpus=4)})
    try:
        running = store.create_job(job("running", 2), tenant="vision")[0].id
        scheduler.tick()
        big = store.create_job(small_job("big", gpus=4, scheduling={"priority": 10}), tenant="vision")[0].id
        small = store.create_job(job("small", 2), tenant="vision")[0].id
        other = store.create_job(job("other", 2), tenant="nlp")[0].id
        scheduler.tick()
        assert runtime.started == [running, other]
        assert "quota running_gpus of tenant 'vision': 2 of 4 GPUs in use" in store.get_job(big).reason
        assert store.get_job(small).reason == f"waiting behind {big}, held by tenant 'vision''s quota"

        runtime.finished.add(running)
        scheduler.tick()
        scheduler.tick()
        assert runtime.started == [running, other, big]
        assert store.get_job(small).state == JobState.QUEUED
    finally:
        store.close()
