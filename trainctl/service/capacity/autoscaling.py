"""Autoscaling (opt-in): ask Ray's autoscaler for the map nodes a blocked queued job needs.

The topology map may name more hosts than Ray has up; those Ray lacks are left out of placement
(`SchedulerState.down_nodes`). When the job at the head of the queue does not fit on the live nodes but
would on the map with the absent ones up, admission asks here (`need`): the absent nodes the solver
would place it on are requested from the autoscaler, each as its map entry (slots and labels,
trainctl.workers.autoscaler), so the node that joins is the one the map describes and the next pass
places the job on it. The request is made once per change of what is needed (`finish_pass`) and
withdrawn when nothing is, so idle nodes go after the autoscaler's idle timeout.

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
        """The scale-up last requested (None: none)."""
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
        """Request what this pass needs when it differs from the last request; withdraw it when nothing is.
        A request Ray refuses is logged and tried again by the next pass."""
        wanted = self._wanted
        if (wanted.nodes if wanted else ()) != (self.pending.nodes if self.pending else ()):
            live = [name for name, _ in self.state.pool.nodes() if name not in down]
            try:
                self._request([*live, *wanted.nodes] if wanted is not None else [])
            except Exception as exc:  # Ray unreachable: the next pass asks again
                log.warning("could not send the scale-up request to Ray's autoscaler (the next pass tries again): %s", exc)
                return
            if wanted is not None:
                log.info("asked Ray's autoscaler for %s for job %s", ", ".join(wanted.nodes), wanted.job_id)
            else:
                log.info("withdrew the scale-up request: no queued job needs a node Ray lacks")
        self.pending = wanted
        self._export()

    def _export(self) -> None:
        if self.state.metrics is not None:
            pending = self.pending
            self.state.metrics.set_scale_up(pending.nodes if pending else (), pending.since if pending else None)
