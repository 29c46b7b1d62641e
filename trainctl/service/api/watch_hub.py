"""Watch fan-out: one reader per followed job reads its new events from the store once and hands them
to every watcher following that job (WatchJob with `follow`).

Contract of `EventHub.follow(job_id, after_sequence)`, an async generator run on the RPC server's loop:

- It yields the job's events with a sequence larger than `after_sequence`, each exactly once and in
  sequence order, each converted once by `encode` (every watcher gets the same converted object).
- It returns once the job is terminal and every event was yielded (the store appends the terminal
  state event in the transaction that sets the state, so "terminal, then nothing more to read" is
  drained), or once `stopping` is set: checked when the watcher is woken (new events, `wake_all`) and
  at least every `poll_seconds`. A call that ends (cancelled, past its deadline) closes the generator,
  which leaves the feed.
- The reader (and a watcher reading the store itself) waits for the store's next commit of an event of
  its job (`JobStore.on_commit`), which wakes it at once for this process's commits, and no other
  commit wakes it; it re-reads at least every `store_poll_seconds`, the delay at which a commit made by
  another process (another replica on the same PostgreSQL) reaches the watchers.
- While a job has followers one reader thread reads `store.events` after the feed's cursor and appends
  each batch to every watcher's buffer; it stops when the job has no watchers left.
- A watcher's buffer holds at most `buffer_events` events (references to the shared converted
  events). A watcher that would overflow it (it reads slower than the job writes) drops its buffer,
  leaves the feed and reads the store itself from its own cursor until it has caught up with the
  reader's cursor, then rejoins; a watcher that starts behind the reader catches up the same way.
  The hand-over happens under the feed's lock, so nothing is skipped, repeated or reordered, a slow
  watcher never blocks the reader or the others, and no buffer grows without bound.
- A watcher whose cursor lies beyond the job's events is served correctly, but a later watcher whose
  cursor lies behind the feed's cursor then reads the store itself at every change until the job
  ends (it cannot prove it has caught up with a cursor no event carries).

Callers authorise the watcher before calling `follow` (tenancy is the servicer's).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, Protocol, TypeVar

from trainctl.service.api.async_bridge import (
    CommitSource,
    LoopSignal,
    ReadSource,
    store_read,
    wait_for_store_change,
)
from trainctl.service.store import Event, JobRecord

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_BUFFER_EVENTS = 1000
"""Undelivered events one watcher may hold before it falls back to reading the store (also the size
of one store read)."""


class WatchFailed(RuntimeError):
    """The job's reader stopped on a store error; the watcher may resume from its last sequence."""


class WatchStopped(RuntimeError):
    """The service is stopping while the job has not ended; the watcher may resume from its last
    sequence on another replica (an end without this would read as the job's end)."""


class EventSource(CommitSource, ReadSource, Protocol):
    """The store methods the hub reads (trainctl.service.store.JobStore)."""

    def events(self, job_id: str, after_sequence: int = 0, limit: int = 1000) -> list[Event]: ...

    def get_job(self, job_id: str) -> JobRecord: ...



@dataclass(eq=False)
class _Watcher(Generic[T]):
    """One follower: `taken` is the last sequence it took (from its buffer or the store); while `live`
    the reader appends events after `high` to `buffer` and sets `ready`. `lock` guards the fields
    (the feed's lock is taken first where both are held); each watcher waits on its own `ready`, so a
    batch wakes the watchers one by one instead of all of them contending for one lock."""

    taken: int
    high: int
    ready: LoopSignal
    live: bool = False
    buffer: deque[tuple[int, T]] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def offer(self, batch: list[tuple[int, T]], capacity: int) -> None:
        """Append the events of `batch` this watcher has not had; on overflow leave the feed instead."""
        with self.lock:
            if not self.live:
                return
            fresh = [item for item in batch if item[0] > self.high]
            if len(self.buffer) + len(fresh) > capacity:
                self.buffer.clear()
                self.live = False
                self.high = self.taken
            elif fresh:
                self.buffer.extend(fresh)
                self.high = fresh[-1][0]
        self.ready.set()


@dataclass(eq=False)
class _Feed(Generic[T]):
    """One followed job: `cursor` is the last sequence its reader handed out; `lock` guards the rest."""

    job_id: str
    cursor: int
    watchers: set[_Watcher[T]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False
    failure: Exception | None = None
    """Why the reader stopped early (a store error): its watchers raise it instead of waiting."""


class EventHub(Generic[T]):
    """Fans each followed job's events out from one store reader to all its watchers (module docstring)."""

    def __init__(
        self,
        store: EventSource,
        encode: Callable[[Event], T],
        *,
        stopping: threading.Event,
        poll_seconds: float = 0.5,
        store_poll_seconds: float = 0.5,
        buffer_events: int = DEFAULT_BUFFER_EVENTS,
        expected_failures: tuple[type[Exception], ...] = (),
    ):
        if buffer_events < 1:
            raise ValueError(f"buffer_events must be at least 1, got {buffer_events}")
        self._store = store
        self._encode = encode
        self._stopping = stopping
        self.poll_seconds = poll_seconds
        self.store_poll_seconds = store_poll_seconds
        self._expected_failures = expected_failures
        """Store errors that are logged as a warning, not with a traceback (a database away for a while)."""
        self.buffer_events = buffer_events
        self._feeds: dict[str, _Feed[T]] = {}
        self._lock = threading.Lock()

    def followed_jobs(self) -> list[str]:
        """Jobs with a running reader now."""
        with self._lock:
            return sorted(self._feeds)

    def buffered(self, job_id: str) -> list[int]:
        """How many events each watcher of `job_id` holds undelivered now (empty without a reader)."""
        with self._lock:
            feed = self._feeds.get(job_id)
        if feed is None:
            return []
        with feed.lock:
            return [len(w.buffer) for w in feed.watchers]

    async def follow(self, job_id: str, after_sequence: int) -> AsyncIterator[T]:
        """The job's events after `after_sequence`, following it until it ends (module docstring). Runs
        on the RPC server's loop: a waiting watcher is a suspended coroutine, woken by the reader thread
        through its LoopSignal; a call that ends (cancelled, past its deadline) closes the generator."""
        watcher: _Watcher[T] = _Watcher(taken=after_sequence, high=after_sequence, ready=LoopSignal())
        feed = self._join(job_id, watcher)
        try:
            while not self._stopping.is_set():
                if not watcher.live:
                    with feed.lock, watcher.lock:
                        if watcher.taken >= feed.cursor:
                            watcher.live, watcher.high = True, watcher.taken
                        live, ended, failure = watcher.live, feed.ended, feed.failure
                else:
                    await watcher.ready.wait(self.poll_seconds)
                    with watcher.lock:
                        batch = list(watcher.buffer)
                        watcher.buffer.clear()
                        if batch:
                            watcher.taken = batch[-1][0]
                        live, ended, failure = watcher.live, feed.ended, feed.failure
                    for _, item in batch:
                        yield item
                if failure is not None:
                    raise WatchFailed(f"the reader of job {job_id} failed: {failure}") from failure
                if live:
                    if ended:  # read after taking the buffer: every delivery came before it
                        return
                    continue
                events = await store_read(self._store, partial(self._store.events, job_id, watcher.taken, limit=self.buffer_events))
                if events:
                    with watcher.lock:
                        watcher.taken = events[-1].sequence
                    for event in events:
                        yield self._encode(event)
                elif ended:
                    return
                else:  # only when the feed began at a cursor beyond every event of the job
                    await wait_for_store_change(self._store, self.store_poll_seconds, job_id)
            raise WatchStopped(f"resume the watch of job {job_id} after sequence {watcher.taken}")
        finally:
            with feed.lock:
                feed.watchers.discard(watcher)

    def wake_all(self) -> None:
        """Wake every waiting watcher (the service calls it once `stopping` is set, so streams end now)."""
        with self._lock:
            feeds = list(self._feeds.values())
        for feed in feeds:
            with feed.lock:
                for watcher in feed.watchers:
                    watcher.ready.set()

    def _join(self, job_id: str, watcher: _Watcher[T]) -> _Feed[T]:
        with self._lock:
            feed = self._feeds.get(job_id)
            if feed is None:
                feed = self._feeds[job_id] = _Feed(job_id, watcher.taken)
                threading.Thread(target=self._read, args=(feed,), name=f"trainctl-watch-{job_id}", daemon=True).start()
            with feed.lock:
                feed.watchers.add(watcher)
        return feed

    def _read(self, feed: _Feed[T]) -> None:
        """The feed's reader thread: its loop, and a store error handed to the watchers."""
        appended = threading.Event()
        unsubscribe = self._store.on_commit(appended.set, feed.job_id)
        try:
            self._read_loop(feed, appended)
        except Exception as exc:  # noqa: BLE001 - handed to every watcher, which raises it
            if isinstance(exc, self._expected_failures):
                log.warning("watch reader of job %s stopped: %s", feed.job_id, exc)
            else:
                log.exception("watch reader of job %s failed", feed.job_id)
            with self._lock, feed.lock:
                feed.failure = exc
                for watcher in feed.watchers:
                    watcher.ready.set()
                if self._feeds.get(feed.job_id) is feed:
                    del self._feeds[feed.job_id]
        finally:
            unsubscribe()

    def _read_loop(self, feed: _Feed[T], appended: threading.Event) -> None:
        """Hand every new event to the watchers; end with the job or its last watcher. `appended` is set
        when this process commits an event of the job."""
        while not self._stopping.is_set():
            if self._retire(feed, ended=False):  # before touching the store: it may be closed by now
                return
            appended.clear()
            events = self._store.events(feed.job_id, feed.cursor, limit=self.buffer_events)
            if not events and self._store.get_job(feed.job_id).terminal:
                events = self._store.events(feed.job_id, feed.cursor, limit=self.buffer_events)
                if not events:
                    self._retire(feed, ended=True)
                    return
            if events:
                batch = [(event.sequence, self._encode(event)) for event in events]
                with feed.lock:
                    for watcher in feed.watchers:
                        watcher.offer(batch, self.buffer_events)
                    feed.cursor = events[-1].sequence
                continue
            appended.wait(self.store_poll_seconds)
        self._retire(feed, ended=False, stopping=True)  # not the job's end: its watchers answer WatchStopped

    def _retire(self, feed: _Feed[T], *, ended: bool, stopping: bool = False) -> bool:
        """Remove the feed when the job `ended`, it has no watchers, or the service is `stopping`; whether
        it was removed. Only `ended` tells the watchers the job is over."""
        with self._lock, feed.lock:
            if not ended and not stopping and feed.watchers:
                return False
            feed.ended = ended
            for watcher in feed.watchers:
                watcher.ready.set()
            if self._feeds.get(feed.job_id) is feed:
                del self._feeds[feed.job_id]
            return True
