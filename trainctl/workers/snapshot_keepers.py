"""Snapshot keepers: the host memory that holds a job's in-memory snapshots (`checkpoint.memory_interval_steps`)
outside its rank processes, one keeper actor per node, so a rank's death does not take its snapshot along.

Each rank hands every snapshot to two keepers (`KeeperSnapshots`, the engine's `SnapshotStore` on a rank):
its own node's, and its peer node's, the next node of the plan in name order (another node: another
failure domain), so losing a node loses one copy of each snapshot and the other survives. A keeper holds the
newest `KEPT_PER_RANK` snapshots of each rank (the newest may be one some ranks never finished handing over).
A restarted generation asks every keeper of the job which steps it holds for each rank and reads its copy
from its own node's keeper when it has one, else from any other (`fetch`). The supervisor owns the keepers
(`SnapshotKeepers`): it starts one on each node of the plan when the job's first generation starts, and
another on each node a re-placement adds; they die with it and are killed when the job ends. A keeper whose
node is lost is gone with its copies, and calls to it fail at once (within `KEEPER_TIMEOUT` at most).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.resources import NODE_LABEL

log = logging.getLogger(__name__)

KEPT_PER_RANK = 2
"""Snapshots a keeper holds per rank: the newest (maybe not on every rank yet) and the one before it."""
KEEPER_TIMEOUT = 10.0
"""Seconds a rank waits for a keeper's answer before it counts the keeper's copies as lost."""


class SnapshotKeeper:
    """One node's copies of a job's rank snapshots (a Ray actor: `SnapshotKeepers` makes it remote)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._held: dict[int, dict[int, bytes | bytearray]] = {}
        """Rank -> step -> that rank's snapshot payload."""

    def put(self, rank: int, step: int, payload: bytes | bytearray) -> None:
        """Keep ``payload`` as ``rank``'s snapshot of ``step``, dropping all but its newest `KEPT_PER_RANK`."""
        held = self._held.setdefault(rank, {})
        held[step] = payload
        for old in sorted(held)[:-KEPT_PER_RANK]:
            del held[old]

    def steps(self, rank: int) -> list[int]:
        """The steps of ``rank``'s snapshots held here."""
        return sorted(self._held.get(rank, {}))

    def get(self, rank: int, step: int) -> bytes | bytearray | None:
        """``rank``'s snapshot of ``step``, None when not held here."""
        return self._held.get(rank, {}).get(step)

    def discard_after(self, rank: int, step: int) -> None:
        """Drop ``rank``'s snapshots of steps after ``step``."""
        held = self._held.get(rank, {})
        for newer in [s for s in held if s > step]:
            del held[newer]

    def held_bytes(self) -> int:
        """The bytes of every snapshot held here."""
        return sum(len(payload) for held in self._held.values() for payload in held.values())


@dataclass(frozen=True)
class SnapshotRoute:
    """What one rank needs to keep its snapshots: every keeper of the job by node, its own node and the peer
    node whose keeper holds its second copy (None: a one-node job, one copy)."""

    keepers: dict[str, Any]
    node: str
    peer: str | None


def peer_nodes(nodes: Iterable[str]) -> dict[str, str | None]:
    """Each node's peer: the next of ``nodes`` in name order, the last node's the first (None alone)."""
    ordered = sorted(set(nodes))
    if len(ordered) < 2:
        return dict.fromkeys(ordered)
    return {node: ordered[(index + 1) % len(ordered)] for index, node in enumerate(ordered)}


class KeeperSnapshots:
    """The engine's `SnapshotStore` of one rank, over its job's keepers (``route``). A snapshot is handed to
    both keepers without waiting for them; while the previous one is still on its way, a new one is skipped
    (with a log line), so at most one is in flight and the step never waits for the copies."""

    def __init__(self, route: SnapshotRoute, rank: int, timeout: float = KEEPER_TIMEOUT) -> None:
        self.route, self.rank, self.timeout = route, rank, timeout
        self._in_flight: list[ray.ObjectRef] = []

    def _targets(self) -> list[str]:
        nodes = [self.route.node] + ([self.route.peer] if self.route.peer else [])
        return [node for node in nodes if node in self.route.keepers]

    def put(self, step: int, payload: bytearray) -> None:
        if self._in_flight:
            done, pending = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
            if pending:
                log.info("rank %d: snapshot of step %d skipped: the previous one is still being kept", self.rank, step)
                return
            for ref in done:  # read, so that Ray does not log a lost keeper's failed call as unhandled
                with contextlib.suppress(RayError):  # that keeper's copy is gone; the other may not be
                    ray.get(ref)
        try:
            shared = ray.put(payload)  # one object for both keepers
            self._in_flight = [self.route.keepers[node].put.remote(self.rank, step, shared) for node in self._targets()]
        except RayError as exc:  # the object store refused it: training goes on without this snapshot
            log.warning("rank %d: snapshot of step %d not kept: %s", self.rank, step, exc)
            self._in_flight = []

    def _ask(self, calls: dict[str, ray.ObjectRef]) -> dict[str, Any]:
        """The answers of the keepers that answer within the timeout, by node (the others' copies are lost)."""
        answers = {}
        deadline = time.monotonic() + self.timeout
        for node, ref in calls.items():
            try:
                answers[node] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (RayError, GetTimeoutError) as exc:
                log.info("rank %d: snapshot keeper on %s did not answer: %s", self.rank, node, type(exc).__name__)
        return answers

    def steps(self) -> set[int]:
        calls = {node: keeper.steps.remote(self.rank) for node, keeper in self.route.keepers.items()}
        return {step for held in self._ask(calls).values() for step in held}

    def fetch(self, step: int) -> tuple[bytes | bytearray, str] | None:
        keepers = self.route.keepers
        for node in sorted(keepers, key=lambda name: (name != self.route.node, name)):
            payload = self._ask({node: keepers[node].get.remote(self.rank, step)}).get(node)
            if payload is not None:
                return payload, f"copy on {node}"
        return None

    def discard_after(self, step: int) -> None:
        self._ask({node: keeper.discard_after.remote(self.rank, step) for node, keeper in self.route.keepers.items()})


@dataclass
class SnapshotKeepers:
    """The snapshot keepers of one job's supervisor, by node."""

    job_id: str
    _by_node: dict[str, Any] = field(default_factory=dict)
    _keeper_class: Any = field(default_factory=lambda: ray.remote(SnapshotKeeper), repr=False)

    def routes(self, slots: Sequence[RankAssignment]) -> dict[int, SnapshotRoute]:
        """Each rank's route on the plan ``slots`` (at a generation's start). A keeper that no longer answers
        (its node lost, its process killed) is forgotten, and each node of the plan without a live keeper
        gets a new one; the keepers of nodes the plan left keep their copies for the restart that reads them."""
        nodes = sorted({slot.node for slot in slots})
        self._forget_the_dead()
        missing = [node for node in nodes if node not in self._by_node]
        for node in missing:
            self._by_node[node] = self._keeper_class.options(
                name=f"trainctl-snapshots-{self.job_id}-{node}-{uuid.uuid4().hex[:8]}", num_cpus=0, max_restarts=0,
                label_selector={NODE_LABEL: node},
            ).remote(node)
        if missing:
            log.info("job %s: snapshot keepers started on %s", self.job_id, ", ".join(missing))
        peers = peer_nodes(nodes)
        keepers = dict(self._by_node)
        return {slot.rank: SnapshotRoute(keepers, slot.node, peers[slot.node]) for slot in slots}

    def _forget_the_dead(self) -> None:
        """Drop the keepers that do not answer within `KEEPER_TIMEOUT`."""
        pings = {node: keeper.held_bytes.remote() for node, keeper in self._by_node.items()}
        deadline = time.monotonic() + KEEPER_TIMEOUT
        for node, ref in pings.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (RayError, GetTimeoutError):
                log.warning("job %s: the snapshot keeper on %s is gone, and its copies with it", self.job_id, node)
                keeper = self._by_node.pop(node)
                with contextlib.suppress(RayError):
                    ray.kill(keeper, no_restart=True)

    def stop(self) -> None:
        """Kill every keeper (the job has ended)."""
        keepers, self._by_node = list(self._by_node.values()), {}
        for keeper in keepers:
            with contextlib.suppress(RayError):  # already gone
                ray.kill(keeper, no_restart=True)
