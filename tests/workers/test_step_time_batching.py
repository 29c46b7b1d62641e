"""Step times sent in batches (issue 38): a rank's `StepTimeBatcher` calls the supervisor once per
STEP_TIME_INTERVAL seconds with the step times before it (spread over SPREAD_STEPS steps by rank), and the supervisor's `StepStats` finds the same
complete steps and straggler statistics from those batches as from one call per step."""

from __future__ import annotations

import pytest

from trainctl.workers.events import StragglerStats
from trainctl.workers.step_stats import (
    BATCH_STEPS,
    SPREAD_STEPS,
    STEP_HISTORY,
    StepStats,
    StepTimeBatcher,
    StepTimes,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_rank_sends_its_first_step_then_the_steps_before_each_interval_a_few_steps_later():
    clock, sent = Clock(960.0), []  # an interval begins at 960 s and the next at 1,020 s
    batcher = StepTimeBatcher(sent.append, rank=3, interval=60.0, clock=clock)  # sends 3 steps late
    for step in range(1, 5):
        batcher(step, 1.0)
        clock.now += 1.0
    assert sent == [{1: 1.0}]  # at step 4: rank 3's delay
    for step in range(5, 60):  # the rest of the interval: nothing more
        batcher(step, 1.0 + step / 1000)
        clock.now += 1.0
    assert len(sent) == 1
    clock.now = 1020.0  # the next interval: the BATCH_STEPS steps before it, sent 3 steps later
    for step in range(60, 64):
        batcher(step, 1.0 + step / 1000)
        assert len(sent) == (1 if step < 63 else 2)
    assert sorted(sent[1]) == list(range(60 - BATCH_STEPS, 60)) and sent[1][59] == pytest.approx(1.059)
    with pytest.raises(ValueError):
        StepTimeBatcher(sent.append, rank=0, interval=0)


@pytest.mark.parametrize("step_seconds", [1.0, 0.05, 30.0])
def test_batches_from_every_rank_give_the_same_stats_as_calls_per_step(step_seconds):
    ranks, clock = 64, Clock(999.5)
    interval = 20 * step_seconds
    per_step, batched, calls = StepStats(), StepStats(), []
    every_time: dict[int, dict[int, float]] = {}

    def send(rank, times):
        calls.append(rank)
        batched.add_many(rank, times)

    batchers = {r: StepTimeBatcher(lambda times, r=r: send(r, times), r, interval=interval, clock=clock)
                for r in range(1, ranks)}
    found = []
    for step in range(1, 61):
        clock.now += step_seconds
        for rank in range(ranks):
            seconds = step_seconds * (1.0 + (rank == 17 and step > 10) * 0.6 + rank * 1e-4)
            every_time.setdefault(step, {})[rank] = seconds
            if rank == 0:  # rank 0's time comes with its StepReport, every step
                per_step.add(0, step, seconds)
                batched.add(0, step, seconds)
            else:
                clock.now += step_seconds * 1e-5  # the ranks' reports of a step spread over a little time
                per_step.add(rank, step, seconds)
                batchers[rank](step, seconds)
        found.append(batched.latest_complete(before=step + 1))
    every = per_step.latest_complete(before=61)
    assert every is not None and every.step == 60 and every.slowest_rank == 17
    assert len(calls) <= (ranks - 1) * 4  # the first step, then once per interval (3 intervals)
    newest = found[-1]
    assert newest is not None and newest.ranks == ranks and 60 - newest.step <= 20 + BATCH_STEPS + SPREAD_STEPS
    assert newest == StragglerStats.of(newest.step, every_time[newest.step])
    assert newest.slowest_rank == 17 and newest.ratio == pytest.approx(1.6, rel=1e-2)
    assert all(s is not None for s in found[SPREAD_STEPS:])  # step 1 is complete once every rank sent it
    assert len(batched.times) <= STEP_HISTORY


def test_a_complete_step_is_summarised_once_and_a_new_rank_reopens_it():
    stats = StepStats()
    for rank in range(3):
        stats.add(rank, 1, 1.0 + rank)
    first = stats.latest_complete(before=2)
    assert first is not None and first is stats.latest_complete(before=2)  # computed once, then reused
    stats.add(3, 2, 1.0)  # a rank that had not reported yet: step 1 lacks it now
    assert stats.latest_complete(before=2) is None
    stats.add(3, 1, 9.0)
    assert stats.latest_complete(before=2).slowest_rank == 3


def test_step_times_of_a_step_are_a_compact_mapping_by_rank():
    times = StepTimes()
    times.set(5, 2.0)
    times.set(2, 1.0)
    times.set(5, 3.0)  # a rank reporting again replaces its time
    assert dict(times) == {2: 1.0, 5: 3.0} and len(times) == 2 and 3 not in times
    with pytest.raises(KeyError):
        times[9]
    with pytest.raises(ValueError):
        times.set(-1, 1.0)
