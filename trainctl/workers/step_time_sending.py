"""How the ranks other than 0 send their step times to the supervisor (rank 0's come with its StepReports):
each rank's `StepTimeBatcher` hands over the times of its newest steps once per `STEP_TIME_INTERVAL`, to its
node's relay rank, whose `StepTimeRelay` sends the batches of the node's ranks on in one call.

Costs (bench/scale/rank_path.py): every Ray call into the supervisor costs it 0.4-0.6 ms of CPU, taken in its
single ``reports`` thread, so one call per rank per step cannot scale (4,095 calls a second at 4,096 ranks and
a 1 s step: more than a core, and rank 0's StepReport queued seconds behind them). Batched per rank, the calls
are ranks / `STEP_TIME_INTERVAL` a second whatever the step time; relayed per node, nodes / `STEP_TIME_INTERVAL`
(8 times fewer on 8-GPU nodes); a relay's collecting is a local call between two processes of one node.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainctl.workers.placement.plan import RankAssignment

STEP_TIME_INTERVAL = 120.0
"""Seconds of wall clock between the batches of a rank's step times: nodes / 120 calls a second to the
supervisor (4 a second at 4,096 ranks on 8-GPU nodes), and the straggler statistics at most about two minutes
behind the newest step (the TrainctlJobStraggler alert waits 15 minutes)."""
BATCH_STEPS = 4
"""Step times one batch carries: the newest steps a rank reported before an interval began."""
SPREAD_STEPS = 8
"""The ranks of a node's k-th relay send their batches k % SPREAD_STEPS steps after the interval began, so the
supervisor takes a 1/SPREAD_STEPS share of the nodes' calls per step rather than all at once ahead of rank 0's
next report. BATCH_STEPS + SPREAD_STEPS < STEP_HISTORY (`trainctl.workers.step_stats`): the batch's steps
are still in the supervisor's history when it comes."""

Batch = dict[int, float]
"""One rank's step times, ``{step: seconds}``."""


@dataclass(frozen=True)
class StepTimeRoute:
    """Where a rank other than 0 hands its step-time batches: the relay rank of its node (the node's lowest
    rank other than 0), which collects the node's batches and sends them to the supervisor together."""

    relay: int
    """The relay rank (this rank itself on the relay)."""
    worker: Any
    """The relay rank's RankWorker actor handle (its ``relay_step_times`` takes the batches)."""
    node_ranks: int
    """Ranks whose batches the relay collects: the node's ranks other than 0."""
    stagger: int
    """Steps after an interval begins at which the node's ranks hand over their batches."""


def step_time_routes(slots: Sequence[RankAssignment], workers: Sequence[Any]) -> dict[int, StepTimeRoute]:
    """The route of every rank but 0, by rank, from the group's slots and their RankWorker handles (in the same
    order). Nodes are numbered for the stagger in the order of their lowest ranks."""
    if len(slots) != len(workers):
        raise ValueError(f"{len(slots)} slots but {len(workers)} workers")
    worker_of = {slot.rank: worker for slot, worker in zip(slots, workers, strict=True)}
    by_node: dict[str, list[int]] = {}
    for slot in sorted(slots, key=lambda slot: slot.rank):
        if slot.rank:
            by_node.setdefault(slot.node, []).append(slot.rank)
    return {
        rank: StepTimeRoute(
            relay=ranks[0], worker=worker_of[ranks[0]], node_ranks=len(ranks), stagger=index % SPREAD_STEPS
        )
        for index, ranks in enumerate(by_node.values())
        for rank in ranks
    }


class StepTimeBatcher:
    """A rank's ``on_step_time``: at the first step it reports in each ``interval`` seconds of wall clock it
    takes the times of the `BATCH_STEPS` steps it reported before (at its very first step: that step's) as
    its next batch, and hands it to ``send`` (``{step: seconds}``, possibly empty) ``stagger`` steps later.
    Ranks train in lockstep and their nodes' clocks agree, so every rank's batch holds the same steps, which
    the supervisor then finds complete."""

    def __init__(
        self,
        send: Callable[[Batch], Any],
        stagger: int,
        interval: float = STEP_TIME_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if stagger < 0:
            raise ValueError(f"stagger must be >= 0, got {stagger}")
        self._send = send
        self._delay = stagger
        self._interval = interval
        self._clock = clock
        self._recent: Batch = {}
        self._batch: Batch | None = None
        self._wait = 0
        self._period: int | None = None

    def __call__(self, step: int, seconds: float) -> None:
        period = math.floor(self._clock() / self._interval)
        first = self._period is None
        if period != self._period:
            self._period = period
            self._batch, self._recent = ({step: float(seconds)} if first else self._recent), {}
            self._wait = self._delay
        if not first:
            self._recent[step] = float(seconds)
            while len(self._recent) > BATCH_STEPS:
                del self._recent[min(self._recent)]
        if self._batch is not None:
            if self._wait > 0:
                self._wait -= 1
            else:
                batch, self._batch = self._batch, None
                self._send(batch)


class StepTimeRelay:
    """A relay rank's collector of one generation: the batches of its node's ``node_ranks`` ranks, sent on in
    one ``send({rank: batch})`` once each of them has handed over one (empty batches left out; nothing sent
    when all are). A rank that hands over a second batch before the others' first (it missed an interval)
    sends what is waiting on first. Called from the relay's training thread and its Ray call threads."""

    def __init__(self, send: Callable[[dict[int, Batch]], Any], node_ranks: int, generation: int) -> None:
        if node_ranks < 1:
            raise ValueError(f"node_ranks must be >= 1, got {node_ranks}")
        self.generation = generation
        self._send = send
        self._node_ranks = node_ranks
        self._waiting: dict[int, Batch] = {}
        self._lock = threading.Lock()

    def add(self, rank: int, batch: Batch) -> None:
        ready = []
        with self._lock:
            if rank in self._waiting:
                ready.append(self._waiting)
                self._waiting = {}
            self._waiting[rank] = dict(batch)
            if len(self._waiting) >= self._node_ranks:
                ready.append(self._waiting)
                self._waiting = {}
        for batches in ready:
            if any(batches.values()):
                self._send({rank: times for rank, times in batches.items() if times})
