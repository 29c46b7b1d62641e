"""Step times sent in batches (issue 38): a rank's `StepTimeBatcher` hands over the step times before each
STEP_TIME_INTERVAL once, its node's `StepTimeRelay` sends the node's batches to the supervisor in one call (the
nodes' calls spread over SPREAD_STEPS steps), and the supervisor's `StepStats` finds the same complete steps
and straggler statistics from those calls as from one call per rank per step."""

from __future__ import annotations

import pytest

from trainctl.workers.events import StragglerStats
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.step_stats import STEP_HISTORY, StepStats, StepTimes
from trainctl.workers.step_time_sending import (
    BATCH_STEPS,
    SPREAD_STEPS,
    StepTimeBatcher,
    StepTimeRelay,
    step_time_routes,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_rank_sends_its_first_step_then_the_steps_before_each_interval_a_few_steps_later():
    clock, sent = Clock(960.0), []  # an interval begins at 960 s and the next at 1,020 s
    batcher = StepTimeBatcher(sent.append, stagger=3, interval=60.0, clock=clock)  # sends 3 steps late
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
        StepTimeBatcher(sent.append, stagger=0, interval=0)
    with pytest.raises(ValueError):
        StepTimeBatcher(sent.append, stagger=-1)
    assert BATCH_STEPS + SPREAD_STEPS < STEP_HISTORY  # a batch's steps are still in the supervisor's history


@pytest.mark.parametrize("step_seconds", [1.0, 0.05, 30.0])
def test_batches_relayed_per_node_give_the_same_stats_as_calls_per_step(step_seconds):
    ranks, per_node, clock = 64, 8, Clock(999.5)
    interval = 20 * step_seconds
    slots = [RankAssignment(rank=r, node=f"node-{r // per_node}", gpu=r % per_node) for r in range(ranks)]
    routes = step_time_routes(slots, [f"worker-{r}" for r in range(ranks)])
    per_step, relayed, calls = StepStats(), StepStats(), []
    every_time: dict[int, dict[int, float]] = {}

    def send(batches):  # the supervisor's record_step_times
        calls.append(sorted(batches))
        for rank, times in batches.items():
            relayed.add_many(rank, times)

    relays = {route.relay: StepTimeRelay(send, route.node_ranks, generation=0) for route in routes.values()}
    batchers = {r: StepTimeBatcher(lambda times, r=r: relays[routes[r].relay].add(r, times), routes[r].stagger,
                                   interval=interval, clock=clock) for r in range(1, ranks)}
    found = []
    for step in range(1, 61):
        clock.now += step_seconds
        for rank in range(ranks):
            seconds = step_seconds * (1.0 + (rank == 17 and step > 10) * 0.6 + rank * 1e-4)
            every_time.setdefault(step, {})[rank] = seconds
            if rank == 0:  # rank 0's time comes with its StepReport, every step
                per_step.add(0, step, seconds)
                relayed.add(0, step, seconds)
            else:
                clock.now += step_seconds * 1e-5  # the ranks' reports of a step spread over a little time
                per_step.add(rank, step, seconds)
                batchers[rank](step, seconds)
        found.append(relayed.latest_complete(before=step + 1))
    every = per_step.latest_complete(before=61)
    assert every is not None and every.step == 60 and every.slowest_rank == 17
    # At most one call per node per interval (the first step, then 3 intervals), each with every rank of its node.
    node_ranks = [[r for r in range(node * per_node, (node + 1) * per_node) if r] for node in range(ranks // per_node)]
    assert len(calls) <= len(node_ranks) * 4
    assert all(call in node_ranks for call in calls) and all(calls.count(node) >= 3 for node in node_ranks)
    newest = found[-1]
    assert newest is not None and newest.ranks == ranks and 60 - newest.step <= 20 + BATCH_STEPS + SPREAD_STEPS
    assert newest == StragglerStats.of(newest.step, every_time[newest.step])
    assert newest.slowest_rank == 17 and newest.ratio == pytest.approx(1.6, rel=1e-2)
    assert all(s is not None for s in found[SPREAD_STEPS:])  # step 1 is complete once every node sent it
    assert len(relayed.times) <= STEP_HISTORY


def test_each_node_relays_through_its_lowest_rank_but_0_and_nodes_are_staggered():
    nodes = ["a", "a", "b", "a", "b", "c"] + [f"n{i}" for i in range(SPREAD_STEPS)]
    slots = [RankAssignment(rank=r, node=node, gpu=r) for r, node in reversed(list(enumerate(nodes)))]
    routes = step_time_routes(slots, [f"w{slot.rank}" for slot in slots])
    assert 0 not in routes  # rank 0's times come with its StepReports
    assert {r: (routes[r].relay, routes[r].worker, routes[r].node_ranks) for r in (1, 3, 2, 4, 5)} == {
        1: (1, "w1", 2), 3: (1, "w1", 2), 2: (2, "w2", 2), 4: (2, "w2", 2), 5: (5, "w5", 1)}
    assert [routes[r].stagger for r in (1, 2, 5, 6, 7)] == [0, 1, 2, 3, 4]
    assert routes[len(nodes) - 1].stagger == (SPREAD_STEPS + 2) % SPREAD_STEPS  # numbered on modulo SPREAD_STEPS
    with pytest.raises(ValueError):
        step_time_routes(slots, ["w0"])


def test_a_relay_sends_once_its_node_is_in_and_first_what_waits_when_a_rank_comes_twice():
    sent = []
    relay = StepTimeRelay(sent.append, node_ranks=3, generation=2)
    relay.add(1, {5: 1.0})
    relay.add(2, {5: 1.1})
    assert sent == []
    relay.add(3, {5: 1.2})
    assert sent == [{1: {5: 1.0}, 2: {5: 1.1}, 3: {5: 1.2}}]
    relay.add(1, {9: 1.0})
    relay.add(1, {13: 1.0})  # rank 2 and 3 missed an interval: what waited goes first, on its own
    assert sent[1:] == [{1: {9: 1.0}}]
    relay.add(2, {})
    relay.add(3, {})  # empty batches are left out
    assert sent[2:] == [{1: {13: 1.0}}]
    relay.add(1, {})
    relay.add(2, {})
    relay.add(3, {})  # nothing to send
    assert len(sent) == 3
    with pytest.raises(ValueError):
        StepTimeRelay(sent.append, node_ranks=0, generation=0)


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
