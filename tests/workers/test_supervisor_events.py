"""The event log (sequence numbers, cursors, the JSONL mirror) and the supervisor's straggler stats."""

from __future__ import annotations

import json

import pytest

from trainctl.workers.events import EventKind, EventLog, JobPhase, read_events, status_of
from trainctl.workers.supervisor import _StepStats


def test_sequence_numbers_and_cursor_resume(tmp_path):
    log = EventLog.open(tmp_path / "events.jsonl")
    log.append(EventKind.STATE, state=JobPhase.SCHEDULED, reason="started")
    for step in range(1, 6):
        log.append(EventKind.STEP, rank=0, step={"step": step, "loss": 5.0 / step})
    log.append(EventKind.STATE, state=JobPhase.SUCCEEDED, reason="done")

    first = status_of(log.all(), cursor=0, limit=3)
    assert [e.seq for e in first.events] == [1, 2, 3]
    assert first.cursor == 3 and not first.drained
    rest = status_of(log.all(), cursor=first.cursor, limit=100)
    assert [e.seq for e in rest.events] == [4, 5, 6, 7]
    assert rest.drained and rest.state is JobPhase.SUCCEEDED and rest.reason == "done"
    empty = status_of(log.all(), cursor=rest.cursor, limit=100)
    assert empty.events == [] and empty.cursor == 7
    for cursor, limit in [(0, 3), (3, 100), (7, 1)]:  # the live log's running state agrees with a replay
        assert log.status(cursor, limit) == status_of(log.all(), cursor, limit)


def test_reopened_log_continues_numbering(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    log = EventLog.open(path)
    log.append(EventKind.STATE, state=JobPhase.RUNNING, reason="up", generation=0)
    log.append(EventKind.LOG, message="hello", rank=1)
    again = EventLog.open(path)
    event = again.append(EventKind.STATE, state=JobPhase.RESTARTING, reason="rank 1 died", generation=0)
    assert event.seq == 3
    events = read_events(path)
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[1].message == "hello" and events[1].rank == 1
    assert status_of(events, 0, 10).restarts == 1


def test_torn_last_line_is_dropped_but_corruption_elsewhere_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog.open(path)
    log.append(EventKind.STATE, state=JobPhase.RUNNING, reason="up")
    log.append(EventKind.LOG, message="x")
    text = path.read_text()
    path.write_text(text + '{"seq": 3, "ti')
    assert [e.seq for e in read_events(path)] == [1, 2]
    path.write_text('{"seq": 1, "kind": "nope"}\n' + text)
    with pytest.raises(ValueError, match="events.jsonl:1"):
        read_events(path)


def test_gap_in_sequence_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog.open(path)
    log.append(EventKind.LOG, message="a")
    record = json.loads(path.read_text())
    record["seq"] = 5
    path.write_text(path.read_text() + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="sequence number 5, expected 2"):
        read_events(path)


def test_bad_cursor_and_limit_are_rejected():
    with pytest.raises(ValueError, match="cursor"):
        status_of([], cursor=-1, limit=1)
    with pytest.raises(ValueError, match="limit"):
        status_of([], cursor=0, limit=0)


def test_terminal_states():
    assert {p for p in JobPhase if p.terminal} == {JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED}


def test_straggler_stats_use_the_newest_step_every_rank_timed():
    stats = _StepStats()
    stats.add(0, 1, 1.0)
    stats.add(1, 1, 1.5)
    stats.add(2, 1, 3.0)
    stats.add(0, 2, 1.0)  # ranks 1 and 2 have not reported step 2 yet
    result = stats.latest_complete(before=3)
    assert result is not None
    assert result["step"] == 1
    assert result["slowest_rank"] == 2 and result["fastest_rank"] == 0
    assert result["ratio"] == pytest.approx(3.0)
    assert stats.latest_complete(before=1) is None
