"""Admission: one pass over the queue in order (priority descending, then submission order), gang
placement, tenants' quotas, the reservation and the run directory of each admitted job, its launch.

The queue is strict: a job that does not fit blocks lower ones, so a large job is never starved by a
stream of small ones, and may preempt running jobs of lower priority to make room
(capacity.preemption); a job its tenant's quota holds blocks that tenant's lower ones (not other
tenants'); a running job waiting to be re-placed blocks them all. Nodes Ray does not have alive are left
out; with autoscaling on, a head of the queue they would hold has them asked for (capacity.autoscaling).
A waiting job's reason says what it waits for. An admitted job's run directory
(trainctl.parallelism.run_directory) is named here, once, and recorded with its placement; every later
start and re-attach hands the runtime that recorded one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.capacity.autoscaling import Autoscaling
from trainctl.service.capacity.preemption import Preemption
from trainctl.service.scheduling.launching import Launcher
from trainctl.service.scheduling.state import ActiveJob, SchedulerState
from trainctl.service.security.tenancy import TenantUsage, start_block_reason
from trainctl.service.store import QueuedJob
from trainctl.workers.events import ACTIVE_STATES, JobState

QUEUE_PAGE = 64
"""Queued jobs the admission pass reads at a time (it stops at the first job that does not fit)."""


@dataclass
class Admission:
    """Starts queued jobs that fit, in order; `admit()` is one pass."""

    state: SchedulerState
    launcher: Launcher
    preemption: Preemption
    autoscaling: Autoscaling | None = None
    """None: autoscaling is off (the default); nodes Ray lacks are waited for, never asked for."""

    def admit(self) -> None:
        """One pass over the queue: start jobs in order until one does not fit; that one and every job
        behind it get their waiting reason in one write, so a pass reads and writes the same few rows
        however long the queue is."""
        state = self.state
        down = state.down_nodes()
        if self.autoscaling is not None:
            self.autoscaling.start_pass()
        self._admit_all(down)
        if self.autoscaling is not None:  # not after a failed pass: what it needed is not known
            self.autoscaling.finish_pass(down)

    def _admit_all(self, down: set[str]) -> None:
        """The pass itself, the nodes Ray lacks (`down`) left out."""
        state = self.state
        usage: dict[str, TenantUsage] = {}
        held: dict[str, str] = {}
        replacing = next((job_id for job_id, active in state.active.items() if active.replan_waiting), None)
        if replacing is not None:  # the GPUs that free up re-place it first, nominated jobs' included
            reason = f"waiting behind {replacing}, which waits for GPUs to re-place it after a node loss"
            state.store.set_queue_reason(reason, behind=None)
            return
        self._admit_nominated(down, usage, held)
        queue = self._queue()
        first = next(queue, None)
        if first is None:
            self._forget_unqueued(set())
            return
        visited: set[str] = set()
        try:
            for entry in itertools.chain([first], queue):
                visited.add(entry.id)
                if not self._admit(entry, down, usage, held):
                    return
        finally:
            self._forget_unqueued(visited)

    def _admit_nominated(self, down: set[str], usage: dict[str, TenantUsage], held: dict[str, str]) -> None:
        """Start the queued jobs that running jobs were preempted for, wherever they are in the queue, once
        the GPUs they wait for are free: a tenant reclaiming its guarantee may stand behind the borrower it
        preempted, which is queued again with its higher priority."""
        state = self.state
        for job_id in sorted(state.nominated):
            record = state.store.get_job(job_id)
            if record.state != JobState.QUEUED:
                state.nominated.discard(job_id)
                continue
            entry = QueuedJob(id=record.id, seq=record.seq, priority=record.priority, tenant=record.tenant,
                              reason=record.reason, job=record.job)
            if self._admit(entry, down, usage, held, head=False):
                state.nominated.discard(job_id)

    def _forget_unqueued(self, visited: set[str]) -> None:
        """Drop the resolved jobs of jobs neither followed nor met by this pass: they left the queue."""
        state = self.state
        for job_id in set(state.resolved) - visited - set(state.active):
            del state.resolved[job_id]

    def _admit(
        self, entry: QueuedJob, down: set[str], usage: dict[str, TenantUsage], held: dict[str, str], head: bool = True,
    ) -> bool:
        """Start `entry` if its quota and the free GPUs allow. In the queue walk (`head`): False when it
        blocks the rest of the queue. Out of it (a nominated job): whether it started; one that does not
        fit changes nothing."""
        state = self.state
        gpus = entry.job.spec.resources.gpus
        quota_reason = self._quota_reason(entry, usage, held)
        if quota_reason is not None:
            self._wait(entry, quota_reason)
            self._decision("quota")
            return head  # a tenant held by its quota does not block other tenants
        started = time.perf_counter()
        placement = state.pool.place(state.resolved_job(entry.id, entry.job), down=down)
        solver_seconds = time.perf_counter() - started
        if placement is None and not head:
            return False
        if placement is None:
            preempting = self.preemption.make_room(entry, down)
            scaling = None
            if not preempting and self.autoscaling is not None:
                scaling = self.autoscaling.need(entry.id, state.resolved_job(entry.id, entry.job), down)
            free = len(state.pool.free_slots(down=down))
            self._wait(entry, preempting or scaling or f"waiting for {gpus} GPUs: {free} of {state.pool.total} free")
            decision = "preempting" if preempting else "scaling_up" if scaling else "no_capacity"
            self._decision(decision, solver_seconds)
            behind = f"waiting behind {entry.id} (priority {entry.priority}), first in the queue"
            state.store.set_queue_reason(behind, behind=entry)
            return False
        state.pool.reserve(entry.id, placement)
        nodes = sorted({a.node for a in placement.assignments})
        updated = state.store.update_status(
            entry.id, expect=[JobState.QUEUED], state=JobState.SCHEDULED,
            reason=f"placed {len(placement.assignments)} ranks on {', '.join(nodes)}", schedule_time=time.time(),
            placement=placement.records(), run_dir=str(RunDirectory.of_job(state.runs_dir, entry.id).root),
        )
        if updated is None:  # cancelled meanwhile
            state.pool.release(entry.id)
            return True
        usage.pop(entry.tenant)  # it runs more now
        self._decision("started", solver_seconds)
        if state.metrics is not None:
            state.metrics.set_job_state(updated.id, updated.tenant, updated.state)
            state.metrics.set_job_placement(updated.id, updated.tenant, state.by_domain(placement))
        cursor = int(updated.runtime_cursor or 0)  # a preempted job's log goes on where it was followed to
        state.active[entry.id] = ActiveJob(cursor=cursor, stored_cursor=cursor)
        self.launcher.launch(updated, placement)
        return True

    def _quota_reason(self, entry: QueuedJob, usage: dict[str, TenantUsage], held: dict[str, str]) -> str | None:
        """Why `entry` waits for its tenant's quota in this pass, or None: the first of a tenant's jobs
        that the quota holds (recorded in `held`, tenant -> job id) holds the tenant's later ones too, so
        its smaller jobs never overtake it. `usage` caches each tenant's usage for the pass."""
        tenant = entry.tenant
        if tenant in held:
            return f"waiting behind {held[tenant]}, held by tenant {tenant!r}'s quota"
        if tenant not in usage:
            usage[tenant] = self._usage(tenant)
        reason = start_block_reason(tenant, self.state.quota_of(tenant), usage[tenant], entry.job.spec.resources.gpus)
        if reason is not None:
            held[tenant] = entry.id
        return reason

    def _queue(self) -> Iterator[QueuedJob]:
        """The queue in admission order, read a page at a time as the pass walks it."""
        after = None
        while True:
            page = self.state.store.queue(after=after, limit=QUEUE_PAGE)
            yield from page
            if len(page) < QUEUE_PAGE:
                return
            after = page[-1]

    def _usage(self, tenant: str) -> TenantUsage:
        store = self.state.store
        active = store.list_jobs(tenant=tenant, states=ACTIVE_STATES)
        queued = store.count_by_state(tenant).get(JobState.QUEUED, 0)
        return TenantUsage(queued_jobs=queued, running_gpus=sum(r.job.spec.resources.gpus for r in active))

    def _decision(self, decision: str, solver_seconds: float | None = None) -> None:
        if self.state.metrics is not None:
            self.state.metrics.observe_scheduling(decision, solver_seconds)

    def _wait(self, entry: QueuedJob, reason: str) -> None:
        if entry.reason != reason:
            self.state.store.update_status(entry.id, expect=[JobState.QUEUED], reason=reason)
