"""A supervised job's plan: the GPU slots its next rank generation runs on and the layout of their size (the
job's own, or an elastic layout: `trainctl.spec.validate.layout_on`), the new plan it waits for after a node
loss, and a change of size asked for while it runs (an elastic job growing back). Every change of plan is a
PLAN event in the job's log, and a change of layout a line after it.

The plan comes from the service's scheduler (`adopt`, `ask_resize`: it owns the GPU accounting) or, when
the supervisor was given a topology map, from the placement solver over the GPU slots free in Ray
(`await_plan`, `growth`: trainctl.workers.elastic).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import cached_property

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.job import JobSpecBody, TrainingJob
from trainctl.spec.validate import layout_on
from trainctl.workers.elastic import grown_plan, layout_line, replacement_or_shrunk
from trainctl.workers.events import EventKind, EventLog
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.replan import describe_move, describe_plan, free_slots
from trainctl.workers.topology.model import TopologyMap

REPLAN_INTERVAL = 1.0
"""Seconds between looks for a new plan while waiting for one after a node loss (the first at once), and for room to grow back."""


class JobPlan:
    """The plan of one supervised job (thread-safe: the driver thread and the supervisor's control calls share it)."""

    def __init__(self, job: TrainingJob, slots: list[RankAssignment], log: EventLog, *, use_gpu: bool,
                 topology: TopologyMap | None) -> None:
        self.job, self.use_gpu, self.topology = job, use_gpu, topology
        self._log = log
        self._lock = threading.Lock()
        self.slots = sorted(slots, key=lambda slot: slot.rank)
        self.body = self.layout_of(self.slots)
        """The spec body the ranks run: the job's own, or the elastic layout of the plan's size."""
        self.awaiting: list[str] | None = None
        """Lost nodes while the driver waits for a new plan (None when it waits for none)."""
        self._ready = threading.Event()
        self.resize_to: list[RankAssignment] | None = None
        """A plan of another size the ranks stop for at their next step boundary; None: none asked."""
        self._growth_looked = 0.0

    @cached_property
    def resolved(self) -> ResolvedJob:
        """The submitted job's grid and model, resolved at first need (a command job's start, a re-placement)."""
        return ResolvedJob.resolve(self.job.spec)

    def layout_of(self, slots: list[RankAssignment]) -> JobSpecBody:
        """The body the ranks run on a plan of `slots`' size; ValueError when the job has no layout of that size."""
        body = layout_on(self.job.spec, len(slots))
        if body is None:
            elastic = "" if self.job.spec.scheduling.elastic is None else ", or an elastic layout of that size"
            raise ValueError(f"the job has no layout on {len(slots)} GPUs (resources.gpus {self.job.spec.resources.gpus}{elastic})")
        return body

    # ---- after a node loss -----------------------------------------------------------------------

    def await_plan(self, lost: list[str], generation: int, timeout: float | None, stopped: Callable[[], str | None]) -> str | None:
        """Record a REPLAN event and wait for a plan off the `lost` nodes: from `adopt`, or from the solver when
        there is a topology map (an elastic job's smaller layout when the whole one does not fit). None once
        one is adopted; else why not: `stopped()`'s answer, or the `timeout` (seconds) passed."""
        ranks = ",".join(str(slot.rank) for slot in self.slots if slot.node in lost)
        source = "on the GPUs free in Ray" if self.topology is not None else "from the scheduler"
        with self._lock:
            self.awaiting = lost
            self._ready.clear()
        self._log.append(
            EventKind.REPLAN, generation=generation, lost_nodes=lost,
            message=f"node(s) {', '.join(lost)} left the Ray cluster; waiting for a new placement of rank(s) {ranks} {source}",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting_logged = False
        while not self._ready.is_set():
            why = stopped()
            if why is not None:
                return why
            if self.topology is not None:
                slots = replacement_or_shrunk(self.resolved, self.topology, free_slots(cuda=self.use_gpu), lost)
                if slots is not None:
                    self.adopt(slots, generation)
                    continue
                if not waiting_logged:
                    waiting_logged = True
                    self._log.append(
                        EventKind.LOG, generation=generation,
                        message=f"no room for {self.job.spec.resources.gpus} ranks off node(s) {', '.join(lost)}; waiting for free GPUs",
                    )
            if deadline is not None and time.monotonic() > deadline:
                with self._lock:
                    if self._ready.is_set():
                        return None
                    self.awaiting = None
                return f"no new placement without node(s) {', '.join(lost)} within {timeout:g}s (replan_timeout)"
            self._ready.wait(REPLAN_INTERVAL)
        return None

    def adopt(self, slots: list[RankAssignment], generation: int) -> bool:
        """Make `slots` the plan when one is awaited (a PLAN event says what moved); False otherwise. ValueError
        when it uses a lost node or has a size the job has no layout of."""
        with self._lock:
            lost = self.awaiting
            if lost is None:
                return False
            on_lost = sorted({slot.node for slot in slots} & set(lost))
            if on_lost:
                raise ValueError(f"the new plan uses lost node(s) {', '.join(on_lost)}")
            ordered = sorted(slots, key=lambda slot: slot.rank)
            self._record(ordered, lost, describe_move(self.slots, ordered, lost), generation)
            self.awaiting = None
            self._ready.set()
        return True

    # ---- a change of size while running ----------------------------------------------------------

    def ask_resize(self, slots: list[RankAssignment], generation: int) -> bool:
        """Take a plan of another size for the next generation (the caller stops the ranks); False while a
        plan is awaited or another resize is pending. ValueError for the current size or one with no layout."""
        if len(slots) == len(self.slots):
            raise ValueError(f"the job runs on {len(slots)} GPUs already; resizing needs a plan of another size")
        self.layout_of(slots)
        with self._lock:
            if self.awaiting is not None or self.resize_to is not None:
                return False
            self.resize_to = sorted(slots, key=lambda slot: slot.rank)
        self._log.append(
            EventKind.LOG, generation=generation,
            message=f"{self.resize_line(len(slots))}: stopping at the next step boundary with a checkpoint",
        )
        return True

    def take_resize(self, generation: int) -> bool:
        """Make a pending resize's plan the plan (a PLAN event); False when none is pending."""
        with self._lock:
            slots, self.resize_to = self.resize_to, None
            if slots is not None:
                self._record(slots, [], f"{self.resize_line(len(slots))}: new plan {describe_plan(slots)}", generation)
        return slots is not None

    def resize_line(self, gpus: int) -> str:
        """``growing back to 4 GPUs`` (or ``growing`` / ``shrinking to``)."""
        verb = "growing back" if gpus == self.job.spec.resources.gpus else ("growing" if gpus > len(self.slots) else "shrinking")
        return f"{verb} to {gpus} GPUs"

    @property
    def shrunk(self) -> bool:
        """Whether the job runs on fewer GPUs than it asked for, with no new plan or resize under way."""
        return len(self.slots) < self.job.spec.resources.gpus and self.awaiting is None and self.resize_to is None

    def growth(self) -> list[RankAssignment] | None:
        """With a topology map, a look every `REPLAN_INTERVAL`: the plan of the whole layout on the GPUs free in
        Ray and the job's own, once it fits; None otherwise."""
        if self.topology is None or time.monotonic() < self._growth_looked + REPLAN_INTERVAL:
            return None
        self._growth_looked = time.monotonic()
        return grown_plan(self.resolved, self.topology, free_slots(cuda=self.use_gpu), self.slots)

    def _record(self, slots: list[RankAssignment], lost: list[str], message: str, generation: int) -> None:
        body = self.layout_of(slots)
        self._log.append(
            EventKind.PLAN, generation=generation, lost_nodes=lost, message=message, placement=[s.model_dump() for s in slots],
        )
        if body.parallelism != self.body.parallelism:
            self._log.append(EventKind.LOG, generation=generation, message=layout_line(self.job.spec, self.body, body))
        self.slots, self.body = slots, body
