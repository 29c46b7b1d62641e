"""Watch fan-out (trainctl.service.api.watch_hub): many followers of one job over real gRPC each get every
event exactly once in order; the store is read once per batch of new events, not once per watcher; a
watcher that joins late at an old cursor, or stops reading, still gets every event, without stalling
the others or growing the server's buffers; the per-tenant stream limit is an explicit setting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from control_plane_fakes import ScriptedRuntime, start_api_server
from small_jobs import small_job

from trainctl.service.api.watch_hub import EventHub, WatchStopped
from trainctl.service.security.hardening import StreamLimiter
from trainctl.service.server import DEFAULT_STREAMS_PER_TENANT, ServiceConfig
from trainctl.service.store import Event, JobRecord, JobStore
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto
from trainctl.workers.events import JobState

WAIT = 30.0


class CountingStore:
    """A JobStore whose `events` reads are counted (the hub's whole view of the store)."""

    def __init__(self, store: JobStore):
        self.store = store
        self.reads = 0
        self._lock = threading.Lock()

    def events(self, job_id: str, after_sequence: int = 0, limit: int = 1000) -> list[Event]:
        with self._lock:
            self.reads += 1
        return self.store.events(job_id, after_sequence, limit)

    def get_job(self, job_id: str) -> JobRecord:
        return self.store.get_job(job_id)

    def on_commit(self, callback: Callable[[], None], job_id: str | None = None) -> Callable[[], None]:
        return self.store.on_commit(callback, job_id)

    @property
    def reads_are_local(self) -> bool:
        return self.store.reads_are_local


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    opened = JobStore(tmp_path)
    yield opened
    opened.close()


def running_job(store: JobStore) -> str:
    record, _ = store.create_job(small_job("followed"))
    store.update_status(record.id, state=JobState.RUNNING, reason="ranks up")
    return record.id


def all_sequences(store: JobStore, job_id: str) -> list[int]:
    return [e.sequence for e in store.events(job_id, 0, limit=100_000)]


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The event loop the watchers run on (the RPC server's, in the service), in a thread of its own."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    LOOPS.append(running)
    yield running
    LOOPS.remove(running)
    running.call_soon_threadsafe(running.stop)
    thread.join(WAIT)
    running.close()


LOOPS: list[asyncio.AbstractEventLoop] = []


class Stream:
    """An async generator of the loop, read from a thread: `next(stream)`, `for event in stream`;
    `cancel()` cancels the read in progress, as gRPC does when the call ends."""

    def __init__(self, generator: AsyncIterator[Event]):
        self._generator = generator
        self._loop = LOOPS[-1]
        self._pending: concurrent.futures.Future | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Event:
        self._pending = asyncio.run_coroutine_threadsafe(anext(self._generator, None), self._loop)
        event = self._pending.result(WAIT)
        if event is None:
            raise StopIteration
        return event

    def reading(self) -> bool:
        """Whether a read is in progress (`cancel` has one to cancel)."""
        return self._pending is not None

    def cancel(self) -> None:
        assert self._pending is not None
        self._pending.cancel()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._generator.aclose(), self._loop).result(WAIT)


class Follower(threading.Thread):
    """Drains one `hub.follow` in a thread, recording each event's sequence."""

    def __init__(self, hub: EventHub[Event], job_id: str, after: int):
        super().__init__(daemon=True)
        self.stream = Stream(hub.follow(job_id, after))
        self.got: list[int] = []
        self.stopped: WatchStopped | None = None
        """Set when the service stopped while the job had not ended."""

    def run(self) -> None:
        with contextlib.suppress(concurrent.futures.CancelledError):
            try:
                self.got.extend(event.sequence for event in self.stream)
            except WatchStopped as stopped:
                self.stopped = stopped


def hub_over(store: JobStore | CountingStore, stopping: threading.Event, buffer_events: int = 1000) -> EventHub[Event]:
    return EventHub(store, lambda event: event, stopping=stopping, poll_seconds=0.05, buffer_events=buffer_events)


def test_followers_share_one_reader_that_reads_once_per_batch(store: JobStore) -> None:
    job = running_job(store)
    counting, stopping = CountingStore(store), threading.Event()
    hub = hub_over(counting, stopping)
    start = all_sequences(store, job)[-1]
    followers = [Follower(hub, job, start) for _ in range(100)]
    for follower in followers:
        follower.start()
    until(lambda: len(hub.buffered(job)) == 100, "100 watchers joined the feed")
    before, writes = counting.reads, 40
    for i in range(writes):
        store.append_event(job, "log", {"message": f"line {i}"})
    store.update_status(job, state=JobState.SUCCEEDED, reason="done")
    for follower in followers:
        follower.join(WAIT)
    expected = [s for s in all_sequences(store, job) if s > start]
    assert len(expected) == writes + 1
    assert all(f.got == expected for f in followers), "every follower gets every event once, in order"
    # each commit wakes the reader for at most one read that finds it and one that finds nothing more,
    # plus the drain check at the end: independent of the 100 watchers (per-watcher polling: >= 100 per write)
    assert counting.reads - before <= 2 * (writes + 1) + 2
    until(lambda: not hub.followed_jobs(), "the reader stops with the job")


def test_a_watcher_joining_mid_stream_at_an_old_cursor_misses_and_repeats_nothing(store: JobStore) -> None:
    job = running_job(store)
    hub = hub_over(store, threading.Event())
    early = Follower(hub, job, 0)
    early.start()
    for i in range(30):
        store.append_event(job, "log", {"message": f"before {i}"})
    until(lambda: len(early.got) >= 32, "the early follower is live")
    old_cursor = all_sequences(store, job)[5]
    late = Follower(hub, job, old_cursor)
    writer = threading.Thread(target=lambda: [store.append_event(job, "log", {"message": f"after {i}"}) for i in range(50)])
    writer.start()
    late.start()  # catches up from the store while the reader hands out new events, then joins the feed
    writer.join(WAIT)
    store.update_status(job, state=JobState.FAILED, reason="stopped")
    early.join(WAIT)
    late.join(WAIT)
    everything = all_sequences(store, job)
    assert early.got == everything
    assert late.got == [s for s in everything if s > old_cursor]


def test_a_feed_begun_beyond_the_jobs_events_still_serves_a_watcher_behind_it(store: JobStore) -> None:
    job = running_job(store)
    hub = hub_over(store, threading.Event())
    ahead = Follower(hub, job, 10**9)  # starts the feed at a cursor no event of the job carries
    ahead.start()
    until(lambda: len(hub.buffered(job)) == 1, "the feed is up")
    behind = Follower(hub, job, 0)  # can never prove it caught up with 10**9: reads the store itself
    behind.start()
    for i in range(10):
        store.append_event(job, "log", {"message": f"line {i}"})
    store.update_status(job, state=JobState.SUCCEEDED, reason="done")
    ahead.join(WAIT)
    behind.join(WAIT)
    assert ahead.got == [] and behind.got == all_sequences(store, job)


def test_a_watcher_that_stops_reading_stalls_nobody_and_its_buffer_stays_bounded(store: JobStore) -> None:
    job = running_job(store)
    start = all_sequences(store, job)[-1]
    hub = hub_over(store, threading.Event(), buffer_events=5)
    stalled = Stream(hub.follow(job, start))
    store.append_event(job, "log", {"message": "first"})
    first = next(stalled)  # the stalled watcher joins the feed on its first read, then stops reading
    others = [Follower(hub, job, start) for _ in range(20)]
    for follower in others:
        follower.start()
    peak = 0
    for i in range(60):
        store.append_event(job, "log", {"message": f"line {i}"})
        peak = max([peak, *hub.buffered(job)])
    until(lambda: all(len(f.got) == 61 for f in others), "the others got every event while one reads nothing")
    peak = max([peak, *hub.buffered(job)])  # the reader has handed out all 61 events by now
    store.update_status(job, state=JobState.SUCCEEDED, reason="done")
    for follower in others:
        follower.join(WAIT)
    expected = [s for s in all_sequences(store, job) if s > start]
    assert all(f.got == expected for f in others), "the others finish while one watcher reads nothing"
    assert peak <= 5, f"a watcher held {peak} undelivered events, over its buffer of 5"
    # the stalled watcher, read again, falls back to the store at its cursor: still everything, in order
    assert [first.sequence, *(e.sequence for e in stalled)] == expected


def test_the_reader_stops_when_its_last_watcher_leaves(store: JobStore) -> None:
    job = running_job(store)
    hub = hub_over(store, threading.Event())
    stream = Stream(hub.follow(job, 0))
    assert next(stream).sequence == all_sequences(store, job)[0]
    assert hub.followed_jobs() == [job]
    stream.close()
    until(lambda: not hub.followed_jobs(), "the reader stops once nobody follows the job")


def test_a_waiting_watcher_ends_as_soon_as_its_call_ends_or_the_service_stops(store: JobStore) -> None:
    job = running_job(store)
    start = all_sequences(store, job)[-1]
    stopping = threading.Event()
    hub = EventHub(store, lambda event: event, stopping=stopping, poll_seconds=600.0)
    ended_call = Follower(hub, job, start)
    at_stop = Follower(hub, job, start)
    for follower in (ended_call, at_stop):
        follower.start()
    # The feed can count a watcher before its thread has the read's future back from the loop.
    until(lambda: len(hub.buffered(job)) == 2 and ended_call.stream.reading(), "both watchers wait on the feed")
    ended_call.stream.cancel()  # gRPC cancels the call's task when it is cancelled or its deadline passes
    ended_call.join(WAIT)
    assert not ended_call.is_alive() and at_stop.is_alive()
    until(lambda: len(hub.buffered(job)) == 1, "the ended call's watcher left the feed")
    stopping.set()
    hub.wake_all()
    at_stop.join(WAIT)
    assert not at_stop.is_alive()
    assert at_stop.stopped is not None and f"after sequence {start}" in str(at_stop.stopped)  # not an end
    assert ended_call.stopped is None


def test_a_follow_of_a_running_job_ends_unavailable_when_the_service_stops(tmp_path: Path) -> None:
    """Not OK, which would read as the job's end: the CLI resumes an UNAVAILABLE watch from its cursor."""
    runtime = ScriptedRuntime()
    api = start_api_server(tmp_path, runtime)
    try:
        with grpc.insecure_channel(api.target) as channel:
            stub = pb_grpc.TrainingServiceStub(channel)
            job = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(small_job("runs-on"))))
            runtime.wait_started(job.id)
            stream = stub.WatchJob(pb.WatchJobRequest(id=job.id, follow=True), timeout=WAIT)
            first = next(stream)
            api.servicer.stopping.set()
            api.servicer.watch_hub.wake_all()
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert "the service is stopping" in info.value.details() and first.sequence > 0
    finally:
        api.stop()


def test_many_grpc_followers_of_one_running_job_each_get_every_event_once_in_order(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    api = start_api_server(tmp_path, runtime, streams_per_tenant=64)
    try:
        channel = grpc.insecure_channel(api.target)
        stub = pb_grpc.TrainingServiceStub(channel)
        job = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(small_job("followed-by-many"))))
        runtime.wait_started(job.id)
        streams = [stub.WatchJob(pb.WatchJobRequest(id=job.id, follow=True)) for _ in range(60)]
        got: list[list[int]] = [[next(s).sequence] for s in streams]  # every stream is open and serving
        extra = [stub.WatchJob(pb.WatchJobRequest(id=job.id, follow=True)) for _ in range(4)]
        for stream in extra:
            next(stream)  # 64 open: the tenant's limit
        with pytest.raises(grpc.RpcError) as info:
            next(stub.WatchJob(pb.WatchJobRequest(id=job.id, follow=True)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        runtime.run(job.id, [4.0 - i / 10 for i in range(20)])

        def drain(index: int) -> None:
            got[index].extend(e.sequence for e in streams[index])

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        expected = all_sequences(api.scheduler.store, job.id)
        assert len(expected) >= 24  # queued, scheduled, running, 20 steps, succeeded
        assert all(sequences == expected for sequences in got)
        for stream in extra:
            stream.cancel()
        channel.close()
    finally:
        api.stop()


def test_the_stream_limit_is_a_stated_policy() -> None:
    assert ServiceConfig().streams_per_tenant == DEFAULT_STREAMS_PER_TENANT
    with pytest.raises(ValueError, match="max_per_key must be at least 1"):
        StreamLimiter(0)
