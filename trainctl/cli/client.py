"""The Python client of the trainctl API: one class over a gRPC channel.

    client = TrainctlClient("127.0.0.1:50051", token=os.environ.get("TRAINCTL_TOKEN"))
    job = client.create_job(load_job_file("job.yaml"))
    for event in client.watch(job.id):
        ...

The target may name several replicas of the service, comma-separated ("a:50051,b:50051"; the same in
$TRAINCTL_SERVER). Calls go to one address at a time; a call answered UNAVAILABLE (connection
refused, the replica gone, its database unreachable) is tried again on the next address, and after
each full round of addresses the client waits (0.4 s, doubling) before the next; it gives up after
RETRIES rounds. Every call is safe to repeat: `create_job` / `create_sweep` send a fresh request id
and repeat it unchanged, so a retry never creates the job twice, and a repeated cancel that finds the
job CANCELLED (FAILED_PRECONDITION: the first try went through) answers the job. `watch` re-opens a
broken stream (UNAVAILABLE) the same way, on the next address, from the last event it saw: no gap, no
duplicate; `watch_sweep` too, skipping the repeat of the sweep it last showed.

`connect()` asks every address at once whether a server answers there, makes the first in order that
does the current one, and raises ServerUnreachable naming them when none does (a refused connection
at once, a silent address after a second and a half). The `trainctl` command's clients (`fail_fast`)
run it before their first call, so a command with no server to talk to ends at once with a hint
rather than after the rounds of retries.

Errors are grpc.RpcError; `trainctl.wire.errors.field_violations(err)` lists the offending fields
of an INVALID_ARGUMENT.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from trainctl.cli.addresses import server_addresses
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.tls import channel_credentials

if TYPE_CHECKING:  # the spec models load only when a call converts one (`trainctl list` never does)
    from trainctl.spec.job import TrainingJob
    from trainctl.spec.sweep import Sweep

TOKEN_ENV = "TRAINCTL_TOKEN"
RETRIES = 5
"""Rounds over the addresses before a call answered UNAVAILABLE everywhere gives up."""
CONNECT_TIMEOUT = 1.5
"""Seconds `connect` waits for an address that neither answers nor refuses the connection."""
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
"""The method `connect` asks (an empty request: the server's overall health), which every server serves."""


class ServerUnreachable(ConnectionError):
    """No server answered at any address of the list; the message names each and what happened there."""


def _job_message(job: TrainingJob) -> pb.Job:
    from trainctl.wire.convert import job_to_proto

    return job_to_proto(job)


def _sweep_message(sweep: Sweep) -> pb.Sweep:
    from trainctl.wire.sweep_convert import sweep_to_proto

    return sweep_to_proto(sweep)


class TrainctlClient:
    """A connection to a trainctl service: one or several replicas (module docstring)."""

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        timeout: float = 30.0,
        fail_fast: bool = False,
    ):
        """`fail_fast`: the first call first runs `connect`, so with no server answering it raises
        ServerUnreachable at once instead of retrying UNAVAILABLE for the rounds (the `trainctl` command's
        choice; a failover once connected is retried as ever)."""
        self.addresses = server_addresses(target)
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key) if tls_ca or tls_cert else None
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0
        self._connect_first = fail_fast
        self.timeout = timeout

    @property
    def target(self) -> str:
        """The address calls go to now."""
        return self.addresses[self._current]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> TrainctlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _channel(self, address: str | None = None) -> grpc.Channel:
        """The channel to `address` (default: the current one), opened on first use."""
        address = address or self.target
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is not None:
                channel = grpc.secure_channel(address, self._credentials)
            else:
                channel = grpc.insecure_channel(address)
            self._channels[address] = channel
        return channel

    @property
    def _stub(self) -> pb_grpc.TrainingServiceStub:
        if self._connect_first:
            self._connect_first = False
            self.connect()
        return pb_grpc.TrainingServiceStub(self._channel())

    def _fail_over(self, exc: grpc.RpcError, failures: int) -> None:
        """After the `failures`-th UNAVAILABLE in a row: move to the next address, waiting after each full
        round; re-raise `exc` when it is not UNAVAILABLE or the rounds are spent."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or failures > RETRIES * len(self.addresses):
            raise exc
        self._current = (self._current + 1) % len(self.addresses)
        rounds, rest = divmod(failures, len(self.addresses))
        if rest == 0:
            time.sleep(0.2 * 2**rounds)

    def _call(self, method: str, request: Any, repeated: Callable[[grpc.RpcError], Any] | None = None) -> Any:
        """A unary call of `method`, failed over across the addresses while it answers UNAVAILABLE.
        `repeated(error)` answers an error other than UNAVAILABLE that a repeat (after an UNAVAILABLE)
        got, when the repeat may have found the first try's effect; it re-raises what it cannot answer."""
        failures = 0
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if failures and repeated is not None and exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return repeated(exc)
                failures += 1
                self._fail_over(exc, failures)

    def connect(self, timeout: float = CONNECT_TIMEOUT) -> TrainctlClient:
        """Make the current address the first, in order, whose server answers, all asked at once (gRPC
        health's Check: any answer but UNAVAILABLE is a server there). An address that refuses the
        connection (nothing listening, no such host, a TLS handshake that fails) is given up at once, one
        that does not answer after `timeout` seconds. Raises ServerUnreachable, channels closed, when
        none answers. Returns the client."""
        probes = [(address, self._channel(address).unary_unary(HEALTH_CHECK).future(b"", timeout=timeout))
                  for address in self.addresses]
        outcomes = []
        for index, (address, probe) in enumerate(probes):
            code = probe.code()
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._current = index
                return self
            outcomes.append(f"{address} ({'connection failed' if code == grpc.StatusCode.UNAVAILABLE else f'no answer in {timeout:g} s'})")
        self.close()
        raise ServerUnreachable(f"no trainctl server at {', '.join(outcomes)}")

    # ---- jobs -----------------------------------------------------------------------------------------
    def create_job(self, job: TrainingJob | pb.Job, *, request_id: str | None = None) -> pb.Job:
        """Submit a job; returns it as recorded (state QUEUED)."""
        message = job if isinstance(job, pb.Job) else _job_message(job)
        return self._call("CreateJob", pb.CreateJobRequest(job=message, request_id=request_id or uuid.uuid4().hex))

    def get_job(self, job_id: str, *, full: bool = False) -> pb.Job:
        """A job; `full` adds every recorded step's metrics."""
        view = pb.JOB_VIEW_FULL if full else pb.JOB_VIEW_BASIC
        return self._call("GetJob", pb.GetJobRequest(id=job_id, view=view))

    def list_jobs(
        self, *, states: Iterable[str] = (), labels: dict[str, str] | None = None, page_size: int = 100
    ) -> Iterator[pb.Job]:
        """Every matching job, newest first, fetching page after page."""
        request = pb.ListJobsRequest(
            states=[pb.JobState.Value(s) for s in states], labels=labels or {}, page_size=page_size
        )
        while True:
            page = self._call("ListJobs", request)
            yield from page.jobs
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    def cancel_job(self, job_id: str, reason: str = "") -> pb.Job:
        """Cancel a job that has not ended (FAILED_PRECONDITION for one that has)."""

        def cancelled_by_the_first_try(exc: grpc.RpcError) -> pb.Job:
            job = self.get_job(job_id) if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            if job is None or job.status.state != pb.CANCELLED:
                raise exc
            return job

        return self._call("CancelJob", pb.CancelJobRequest(id=job_id, reason=reason), cancelled_by_the_first_try)

    def watch(self, job_id: str, *, after_sequence: int = 0, follow: bool = True) -> Iterator[pb.JobEvent]:
        """The job's events after `after_sequence`; with `follow`, until the job ends. A broken stream
        (UNAVAILABLE) is re-opened from the last event seen, on the next address."""
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
                self._fail_over(exc, failures)

    def plan_job(self, job: TrainingJob | pb.Job) -> pb.PlanJobResponse:
        message = job if isinstance(job, pb.Job) else _job_message(job)
        return self._call("PlanJob", pb.PlanJobRequest(job=message))

    def get_cluster(self) -> pb.Cluster:
        return self._call("GetCluster", pb.GetClusterRequest())

    # ---- sweeps ---------------------------------------------------------------------------------------
    def create_sweep(self, sweep: Sweep | pb.Sweep, *, request_id: str | None = None) -> pb.Sweep:
        """Submit a sweep (repeated with the same request id while it is answered UNAVAILABLE)."""
        message = sweep if isinstance(sweep, pb.Sweep) else _sweep_message(sweep)
        return self._call("CreateSweep", pb.CreateSweepRequest(sweep=message, request_id=request_id or uuid.uuid4().hex))

    def get_sweep(self, sweep_id: str) -> pb.Sweep:
        return self._call("GetSweep", pb.GetSweepRequest(id=sweep_id))

    def list_sweeps(self, *, page_size: int = 100) -> Iterator[pb.Sweep]:
        """Every sweep the caller may see, newest first."""
        request = pb.ListSweepsRequest(page_size=page_size)
        while True:
            page = self._call("ListSweeps", request)
            yield from page.sweeps
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    def cancel_sweep(self, sweep_id: str, reason: str = "") -> pb.Sweep:
        return self._call("CancelSweep", pb.CancelSweepRequest(id=sweep_id, reason=reason))

    def watch_sweep(self, sweep_id: str) -> Iterator[pb.Sweep]:
        """The sweep each time it changes, until it has ended. A broken stream (UNAVAILABLE) is re-opened
        on the next address; a stream opens with the sweep as it is, which is skipped when it is the
        one last seen."""
        last = b""
        failures = 0
        while True:
            try:
                for sweep in self._stub.WatchSweep(pb.WatchSweepRequest(id=sweep_id), metadata=self._metadata):
                    failures = 0
                    seen = sweep.SerializeToString(deterministic=True)
                    if seen != last:
                        last = seen
                        yield sweep
                return
            except grpc.RpcError as exc:
                failures += 1
                self._fail_over(exc, failures)
