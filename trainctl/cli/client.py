"""The Python client of the trainctl API: one class over a gRPC channel.

    client = TrainctlClient("127.0.0.1:50051", token=os.environ.get("TRAINCTL_TOKEN"))
    job = client.create_job(load_job_file("job.yaml"))
    for event in client.watch(job.id):
        ...

Errors are grpc.RpcError; `trainctl.service.errors.field_violations(err)` lists the offending fields
of an INVALID_ARGUMENT. `create_job` sends a fresh request id, and retries an UNAVAILABLE answer
with the same id, so a retry never creates the job twice. `watch` resumes from the last event it
saw when the stream breaks.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc

from trainctl.service.convert import job_to_proto
from trainctl.service.sweep_convert import sweep_to_proto
from trainctl.service.tls import channel_credentials
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50051"
SERVER_ENV = "TRAINCTL_SERVER"
TOKEN_ENV = "TRAINCTL_TOKEN"
RETRIES = 5


class TrainctlClient:
    """A connection to a trainctl service."""

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        timeout: float = 30.0,
    ):
        self.target = target or os.environ.get(SERVER_ENV) or DEFAULT_SERVER
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if tls_ca or tls_cert:
            self._channel = grpc.secure_channel(self.target, channel_credentials(tls_ca, tls_cert, tls_key))
        else:
            self._channel = grpc.insecure_channel(self.target)
        self._stub = pb_grpc.TrainingServiceStub(self._channel)
        self.timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TrainctlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (grpc.FutureTimeoutError after `timeout`)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # ---- jobs -----------------------------------------------------------------------------------------
    def create_job(self, job: TrainingJob | pb.Job, *, request_id: str | None = None) -> pb.Job:
        """Submit a job; returns it as recorded (state QUEUED)."""
        message = job if isinstance(job, pb.Job) else job_to_proto(job)
        request = pb.CreateJobRequest(job=message, request_id=request_id or uuid.uuid4().hex)
        for attempt in range(RETRIES):
            try:
                return self._stub.CreateJob(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def get_job(self, job_id: str, *, full: bool = False) -> pb.Job:
        """A job; `full` adds every recorded step's metrics."""
        view = pb.JOB_VIEW_FULL if full else pb.JOB_VIEW_BASIC
        return self._stub.GetJob(pb.GetJobRequest(id=job_id, view=view), timeout=self.timeout, metadata=self._metadata)

    def list_jobs(
        self, *, states: Iterable[str] = (), labels: dict[str, str] | None = None, page_size: int = 100
    ) -> Iterator[pb.Job]:
        """Every matching job, newest first, fetching page after page."""
        request = pb.ListJobsRequest(
            states=[pb.JobState.Value(s) for s in states], labels=labels or {}, page_size=page_size
        )
        while True:
            page = self._stub.ListJobs(request, timeout=self.timeout, metadata=self._metadata)
            yield from page.jobs
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    def cancel_job(self, job_id: str, reason: str = "") -> pb.Job:
        return self._stub.CancelJob(pb.CancelJobRequest(id=job_id, reason=reason), timeout=self.timeout, metadata=self._metadata)

    def watch(self, job_id: str, *, after_sequence: int = 0, follow: bool = True) -> Iterator[pb.JobEvent]:
        """The job's events after `after_sequence`; with `follow`, until the job ends. A broken stream
        (UNAVAILABLE) is re-opened from the last event seen."""
        cursor = after_sequence
        failures = 0
        while True:
            request = pb.WatchJobRequest(id=job_id, after_sequence=cursor, follow=follow)
            try:
                for event in self._stub.WatchJob(request, metadata=self._metadata):
                    cursor = event.sequence
                    failures = 0
                    yield event
                return
            except grpc.RpcError as exc:
                failures += 1
                if exc.code() != grpc.StatusCode.UNAVAILABLE or failures > RETRIES:
                    raise
                time.sleep(0.2 * 2**failures)

    def plan_job(self, job: TrainingJob | pb.Job) -> pb.PlanJobResponse:
        message = job if isinstance(job, pb.Job) else job_to_proto(job)
        return self._stub.PlanJob(pb.PlanJobRequest(job=message), timeout=self.timeout, metadata=self._metadata)

    def get_cluster(self) -> pb.Cluster:
        return self._stub.GetCluster(pb.GetClusterRequest(), timeout=self.timeout, metadata=self._metadata)

    # ---- sweeps ---------------------------------------------------------------------------------------
    def create_sweep(self, sweep: Sweep | pb.Sweep, *, request_id: str | None = None) -> pb.Sweep:
        """Submit a sweep (retried with the same request id while the service is UNAVAILABLE)."""
        message = sweep if isinstance(sweep, pb.Sweep) else sweep_to_proto(sweep)
        request = pb.CreateSweepRequest(sweep=message, request_id=request_id or uuid.uuid4().hex)
        for attempt in range(RETRIES):
            try:
                return self._stub.CreateSweep(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == RETRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def get_sweep(self, sweep_id: str) -> pb.Sweep:
        return self._stub.GetSweep(pb.GetSweepRequest(id=sweep_id), timeout=self.timeout, metadata=self._metadata)

    def list_sweeps(self, *, page_size: int = 100) -> Iterator[pb.Sweep]:
        """Every sweep the caller may see, newest first."""
        request = pb.ListSweepsRequest(page_size=page_size)
        while True:
            page = self._stub.ListSweeps(request, timeout=self.timeout, metadata=self._metadata)
            yield from page.sweeps
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    def cancel_sweep(self, sweep_id: str, reason: str = "") -> pb.Sweep:
        request = pb.CancelSweepRequest(id=sweep_id, reason=reason)
        return self._stub.CancelSweep(request, timeout=self.timeout, metadata=self._metadata)

    def watch_sweep(self, sweep_id: str) -> Iterator[pb.Sweep]:
        """The sweep each time it changes, until it has ended."""
        yield from self._stub.WatchSweep(pb.WatchSweepRequest(id=sweep_id), metadata=self._metadata)
