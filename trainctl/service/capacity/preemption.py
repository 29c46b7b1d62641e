"""Preemption: when the first job in the queue does not fit, stop running jobs to make room for it, at the
least lost work: jobs of lower priority, and jobs of tenants borrowing beyond their guaranteed share.

A running job may be chosen (a victim) when its spec allows it (`scheduling.preemptible`), it resumes
from checkpoints (an engine job with `checkpoint.resume`; a command job is trusted to save on SIGTERM, as
torchrun programs are), and either

- its priority is lower than the waiting job's and it was not preempted in the last
  `PreemptionPolicy.cooldown_seconds` (a job just preempted is not chosen again at once, so priority
  preemptions do not cascade back and forth); or
- the waiting job's tenant stays within its `guaranteed_gpus` with it, and the victim's tenant is another
  one: the guarantee is reclaimed whatever the priorities (Kueue's `reclaimWithinCohort: Any`, the whole
  cluster one cohort).

Either way, a job of another tenant is taken only while its tenant holds more than its own guarantee
(borrowing idle GPUs), and only down to that guarantee: what a tenant is guaranteed no other tenant's job
preempts, whatever its priority, so a reclaim and a priority preemption never take the same GPUs back and
forth. Without guarantees every tenant only borrows.

A victim's cost is the work a crash would lose: its GPUs times the seconds since its newest checkpoint
(its start when it has none). Victims are taken cheapest first (then lowest priority, then the newest)
until the solver places the waiting job on the free GPUs plus theirs; then any victim the placement does
not need is put back, the costliest first (at most `PLACEMENT_TRIALS` solver runs in all). Each victim is recorded PREEMPTED with a reason naming the
waiting job; following it sends the preemption to its supervisor (every rank checkpoints at its next step
boundary and stops, or is stopped after `PreemptionPolicy.grace_seconds`), and once its run has ended it
is queued again (`SchedulerState.requeue`) to resume from that checkpoint. The waiting job keeps the head
of the queue meanwhile, and no further victim is chosen for it while its victims stop.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from trainctl.service import store as st
from trainctl.service.scheduling.state import SchedulerState
from trainctl.service.store import JobRecord, QueuedJob
from trainctl.workers.events import ACTIVE_STATES, JobState

PLACEMENT_TRIALS = 8
"""Most placements one decision tries (each is a solver run over the map: ~0.15 s at 1,024 nodes); a
decision that needs more preempts nothing, and one that runs out while putting victims back keeps them."""


@dataclass(frozen=True)
class _Candidate:
    """A running job that may be preempted for the waiting one, and why."""

    record: JobRecord
    reclaims: bool
    """Chosen to give back GPUs its tenant borrows beyond its guarantee (else: for its lower priority)."""

    @property
    def gpus(self) -> int:
        return self.record.job.spec.resources.gpus


@dataclass
class Preemption:
    """Chooses and records victims for the job at the head of the queue (`make_room`)."""

    state: SchedulerState

    def make_room(self, entry: QueuedJob, down: Collection[str]) -> str | None:
        """Preempt running jobs so that `entry`, which does not fit, can be placed; its waiting reason
        while they stop, or None when preemption cannot make room for it (or is off)."""
        state = self.state
        stopping = sorted(v for v, waiting in state.preempting.items() if waiting == entry.id and v in state.active)
        if not stopping:
            if not state.preemption.enabled:
                return None
            stopping = [victim.id for victim in self._choose(entry, down)]
            if not stopping:
                return None
        gpus = entry.job.spec.resources.gpus
        return f"waiting for {gpus} GPUs held by preempted job(s) {', '.join(stopping)}, which checkpoint and stop"

    def _choose(self, entry: QueuedJob, down: Collection[str]) -> list[JobRecord]:
        """Record the victims that make room for `entry` PREEMPTED; none when no set of them does (within
        `PLACEMENT_TRIALS` placements)."""
        state = self.state
        job = state.resolved_job(entry.id, entry.job)
        needed = entry.job.spec.resources.gpus - len(state.pool.free_slots(down=down))
        running = self._preemptible()
        guarantees = any(self._guaranteed(t) for t in {entry.tenant} | {r.tenant for r in running})
        held = self._held_by_tenant() if guarantees else None
        trials = PLACEMENT_TRIALS

        def fits(victims: list[_Candidate]) -> bool:
            nonlocal trials
            trials -= 1
            return state.pool.place(job, down=down, releasing=[c.record.id for c in victims]) is not None

        chosen: list[_Candidate] = []
        freed = 0
        for candidate in sorted(self._candidates(entry, running, held), key=self._order):
            tenant = candidate.record.tenant
            if held is not None and tenant != entry.tenant:
                if held[tenant] <= self._guaranteed(tenant):
                    continue  # what its tenant holds now is its guarantee, which no other tenant takes
                held[tenant] -= candidate.gpus
            chosen.append(candidate)
            freed += candidate.gpus
            if freed >= needed:
                if trials == 0:
                    return []  # out of placements before one fitted
                if fits(chosen):
                    break
        else:
            return []
        for candidate in sorted(chosen, key=self._order, reverse=True):  # put back what the placement does not need
            rest = [c for c in chosen if c is not candidate]
            if trials > 0 and freed - candidate.gpus >= needed and fits(rest):
                chosen, freed = rest, freed - candidate.gpus
        return [c.record for c in chosen if self._preempt(c, entry)]

    def _preemptible(self) -> list[JobRecord]:
        """The RUNNING jobs that may be preempted at all: allowed by their spec, resuming from checkpoints,
        followed here and not already stopping or waiting to be re-placed."""
        state = self.state
        found = []
        for record in state.store.list_jobs(states=[JobState.RUNNING]):
            spec = record.job.spec
            if not spec.scheduling.preemptible or (spec.command is None and not spec.checkpoint.resume):
                continue
            if record.id not in state.active or record.id in state.unlaunched or record.id in state.preempting:
                continue
            if not state.active[record.id].replan_waiting:
                found.append(record)
        return found

    def _candidates(self, entry: QueuedJob, running: list[JobRecord], held: Counter[str] | None) -> list[_Candidate]:
        """The jobs of `running` that `entry` may preempt (the module docstring says which), given the GPUs
        each tenant holds (None: no tenant involved has a guarantee, so none is protected or reclaimed)."""
        now = time.time()
        cooldown = self.state.preemption.cooldown_seconds
        reclaiming = held is not None and held[entry.tenant] + entry.job.spec.resources.gpus <= self._guaranteed(entry.tenant)
        found = []
        for record in running:
            cooled = record.preempt_time is None or now - record.preempt_time >= cooldown
            if record.priority < entry.priority and cooled:
                found.append(_Candidate(record, reclaims=False))
            elif reclaiming and record.tenant != entry.tenant:
                found.append(_Candidate(record, reclaims=True))
        return found

    def _held_by_tenant(self) -> Counter[str]:
        """GPUs each tenant's active jobs hold, those being preempted left out (they are on their way out)."""
        held: Counter[str] = Counter()
        for record in self.state.store.list_jobs(states=ACTIVE_STATES - {JobState.PREEMPTED}):
            held[record.tenant] += record.job.spec.resources.gpus
        return held

    def _guaranteed(self, tenant: str) -> int:
        return self.state.quota_of(tenant).guaranteed_gpus or 0

    def _order(self, candidate: _Candidate) -> tuple[float, int, int]:
        """Cheapest first: lost work (GPUs x seconds since the newest checkpoint), then lower priority,
        then the newer job."""
        record = candidate.record
        active = self.state.active[record.id]
        since = active.checkpoint_time or record.start_time or record.schedule_time or record.create_time
        return candidate.gpus * max(0.0, time.time() - since), record.priority, -record.seq

    def _preempt(self, candidate: _Candidate, entry: QueuedJob) -> bool:
        """Record the candidate PREEMPTED for `entry` (following it sends the preemption); False when it
        left RUNNING meanwhile."""
        state, victim = self.state, candidate.record
        if candidate.reclaims:
            why = f"preempted by job {entry.id}, whose tenant {entry.tenant!r} reclaims GPUs within its guaranteed share"
        else:
            why = f"preempted by job {entry.id} (priority {entry.priority})"
        updated = state.store.update_status(
            victim.id, expect=[JobState.RUNNING], state=JobState.PREEMPTED, reason=f"{why}: checkpointing at its next step boundary",
        )
        if updated is None:
            return False
        state.preempting[victim.id] = entry.id
        state.nominated.add(entry.id)
        borrowed = f", borrowed beyond tenant {victim.tenant!r}'s guarantee" if candidate.reclaims else ""
        state.store.append_event(entry.id, st.EVENT_LOG, {
            "level": "INFO",
            "message": f"preempting job {victim.id} (priority {victim.priority}, {candidate.gpus} GPUs{borrowed}) to make room",
        })
        if state.metrics is not None:
            state.metrics.set_job_state(updated.id, updated.tenant, updated.state)
            state.metrics.record_preemption(updated.id, updated.tenant)
        return True
