"""The supervisor's event log: state changes, step reports, log lines and the placement obtained.

Events carry a sequence number that increases by one per event, starting at 1. A poller keeps the
sequence number of the last event it has seen (its *cursor*; 0 before the first) and asks for the
events after it, so it can stop and resume at any point without losing or repeating one. The log
is appended, one JSON object per line, to the run directory's ``events.jsonl`` (`RunDirectory.events`):
a supervisor restarted by Ray reloads it and continues the numbering, and the runtime reads it once
the supervisor is gone. However long the job runs, the supervisor holds a bounded part of it in memory
(its newest events, a sparse index of byte offsets, and what is derived from the rest), and every
`INDEX_STRIDE` events it replaces a snapshot of that (``events.jsonl.snapshot``), so opening the log
again reads the snapshot and the newest events, not the whole file (bench/scale/event_log.py).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from trainctl.parallelism.engine.step_report import StepReport


class JobState(StrEnum):
    """Every state of a job: the service queues it (QUEUED) and its supervisor drives it through the
    others. The service's store persists the values."""

    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    CANCELLING = "CANCELLING"
    PREEMPTED = "PREEMPTED"
    """The scheduler took the job's GPUs for a job of higher priority: it checkpoints at its next step
    boundary and stops (its supervisor's run ends in this state), then the service queues it again."""
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED."""
        return self in TERMINAL_STATES

    @property
    def ends_run(self) -> bool:
        """True for the states a supervisor's run ends in: the terminal ones and PREEMPTED."""
        return self.terminal or self is JobState.PREEMPTED


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
"""States a job never leaves."""
ACTIVE_STATES = frozenset(
    {JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING, JobState.PREEMPTED}
)
"""States of a job that has a supervisor and holds its GPUs."""


class EventKind(StrEnum):
    """What an event reports."""

    STATE = "state"
    """A state change: ``state`` and ``reason`` are set."""
    STEP = "step"
    """A step report from the ranks: ``step`` holds the StepReport fields plus straggler stats."""
    LOG = "log"
    """A log line: ``message`` (and ``rank`` when it came from one)."""
    PLACEMENT = "placement"
    """Where the ranks actually run: ``placement`` lists one RankLocation dict per rank."""
    REPLAN = "replan"
    """The supervisor needs a plan that avoids ``lost_nodes`` (gone from the Ray cluster); ``message`` says
    so. Pending until a PLAN or STATE event follows."""
    PLAN = "plan"
    """The plan the next rank group uses: ``placement`` lists ``{rank, node, gpu}`` per rank; ``message``
    says which ranks moved where off ``lost_nodes``."""


@dataclass(frozen=True)
class StragglerStats:
    """The spread of per-rank wall times of the newest step every reporting rank has timed (sent with a
    later STEP event): its extremes and median, so an event's size does not grow with the ranks."""

    step: int
    ranks: int
    """How many ranks timed the step."""
    slowest_rank: int
    slowest_seconds: float
    fastest_rank: int
    fastest_seconds: float
    median_seconds: float
    ratio: float | None
    """Slowest over fastest time (None when the fastest took no time)."""

    @classmethod
    def of(cls, step: int, times: Mapping[int, float]) -> StragglerStats:
        """The stats of one step from its per-rank wall seconds (at least one rank)."""
        slowest = max(times, key=times.__getitem__)
        fastest = min(times, key=times.__getitem__)
        return cls(
            step=step,
            ranks=len(times),
            slowest_rank=slowest,
            slowest_seconds=times[slowest],
            fastest_rank=fastest,
            fastest_seconds=times[fastest],
            median_seconds=statistics.median(times.values()),
            ratio=times[slowest] / times[fastest] if times[fastest] > 0 else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StragglerStats:
        """Inverse of `to_dict`; also reads the per-rank times that event logs written before the summary
        held (``rank_step_times``)."""
        if "rank_step_times" in data:
            return cls.of(int(data["step"]), {int(r): float(t) for r, t in data["rank_step_times"].items()})
        return cls(
            step=int(data["step"]),
            ranks=int(data["ranks"]),
            slowest_rank=int(data["slowest_rank"]),
            slowest_seconds=float(data["slowest_seconds"]),
            fastest_rank=int(data["fastest_rank"]),
            fastest_seconds=float(data["fastest_seconds"]),
            median_seconds=float(data["median_seconds"]),
            ratio=None if data.get("ratio") is None else float(data["ratio"]),
        )


@dataclass(frozen=True)
class Event:
    """One entry of a job's event log."""

    seq: int
    """Position in the log, from 1, without gaps."""
    time: float
    """Unix time the supervisor recorded it."""
    kind: EventKind
    """What it reports."""
    state: JobState | None = None
    """New state (STATE events)."""
    reason: str = ""
    """Why the state changed (STATE events)."""
    message: str = ""
    """Log line (LOG events) or a human summary."""
    rank: int | None = None
    """The rank it came from, when one did."""
    generation: int = 0
    """Rank-group generation it belongs to (0 for the first group, +1 per restart)."""
    step: dict[str, Any] | None = None
    """`StepReport.to_dict` (STEP events), plus ``straggler``: `StragglerStats.to_dict` of the newest
    earlier step every rank timed, or None; read them with `step_report` and `straggler`."""
    placement: list[dict[str, Any]] | None = None
    """Per-rank locations (PLACEMENT events) or planned slots (PLAN events)."""
    lost_nodes: list[str] | None = None
    """Nodes gone from the Ray cluster that the plan must avoid (REPLAN and PLAN events)."""

    def step_report(self) -> StepReport:
        """The step report of a STEP event."""
        if self.step is None:
            raise ValueError(f"event {self.seq} ({self.kind}) carries no step report")
        return StepReport.from_dict(self.step)

    def straggler(self) -> StragglerStats | None:
        """The straggler statistics a STEP event carries (None when no earlier step was timed by every rank)."""
        stats = (self.step or {}).get("straggler")
        return None if stats is None else StragglerStats.from_dict(stats)

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, line: str) -> Event:
        """Inverse of `to_json`."""
        data = json.loads(line)
        data["kind"] = EventKind(data["kind"])
        data["state"] = JobState(data["state"]) if data.get("state") else None
        return cls(**data)


@dataclass(frozen=True)
class JobStatus:
    """What a poll returns: the new events, the cursor to resume from, and where the job stands."""

    events: list[Event]
    cursor: int
    """Sequence number of the last event returned (the input cursor when there were none)."""
    state: JobState
    """Latest state recorded in the log."""
    reason: str
    """Reason of the latest state change."""
    restarts: int
    """Group restarts so far."""
    last_seq: int = 0
    """Sequence number of the newest event in the log; ``cursor == last_seq`` means drained."""
    replan: tuple[str, ...] = ()
    """While the supervisor waits for a new plan: the lost nodes it must avoid (empty otherwise)."""

    @property
    def drained(self) -> bool:
        """True when the poller has seen every event recorded so far."""
        return self.cursor >= self.last_seq


RECENT_EVENTS = 4096
"""Events a file-backed log keeps in memory: what pollers that keep up ask for. Older pages are read
back from the file."""
INDEX_STRIDE = 1024
"""A file-backed log remembers the byte offset of every this-many-th event, so an old page is read by
seeking near it (memory: one integer per stride)."""


@dataclass
class EventLog:
    """A thread-safe, append-only event log mirrored to a JSONL file.

    Bounded in memory however long the job runs: a log backed by a file keeps its newest `RECENT_EVENTS`
    events, the byte offset of every `INDEX_STRIDE`-th event, and what is derived from all of them (the
    state, reason, restart count, pending replan, the highest generation, the newest plan, the newest step
    reported, and the counts of `tallies`, over the whole log and since that step was first reported); a
    page older than the kept events is read back from the file. A log without a file keeps every event."""

    path: Path | None = None
    tallies: Mapping[str, Callable[[Event], bool]] = field(default_factory=dict)
    """Named predicates whose matching events the log counts (`tally`), over its whole history."""
    _keep: int | None = None
    """Newest events kept in memory when the log has a file (None: `RECENT_EVENTS`)."""
    _recent: deque[Event] = field(default_factory=deque)
    _count: int = 0
    _offsets: list[int] = field(default_factory=list)
    _size: int = 0
    """Bytes of the file the log has written or read (the next event's offset)."""
    _state: JobState = JobState.SCHEDULED
    _reason: str = ""
    _restarts: int = 0
    _replan: tuple[str, ...] = ()
    _max_generation: int = -1
    _plan: list[dict[str, Any]] | None = None
    _tallied: dict[str, int] = field(default_factory=dict)
    _newest_step: int | None = None
    _tallied_since_step: dict[str, int] = field(default_factory=dict)
    """The counts of `tallies` since `_newest_step` was first reported (since the start before any step)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, path: Path | None, tallies: Mapping[str, Callable[[Event], bool]] | None = None) -> EventLog:
        """A log backed by ``path``, holding the events already in it (none when it does not exist), to
        append to. Its snapshot (`snapshot_path`) lets it skip the events the snapshot covers, so opening
        reads only the newest `RECENT_EVENTS` and those written after the snapshot."""
        log = cls(path=path, tallies=dict(tallies or {}))
        if path is not None and path.exists():
            _drop_torn_tail(path)
            log._load()
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        return log

    @classmethod
    def read(cls, path: Path, tallies: Mapping[str, Callable[[Event], bool]] | None = None) -> EventLog:
        """The log in ``path`` to read only (a torn last line is left as it is): what a poller uses once
        the supervisor that writes it is gone, and what a restarted service decides a relaunch from. It
        keeps no events in memory: every page is read from the file, so reading costs the snapshot, the
        events after it and the page (the whole file when the snapshot lacks one of `tallies`)."""
        log = cls(path=path, tallies=dict(tallies or {}), _keep=0)
        log._load()
        return log

    @staticmethod
    def snapshot_path(path: Path) -> Path:
        """The sidecar that holds what a log derived from its events up to an index stride."""
        return path.with_name(path.name + ".snapshot")

    def _load(self) -> None:
        """Take the file's events: from the snapshot on when one matches the file, else from the start."""
        snapshot = self._read_snapshot()
        if snapshot is None:
            for offset, event in _scan(self.path):
                self._take(event, offset)
        else:
            count = snapshot["count"]
            first_recent = max(count - self._kept(), 0)
            if first_recent < count:  # the newest events the snapshot covers, kept but not counted again
                index = first_recent // INDEX_STRIDE
                for _, event in _scan(self.path, start=self._offsets[index], first_seq=index * INDEX_STRIDE + 1):
                    if event.seq > count:
                        break
                    if event.seq > first_recent:
                        self._recent.append(event)
            for offset, event in _scan(self.path, start=snapshot["size"], first_seq=count + 1):
                self._take(event, offset)
        self._size = self.path.stat().st_size

    def _read_snapshot(self) -> dict[str, Any] | None:
        """The snapshot, applied to this log's derived state, when it matches the file (its last indexed
        event where it says, and every tally asked for in it); None otherwise (the file is scanned)."""
        try:
            snapshot = json.loads(self.snapshot_path(self.path).read_text(encoding="utf-8"))
            offsets = [int(o) for o in snapshot["offsets"]]
            if not set(self.tallies) <= set(snapshot["tallied"]) or snapshot["size"] > self.path.stat().st_size:
                return None
            # a snapshot written before these were kept lacks them (KeyError): the file is scanned once more
            newest_step = None if snapshot["newest_step"] is None else int(snapshot["newest_step"])
            since_step = {name: int(snapshot["tallied_since_step"][name]) for name in self.tallies}
            with self.path.open("rb") as log_file:
                log_file.seek(offsets[-1])
                if Event.from_json(log_file.readline().decode("utf-8")).seq != (len(offsets) - 1) * INDEX_STRIDE + 1:
                    return None
        except (OSError, ValueError, TypeError, KeyError, IndexError):
            return None
        self._count, self._offsets = int(snapshot["count"]), offsets
        self._state, self._reason = JobState(snapshot["state"]), snapshot["reason"]
        self._restarts, self._replan = int(snapshot["restarts"]), tuple(snapshot["replan"])
        self._max_generation, self._plan = int(snapshot["max_generation"]), snapshot["plan"]
        self._tallied = {name: int(snapshot["tallied"][name]) for name in self.tallies}
        self._newest_step, self._tallied_since_step = newest_step, since_step
        return snapshot

    def _write_snapshot(self) -> None:
        """Replace the snapshot with what the log has derived so far (atomically: a crash leaves the old one)."""
        snapshot = {
            "count": self._count, "size": self._size, "offsets": self._offsets, "state": self._state.value,
            "reason": self._reason, "restarts": self._restarts, "replan": list(self._replan),
            "max_generation": self._max_generation, "plan": self._plan,
            "tallied": {name: self._tallied.get(name, 0) for name in self.tallies},
            "newest_step": self._newest_step,
            "tallied_since_step": {name: self._tallied_since_step.get(name, 0) for name in self.tallies},
        }
        target = self.snapshot_path(self.path)
        temporary = target.with_name(target.name + ".tmp")
        temporary.write_text(json.dumps(snapshot, separators=(",", ":")), encoding="utf-8")
        temporary.replace(target)

    def append(self, kind: EventKind, **fields: Any) -> Event:
        """Record an event with the next sequence number and return it."""
        with self._lock:
            event = Event(seq=self._count + 1, time=time.time(), kind=kind, **fields)
            offset = self._size
            if self.path is not None:
                line = (event.to_json() + "\n").encode("utf-8")
                with self.path.open("ab") as out:
                    out.write(line)
                self._size += len(line)
            self._take(event, offset)
            if self.path is not None and self._count % INDEX_STRIDE == 0:
                self._write_snapshot()
            return event

    def status(self, cursor: int, limit: int) -> JobStatus:
        """Up to ``limit`` events after ``cursor`` and the state so far: from memory when the page is among
        the kept events, else read from the file near it (cost independent of the log's length)."""
        _check_page(cursor, limit)
        with self._lock:
            first_kept = self._count - len(self._recent) + 1
            if cursor + 1 >= first_kept or self.path is None:
                start = max(cursor + 1 - first_kept, 0)  # indexing a deque near either end is O(1)
                page = [self._recent[i] for i in range(start, min(start + limit, len(self._recent)))]
            else:
                page = self._read_page(cursor, min(limit, first_kept - 1 - cursor))
            return JobStatus(
                events=page,
                cursor=page[-1].seq if page else cursor,
                state=self._state,
                reason=self._reason,
                restarts=self._restarts,
                last_seq=self._count,
                replan=self._replan,
            )

    def _kept(self) -> int:
        return RECENT_EVENTS if self._keep is None else self._keep

    def _read_page(self, cursor: int, limit: int) -> list[Event]:
        """Events cursor+1 .. cursor+limit, read from the file from the indexed offset before them."""
        index = cursor // INDEX_STRIDE
        seq = index * INDEX_STRIDE + 1
        page: list[Event] = []
        with self.path.open("rb") as log_file:
            log_file.seek(self._offsets[index])
            for raw in log_file:
                if seq > cursor:
                    page.append(Event.from_json(raw.decode("utf-8")))
                    if len(page) == limit:
                        break
                seq += 1
        return page

    def _take(self, event: Event, offset: int = 0) -> None:
        self._count += 1
        if (event.seq - 1) % INDEX_STRIDE == 0:
            self._offsets.append(offset)
        self._recent.append(event)
        if self.path is not None and len(self._recent) > self._kept():
            self._recent.popleft()
        if event.kind is EventKind.STATE and event.state is not None:
            self._state, self._reason = event.state, event.reason
            self._restarts += event.state is JobState.RESTARTING
        if event.kind is EventKind.REPLAN:
            self._replan = tuple(event.lost_nodes or ())
        elif event.kind in (EventKind.PLAN, EventKind.STATE):
            self._replan = ()
        if event.kind is EventKind.PLAN and event.placement:
            self._plan = list(event.placement)
        self._max_generation = max(self._max_generation, event.generation)
        if event.kind is EventKind.STEP and event.step:
            newest = max(int(event.step["step"]), self._newest_step or 0)
            if newest != self._newest_step:
                self._newest_step, self._tallied_since_step = newest, {}
        for name, matches in self.tallies.items():
            if matches(event):
                self._tallied[name] = self._tallied.get(name, 0) + 1
                self._tallied_since_step[name] = self._tallied_since_step.get(name, 0) + 1

    def all(self) -> list[Event]:
        """Every event so far, read back from the file where they are no longer kept (linear in the log's
        length: for tests and tools, not for a running job's loop)."""
        with self._lock:
            if self._count == len(self._recent):
                return list(self._recent)
            return [event for _, event in _scan(self.path)][: self._count]

    def tally(self, name: str) -> int:
        """How many events so far matched the predicate `tallies[name]`."""
        with self._lock:
            return self._tallied.get(name, 0)

    def tally_since_step(self, name: str) -> int:
        """How many events matched `tallies[name]` since the newest step (`newest_step`) was first
        reported; since the start of the log when no step was."""
        with self._lock:
            return self._tallied_since_step.get(name, 0)

    @property
    def newest_step(self) -> int | None:
        """The highest step number any STEP event reported (None before the first)."""
        with self._lock:
            return self._newest_step

    @property
    def max_generation(self) -> int:
        """The highest rank generation any event names (-1 before the first)."""
        with self._lock:
            return self._max_generation

    @property
    def latest_plan(self) -> list[dict[str, Any]] | None:
        """The placement of the newest PLAN event that carries one (None before the first)."""
        with self._lock:
            return None if self._plan is None else list(self._plan)

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event (0 when empty)."""
        with self._lock:
            return self._count


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line a crash left unfinished (no newline), so the next append starts a line of its own
    instead of continuing the torn one (which would make every later event unreadable)."""
    with path.open("r+b") as log_file:
        end = log_file.seek(0, 2)
        if end == 0:
            return
        log_file.seek(end - 1)
        if log_file.read(1) == b"\n":
            return
        position = end  # read back from the end to the last newline (a line is at most a few KiB)
        while position > 0:
            step = min(65536, position)
            position -= step
            log_file.seek(position)
            newline = log_file.read(step).rfind(b"\n")
            if newline >= 0:
                log_file.truncate(position + newline + 1)
                return
        log_file.truncate(0)


def _scan(path: Path, start: int = 0, first_seq: int = 1) -> Iterator[tuple[int, Event]]:
    """(byte offset, event) of each line of a JSONL log from byte `start` (where event `first_seq` is),
    streamed; a torn last line (a crash mid-write) is dropped, any other unreadable line or a gap in the
    numbering is an error naming the line."""
    expected = first_seq
    offset = start
    with path.open("rb") as log_file:
        log_file.seek(start)
        pending: tuple[int, bytes, Exception] | None = None
        for number, raw in enumerate(log_file, start=1):
            if pending is not None:  # an unreadable line with another after it: not a torn tail
                raise ValueError(f"{path}:{pending[0]}: not an event record: {pending[2]}") from pending[2]
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                event = Event.from_json(raw.decode("utf-8"))
            except (ValueError, TypeError, KeyError) as exc:
                pending = (number, raw, exc)
                continue
            if event.seq != expected:
                raise ValueError(f"{path}:{number}: sequence number {event.seq}, expected {expected}")
            expected += 1
            yield start, event


def read_events(path: Path) -> list[Event]:
    """The events of a JSONL log; a torn last line (a crash mid-write) is dropped."""
    return [event for _, event in _scan(path)]


def status_of(events: list[Event], cursor: int, limit: int) -> JobStatus:
    """A JobStatus over a complete list of events (a log read back from its file)."""
    _check_page(cursor, limit)
    log = EventLog()
    for event in events:
        log._take(event)
    return log.status(cursor, limit)


def _check_page(cursor: int, limit: int) -> None:
    if cursor < 0:
        raise ValueError(f"cursor must be >= 0, got {cursor}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
