"""The sweep RPCs of the TrainingService (CreateSweep, GetSweep, ListSweeps, CancelSweep, WatchSweep).

`trainctl.service.api.servicer.TrainingServicer` holds one `SweepRpcs` and hands these calls to it: the same
tenancy (another tenant's sweep is NOT_FOUND), the same job checks for the template (its fields named
`spec.template.*`), and the sweep's own rules (trainctl.spec.sweep.sweep_violations) plus the tenant's
quota against `parallel_trials`.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.fit import fit_violations
from trainctl.planning.pool import GpuPool
from trainctl.service.api.async_bridge import wait_for_store_change
from trainctl.service.api.owned_records import MAX_ID_LENGTH, owned_record
from trainctl.service.api.paging import page_size
from trainctl.service.scheduling.sweeps import SweepDriver
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.hardening import MAX_REASON_LENGTH, check_text
from trainctl.service.security.tenancy import Principal, Quota
from trainctl.service.store import (
    JobRecord,
    JobStore,
    RequestReused,
    SweepNotFound,
    SweepRecord,
    SweepState,
    TrialRecord,
    TrialState,
)
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep, sweep_violations
from trainctl.spec.validate import FieldViolation, SpecError
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import request_digest, timestamp
from trainctl.wire.errors import (
    bad_field,
    failed_precondition,
    invalid_argument,
    reused_request_id,
    service_stopping,
)
from trainctl.wire.sweep_convert import sweep_from_proto, sweep_to_proto, value_to_proto
from trainctl.workers.events import JobState

WATCH_POLL_SECONDS = 0.5


def quota_violations(sweep: Sweep, tenant: str, quota: Quota) -> list[FieldViolation]:
    """`spec.parallel_trials` against the tenant's quota: the trials that run at once must fit its
    running GPUs, and the trials waiting at once its queued jobs."""
    parallel, gpus = sweep.spec.parallel_trials, sweep.spec.template.resources.gpus
    out = []
    if quota.running_gpus is not None and parallel * gpus > quota.running_gpus:
        out.append(FieldViolation("spec.parallel_trials", (
            f"{parallel} trials of {gpus} GPUs need {parallel * gpus} GPUs at once; quota running_gpus of "
            f"tenant {tenant!r} is {quota.running_gpus}"
        )))
    if quota.queued_jobs is not None and parallel > quota.queued_jobs:
        out.append(FieldViolation("spec.parallel_trials", (
            f"{parallel} trials may wait in the queue at once; quota queued_jobs of tenant {tenant!r} is {quota.queued_jobs}"
        )))
    return out


@dataclass
class SweepRpcs:
    """The sweep handlers, given what they use of the service."""

    store: JobStore
    pool: GpuPool
    auth: Authenticator
    checked: Callable[[TrainingJob, Principal], tuple[TrainingJob, ResolvedJob | None, list[FieldViolation]]]
    """The servicer's checks of a job (`TrainingServicer._checked`), applied to the sweep's template."""
    cancel_job: Callable[[str, str], JobRecord]
    """Cancels a job with a reason (`Scheduler.request_cancel`)."""
    stopping: threading.Event
    """Set while the service stops: a WatchSweep ends UNAVAILABLE."""
    sweeps: SweepDriver | None = None
    """The sweep driver, woken when a sweep is created (None: sweeps wait for its next pass)."""

    def _sweep(self, sweep_id: str, principal: Principal) -> SweepRecord:
        return owned_record("sweep", sweep_id, principal, self.store.get_sweep, SweepNotFound)

    def _sweep_message(self, record: SweepRecord) -> pb.Sweep:
        """The sweep with its trials' jobs' states, read by the trials' own job ids: not by the sweep's
        label, which any tenant's job may carry (one per trial, however many jobs carry it)."""
        jobs = {}
        for trial in record.trials:
            if trial.job_id:
                job = self.store.get_job(trial.job_id)
                jobs[job.id] = (job.state, job.steps_done)
        return sweep_record_to_proto(record, jobs)

    def _valid_sweep(self, message: pb.Sweep, principal: Principal) -> Sweep:
        """The request's sweep with its template's paths resolved, or INVALID_ARGUMENT naming each field."""
        try:
            sweep = sweep_from_proto(message)
        except SpecError as exc:
            raise invalid_argument(exc.violations, "invalid sweep: " + str(exc)) from None
        violations = sweep_violations(sweep, pool_gpus=self.pool.total)
        if not violations:
            job, resolved, problems = self.checked(TrainingJob(metadata=sweep.metadata, spec=sweep.spec.template), principal)
            problems = problems or ([] if resolved is None else fit_violations(resolved, self.pool))
            violations += [FieldViolation("spec.template" + v.field.removeprefix("spec"), v.description) for v in problems]
            sweep = sweep.model_copy(update={"spec": sweep.spec.model_copy(update={"template": job.spec})})
        violations += quota_violations(sweep, principal.tenant, self.auth.quota(principal.tenant))
        if violations:
            raise invalid_argument(violations, "invalid sweep: " + "; ".join(map(str, violations)))
        return sweep

    def CreateSweep(self, request: pb.CreateSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        if not request.HasField("sweep"):
            raise bad_field("sweep", "the sweep to create is required")
        check_text("request_id", request.request_id, MAX_ID_LENGTH)
        digest = request_digest(request.sweep)
        try:
            retried = self.store.sweep_of_request(principal.tenant, request.request_id, digest) if request.request_id else None
            if retried is not None:  # answered its sweep, whatever the checks would say now
                return self._sweep_message(retried)
            sweep = self._valid_sweep(request.sweep, principal)
            record, _created = self.store.create_sweep(
                sweep, tenant=principal.tenant, request_id=request.request_id or None, digest=digest
            )
        except RequestReused as reused:
            raise reused_request_id(f"sweep {reused}") from None
        if self.sweeps is not None:
            self.sweeps.wake()
        return self._sweep_message(record)

    def GetSweep(self, request: pb.GetSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        return self._sweep_message(self._sweep(request.id, principal))

    def ListSweeps(self, request: pb.ListSweepsRequest, principal: Principal) -> pb.ListSweepsResponse:  # noqa: N802
        size = page_size(request.page_size)
        before = None
        if request.page_token:
            if not re.fullmatch(r"[0-9]{1,18}", request.page_token):  # ASCII digits: isdigit() takes '²'
                raise bad_field("page_token", "not a token this server issued (pass next_page_token unchanged)")
            before = int(request.page_token)
        records = self.store.list_sweeps(tenant=principal.tenant_filter(), limit=size + 1, before_seq=before)
        response = pb.ListSweepsResponse(sweeps=[self._sweep_message(r) for r in records[:size]])
        if len(records) > size:
            response.next_page_token = str(records[size - 1].seq)
        return response

    def CancelSweep(self, request: pb.CancelSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        record = self._sweep(request.id, principal)
        check_text("reason", request.reason, MAX_REASON_LENGTH)
        if record.state in (SweepState.SUCCEEDED, SweepState.FAILED):
            raise failed_precondition(f"sweep {record.id} already ended {record.state}")
        reason = request.reason or f"sweep cancelled by {principal.name}"
        self.store.finish_sweep(record.id, SweepState.CANCELLED, reason)
        record = self.store.get_sweep(record.id)
        for trial in record.trials:
            if trial.state == TrialState.CANCELLED and trial.job_id:
                job = self.store.get_job(trial.job_id)
                if job.state in (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING):
                    self.cancel_job(trial.job_id, trial.reason)
        return self._sweep_message(record)

    async def WatchSweep(self, request: pb.WatchSweepRequest, principal: Principal) -> AsyncIterator[pb.Sweep]:  # noqa: N802
        """The sweep as it is, then again each time it changes, until it ends or the service stops. Its
        reads are a read-only transaction of several statements, so they run on the server's thread pool."""
        loop = asyncio.get_running_loop()
        record = await loop.run_in_executor(None, self._sweep, request.id, principal)
        last = b""
        while True:
            record, message = await loop.run_in_executor(None, self._sweep_snapshot, record.id)
            serialized = message.SerializeToString(deterministic=True)
            if serialized != last:
                last = serialized
                yield message
            if record.state.terminal:
                return
            if self.stopping.is_set():  # UNAVAILABLE, not OK: the sweep goes on, the client resumes elsewhere
                raise service_stopping(f"watch sweep {record.id} again")
            await wait_for_store_change(self.store, WATCH_POLL_SECONDS)

    def _sweep_snapshot(self, sweep_id: str) -> tuple[SweepRecord, pb.Sweep]:
        record = self.store.get_sweep(sweep_id)
        return record, self._sweep_message(record)


# ---- a stored sweep as the API's answer ------------------------------------------------------------


def best_trial(record: SweepRecord) -> TrialRecord | None:
    """The COMPLETE trial with the best objective (the lowest number among equals), or None. A NaN
    objective (recorded before NaN failed a trial) is never the best."""
    complete = [
        t for t in record.trials if t.state == TrialState.COMPLETE and t.objective is not None and not math.isnan(t.objective)
    ]
    if not complete:
        return None
    sign = -1.0 if record.sweep.spec.objective.direction == "maximize" else 1.0
    return min(complete, key=lambda t: (sign * t.objective, t.number))


def sweep_record_to_proto(record: SweepRecord, jobs: dict[str, tuple[JobState, int]]) -> pb.Sweep:
    """A stored sweep as the API's Sweep; `jobs` maps each trial job id to its (state, steps done)."""
    message = sweep_to_proto(record.sweep)
    message.id = record.id
    status = message.status
    status.state = pb.SweepState.Value(f"SWEEP_STATE_{record.state}")
    status.reason = record.reason
    for name in ("create_time", "update_time", "end_time"):
        timestamp(getattr(status, name), getattr(record, name))
    for trial in record.trials:
        item = status.trials.add(number=trial.number, job_id=trial.job_id or "", reason=trial.reason)
        item.state = pb.TrialState.Value(f"TRIAL_STATE_{trial.state}")
        for path, value in trial.params.items():
            value_to_proto(value, item.params[path])
        if trial.objective is not None:
            item.objective = trial.objective
        if trial.objective_step is not None:
            item.objective_step = trial.objective_step
        if trial.job_id in jobs:
            job_state, steps = jobs[trial.job_id]
            item.job_state = pb.JobState.Value(job_state)
            item.steps_done = steps
        timestamp(item.create_time, trial.create_time)
        timestamp(item.end_time, trial.end_time)
    best = best_trial(record)
    if best is not None and best.objective is not None:
        status.best_trial = best.number
        status.best_objective = best.objective
    return message
