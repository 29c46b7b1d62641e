"""Losing the database.

Under load: a real PostgreSQL behind the real gRPC server and scheduler loop (scripted runtime) is
stopped for a few seconds while clients create, list and watch jobs and a job keeps training, then
started again. Every call in between answers OK or UNAVAILABLE (never INTERNAL, never past its
deadline), health is NOT_SERVING meanwhile (readiness), the service serves again by itself, every
acknowledged job is there once, and the steps the job made meanwhile are recorded once each.

At the scheduler's worst moments (a store whose chosen write fails, before or after committing, as a
lost connection leaves it): the loop survives, re-syncs from the store and neither loses nor repeats
anything."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from control_plane_fakes import ScriptedRuntime, free_port, make_scheduler, start_api_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from postgres_server import PostgresServer
from small_jobs import small_job

from trainctl.service.readiness import StoreReadiness
from trainctl.service.store import JobStore, StoreUnavailable
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto
from trainctl.workers.events import JobState

CLIENTS = 3
OUTAGE_SECONDS = 3.0
CALL_DEADLINE_SECONDS = 10.0
"""A call still unanswered after this fails DEADLINE_EXCEEDED, which the test refuses (a hang)."""
RECOVERY_SECONDS = 30.0


def eventually(check: Callable[[], Any], what: str, timeout: float = RECOVERY_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.1)


class Load:
    """Client threads creating jobs (a failed create is retried with the same request id) and listing."""

    def __init__(self, stub: pb_grpc.TrainingServiceStub):
        self.stub = stub
        self.codes: Counter[str] = Counter()
        self.acknowledged: dict[str, str] = {}  # request id -> job id
        self.pending: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(CLIENTS)]

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            response = method(request, timeout=CALL_DEADLINE_SECONDS)
        except grpc.RpcError as exc:
            with self._lock:
                self.codes[exc.code().name] += 1
            return None
        with self._lock:
            self.codes["OK"] += 1
        return response

    def create(self, request_id: str) -> bool:
        request = pb.CreateJobRequest(job=job_to_proto(small_job(f"load-{request_id}")), request_id=request_id)
        with self._lock:
            self.pending.add(request_id)
        job = self._call(self.stub.CreateJob, request)
        if job is None:
            return False
        with self._lock:
            self.pending.discard(request_id)
            self.acknowledged[request_id] = job.id
        return True

    def _client(self, n: int) -> None:
        number = 0
        while not self._stop.is_set():
            if self.create(f"c{n}-{number}"):
                number += 1
            self._call(self.stub.ListJobs, pb.ListJobsRequest(page_size=5))
            time.sleep(0.05)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CALL_DEADLINE_SECONDS * 3)


def watch(stub: pb_grpc.TrainingServiceStub, job_id: str, ended: dict[str, str]) -> None:
    try:
        for _ in stub.WatchJob(pb.WatchJobRequest(id=job_id, follow=True)):
            pass
        ended["code"] = "OK"
    except grpc.RpcError as exc:
        ended["code"] = exc.code().name


@pytest.mark.parametrize("lease_ttl", [None, 1.0], ids=["single", "leader-lease-lapses"])
def test_losing_the_database_answers_unavailable_and_recovers_losing_nothing(
    tmp_path: Path, private_postgres: PostgresServer, lease_ttl: float | None
) -> None:
    """Also as a replica whose scheduler lease (1 s) lapses during the outage: it stands down, takes
    the lease again when the database returns and re-syncs from the store."""
    runtime = ScriptedRuntime()
    api = start_api_server(tmp_path, runtime, nodes=1, gpus=2, store=private_postgres.create_database(),
                           lease_ttl=lease_ttl)
    channel = grpc.insecure_channel(api.target)
    stub = pb_grpc.TrainingServiceStub(channel)
    readiness = StoreReadiness(api.scheduler.store, api.health, [""], stopping=threading.Event(), interval=0.2)
    readiness.start()
    health_stub = health_pb2_grpc.HealthStub(channel)

    def serving() -> bool:
        return health_stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING

    try:
        assert serving()
        running = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(small_job("running")), request_id="running"))
        runtime.wait_started(running.id)
        runtime.state(running.id, JobState.RUNNING, "ranks up")
        runtime.step(running.id, 1, 3.0)
        eventually(lambda: stub.GetJob(pb.GetJobRequest(id=running.id)).status.steps_done == 1, "step 1 recorded")
        ended: dict[str, str] = {}
        watcher = threading.Thread(target=watch, args=(stub, running.id, ended), daemon=True)
        watcher.start()

        with Load(stub) as load:
            eventually(lambda: len(load.acknowledged) >= CLIENTS, "the clients' first jobs acknowledged")
            private_postgres.stop()
            runtime.step(running.id, 2, 2.5)  # the job trains on while the database is away
            runtime.step(running.id, 3, 2.0)
            eventually(lambda: load.codes["UNAVAILABLE"] >= CLIENTS, "UNAVAILABLE answers during the outage")
            eventually(lambda: not serving(), "NOT_SERVING during the outage")
            if lease_ttl is not None:
                eventually(lambda: not api.scheduler.leading, "the lease lapsed during the outage")
            time.sleep(OUTAGE_SECONDS)
            acknowledged_before = len(load.acknowledged)
            private_postgres.start()
            eventually(lambda: len(load.acknowledged) > acknowledged_before, "jobs acknowledged after the database returned")
            eventually(serving, "SERVING again")

        assert set(load.codes) <= {"OK", "UNAVAILABLE"}, load.codes  # never INTERNAL, never a hang
        watcher.join(CALL_DEADLINE_SECONDS)
        assert ended.get("code") == "UNAVAILABLE"  # a watch in the outage ends retryably (clients resume at their cursor)
        for request_id in sorted(load.pending):  # creates whose answer was lost: a retry returns their job
            assert load.create(request_id), request_id
        jobs = list(stub.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs)
        assert sorted(j.id for j in jobs) == sorted([running.id, *load.acknowledged.values()])  # none lost, none twice

        full = eventually(
            lambda: (job := stub.GetJob(pb.GetJobRequest(id=running.id, view=pb.JOB_VIEW_FULL))).status.steps_done == 3 and job,
            "the steps made during the outage recorded",
        )
        assert [m.step for m in full.metrics] == [1, 2, 3]
        steps = [e.step.step for e in stub.WatchJob(pb.WatchJobRequest(id=running.id, follow=False))
                 if e.WhichOneof("payload") == "step"]
        assert steps == [1, 2, 3]  # each once: the scheduler resumed after the last event it applied

        assert api.scheduler._thread is not None and api.scheduler._thread.is_alive()
        eventually(lambda: api.scheduler.leading, "the scheduler leads again")
        runtime.state(running.id, JobState.SUCCEEDED, "done")
        first_queued = [j for j in jobs if j.id != running.id][-1]  # ListJobs is newest first
        runtime.wait_started(first_queued.id, timeout=RECOVERY_SECONDS)  # the scheduler admits again
        assert [job_id for job_id, _ in runtime.started].count(running.id) == 1
    finally:
        readiness.stop()
        channel.close()
        api.stop()


class FlakyStore(JobStore):
    """A SQLite store whose next write matching `fail_when` raises StoreUnavailable once, before its
    transaction (`committed=False`) or after it committed (the answer lost with the connection)."""

    fail_when: Callable[[str, dict[str, Any]], bool] = staticmethod(lambda _op, _kwargs: False)
    committed = False

    def _maybe_fail(self, op: str, kwargs: dict[str, Any], write: Callable[[], Any]) -> Any:
        if not self.fail_when(op, kwargs):
            return write()
        self.fail_when = staticmethod(lambda _op, _kwargs: False)
        if self.committed:
            write()
        raise StoreUnavailable("the database is unreachable (injected)")

    def record_step(self, job_id: str, metrics: dict[str, Any], **kwargs: Any) -> int:
        return self._maybe_fail("record_step", metrics, lambda: super(FlakyStore, self).record_step(job_id, metrics, **kwargs))

    def update_status(self, job_id: str, **kwargs: Any) -> Any:
        return self._maybe_fail("update_status", kwargs, lambda: super(FlakyStore, self).update_status(job_id, **kwargs))


def flaky_scheduler(tmp_path: Path, runtime: ScriptedRuntime) -> Any:
    scheduler = make_scheduler(tmp_path, runtime, nodes=1, gpus=2)
    scheduler.store.close()
    scheduler.store = FlakyStore(tmp_path)
    scheduler.interval = 0.05
    return scheduler


def test_a_failed_write_mid_page_resumes_after_the_last_event_applied(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    scheduler = flaky_scheduler(tmp_path, runtime)
    job_id = scheduler.store.create_job(small_job("a"))[0].id
    scheduler.tick()
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    for step in (1, 2, 3):
        runtime.step(job_id, step, 4.0 - step)
    scheduler.store.fail_when = staticmethod(lambda op, metrics: op == "record_step" and metrics["step"] == 2)
    scheduler.start()
    try:
        eventually(lambda: scheduler.store.get_job(job_id).steps_done == 3, "every step recorded", timeout=10)
    finally:
        scheduler.stop()
    events = scheduler.store.events(job_id)
    assert [e.payload["step"] for e in events if e.type == "step"] == [1, 2, 3]
    assert [e.payload["to"] for e in events if e.type == "state"] == ["QUEUED", "SCHEDULED", "RUNNING"]


@pytest.mark.parametrize("committed", [False, True], ids=["lost-before-commit", "committed-unseen"])
def test_an_admission_whose_write_failed_is_started_exactly_once(tmp_path: Path, committed: bool) -> None:
    """Before the commit the job is still QUEUED and its reservation must go (else it blocks its own
    GPUs); after it the job is SCHEDULED in the store and must be started by the re-sync."""
    runtime = ScriptedRuntime()
    scheduler = flaky_scheduler(tmp_path, runtime)
    scheduler.store.committed = committed
    scheduler.store.fail_when = staticmethod(lambda op, changes: op == "update_status" and changes.get("state") == "SCHEDULED")
    job_id = scheduler.store.create_job(small_job("a"))[0].id
    scheduler.start()
    try:
        eventually(lambda: [started for started, _ in runtime.started] == [job_id], "the job started", timeout=10)
        eventually(lambda: scheduler.store.get_job(job_id).state == JobState.SCHEDULED, "the job admitted", timeout=10)
        runtime.run(job_id, [3.0, 2.0])
        eventually(lambda: scheduler.store.get_job(job_id).state == JobState.SUCCEEDED, "the job finished", timeout=10)
    finally:
        scheduler.stop()
    assert [started for started, _ in runtime.started] == [job_id]
    assert scheduler.pool.holders() == {}


def test_serve_with_an_unreachable_database_fails_clearly_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainctl.cli.main import main

    url = f"postgresql://trainctl@127.0.0.1:{free_port()}/nothing-listens-here"
    assert main(["serve", "--store", url, "--data-dir", str(tmp_path), "--metrics-port", "0", "--address", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert "error: the job store: the database postgresql://127.0.0.1:" in err and "unreachable" in err
    import ray

    assert not ray.is_initialized()  # the store is opened before Ray: nothing was started
