"""The event log (sequence numbers, cursors, the JSONL mirror), the supervisor's straggler stats and its
failure classes."""

from __future__ import annotations

import json
import pickle

import pytest
from ray.exceptions import RayActorError, RayTaskError

from trainctl.parallelism.data.corpus import DataError
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.spec.files import FileRuleError
from trainctl.workers.events import EventKind, EventLog, JobState, StragglerStats, read_events, status_of
from trainctl.workers.outcomes import Outcome, failure_class
from trainctl.workers.step_stats import STEP_HISTORY, StepStats


def test_sequence_numbers_and_cursor_resume(tmp_path):
    log = EventLog.open(tmp_path / "events.jsonl")
    log.append(EventKind.STATE, state=JobState.SCHEDULED, reason="started")
    for step in range(1, 6):
        log.append(EventKind.STEP, rank=0, step={"step": step, "loss": 5.0 / step})
    log.append(EventKind.STATE, state=JobState.SUCCEEDED, reason="done")

    first = status_of(log.all(), cursor=0, limit=3)
    assert [e.seq for e in first.events] == [1, 2, 3]
    assert first.cursor == 3 and not first.drained
    rest = status_of(log.all(), cursor=first.cursor, limit=100)
    assert [e.seq for e in rest.events] == [4, 5, 6, 7]
    assert rest.drained and rest.state is JobState.SUCCEEDED and rest.reason == "done"
    empty = status_of(log.all(), cursor=rest.cursor, limit=100)
    assert empty.events == [] and empty.cursor == 7
    for cursor, limit in [(0, 3), (3, 100), (7, 1)]:  # the live log's running state agrees with a replay
        assert log.status(cursor, limit) == status_of(log.all(), cursor, limit)


def test_a_long_log_keeps_bounded_memory_and_serves_every_page(tmp_path, monkeypatch):
    """A file-backed log keeps only its newest events in memory (here 50, an offset every 16th): every
    page, old or new, equals a replay of the whole file, and what is derived from the log (state,
    restarts, the highest generation, the newest plan, tallies) survives the events it no longer keeps,
    also when it is opened again, or read (every page from the file) once the supervisor is gone."""
    from trainctl.workers import events

    monkeypatch.setattr(events, "RECENT_EVENTS", 50)
    monkeypatch.setattr(events, "INDEX_STRIDE", 16)
    path = tmp_path / "events.jsonl"
    log = EventLog.open(path, tallies={"restarting": lambda e: e.state is JobState.RESTARTING})
    plan = [{"rank": 0, "node_id": "n1", "node_name": "a", "gpu": 0}]
    log.append(EventKind.PLAN, placement=plan, generation=0)
    log.append(EventKind.STATE, state=JobState.RESTARTING, reason="rank 0 died", generation=3)
    for step in range(1, 301):
        log.append(EventKind.STEP, rank=0, generation=1, step={"step": step, "loss": 1.0 / step})
    log.append(EventKind.STATE, state=JobState.SUCCEEDED, reason="done", generation=1)
    assert len(log._recent) == 50 and len(log._offsets) == (303 + 15) // 16
    replay = read_events(path)
    for current in (log, EventLog.open(path, tallies=log.tallies), EventLog.read(path)):
        for cursor, limit in [(0, 1), (0, 1000), (1, 7), (17, 16), (200, 100), (250, 3), (252, 10), (253, 100), (303, 5)]:
            page = current.status(cursor, limit)
            assert page.events == replay[cursor : cursor + len(page.events)], (cursor, limit)
            assert page.events or cursor == 303
            assert (page.state, page.restarts, page.last_seq) == (JobState.SUCCEEDED, 1, 303)
        assert current.all() == replay
        assert (current.max_generation, current.latest_plan) == (3, plan)
        assert current.tally("restarting") == (1 if current.tallies else 0)  # a reader counts nothing
    assert status_of(replay, 100, 10) == log.status(100, 10)


def test_a_reopened_long_log_starts_from_its_snapshot_and_survives_a_bad_one(tmp_path, monkeypatch):
    """Opening reads the snapshot and the events after it (not the whole file); a snapshot behind the file
    (a crash between an append and the next snapshot), damaged, or describing another file is not trusted
    beyond what the file confirms, and every page and derived value stays what a full replay gives."""
    from trainctl.workers import events

    monkeypatch.setattr(events, "RECENT_EVENTS", 20)
    monkeypatch.setattr(events, "INDEX_STRIDE", 8)
    path = tmp_path / "events.jsonl"
    log = EventLog.open(path, tallies={"restarting": lambda e: e.state is JobState.RESTARTING})
    for step in range(1, 101):
        if step % 30 == 0:
            log.append(EventKind.STATE, state=JobState.RESTARTING, reason="rank 0 died", generation=step)
        log.append(EventKind.STEP, rank=0, generation=step // 30, step={"step": step, "loss": 1.0 / step})
    snapshot = EventLog.snapshot_path(path)
    assert json.loads(snapshot.read_text())["count"] == 96  # the last multiple of 8: 103 events in all
    scanned = []
    real_scan = events._scan
    monkeypatch.setattr(events, "_scan", lambda path, **k: scanned.append(k.get("first_seq", 1)) or real_scan(path, **k))
    replay = read_events(path)
    expected = [(c, log.status(c, 7)) for c in (0, 40, 80, 95, 102)]
    tallies = log.tallies

    def reopened() -> EventLog:
        again = EventLog.open(path, tallies=tallies)
        assert [(c, again.status(c, 7)) for c, _ in expected] == expected
        assert (again.max_generation, again.tally("restarting"), again.last_seq) == (90, 3, 103)
        return again

    scanned.clear()
    reopened()
    # the newest 20 of the 96 events the snapshot covers (from the indexed event before them), then the 7 after it
    assert scanned == [73, 97]
    good = snapshot.read_text()
    for bad in ("{", json.dumps({**json.loads(good), "offsets": [0, 5]}), json.dumps({**json.loads(good), "size": 10**9})):
        snapshot.write_text(bad)
        scanned.clear()
        reopened()
        assert scanned == [1]  # not trusted: the whole file
    snapshot.write_text(good)
    reopened().append(EventKind.LOG, message="after")
    assert [e.seq for e in read_events(path)] == list(range(1, 105)) and replay == read_events(path)[:103]


def test_reopened_log_continues_numbering(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    log = EventLog.open(path)
    log.append(EventKind.STATE, state=JobState.RUNNING, reason="up", generation=0)
    log.append(EventKind.LOG, message="hello", rank=1)
    again = EventLog.open(path)
    event = again.append(EventKind.STATE, state=JobState.RESTARTING, reason="rank 1 died", generation=0)
    assert event.seq == 3
    events = read_events(path)
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[1].message == "hello" and events[1].rank == 1
    assert status_of(events, 0, 10).restarts == 1


def test_torn_last_line_is_dropped_but_corruption_elsewhere_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog.open(path)
    log.append(EventKind.STATE, state=JobState.RUNNING, reason="up")
    log.append(EventKind.LOG, message="x")
    text = path.read_text()
    path.write_text(text + '{"seq": 3, "ti')
    assert [e.seq for e in read_events(path)] == [1, 2]
    path.write_text('{"seq": 1, "kind": "nope"}\n' + text)
    with pytest.raises(ValueError, match="events.jsonl:1"):
        read_events(path)


def test_an_append_after_a_torn_last_line_starts_a_line_of_its_own(tmp_path):
    """A process killed mid-write leaves a line without its newline; the next writer's event must not be
    glued to it (the log would be unreadable from there on)."""
    path = tmp_path / "events.jsonl"
    EventLog.open(path).append(EventKind.STATE, state=JobState.RUNNING, reason="up")
    path.write_text(path.read_text() + '{"seq": 2, "kind": "lo')
    EventLog.open(path).append(EventKind.STATE, state=JobState.FAILED, reason="relaunch refused")
    events = read_events(path)
    assert [(e.seq, e.state) for e in events] == [(1, JobState.RUNNING), (2, JobState.FAILED)]
    assert path.read_text().endswith("\n")


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
    assert {p for p in JobState if p.terminal} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


def test_straggler_stats_use_the_newest_step_every_rank_timed():
    stats = StepStats()
    stats.add(0, 1, 1.0)
    stats.add(1, 1, 1.5)
    stats.add(2, 1, 3.0)
    stats.add(0, 2, 1.0)  # ranks 1 and 2 have not reported step 2 yet
    result = stats.latest_complete(before=3)
    assert result is not None
    assert result.step == 1
    assert result.slowest_rank == 2 and result.fastest_rank == 0
    assert result.ratio == pytest.approx(3.0)
    assert (result.ranks, result.slowest_seconds, result.fastest_seconds, result.median_seconds) == (3, 3.0, 1.0, 1.5)
    assert StragglerStats.from_dict(result.to_dict()) == result
    assert stats.latest_complete(before=1) is None


def test_straggler_stats_stay_one_summary_however_many_ranks_and_steps():
    """A STEP event carries the extremes and the median, not a time per rank, and the supervisor keeps
    the times of STEP_HISTORY steps: neither grows with the ranks' count or the run's length."""
    stats = StepStats()
    ranks = 4096
    for step in range(1, 41):
        for rank in range(ranks):
            stats.add(rank, step, 1.0 + (rank == 17) * 0.5 + rank * 1e-6)
    result = stats.latest_complete(before=41)
    assert result is not None and result.step == 40 and result.ranks == ranks
    assert (result.slowest_rank, result.fastest_rank) == (17, 0)
    assert len(json.dumps(result.to_dict())) < 300
    assert sorted(stats.times) == list(range(41 - STEP_HISTORY, 41))
    stats.add(5, 3, 9.0)  # a late time for a step out of the history is dropped
    assert sorted(stats.times) == list(range(41 - STEP_HISTORY, 41))


def test_straggler_stats_of_an_event_log_written_with_per_rank_times_read_as_the_summary():
    old = {"step": 3, "rank_step_times": {"0": 1.0, "1": 2.0, "2": 1.5}, "slowest_rank": 1, "fastest_rank": 0, "ratio": 2.0}
    assert StragglerStats.from_dict(old) == StragglerStats(
        step=3, ranks=3, slowest_rank=1, slowest_seconds=2.0, fastest_rank=0, fastest_seconds=1.0,
        median_seconds=1.5, ratio=2.0)


def test_step_times_from_every_rank_give_the_ratio_and_name_the_slowest_rank_once():
    stats = StepStats()
    for step, times in [(1, (1.0, 1.1)), (2, (1.0, 1.5)), (3, (1.0, 1.6)), (4, (1.7, 1.0)), (5, (1.0, 1.05))]:
        for rank, seconds in enumerate(times):  # rank 0 via its StepReport, rank 1 via record_step_times
            stats.add(rank, step, seconds)
    lines = [stats.straggler_line(stats.latest_complete(before=step)) for step in range(2, 7)]
    assert lines[0] is None  # step 1: 1.1x is even enough
    assert lines[1] == "straggler at step 2: rank 1 took 1.500s, 1.50x rank 0 (1.000s)"
    assert lines[2] is None  # still rank 1: named once
    assert lines[3] == "straggler at step 4: rank 0 took 1.700s, 1.70x rank 1 (1.000s)"
    assert lines[4] is None and stats.named is None  # even again; a new straggler will be named
    assert stats.latest_complete(before=6).ratio == pytest.approx(1.05)


def test_no_ratio_until_every_reporting_rank_timed_a_step():
    stats = StepStats()
    stats.add(0, 1, 1.0)
    assert stats.latest_complete(before=2) is None and stats.straggler_line(None) is None
    stats.add(1, 1, 0.0)  # a zero time gives no ratio rather than a division by zero
    assert stats.latest_complete(before=2).ratio is None
    assert stats.straggler_line(stats.latest_complete(before=2)) is None


def _task_error(cause: Exception) -> RayTaskError:
    """What `ray.get` raises for a rank whose `train` call raised `cause`."""
    return RayTaskError("RankWorker.train", f"Traceback ...\n{type(cause).__name__}: {cause}", cause).as_instanceof_cause()


def test_failure_classes_a_death_outranks_a_configuration_error_which_outranks_other_errors():
    misconfigured = (1, _task_error(DataError("spec.data.paths: the 1 files hold 10 tokens, fewer than one sample of 33")))
    broken = (0, _task_error(RuntimeError("Connection closed by peer")))
    died = (2, RayActorError())
    outcome, reason = failure_class([broken, misconfigured])
    assert outcome is Outcome.MISCONFIGURED
    assert reason == (
        "configuration error on rank 1: spec.data.paths: the 1 files hold 10 tokens, fewer than one sample of 33; "
        "not restarted (a restart cannot fix it)"
    )
    outcome, reason = failure_class([broken, misconfigured, died])
    assert outcome is Outcome.FAILED and reason.startswith("rank 2 died")
    outcome, reason = failure_class([broken, (3, _task_error(ValueError("not a configuration error")))])
    assert outcome is Outcome.FAILED and reason == "rank 0 failed: RuntimeError: Connection closed by peer"


def test_a_death_seen_first_is_the_root_cause_at_once_and_other_errors_wait_for_the_peers(monkeypatch):
    """The supervisor waits ROOT_CAUSE_WAIT for the other ranks only when no death is known yet: a death
    outranks whatever they could report (and NCCL peers of a dead rank hang, so the wait would run out)."""
    from trainctl.workers import outcomes

    waits = []
    monkeypatch.setattr(outcomes.ray, "wait", lambda refs, **kw: waits.append(kw["timeout"]) or ([], refs))
    pending = ["rank-1-ref"]
    outcome, reason = outcomes.root_cause([(0, RayActorError())], pending, {})
    assert (outcome, waits) == (Outcome.FAILED, []) and reason.startswith("rank 0 died")
    broken = (0, _task_error(RuntimeError("Connection closed by peer")))
    outcome, reason = outcomes.root_cause([broken], pending, {})
    assert waits == [outcomes.ROOT_CAUSE_WAIT] and reason == "rank 0 failed: RuntimeError: Connection closed by peer"


def test_a_file_the_rule_refused_on_a_rank_is_a_configuration_error():
    """A rank's FileRuleError survives the trip to the supervisor (pickled, as Ray sends it) and fails
    the job at once with the rule's message."""
    refused = FileRuleError("spec.model.from_pretrained", "'/data/m/model.safetensors' resolves through a symlink outside the data roots (/data)")
    arrived = pickle.loads(pickle.dumps(refused))
    assert (arrived.field, arrived.message, arrived.args) == (refused.field, refused.message, refused.args)
    outcome, reason = failure_class([(0, _task_error(arrived))])
    assert outcome is Outcome.MISCONFIGURED
    assert reason == f"configuration error on rank 0: {refused}; not restarted (a restart cannot fix it)"


def test_a_step_event_reads_back_its_report_and_straggler_stats(tmp_path):
    report = StepReport(step=4, loss=2.0, grad_norm=0.5, lr=1e-3, tokens=64, tokens_per_second=32.0, mfu=None,
                        step_time_seconds=2.0, breakdown={"checkpoint": 0.5}, peak_memory_bytes=10, checkpoint_bytes=99)
    stats = StragglerStats.of(3, {0: 1.0, 1: 2.0})
    log = EventLog.open(tmp_path / "events.jsonl")
    log.append(EventKind.STEP, rank=0, step={**report.to_dict(), "straggler": stats.to_dict()})
    log.append(EventKind.STEP, rank=0, step={**report.to_dict(), "straggler": None})
    first, second = read_events(tmp_path / "events.jsonl")
    assert first.step_report() == report and first.straggler() == stats
    assert second.straggler() is None
