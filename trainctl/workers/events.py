"""The supervisor's event log: state changes, step reports, log lines and the placement obtained.

Events carry a sequence number that increases by one per event, starting at 1. A poller keeps the
sequence number of the last event it has seen (its *cursor*; 0 before the first) and asks for the
events after it, so it can stop and resume at any point without losing or repeating one. The log
is kept in memory by the job's supervisor and appended, one JSON object per line, to the run
directory's ``events.jsonl`` (`RunDirectory.events`): a supervisor restarted by Ray reloads it and
continues the numbering, and the runtime reads it once the supervisor is gone.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Mapping
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
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
"""States a job never leaves."""
ACTIVE_STATES = frozenset({JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING})
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


@dataclass
class EventLog:
    """A thread-safe, append-only event log mirrored to a JSONL file."""

    path: Path | None = None
    _events: list[Event] = field(default_factory=list)
    _state: JobState = JobState.SCHEDULED
    _reason: str = ""
    _restarts: int = 0
    _replan: tuple[str, ...] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, path: Path | None) -> EventLog:
        """A log backed by ``path``, holding the events already in it (none when it does not exist)."""
        log = cls(path=path)
        if path is not None and path.exists():
            _drop_torn_tail(path)
            for event in read_events(path):
                log._take(event)
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        return log

    def append(self, kind: EventKind, **fields: Any) -> Event:
        """Record an event with the next sequence number and return it."""
        with self._lock:
            event = Event(seq=len(self._events) + 1, time=time.time(), kind=kind, **fields)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(event.to_json() + "\n")
            self._take(event)
            return event

    def status(self, cursor: int, limit: int) -> JobStatus:
        """Up to ``limit`` events after ``cursor`` and the state so far (cost independent of log length)."""
        _check_page(cursor, limit)
        with self._lock:
            page = self._events[cursor : cursor + limit]
            return JobStatus(
                events=page,
                cursor=page[-1].seq if page else cursor,
                state=self._state,
                reason=self._reason,
                restarts=self._restarts,
                last_seq=len(self._events),
                replan=self._replan,
            )

    def _take(self, event: Event) -> None:
        self._events.append(event)
        if event.kind is EventKind.STATE and event.state is not None:
            self._state, self._reason = event.state, event.reason
            self._restarts += event.state is JobState.RESTARTING
        if event.kind is EventKind.REPLAN:
            self._replan = tuple(event.lost_nodes or ())
        elif event.kind in (EventKind.PLAN, EventKind.STATE):
            self._replan = ()

    def all(self) -> list[Event]:
        """Every event so far."""
        with self._lock:
            return list(self._events)

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event (0 when empty)."""
        with self._lock:
            return len(self._events)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line a crash left unfinished (no newline), so the next append starts a line of its own
    instead of continuing the torn one (which would make every later event unreadable)."""
    with path.open("r+b") as log_file:
        data = log_file.read()
        if data and not data.endswith(b"\n"):
            log_file.truncate(data.rfind(b"\n") + 1)


def read_events(path: Path) -> list[Event]:
    """The events of a JSONL log; a torn last line (a crash mid-write) is dropped."""
    events: list[Event] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = Event.from_json(line)
        except (ValueError, TypeError, KeyError) as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not an event record: {exc}") from exc
        if event.seq != len(events) + 1:
            raise ValueError(f"{path}:{number}: sequence number {event.seq}, expected {len(events) + 1}")
        events.append(event)
    return events


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
