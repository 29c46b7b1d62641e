"""What a job's event log derives for a restarted service's relaunch decision (issue 38): the newest step
reported, the relaunches, and the relaunches since that step was first reported. They are kept with the
log's other derived state and in its snapshot, so reading them costs the snapshot and the events after
it, not the whole log; they equal a replay of every event, whichever way the log was opened."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainctl.workers import events
from trainctl.workers.events import Event, EventKind, EventLog, JobState, read_events
from trainctl.workers.relaunch import Relaunch, is_relaunch

TALLIES = {"relaunches": is_relaunch}
RELAUNCH = Relaunch(resume="resuming from checkpoint step 10", count=1).reason


def replayed(all_events: list[Event]) -> tuple[int | None, int, int]:
    """(newest step, relaunches, relaunches since the newest step was first reported), from every event:
    what trainctl.service.scheduling.relaunch computed before the log kept them."""
    newest: int | None = None
    relaunched_at: list[int | None] = []
    for event in all_events:
        if event.kind is EventKind.STEP and event.step:
            newest = max(int(event.step["step"]), newest or 0)
        elif is_relaunch(event):
            relaunched_at.append(newest)
    stalled = 0
    for at in reversed(relaunched_at):
        if at != newest:
            break
        stalled += 1
    return newest, len(relaunched_at), stalled


def derived(log: EventLog) -> tuple[int | None, int, int]:
    return log.newest_step, log.tally("relaunches"), log.tally_since_step("relaunches")


def random_log(path: Path, seed: int, count: int) -> EventLog:
    """A log of steps that go forward and back (a restart re-runs steps), relaunches, other restarts
    and log lines, in random order."""
    rng = random.Random(seed)
    log = EventLog.open(path, tallies=TALLIES)
    step = 0
    for _ in range(count):
        roll = rng.random()
        if roll < 0.6:
            step = max(0, step + rng.choice((1, 1, 1, -3)))
            log.append(EventKind.STEP, rank=0, step={"step": step, "loss": 1.0})
        elif roll < 0.75:
            log.append(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH)
        elif roll < 0.85:
            log.append(EventKind.STATE, state=JobState.RESTARTING, reason="rank 1 died")
        else:
            log.append(EventKind.LOG, message="hello")
    return log


@pytest.mark.parametrize("seed", range(6))
def test_the_derived_progress_equals_a_replay_however_the_log_is_opened(tmp_path: Path, monkeypatch, seed: int) -> None:
    monkeypatch.setattr(events, "RECENT_EVENTS", 12)
    monkeypatch.setattr(events, "INDEX_STRIDE", 8)
    path = tmp_path / "events.jsonl"
    log = random_log(path, seed, 150 + seed)
    expected = replayed(read_events(path))
    assert derived(log) == expected
    assert derived(EventLog.open(path, tallies=TALLIES)) == expected
    assert derived(EventLog.read(path, tallies=TALLIES)) == expected
    EventLog.snapshot_path(path).unlink()  # no snapshot: the whole file is replayed
    assert derived(EventLog.read(path, tallies=TALLIES)) == expected


def test_relaunches_since_the_newest_step_restart_when_a_new_step_is_reached(tmp_path: Path) -> None:
    log = EventLog.open(tmp_path / "events.jsonl", tallies=TALLIES)
    assert derived(log) == (None, 0, 0)
    log.append(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH)
    assert derived(log) == (None, 1, 1)  # before the first step every relaunch counts
    log.append(EventKind.STEP, step={"step": 0, "loss": 1.0})
    assert derived(log) == (0, 1, 0)
    log.append(EventKind.STEP, step={"step": 5, "loss": 1.0})
    log.append(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH)
    log.append(EventKind.STEP, step={"step": 3, "loss": 1.0})  # re-run after the restart: not progress
    log.append(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH)
    assert derived(log) == (5, 3, 2)
    log.append(EventKind.STEP, step={"step": 6, "loss": 1.0})
    assert derived(log) == (6, 3, 0)


def test_reading_the_progress_of_a_long_log_parses_only_the_events_after_its_snapshot(tmp_path: Path, monkeypatch) -> None:
    """Reading a 2,000-event log for a relaunch decision parses at most a stride of events (and the one
    that checks the snapshot), not all 2,000: what a restarted service reads per job."""
    monkeypatch.setattr(events, "INDEX_STRIDE", 64)
    path = tmp_path / "events.jsonl"
    log = random_log(path, 7, 2000)
    expected = replayed(read_events(path))
    parsed = []
    real = Event.from_json.__func__

    def counting(cls: type[Event], line: str) -> Event:
        parsed.append(line)
        return real(cls, line)

    monkeypatch.setattr(Event, "from_json", classmethod(counting))
    reader = EventLog.read(path, tallies=TALLIES)
    assert derived(reader) == expected == derived(log)
    assert reader.status(reader.last_seq, 1).state == log.status(log.last_seq, 1).state
    assert len(parsed) <= 64 + 1, len(parsed)


def test_a_snapshot_from_before_the_progress_was_kept_is_not_trusted(tmp_path: Path, monkeypatch) -> None:
    """A snapshot an earlier trainctl wrote has no newest step: the log is replayed instead (once)."""
    monkeypatch.setattr(events, "INDEX_STRIDE", 8)
    path = tmp_path / "events.jsonl"
    log = random_log(path, 3, 100)
    snapshot = EventLog.snapshot_path(path)
    old = json.loads(snapshot.read_text())
    del old["newest_step"], old["tallied_since_step"]
    snapshot.write_text(json.dumps(old))
    assert derived(EventLog.read(path, tallies=TALLIES)) == replayed(read_events(path)) == derived(log)
