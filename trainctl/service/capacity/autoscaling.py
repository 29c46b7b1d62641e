"""Autoscaling (opt-in): ask Ray's autoscaler for the map nodes a blocked queued job needs.

The topology map may name more hosts than Ray has up; those Ray lacks are left out of placement
(`SchedulerState.down_nodes`). When the job at the head of the queue does not fit on the live nodes but
would on the map with the absent ones up, admission asks here (`need`): the absent nodes the solver
would place it on are requested from the autoscaler, each as its map entry (slots and labels,
trainctl.workers.autoscaler), so the node that joins is the one the map describes and the next pass
places the job on it. The request is made once per change of what is needed (`finish_pass`) and
withdrawn when nothing is, so idle nodes go after the autoscaler's idle timeout.

Placing the job is not holding the node: until its ranks start, the node's slots are free and the node
counts as idle since it joined, so a withdrawal at placement lets an autoscaler whose idle timeout is
shorter than the job's start (a loaded service, a slow join) take the node back under the job being
started on it. The request stands until the job it was made for has left SCHEDULED (its ranks hold the
slots, or it ended).

Ray's request is a floor on the cluster's capacity, not an increment: it names the live map nodes too,
so nodes of the same shape already up do not count as the new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.pool import GpuPool
from trainctl.service.scheduling.state import SchedulerState
from trainctl.service.store import JobNotFound
from trainctl.workers.events import JobState

log = logging.getLogger(__name__)

NodeRequest = Callable[[Sequence[str]], None]
"""Ask the autoscaler for these map nodes, replacing the last request (empty: withdraw it)."""


@dataclass(frozen=True)
class ScaleUp:
    """A pending scale-up: the map nodes asked for, for which queued job, since when (Unix time)."""

    job_id: str
    nodes: tuple[str, ...]
    since: float


def nodes_to_add(pool: GpuPool, job: ResolvedJob, down: Collection[str]) -> tuple[str, ...]:
    """The `down` map nodes `job` would be placed on were they up, with every GPU held now still held;
    empty when not even they would hold it. For a job admission could not place on the live nodes (it
    asks only then, so the solver runs once more, not twice)."""
    if not down:
        return ()
    placement = pool.place(job)
    if placement is None:
        return ()
    return tuple(sorted({a.node for a in placement.assignments} & set(down)))


class Autoscaling:
    """The scale-up each admission pass needs, requested when it changes (`pending` while asked for)."""

    def __init__(self, state: SchedulerState, request: NodeRequest):
        self.state = state
        self._request = request
        self.pending: ScaleUp | None = None
        """The scale-up last requested for a queued job (None: none)."""
        self._starting: ScaleUp | None = None
        """A scale-up whose job was placed and whose ranks do not hold the nodes yet: the request stands."""
        self._requested: tuple[str, ...] | None = None
        """The map nodes of the request standing in Ray (empty: none; None: not known, so the next pass
        sends its own: a request is the cluster's, and one a previous leader left must not stand forever,
        keeping its nodes from the idle timeout)."""
        self._wanted: ScaleUp | None = None

    def start_pass(self) -> None:
        """An admission pass begins: nothing is needed until `need` says so."""
        self._wanted = None

    def need(self, job_id: str, job: ResolvedJob, down: Collection[str]) -> str | None:
        """For the blocked head of the queue: the waiting reason when nodes Ray lacks would hold it (they
        are requested at the pass's end), else None."""
        nodes = nodes_to_add(self.state.pool, job, down)
        if not nodes:
            return None
        same = self.pending is not None and (self.pending.job_id, self.pending.nodes) == (job_id, nodes)
        self._wanted = self.pending if same else ScaleUp(job_id, nodes, time.time())
        return f"waiting for the autoscaler to add {', '.join(nodes)} (asked for this job's placement)"

    def finish_pass(self, down: Collection[str]) -> None:
        """Request what this pass needs when it differs from the standing request, and withdraw it when
        nothing is (nor a job placed on asked-for nodes is still starting). A request Ray refuses is logged
        and tried again by the next pass."""
        wanted = self._wanted
        if self.pending is not None and (wanted is None or wanted.job_id != self.pending.job_id):
            self._starting = self.pending  # its job left the queue: placed, or cancelled
        if self._starting is not None and not self._still_starting(self._starting.job_id):
            self._starting = None
        live = [name for name, _ in self.state.pool.nodes() if name not in down]
        extra = wanted.nodes if wanted is not None else ()
        request = tuple(sorted({*live, *extra})) if wanted is not None or self._starting is not None else ()
        if request != self._requested:
            try:
                self._request(list(request))
            except Exception as exc:  # Ray unreachable: the next pass asks again
                log.warning("could not send the scale-up request to Ray's autoscaler (the next pass tries again): %s", exc)
                return
            self._requested = request
            if wanted is not None and (self.pending is None or self.pending.nodes != wanted.nodes):
                log.info("asked Ray's autoscaler for %s for job %s", ", ".join(wanted.nodes), wanted.job_id)
            elif not request:
                log.info("withdrew the scale-up request: no queued job needs a node Ray lacks, none placed on one is starting")
        self.pending = wanted
        self._export()

    def forget(self) -> None:
        """This replica stops leading: the leader's request stands in Ray, and the leader shows it."""
        self.pending = self._starting = self._wanted = self._requested = None

    def _still_starting(self, job_id: str) -> bool:
        """Whether `job_id` is placed and its ranks do not hold their slots yet (SCHEDULED)."""
        try:
            return self.state.store.get_job(job_id).state is JobState.SCHEDULED
        except JobNotFound:
            return False

    def _export(self) -> None:
        if self.state.metrics is not None:
            pending = self.pending
            self.state.metrics.set_scale_up(pending.nodes if pending else (), pending.since if pending else None)
