"""The TrainingService servicer: request checks, tenancy, and the store/scheduler calls behind each RPC.

Each method takes the request and the caller's Principal (authenticated by trainctl.service.api.rpc_calls,
which also runs the method: the methods in `BLOCKING` on a thread of the server's pool, the other unary
ones on its event loop, the coroutines and streams on it too, handing their blocking parts to the pool). Handlers raise `ApiError`
(trainctl.wire.errors), which becomes the call's status. A job of another tenant is NOT_FOUND to a
user, so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc

from trainctl.parallelism.checkpoint.source import init_from_problem
from trainctl.parallelism.layouts.grid import LayoutError
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.fit import fit_violations
from trainctl.planning.plan import plan_response
from trainctl.planning.pool import GpuPool
from trainctl.service import store as st
from trainctl.service.api import job_messages
from trainctl.service.api.async_bridge import store_read
from trainctl.service.api.job_messages import JobMessages, full_view, step_to_proto
from trainctl.service.api.owned_records import MAX_ID_LENGTH, owned_record
from trainctl.service.api.paging import page_size
from trainctl.service.api.sweep_rpcs import SweepRpcs
from trainctl.service.api.watch_hub import EventHub, WatchFailed, WatchStopped
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.scheduling.sweeps import SweepDriver
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.hardening import MAX_REASON_LENGTH, check_text
from trainctl.service.security.paths import JobPathPolicy, job_reference
from trainctl.service.security.tenancy import Principal, admission_violation, tenant_shares
from trainctl.service.store import (
    AdmissionRefused,
    JobNotFound,
    JobRecord,
    JobStore,
    RequestReused,
    StoreUnavailable,
)
from trainctl.service.tracking.policy import TrackingPolicy
from trainctl.spec.bounds import INT64_MAX
from trainctl.spec.data_checks import data_violations, evaluation_data_violations
from trainctl.spec.job import TrainingJob
from trainctl.spec.model_checks import pretrained_check, pretrained_warnings
from trainctl.spec.presets import ModelConfig, UnknownPresetError
from trainctl.spec.validate import FieldViolation, SpecError, semantic_violations, working_dir_violations
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_from_proto, request_digest, timestamp
from trainctl.wire.errors import (
    ApiError,
    bad_field,
    failed_precondition,
    invalid_argument,
    reused_request_id,
    service_stopping,
)
from trainctl.wire.plan_convert import plan_to_proto
from trainctl.workers.events import ACTIVE_STATES, JobState

MAX_LABEL_FILTERS = 32
MAX_PAGE_TOKEN_LENGTH = 64
"""Longer than any ListJobs page token the server issues (44 characters at most)."""
WATCH_IDLE_CHECK_SECONDS = 5.0
"""A following WatchJob with nothing to send re-checks that the service is not stopping this often; it
is woken at once by new events and by the service stopping (`EventHub.wake_all`)."""


class TrainingServicer:
    """Implements trainctl.v1.TrainingService over a JobStore, a Scheduler and a GpuPool (the sweep RPCs are
    handed to a `trainctl.service.api.sweep_rpcs.SweepRpcs`, the sweeps driven by a SweepDriver)."""

    BLOCKING = frozenset({"CancelJob", "PlanJob", "GetCluster", "CreateSweep", "GetSweep", "ListSweeps", "CancelSweep"})
    """Unary methods that may block (a write's commit, a call to Ray, the sweep reads: a read-only
    transaction of a statement per sweep and one for its trials, PlanJob's checks of the files a job
    names): they run on the server's thread pool. The other plain methods only read the store and
    compute; the async ones (CreateJob, GetJob, the streams) hand their own blocking parts to the pool."""

    def __init__(
        self,
        store: JobStore,
        scheduler: Scheduler,
        pool: GpuPool,
        authenticator: Authenticator,
        *,
        paths: JobPathPolicy | None = None,
        stopping: threading.Event | None = None,
        ray_nodes: Callable[[], dict[str, bool]] | None = None,
        sweeps: SweepDriver | None = None,
        tracking: TrackingPolicy | None = None,
    ):
        self.store = store
        self.scheduler = scheduler
        self.pool = pool
        self.auth = authenticator
        self.paths = paths or JobPathPolicy((), scheduler.runs_dir)
        """The confinement rule for every path a job names (no data roots unless the service has some)."""
        self.tracking = tracking or TrackingPolicy.of_service(None, [])
        """The MLflow servers jobs may name, and whether TensorBoard files can be written."""
        self.stopping = stopping or threading.Event()
        self.ray_nodes = ray_nodes
        self.watch_hub: EventHub[pb.JobEvent] = EventHub(
            store, event_to_proto, stopping=self.stopping, poll_seconds=WATCH_IDLE_CHECK_SECONDS,
            expected_failures=(StoreUnavailable,),
        )
        """Following WatchJobs: one store reader per followed job, its events converted once for all."""
        self.jobs = JobMessages()
        """Answers' Job messages, each job's spec converted once."""
        self.sweep_rpcs = SweepRpcs(
            store, pool, authenticator, checked=self._checked, cancel_job=scheduler.request_cancel,
            stopping=self.stopping, sweeps=sweeps,
        )
        """The sweep RPCs' handlers (the methods below hand them the calls)."""

    # ---- helpers ----------------------------------------------------------------------------------
    def _job(self, job_id: str, principal: Principal) -> JobRecord:
        return owned_record("job", job_id, principal, self.store.get_job, JobNotFound)

    def _violations(
        self, message: pb.Job, principal: Principal
    ) -> tuple[TrainingJob | None, ResolvedJob | None, list[FieldViolation]]:
        """The request's job (its `init_from: job:<id>` resolved), resolved once (None while it breaks a
        rule), and everything wrong with it: schema, semantics, paths, data, and whether its ranks fit the
        pool's largest GPU (checked last: it is the only estimate, and needs a sane job)."""
        try:
            job = job_from_proto(message)
        except SpecError as exc:
            return None, None, exc.violations
        job, resolved, violations = self._checked(job, principal)
        if resolved is not None:
            violations = fit_violations(resolved, self.pool)
        return job, None if violations else resolved, violations

    def _validated(self, message: pb.Job, principal: Principal) -> tuple[TrainingJob, ResolvedJob]:
        """The request's job and its resolved job, valid in every respect `_violations` checks, or
        INVALID_ARGUMENT naming each field."""
        job, resolved, violations = self._violations(message, principal)
        if violations or job is None or resolved is None:
            raise invalid_argument(violations)
        return job, resolved

    def _checked(self, job: TrainingJob, principal: Principal) -> tuple[TrainingJob, ResolvedJob | None, list[FieldViolation]]:
        """`job` with its `init_from: job:<id>` resolved, the job resolved (its grid and model, config.json
        read once; None when a rule is broken), and every rule it breaks: the spec's semantics, the path
        rule (paths.JobPathPolicy) and then, only for paths it let through, the data and the init_from
        checkpoint or from_pretrained directory they name (exist, are readable, hold one sample, fit the
        model), every file opened inside them under the job's FileRule (trainctl.spec.files)."""
        violations = semantic_violations(job, pool_gpus=self.pool.total, check_data=False)
        violations += self.tracking.violations(job.spec.tracking)
        if job.spec.command is not None and not self.auth.may_run_commands(principal):
            violations.append(FieldViolation(
                "spec.command", f"tenant {principal.tenant!r} may not run programs of its own (command jobs): "
                "the operator lists the tenants that may under command_tenants in the access file"))
        confinement = self.paths.violations(job.spec, principal, self._tenant_of)
        if confinement:
            return job, None, violations + confinement
        reference = job_reference(job.spec.init_from)
        job = job.model_copy(update={"spec": self.paths.resolve(job.spec)})
        if job.spec.command is not None:
            violations += working_dir_violations(job.spec.command)
            return job, None if violations else _resolved(job, None, violations), violations
        files = self.paths.file_rule(job.spec, None, lambda job_id: self._owns(principal, job_id))
        violations += data_violations(job.spec.data, model_dir=job.spec.model.from_pretrained, files=files)
        violations += evaluation_data_violations(job.spec, files)
        model, problems = pretrained_check(job, files)
        violations += problems
        resolved = None if problems else _resolved(job, model, violations)
        if job.spec.init_from is not None and job.spec.init_from.strip() and resolved is not None:
            problem = init_from_problem(job.spec.init_from, resolved.config, files)
            if problem is not None:
                named = f"job {reference!r}" if reference is not None else repr(job.spec.init_from)
                violations.append(FieldViolation("spec.init_from", f"{named} names no usable checkpoint: {problem}"))
        return job, None if violations else resolved, violations

    def _tenant_of(self, job_id: str) -> str | None:
        if len(job_id) > MAX_ID_LENGTH:
            return None
        try:
            return self.store.get_job(job_id).tenant
        except JobNotFound:
            return None

    # ---- RPCs ---------------------------------------------------------------------------------------
    async def CreateJob(self, request: pb.CreateJobRequest, principal: Principal) -> pb.Job:  # noqa: N802
        """Checked and committed in one call on the thread pool: the checks read the file system (a
        dataset's glob may walk a large tree), which must never hold up the event loop's other calls."""
        if not request.HasField("job"):
            raise bad_field("job", "the job to create is required")
        check_text("request_id", request.request_id, MAX_ID_LENGTH)
        record = await asyncio.get_running_loop().run_in_executor(None, self._retried_or_created, request, principal)
        self.scheduler.wake()
        return self.jobs.message(record)

    def _retried_or_created(self, request: pb.CreateJobRequest, principal: Principal) -> JobRecord:
        """CreateJob's whole work in one call: the retried job, else the request's job checked and
        committed. A request id sent again with another job is INVALID_ARGUMENT naming request_id."""
        digest = request_digest(request.job)
        try:
            retried = self._retried(request.request_id, digest, principal)
            if retried is not None:
                return retried
            job, resolved = self._validated(request.job, principal)
            record = self._create(job, request.request_id, digest, principal)
            for warning in pretrained_warnings(job, resolved.model):  # accepted, and said in the job's log (`trainctl logs`)
                self.store.append_event(record.id, st.EVENT_LOG, {"level": "WARNING", "message": f"{warning.field}: {warning.description}"})
            return record
        except RequestReused as reused:
            raise reused_request_id(f"job {reused}") from None

    def _retried(self, request_id: str, digest: str, principal: Principal) -> JobRecord | None:
        """The job the tenant already created with `request_id` (a retry is answered it, whatever the
        checks would say now: its first answer may have been lost), or None."""
        return self.store.job_of_request(principal.tenant, request_id, digest) if request_id else None

    def _create(self, job: TrainingJob, request_id: str, digest: str, principal: Principal) -> JobRecord:
        """Commit `job` if the tenant's quota admits it (else RESOURCE_EXHAUSTED), checked in the commit's
        own transaction so that concurrent creates cannot all pass a queued_jobs quota."""
        quota = self.auth.quota(principal.tenant)
        gpus = job.spec.resources.gpus
        try:
            record, _created = self.store.create_job(
                job, tenant=principal.tenant, request_id=request_id or None, digest=digest,
                admit=lambda queued: admission_violation(principal.tenant, quota, gpus, queued),
            )
        except AdmissionRefused as refused:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused)) from None
        return record

    async def GetJob(self, request: pb.GetJobRequest, principal: Principal) -> pb.Job:  # noqa: N802
        """The job; with JOB_VIEW_FULL also its step metrics (`job_messages.full_view`: at most
        FULL_VIEW_STEPS, spread over the run by the store, `JobStore.thinned_step_metrics`), read and built
        on the thread pool: up to 10,000 rows, which must not hold up the event loop."""
        if request.view not in pb.JobView.values():
            raise bad_field("view", f"unknown JobView value {request.view}")
        if request.view == pb.JOB_VIEW_FULL:
            return await asyncio.get_running_loop().run_in_executor(None, self._full_view, request.id, principal)
        return await store_read(self.store, lambda: self.jobs.message(self._job(request.id, principal)))

    def _full_view(self, job_id: str, principal: Principal) -> pb.Job:
        record = self._job(job_id, principal)  # at most FULL_VIEW_STEPS rows read, however long the run
        return full_view(self.jobs, record, self.store.thinned_step_metrics(record.id, job_messages.FULL_VIEW_STEPS))

    def ListJobs(self, request: pb.ListJobsRequest, principal: Principal) -> bytes:  # noqa: N802
        """The page as a serialized ListJobsResponse: its jobs' answers are kept serialized (`JobMessages`)."""
        size = page_size(request.page_size)
        states = set()
        for i, number in enumerate(request.states):
            if number not in pb.JobState.values() or number == pb.JOB_STATE_UNSPECIFIED:
                raise bad_field(f"states[{i}]", f"unknown JobState value {number}")
            states.add(JobState(pb.JobState.Name(number)))
        if len(request.labels) > MAX_LABEL_FILTERS:
            raise bad_field("labels", f"at most {MAX_LABEL_FILTERS} label filters")
        if any("\x00" in key + value for key, value in request.labels.items()):
            raise bad_field("labels", "a label filter contains a NUL character")
        before = _decode_page_token(request.page_token) if request.page_token else None
        records = self.store.list_jobs(
            tenant=principal.tenant_filter(), states=states, labels=dict(request.labels), limit=size + 1,
            before_seq=before,
        )
        answer = self.jobs.page(records[:size])
        if len(records) > size:
            answer += pb.ListJobsResponse(next_page_token=_encode_page_token(records[size - 1].seq)).SerializeToString()
        return answer

    def CancelJob(self, request: pb.CancelJobRequest, principal: Principal) -> pb.Job:  # noqa: N802
        """Cancel a job that has not ended; one that has (SUCCEEDED, FAILED or CANCELLED) is FAILED_PRECONDITION."""
        record = self._job(request.id, principal)
        if record.state.terminal:
            raise failed_precondition(f"job {record.id} has already ended ({record.state}); nothing to cancel")
        check_text("reason", request.reason, MAX_REASON_LENGTH)
        reason = request.reason or f"cancelled by {principal.name}"
        record = self.scheduler.request_cancel(record.id, reason)
        if record.state in (JobState.SUCCEEDED, JobState.FAILED):  # it ended on its own meanwhile
            raise failed_precondition(f"job {record.id} has already ended ({record.state}); nothing to cancel")
        return self.jobs.message(record)

    async def WatchJob(self, request: pb.WatchJobRequest, principal: Principal) -> AsyncIterator[pb.JobEvent]:  # noqa: N802
        record = await store_read(self.store, lambda: self._job(request.id, principal))
        if request.after_sequence < 0:
            raise bad_field("after_sequence", "must not be negative")
        if request.follow:
            try:
                async for event in self.watch_hub.follow(record.id, request.after_sequence):
                    yield event
            except WatchFailed as exc:
                if isinstance(exc.__cause__, StoreUnavailable):  # answered UNAVAILABLE: the client resumes
                    raise StoreUnavailable(str(exc.__cause__)) from exc
                raise
            except WatchStopped as exc:  # UNAVAILABLE, not OK: the job goes on, the client resumes elsewhere
                raise service_stopping(str(exc)) from None
            return
        cursor = request.after_sequence
        while events := await store_read(self.store, partial(self.store.events, record.id, cursor)):
            for event in events:
                yield event_to_proto(event)
            cursor = events[-1].sequence

    def PlanJob(self, request: pb.PlanJobRequest, principal: Principal) -> pb.PlanJobResponse:  # noqa: N802
        if not request.HasField("job"):
            raise bad_field("job", "the job to plan is required")
        job, resolved, violations = self._violations(request.job, principal)
        plan = plan_response(resolved, violations, self.pool)
        if plan.valid and job is not None and resolved is not None:
            plan = plan.with_warnings(pretrained_warnings(job, resolved.model))
        return plan_to_proto(plan)

    def GetCluster(self, request: pb.GetClusterRequest, principal: Principal) -> pb.Cluster:  # noqa: N802
        holders = self.pool.holders()
        shown = {  # each holding job's owner is read once, not once per GPU it holds
            job_id: job_id if principal.is_admin or self._owns(principal, job_id) else "(another tenant)"
            for job_id in set(holders.values())
        }
        alive = self.ray_nodes() if self.ray_nodes is not None else {}
        cluster = pb.Cluster(topology_source=self.pool.source, total_gpus=self.pool.total)
        for name, gpus in self.pool.nodes():
            node = cluster.nodes.add(name=name, alive=alive.get(name, False))
            for gpu in gpus:
                holder = holders.get((name, gpu))
                node.gpus.add(index=gpu, job_id=shown[holder] if holder else "")
        cluster.used_gpus = len(holders)
        cluster.free_gpus = cluster.total_gpus - cluster.used_gpus
        counts = self.store.count_by_state(principal.tenant_filter())
        cluster.queued_jobs = counts.get(JobState.QUEUED, 0)
        cluster.running_jobs = sum(counts.get(s, 0) for s in ACTIVE_STATES)
        cluster.preempted_jobs = counts.get(JobState.PREEMPTED, 0)
        active = self.store.list_jobs(tenant=principal.tenant_filter(), states=ACTIVE_STATES)
        for share in tenant_shares(((r.tenant, r.job.spec.resources.gpus) for r in active), self.auth.quota):
            shown_share = cluster.tenants.add(tenant=share.tenant, used_gpus=share.used_gpus, borrowed_gpus=share.borrowed_gpus)
            if share.guaranteed_gpus is not None:
                shown_share.guaranteed_gpus = share.guaranteed_gpus
        pending = self.scheduler.autoscaling.pending if self.scheduler.autoscaling is not None else None
        if pending is not None:
            shown_job = pending.job_id if principal.is_admin or self._owns(principal, pending.job_id) else "(another tenant)"
            cluster.scale_up.job_id = shown_job
            cluster.scale_up.nodes.extend(pending.nodes)
            timestamp(cluster.scale_up.request_time, pending.since)
        return cluster

    def _owns(self, principal: Principal, job_id: str) -> bool:
        tenant = self._tenant_of(job_id)
        return tenant is not None and principal.can_access(tenant)

    # ---- sweeps (trainctl.service.api.sweep_rpcs) ----------------------------------------------------------
    def CreateSweep(self, request: pb.CreateSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        return self.sweep_rpcs.CreateSweep(request, principal)

    def GetSweep(self, request: pb.GetSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        return self.sweep_rpcs.GetSweep(request, principal)

    def ListSweeps(self, request: pb.ListSweepsRequest, principal: Principal) -> pb.ListSweepsResponse:  # noqa: N802
        return self.sweep_rpcs.ListSweeps(request, principal)

    def CancelSweep(self, request: pb.CancelSweepRequest, principal: Principal) -> pb.Sweep:  # noqa: N802
        return self.sweep_rpcs.CancelSweep(request, principal)

    def WatchSweep(self, request: pb.WatchSweepRequest, principal: Principal) -> AsyncIterator[pb.Sweep]:  # noqa: N802
        return self.sweep_rpcs.WatchSweep(request, principal)


# ---- conversions ------------------------------------------------------------------------------------


def _resolved(job: TrainingJob, model: ModelConfig | None, violations: list[FieldViolation]) -> ResolvedJob | None:
    """`job` resolved (with `model` when the checks already resolved it), or None when it cannot be: an
    unknown preset or an impossible layout, appended to `violations` unless a check named its field."""
    try:
        return ResolvedJob.resolve(job.spec, model=model)
    except UnknownPresetError as exc:
        field, problem = "spec.model.preset", str(exc)
    except LayoutError as exc:
        field, problem = "spec.parallelism", str(exc)
    if not any(v.field.startswith(field) for v in violations):
        violations.append(FieldViolation(field, problem))
    return None


def _encode_page_token(seq: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": seq}).encode()).decode()


def _decode_page_token(token: str) -> int:
    """The seq a token this server issued carries: an int64 (the column's type) that is not negative.
    A token longer than any issued one is refused unread (deeply nested JSON would exhaust the parser)."""
    try:
        if len(token) > MAX_PAGE_TOKEN_LENGTH:
            raise ValueError(len(token))
        value = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))["before"]
        if type(value) is not int or not 0 <= value <= INT64_MAX:  # not a bool either
            raise ValueError(value)
        return value
    except (ValueError, KeyError, TypeError, UnicodeError, binascii.Error):
        raise bad_field("page_token", "not a token this server issued (pass next_page_token unchanged)") from None


def event_to_proto(event: st.Event) -> pb.JobEvent:
    """A stored event as the API's JobEvent."""
    message = pb.JobEvent(sequence=event.sequence, job_id=event.job_id)
    timestamp(message.time, event.time)
    payload = event.payload
    if event.type == st.EVENT_STATE:
        message.state_change.from_state = pb.JobState.Value(payload["from"]) if payload.get("from") else 0
        message.state_change.to_state = pb.JobState.Value(payload["to"])
        message.state_change.reason = payload.get("reason", "")
    elif event.type == st.EVENT_STEP:
        step_to_proto(payload, message.step)
    else:
        message.log.message = payload.get("message", "")
        message.log.level = payload.get("level", "INFO")
        if payload.get("rank") is not None:
            message.log.rank = int(payload["rank"])
    return message
