"""One client process of the load benchmark: asyncio gRPC clients, each on its own channel and TCP
connection, each issuing one RPC at a time from a weighted mix until the deadline or its request cap.

Every call is checked against what that kind of request must get (status code and, where it says
something, the answer's content); anything else is counted as unexpected, with the first few samples
kept. With `unavailable_allowed` (the driver takes the database away meanwhile) any kind may also get
UNAVAILABLE; the driver judges from each call's end time whether that answer fell in the outage.
Results go back to the driver (bench_load.py) as one dict per process, with every call's end time,
kind and code (the timeline) and the ids of the jobs whose CreateJob was acknowledged.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc

RPC_TIMEOUT = 60.0
"""Deadline of every unary call and non-follow watch; reaching it is an unexpected DEADLINE_EXCEEDED."""
FOLLOW_SECONDS = 5.0
"""Deadline of a following WatchJob on a job that stays QUEUED: it ends DEADLINE_EXCEEDED (or OK if
the job was cancelled meanwhile). Longer than the queueing delay at full load (p99 about 3 s), so a
follow is served and held open rather than expiring in the server's queue."""
FOLLOWS_PER_TENANT = 4
"""Following watches a tenant keeps open at most, across all client processes (the server allows 16)."""
KEEP_SAMPLES = 5
POOL_GPUS = 4
TEAMS = ("red", "green", "blue")
OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

MIX: tuple[tuple[str, int], ...] = (
    ("create_valid", 16), ("create_invalid", 4), ("get_own", 16), ("get_other_tenant", 2), ("get_unknown", 1),
    ("list", 14), ("watch_read", 12), ("watch_follow", 1), ("watch_other_tenant", 1), ("cancel_own", 13),
    ("cancel_other_tenant", 1), ("plan_valid", 7), ("plan_invalid", 2), ("cluster", 8), ("bad_token", 2),
)
"""Request kinds and their relative weights. A kind that needs one of the client's own jobs while it
has none creates a job instead."""


@dataclass
class Stats:
    """Outcomes of one process's calls, by request kind."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    codes: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: Counter[str] = field(default_factory=Counter)
    samples: dict[str, list[str]] = field(default_factory=dict)
    timeline: list[tuple[float, str, str, bool]] = field(default_factory=list)
    """Every call as (end, wall-clock seconds; kind; code name; unexpected)."""
    acknowledged: list[str] = field(default_factory=list)
    """Ids of the jobs CreateJob answered OK (each must be in the store afterwards)."""
    in_flight: int = 0

    def record(self, kind: str, method: str, seconds: float, code: grpc.StatusCode, problem: str | None) -> None:
        self.timeline.append((time.time(), kind, code.name, problem is not None))
        self.methods[kind] = method
        self.latencies.setdefault(kind, []).append(seconds)
        self.codes.setdefault(kind, Counter())[code.name] += 1
        if problem is not None:
            self.unexpected[kind] += 1
            kept = self.samples.setdefault(kind, [])
            if len(kept) < KEEP_SAMPLES:
                kept.append(problem)


@dataclass
class Shared:
    """What the clients of one process share: the target, stats, other tenants' job ids, follow slots."""

    target: str
    data_root: str
    stats: Stats
    follows: dict[str, asyncio.Semaphore]
    unavailable_allowed: bool = False
    recent: dict[str, deque[str]] = field(default_factory=dict)


def job_message(name: str, tenant: str, team: str, gpus: int, data_root: str) -> pb.Job:
    """A small valid job: the debug model, `gpus` data-parallel ranks on CPU, data under the data root."""
    job = pb.Job(api_version="trainctl/v1", kind="TrainingJob")
    job.metadata.name = name
    job.metadata.labels.update({"bench": "load", "tenant": tenant, "team": team})
    job.spec.data.paths.values.append(f"{data_root}/corpus/*.txt")
    job.spec.data.seq_len = 64
    job.spec.parallelism.dp_shard = gpus
    job.spec.training.steps = 20
    job.spec.training.global_batch_size = 2 * gpus
    job.spec.resources.gpus = gpus
    job.spec.resources.device = pb.DEVICE_CPU
    return job


def _bad_name(job: pb.Job) -> None:
    job.metadata.name = "Not_A_DNS_Label"


def _too_many_gpus(job: pb.Job) -> None:
    job.spec.resources.gpus = 2 * POOL_GPUS
    job.spec.parallelism.dp_shard = 2 * POOL_GPUS
    job.spec.training.global_batch_size = 4 * POOL_GPUS


def _tp_not_dividing_heads(job: pb.Job) -> None:
    job.spec.resources.gpus = 3
    job.spec.parallelism.dp_shard = 1
    job.spec.parallelism.tp = 3


def _data_outside_root(job: pb.Job) -> None:
    del job.spec.data.paths.values[:]
    job.spec.data.paths.values.append("/etc/passwd")


def _batch_not_divisible(job: pb.Job) -> None:
    job.spec.resources.gpus = 2
    job.spec.parallelism.dp_shard = 2
    job.spec.training.global_batch_size = 3


INVALID: tuple[tuple[Callable[[pb.Job], None], str], ...] = (
    (_bad_name, "metadata.name"),
    (_too_many_gpus, "spec.resources.gpus"),
    (_tp_not_dividing_heads, "spec.model.n_heads"),
    (_data_outside_root, "spec.data.paths[0]"),
    (_batch_not_divisible, "spec.training.global_batch_size"),
)
"""Broken jobs and the field path the server's BadRequest must name."""


def violated_fields(error: grpc.aio.AioRpcError) -> set[str]:
    """The BadRequest field paths in a failed call's status details."""
    fields: set[str] = set()
    for key, value in error.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        for detail in status_pb2.Status.FromString(value).details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                request = error_details_pb2.BadRequest()
                detail.Unpack(request)
                fields.update(v.field for v in request.field_violations)
    return fields


Check = Callable[[Any], str | None]


class Client:
    """One simulated user: its own channel, token and jobs."""

    def __init__(self, number: int, tenant: str, token: str, shared: Shared, seed: int):
        self.number = number
        self.tenant = tenant
        self.shared = shared
        self.rng = random.Random(seed)
        self.metadata = (("authorization", f"Bearer {token}"),)
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, as a separate client has
        self.channel = grpc.aio.insecure_channel(shared.target, options=options)
        self.stub = pb_grpc.TrainingServiceStub(self.channel)
        self.live: list[str] = []
        self.cancel_retries: set[str] = set()
        """Live jobs whose cancel was answered UNAVAILABLE (it may have been carried out)."""
        self.cursors: dict[str, int] = {}
        self.created = 0
        self.last_code = OK
        """The status of this client's last call (it makes one at a time)."""

    async def call(
        self, kind: str, method: str, run: Callable[[], Awaitable[Any]], expect: set[grpc.StatusCode], check: Check | None = None,
    ) -> Any:
        """Time `run()`; record its status, and a problem if the status or `check(answer)` is not as expected.
        Returns the answer (or the error) when the outcome was expected, else None (also for an allowed
        UNAVAILABLE)."""
        stats = self.shared.stats
        stats.in_flight += 1
        started = time.perf_counter()
        try:
            answer, code = await run(), OK
        except grpc.aio.AioRpcError as error:
            answer, code = error, error.code()
        finally:
            stats.in_flight -= 1
        seconds = time.perf_counter() - started
        self.last_code = code
        problem = None
        if code not in expect:
            if code != UNAVAILABLE or not self.shared.unavailable_allowed:
                details = answer.details() if isinstance(answer, grpc.aio.AioRpcError) else ""
                problem = f"{code.name}: {details}"
        elif check is not None:
            problem = check(answer)
        stats.record(kind, method, seconds, code, problem)
        return answer if problem is None and code in expect else None

    # ---- request kinds ----------------------------------------------------------------------------
    def _job(self) -> pb.Job:
        self.created += 1
        gpus = self.rng.choice((1, 2, 4))
        name = f"load-{self.number}-{self.created}"
        return job_message(name, self.tenant, self.rng.choice(TEAMS), gpus, self.shared.data_root)

    async def create_valid(self) -> None:
        request = pb.CreateJobRequest(job=self._job(), request_id=f"{self.number}-{self.created}")
        job = await self.call(
            "create_valid", "CreateJob", lambda: self.stub.CreateJob(request, metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK}, lambda j: None if j.id and j.status.state == pb.QUEUED else f"answered {j.id!r} in {j.status.state}",
        )
        if job is not None:
            self.shared.stats.acknowledged.append(job.id)
            self.live.append(job.id)
            self.shared.recent.setdefault(self.tenant, deque(maxlen=500)).append(job.id)

    def _broken_job(self) -> tuple[pb.Job, str]:
        """A job broken one way from INVALID, and the field path the answer must name."""
        job = self._job()
        breaks, expected_field = self.rng.choice(INVALID)
        breaks(job)
        return job, expected_field

    async def create_invalid(self) -> None:
        job, expected_field = self._broken_job()
        await self.call(
            "create_invalid", "CreateJob",
            lambda: self.stub.CreateJob(pb.CreateJobRequest(job=job), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {grpc.StatusCode.INVALID_ARGUMENT},
            lambda e: None if expected_field in violated_fields(e) else f"violations {violated_fields(e)} lack {expected_field}",
        )

    async def get_own(self) -> None:
        job_id = self.rng.choice(self.live)
        view = pb.JOB_VIEW_FULL if self.rng.random() < 0.2 else pb.JOB_VIEW_UNSPECIFIED
        await self.call(
            "get_own", "GetJob",
            lambda: self.stub.GetJob(pb.GetJobRequest(id=job_id, view=view), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK}, lambda j: None if j.id == job_id and j.metadata.labels["tenant"] == self.tenant else f"got {j.id}",
        )

    def _other_tenants_job(self) -> str | None:
        others = [ids for tenant, ids in self.shared.recent.items() if tenant != self.tenant and ids]
        return self.rng.choice(self.rng.choice(others)) if others else None

    async def _other_tenant(self, kind: str, method: str, run: Callable[[str], Awaitable[Any]]) -> None:
        """`run(id)` on a recent job of another tenant must get NOT_FOUND (an unknown id when none is known yet)."""
        job_id = self._other_tenants_job()
        if job_id is None:
            return await self.get_unknown()
        await self.call(kind, method, lambda: run(job_id), {grpc.StatusCode.NOT_FOUND})

    async def get_other_tenant(self) -> None:
        await self._other_tenant(
            "get_other_tenant", "GetJob",
            lambda i: self.stub.GetJob(pb.GetJobRequest(id=i), metadata=self.metadata, timeout=RPC_TIMEOUT),
        )

    async def get_unknown(self) -> None:
        job_id = f"load-unknown-{self.rng.getrandbits(32):08x}"
        await self.call(
            "get_unknown", "GetJob",
            lambda: self.stub.GetJob(pb.GetJobRequest(id=job_id), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {grpc.StatusCode.NOT_FOUND},
        )

    async def bad_token(self) -> None:
        job_id = self.rng.choice(self.live)
        metadata = (("authorization", f"Bearer {self.rng.getrandbits(256):064x}"),)
        await self.call(
            "bad_token", "GetJob",
            lambda: self.stub.GetJob(pb.GetJobRequest(id=job_id), metadata=metadata, timeout=RPC_TIMEOUT),
            {grpc.StatusCode.UNAUTHENTICATED},
        )

    async def list(self) -> None:
        """A filtered listing walked for up to three pages (each page one call)."""
        states = self.rng.choice(([], [pb.QUEUED], [pb.CANCELLED], [pb.QUEUED, pb.CANCELLED]))
        labels = {"team": self.rng.choice(TEAMS)} if self.rng.random() < 0.5 else {}
        request = pb.ListJobsRequest(states=states, labels=labels, page_size=self.rng.choice((10, 50)))

        def check(page: pb.ListJobsResponse) -> str | None:
            for job in page.jobs:
                if job.metadata.labels["tenant"] != self.tenant:
                    return f"listed {job.id} of tenant {job.metadata.labels['tenant']}"
                if states and job.status.state not in states:
                    return f"listed {job.id} in {pb.JobState.Name(job.status.state)}, filter {states}"
                if any(job.metadata.labels.get(k) != v for k, v in labels.items()):
                    return f"listed {job.id} without labels {labels}"
            return None

        for _ in range(3):
            page = await self.call(
                "list", "ListJobs", lambda: self.stub.ListJobs(request, metadata=self.metadata, timeout=RPC_TIMEOUT),
                {OK}, check,
            )
            if page is None or not page.next_page_token:
                return
            request.page_token = page.next_page_token

    async def _watch(self, job_id: str, after: int, follow: bool, timeout: float) -> list[pb.JobEvent]:
        request = pb.WatchJobRequest(id=job_id, after_sequence=after, follow=follow)
        return [event async for event in self.stub.WatchJob(request, metadata=self.metadata, timeout=timeout)]

    async def watch_read(self) -> None:
        job_id = self.rng.choice(self.live)
        after = self.cursors.get(job_id, 0) if self.rng.random() < 0.5 else 0

        def check(events: list[pb.JobEvent]) -> str | None:
            sequences = [e.sequence for e in events]
            if any(e.job_id != job_id for e in events) or sequences != sorted(set(sequences)):
                return f"events out of order or of another job: {sequences}"
            if sequences and sequences[0] <= after:
                return f"event {sequences[0]} not after the cursor {after}"
            return None

        events = await self.call(
            "watch_read", "WatchJob", lambda: self._watch(job_id, after, False, RPC_TIMEOUT), {OK}, check,
        )
        if events:
            self.cursors[job_id] = events[-1].sequence

    async def watch_follow(self) -> None:
        slots = self.shared.follows[self.tenant]
        if slots.locked():
            return await self.watch_read()
        job_id = self.live[-1]
        async with slots:
            await self.call(
                "watch_follow", "WatchJob", lambda: self._watch(job_id, 0, True, FOLLOW_SECONDS),
                {OK, grpc.StatusCode.DEADLINE_EXCEEDED},
            )

    async def watch_other_tenant(self) -> None:
        await self._other_tenant("watch_other_tenant", "WatchJob", lambda i: self._watch(i, 0, False, RPC_TIMEOUT))

    async def cancel_own(self) -> None:
        """Cancel the oldest live job; one answered UNAVAILABLE (allowed during an outage) stays live, to be
        cancelled again later: that cancel may have been carried out, and cancelling an ended job is
        FAILED_PRECONDITION, which is then expected too."""
        job_id = self.live.pop(0)
        retried = job_id in self.cancel_retries
        self.cancel_retries.discard(job_id)
        job = await self.call(
            "cancel_own", "CancelJob",
            lambda: self.stub.CancelJob(pb.CancelJobRequest(id=job_id, reason="load"), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK, FAILED_PRECONDITION} if retried else {OK},
            lambda j: None if isinstance(j, grpc.aio.AioRpcError) or j.status.state == pb.CANCELLED
            else f"{job_id} is {pb.JobState.Name(j.status.state)}",
        )
        if job is None and self.last_code == UNAVAILABLE and self.shared.unavailable_allowed:
            self.live.insert(0, job_id)
            self.cancel_retries.add(job_id)

    async def cancel_other_tenant(self) -> None:
        await self._other_tenant(
            "cancel_other_tenant", "CancelJob",
            lambda i: self.stub.CancelJob(pb.CancelJobRequest(id=i), metadata=self.metadata, timeout=RPC_TIMEOUT),
        )

    async def plan_valid(self) -> None:
        request = pb.PlanJobRequest(job=self._job())
        await self.call(
            "plan_valid", "PlanJob", lambda: self.stub.PlanJob(request, metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK}, lambda p: None if p.valid else f"valid job planned invalid: {list(p.violations)}",
        )

    async def plan_invalid(self) -> None:
        job, expected_field = self._broken_job()
        await self.call(
            "plan_invalid", "PlanJob",
            lambda: self.stub.PlanJob(pb.PlanJobRequest(job=job), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK},
            lambda p: None if not p.valid and expected_field in {v.field for v in p.violations}
            else f"plan valid={p.valid}, violations lack {expected_field}",
        )

    async def cluster(self) -> None:
        await self.call(
            "cluster", "GetCluster",
            lambda: self.stub.GetCluster(pb.GetClusterRequest(), metadata=self.metadata, timeout=RPC_TIMEOUT),
            {OK}, lambda c: None if c.total_gpus == POOL_GPUS and c.free_gpus == 0 else f"{c.total_gpus} GPUs, {c.free_gpus} free",
        )

    async def run(self, deadline: float, max_requests: int) -> None:
        """Issue requests until `deadline` (time.monotonic) or `max_requests` of them, then close the channel."""
        kinds, weights = [k for k, _ in MIX], [w for _, w in MIX]
        needs_own = {"get_own", "bad_token", "watch_read", "watch_follow", "cancel_own"}
        made = 0
        while made < max_requests and time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            if kind in needs_own and not self.live:
                kind = "create_valid"
            await getattr(self, kind)()
            made += 1
        await self.channel.close()


async def _sample_in_flight(stats: Stats, samples: list[int], deadline: float) -> None:
    """Calls in flight, every 0.25 s from 0.25 s after the start until `deadline` (time.monotonic)."""
    await asyncio.sleep(0.25)
    while time.monotonic() < deadline:
        samples.append(stats.in_flight)
        await asyncio.sleep(0.25)


async def run_clients(
    numbers: list[int], tokens: dict[str, str], target: str, data_root: str, seconds: float, max_requests: int,
    seed: int, processes: int, ready: Callable[[], None], unavailable_allowed: bool = False,
) -> dict[str, Any]:
    """Run clients `numbers` (client n belongs to tenant n mod len(tokens)); `ready()` is called once
    every channel is connected and blocks until all processes are (the start barrier)."""
    stats = Stats()
    tenants = sorted(tokens)
    follows = {t: asyncio.Semaphore(max(1, FOLLOWS_PER_TENANT // processes)) for t in tenants}
    shared = Shared(target, data_root, stats, follows, unavailable_allowed=unavailable_allowed)
    clients = [Client(n, tenants[n % len(tenants)], tokens[tenants[n % len(tenants)]], shared, seed * 100_003 + n) for n in numbers]
    await asyncio.gather(*(asyncio.wait_for(c.channel.channel_ready(), 120) for c in clients))
    ready()
    started_wall, started = time.time(), time.monotonic()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    samples: list[int] = []
    sampler = asyncio.create_task(_sample_in_flight(stats, samples, started + seconds))
    await asyncio.gather(*(c.run(started + seconds, max_requests) for c in clients))
    await sampler
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "started": started_wall, "finished": time.time(),
        "cpu_seconds": cpu.ru_utime + cpu.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime,
        "in_flight_samples": samples, "latencies": stats.latencies, "methods": stats.methods,
        "codes": {k: dict(v) for k, v in stats.codes.items()}, "unexpected": dict(stats.unexpected),
        "samples": stats.samples, "timeline": stats.timeline, "acknowledged": stats.acknowledged,
    }
