"""JobSupervisor: one detached, named Ray actor per job that keeps its rank group running.

The supervisor builds the rank group, records where every rank landed, starts training and
collects step reports and log lines into the job's event log. It watches the ranks: a dead rank
(its actor or process gone, its node removed) fails the rank's pending call within about a second,
and a group that makes no step progress for ``scheduling.step_timeout_seconds`` counts as hung.
Either ends the generation and starts a new one, which resumes from the newest complete checkpoint in
the run directory's ``checkpoints/``, up to ``scheduling.max_restarts`` times; after that the job FAILS
with the reason. A restart is warm where it can be (``SupervisorConfig.warm_restarts``): an engine job's
surviving ranks (their calls returned when a peer died) run the next generation in their own processes on
the same placement group, and a dead rank's slot takes a spare, an engine-loaded process the supervisor
keeps on each node of the plan once the job has trained for ``spare_after`` seconds
(`trainctl.workers.spares`); ranks still blocked, and every rank after a hang, get fresh processes.
A rank that raised the engine's `ConfigurationError` (bad data, checkpoint or tokenizer for this spec)
or a `FileRuleError` (a file the job's `FileRule`, which the ranks get from ``file_rule_json``,
refuses), while no rank died, FAILS the job at once: a restart cannot fix it. A cancel tears the group down and ends in CANCELLED. A preemption (`preempt`, the
service's scheduler giving the GPUs to a job of higher priority) asks every rank to stop at its next step
boundary with a checkpoint (a command job's program gets SIGTERM), tears the group down after the grace
period if it has not stopped by then, and ends in PREEMPTED; the service queues the job again and a new
supervisor resumes it (`Relaunch.after_preemption`) from that checkpoint.

A command job (``spec.command``) runs the user's program on every rank instead of the engine
(`RankGroup.start_programs`): a program that exits non-zero ends the generation like a dead rank, named
by the program that ended first ("rank R exited with code C" and its last stderr lines). Its log lines
count as progress: one that never calls `trainctl.report` is hung only after
``spec.command.no_progress_timeout_seconds`` without a report or a line; once it reports, the step
timeout applies.

When a planned node is gone from the Ray cluster, the next generation needs a new plan: the supervisor
records a REPLAN event naming the lost nodes and waits. The plan comes from `replace_plan` (the
service's scheduler, which owns the GPU accounting) or, when the supervisor was given a topology map,
from the placement solver over the GPU slots free in Ray; it is recorded as a PLAN event (`JobPlan`,
trainctl.workers.job_plan, keeps the plan). An elastic job (``spec.scheduling.elastic``) may get a plan of
fewer GPUs, whose size names the smaller layout its ranks then run; `resize` (or, with a map, room for its
whole layout) grows it back: the ranks stop at their next step boundary with a checkpoint and the next
generation runs the new plan, a RESTARTING state not counted against ``scheduling.max_restarts``.

The actor is threaded: a driver thread runs the generations while the ``control`` concurrency group
serves poll/cancel and the single-threaded ``reports`` group takes rank reports in order. If the
actor itself is restarted by Ray, it reloads its event log from the run directory's ``events.jsonl``,
removes what its previous incarnation left and starts a new generation from the checkpoint. A supervisor the
service starts again for a job whose previous one ended with the Ray cluster it ran on
(``SupervisorConfig.relaunch``, trainctl.service.scheduling.relaunch) does the same and records the service's
reason; those relaunches do not count against ``scheduling.max_restarts``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import yaml
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.files import FileRule
from trainctl.spec.job import ParallelismSpec, TrainingJob
from trainctl.workers.events import EventKind, EventLog, JobState, JobStatus
from trainctl.workers.group_keeper import GroupKeeper
from trainctl.workers.job_plan import JobPlan
from trainctl.workers.outcomes import Outcome, finished_summary, first_line, root_cause, stopped_summary
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import PlacementMismatch, PlacementUnavailable, RankGroup
from trainctl.workers.relaunch import (
    RESIZE_PREFIX,
    Relaunch,
    is_relaunch,
    is_resize,
    is_resume_after_preemption,
)
from trainctl.workers.replan import missing_nodes
from trainctl.workers.snapshot_keepers import SnapshotRoute
from trainctl.workers.step_stats import StepStats
from trainctl.workers.topology.model import parse_topology
from trainctl.workers.watchdog import Watchdog

log = logging.getLogger(__name__)

SUPERVISOR_PREFIX = "trainctl-job-"
RELAUNCHES = "relaunches"
PREEMPTION_RESUMES = "preemption_resumes"
RESIZES = "resizes"
LOG_TALLIES = {RELAUNCHES: is_relaunch, PREEMPTION_RESUMES: is_resume_after_preemption, RESIZES: is_resize}
"""What the supervisor's event log counts over its whole history: the service's relaunches after a cluster
loss, its resumes after a preemption and an elastic job's changes of size (restarts that are not the job's fault)."""
SPARE_AFTER = 120.0
"""Seconds a job trains before its supervisor starts the spares (`SupervisorConfig.spare_after`)."""


def supervisor_name(job_id: str) -> str:
    """Ray actor name of a job's supervisor."""
    return f"{SUPERVISOR_PREFIX}{job_id}"


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything a supervisor needs; Ray passes it again to a restarted supervisor."""

    job_id: str
    job_json: str
    """The TrainingJob as JSON."""
    slots: list[RankAssignment]
    """The plan: one slot per rank."""
    run_dir: str
    """The job's `RunDirectory` (its root), shared by the service, the supervisor and the ranks: events,
    checkpoints, a command job's logs."""
    use_gpu: bool
    """Ranks use CUDA and NCCL (True) or CPU and gloo (False)."""
    placement_timeout: float = 60.0
    """Seconds to wait for the planned GPUs to be reserved."""
    call_timeout: float = 60.0
    """Seconds to wait for a rank to answer a set-up call."""
    watch_interval: float = 0.5
    """Seconds between checks of the ranks, the cancel flag and step progress."""
    startup_grace: float = 300.0
    """Seconds a new generation may take to its first step report (imports, data, model build, resume)
    before it counts as hung; ``scheduling.step_timeout_seconds`` applies once steps are reported."""
    topology_yaml: str | None = None
    """The topology map (YAML) the supervisor re-places ranks on by itself after a node loss, over the
    GPU slots free in Ray; None: it waits for `JobSupervisor.replace_plan` (the service's scheduler)."""
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per node, environment its ranks get before the process group or the program starts (the
    topology map's NCCL settings); a node not named gets none."""
    replan_timeout: float | None = None
    """Seconds to wait for a new plan after a node loss before the job fails; None: until one comes
    or the job is cancelled."""
    warm_workers: dict[int, Any] = field(default_factory=dict)
    """Rank -> idle pooled RankWorker of its planned slot (`trainctl.workers.warm_pool`), for the first
    rank group; a restarted supervisor ignores them (they were bound or killed)."""
    file_rule_json: str = FileRule().to_json()
    """The job's `FileRule` (trainctl.spec.files) as JSON: where the files its ranks open may lie. The
    default confines nothing (bounded reads and index entries kept in their directories only)."""
    relaunch: Relaunch | None = None
    """Set when the service starts this supervisor for a job whose previous one ended with the Ray cluster
    it ran on: the restart is recorded with its reason, and the service's relaunches do not count against
    ``scheduling.max_restarts``. None: a new job."""
    warm_restarts: bool = True
    """Restart an engine job's failed generation on the ranks that survived it (their own processes, the
    same placement group, new process groups) and on spares; False: every restart starts fresh processes."""
    spare_after: float = SPARE_AFTER
    """Seconds the job's generations train (in all, under this supervisor) before it starts one spare rank
    process on each node of the plan for the next warm restart (with ``warm_restarts``), and then again at
    each generation's first step; a job that ends sooner starts none (a spare costs a process's imports)."""


class JobSupervisor:
    """The supervisor actor's class (made remote by `trainctl.workers.runtime`)."""

    def __init__(self, config: SupervisorConfig) -> None:
        self._cfg = config
        self._job = TrainingJob.model_validate_json(config.job_json)
        self._run = RunDirectory.at(config.run_dir)
        self._log = EventLog.open(self._run.events, tallies=LOG_TALLIES)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._generation = 1 + self._log.max_generation
        self._groups = GroupKeeper(
            config.job_id, config.use_gpu, programs=self._job.spec.command is not None,
            placement_timeout=config.placement_timeout, call_timeout=config.call_timeout,
            warm=dict(config.warm_workers) if self._log.last_seq == 0 else {},
        )
        relaunch = config.relaunch
        if relaunch is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            relaunch = None  # Ray restarted the relaunched supervisor: its own process died
        # A relaunch runs on the service's placement (which holds every re-placement since); a supervisor
        # Ray restarted continues with its log's newest plan.
        self._plan = JobPlan(
            self._job, list(config.slots) if relaunch is not None else _latest_plan(self._log) or list(config.slots),
            self._log, use_gpu=config.use_gpu,
            topology=parse_topology(yaml.safe_load(config.topology_yaml), "supervisor config") if config.topology_yaml else None,
        )
        self._snapshots_of: ParallelismSpec | None = None
        """The layout the snapshot keepers hold snapshots of (None before the first generation that takes them)."""
        self._watchdog = Watchdog(self._job, config.startup_grace)
        self._stats = StepStats()
        self._thread: threading.Thread | None = None
        status = self.poll(0, 1)
        if status.state.terminal or (status.state is JobState.PREEMPTED and relaunch is None):
            return
        if self._log.last_seq > 0:  # Ray restarted this actor after its process died, or the service relaunched it
            self._groups.remove_leftovers()
            if status.state is JobState.CANCELLING:
                self._state(JobState.CANCELLED, "cancelled by request")
                return
            self._state(
                JobState.RESTARTING,
                relaunch.reason if relaunch is not None else
                "job supervisor restarted (its process died); rebuilding the rank group from the last complete checkpoint",
            )
        else:
            nodes = sorted({slot.node for slot in config.slots})
            self._state(
                JobState.SCHEDULED,
                f"supervisor started; reserving {len(config.slots)} GPUs on {', '.join(nodes)}",
            )
        self._thread = threading.Thread(target=self._drive, name=f"supervise-{config.job_id}", daemon=True)
        self._thread.start()

    # ---- calls from the runtime ------------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def poll(self, cursor: int, limit: int) -> JobStatus:
        """Events after ``cursor`` (at most ``limit``) and the job's current state."""
        return self._log.status(cursor, limit)

    @ray.method(concurrency_group="control")
    def cancel(self, timeout: float) -> JobStatus:
        """Stop the job: tear the group down and end CANCELLED (a finished or preempted run stays as it is)."""
        if not self.poll(0, 1).state.ends_run and not self._cancel.is_set():
            self._state(JobState.CANCELLING, "cancel requested")
            self._cancel.set()
            self._groups.shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.poll(0, 1)

    @ray.method(concurrency_group="control")
    def preempt(self, reason: str, grace: float) -> JobStatus:
        """Stop the job for a preemption (``reason`` names the job that takes its GPUs): every rank saves
        a checkpoint at its next step boundary and stops; a group still running ``grace`` seconds later is
        torn down (it resumes from its newest complete checkpoint). Ends PREEMPTED; a job that has ended,
        is being cancelled or preempted already is left as it is."""
        with self._lock:
            if self.poll(0, 1).state.ends_run or self._cancel.is_set() or self._watchdog.preemption is not None:
                return self.poll(0, 1)
            self._watchdog.preemption = (time.monotonic(), grace)
            group = self._groups.current
        self._log.append(
            EventKind.LOG, generation=self._generation,
            message=f"{reason}; stopping at the next step boundary with a checkpoint (grace {grace:g}s)",
        )
        if group is not None:
            group.request_stop(grace)
        return self.poll(0, 1)

    @ray.method(concurrency_group="control")
    def replace_plan(self, slots: list[RankAssignment], use_gpu: bool) -> bool:
        """A new plan while the supervisor waits for one after a node loss: True once adopted, False when
        it waits for none. ValueError when the plan uses a lost node or another backend (CUDA or CPU)."""
        self._check_backend(use_gpu)
        return self._plan.adopt(list(slots), self._generation)

    @ray.method(concurrency_group="control")
    def resize(self, slots: list[RankAssignment], use_gpu: bool) -> bool:
        """Grow (or shrink) a running elastic job to a plan of another size: every rank saves a checkpoint at
        its next step boundary and stops, and the next generation runs the plan's layout from it (a RESTARTING
        state that does not count against ``scheduling.max_restarts``). True once taken; False while the job is
        not running with a group, is stopping, resizing or waiting for a plan. ValueError for a plan of this
        job's current size or with no layout of its size, or of another backend."""
        self._check_backend(use_gpu)
        with self._lock:
            group = self._groups.current
            running = (
                group is not None and not self._cancel.is_set() and self._watchdog.preemption is None
                and self.poll(0, 1).state is JobState.RUNNING
            )
            if not (running and self._plan.ask_resize(list(slots), self._generation)):
                return False
        group.request_stop(0.0)
        return True

    def _check_backend(self, use_gpu: bool) -> None:
        """ValueError when a plan handed over needs the other backend (CUDA or CPU) than the job's ranks use."""
        if use_gpu != self._cfg.use_gpu:
            raise ValueError(f"the new plan needs {'CUDA' if use_gpu else 'CPU'} ranks; this job's ranks use the other")

    # ---- calls from the ranks --------------------------------------------------------------------

    @ray.method(concurrency_group="reports")
    def record_step(self, generation: int, rank: int, report: dict[str, Any]) -> None:
        """A rank's StepReport; the first report of each step becomes a STEP event."""
        if generation != self._generation:
            return
        self._watchdog.stepped()
        step = int(report["step"])
        self._stats.add(rank, step, report.get("step_time_seconds"))
        if step <= self._stats.last_emitted:
            return
        self._stats.last_emitted = step
        stats = self._stats.latest_complete(before=step)
        payload = {**report, "straggler": None if stats is None else stats.to_dict()}
        self._log.append(EventKind.STEP, rank=rank, generation=generation, step=payload)
        line = self._stats.straggler_line(stats)
        if line is not None:
            self._log.append(EventKind.LOG, generation=generation, message=line)

    @ray.method(concurrency_group="reports")
    def record_step_times(self, generation: int, batches: dict[int, dict[int, float]]) -> None:
        """Other ranks' wall times of their newest reported steps, ``{rank: {step: seconds}}`` (rank 0's come
        with its StepReports): one call per node every `STEP_TIME_INTERVAL` seconds, from the node's relay rank
        (`trainctl.workers.step_time_sending`), not one per rank per step."""
        if generation == self._generation:
            for rank, times in batches.items():
                self._stats.add_many(int(rank), times)

    @ray.method(concurrency_group="reports")
    def record_log(self, generation: int, rank: int, message: str) -> None:
        """A log line from a rank."""
        if generation == self._generation:
            self._watchdog.printed()
        self._log.append(EventKind.LOG, rank=rank, generation=generation, message=message)

    # ---- the driver thread -----------------------------------------------------------------------

    def _drive(self) -> None:
        try:
            self._supervise()
        except Exception as exc:  # a bug here must still end the job with a reason
            log.exception("job %s: supervisor error", self._cfg.job_id)
            self._groups.shutdown()
            self._state(JobState.FAILED, f"supervisor error: {type(exc).__name__}: {exc}")
        finally:
            self._groups.stop()

    def _supervise(self) -> None:
        max_restarts = self._job.spec.scheduling.max_restarts
        relaunches = sum(self._log.tally(name) for name in LOG_TALLIES)  # not the job's fault: not in its budget
        restarts = self.poll(0, 1).restarts - relaunches
        while True:
            outcome, detail = self._run_generation()
            restarting = (
                outcome in (Outcome.FAILED, Outcome.HUNG) and restarts < max_restarts
                and not self._cancel.is_set() and self._watchdog.preemption is None
            )
            if not (restarting and outcome is Outcome.FAILED):
                self._groups.shutdown()  # a failed generation's ranks wait for the RESTARTING state
            if self._cancel.is_set():
                self._state(JobState.CANCELLED, "cancelled by request")
                return
            if self._watchdog.preemption is not None and outcome is not Outcome.SUCCEEDED:
                self._state(JobState.PREEMPTED, detail if outcome is Outcome.PREEMPTED else f"preempted ({detail})")
                return
            if outcome is Outcome.SUCCEEDED:
                self._state(JobState.SUCCEEDED, detail)
                return
            if outcome in (Outcome.UNPLACED, Outcome.MISCONFIGURED):
                self._state(JobState.FAILED, detail)
                return
            if outcome is Outcome.RESIZED:
                self._generation += 1
                self._state(JobState.RESTARTING, f"{RESIZE_PREFIX}{detail}; resuming from the checkpoint it saved")
                self._plan.take_resize(self._generation)
                continue
            if restarts >= max_restarts:
                self._state(
                    JobState.FAILED,
                    f"{detail}; giving up after {restarts} restart(s) (scheduling.max_restarts={max_restarts})",
                )
                return
            restarts += 1
            self._generation += 1
            self._state(
                JobState.RESTARTING,
                f"{detail}; restart {restarts} of {max_restarts} from the last complete checkpoint",
            )
            resized = self._plan.take_resize(self._generation)  # a resize asked before the failure: its plan now
            if resized or not self._restarts_warm():
                self._groups.shutdown()
            else:
                self._groups.keep_survivors()

    def _run_generation(self) -> tuple[Outcome, str]:
        cfg = self._cfg
        group = self._create_group()
        if not isinstance(group, RankGroup):
            return group
        with self._lock:  # a preemption from now on reaches this group
            self._groups.hold(group)
            preempted = self._watchdog.preemption is not None
        if self._cancel.is_set():
            self._groups.shutdown()
            return Outcome.CANCELLED, "cancelled"
        if preempted:
            self._groups.shutdown()
            return Outcome.PREEMPTED, "stopped before its ranks started; resumes from its newest complete checkpoint"
        left = False
        try:
            locations = group.locations(cfg.call_timeout)
            self._log.append(
                EventKind.PLACEMENT,
                generation=self._generation,
                placement=[loc.to_dict() for loc in locations],
            )
            self._watchdog.started()
            self._stats = StepStats()
            refs = self._start(group)
            nodes = sorted({loc.node or "?" for loc in locations})
            self._state(
                JobState.RUNNING,
                f"{len(refs)} ranks running on {', '.join(nodes)} (generation {self._generation})",
            )
            outcome, detail = self._watch(refs)
            self._watchdog.ended()
            left = outcome is Outcome.FAILED
            return outcome, detail
        except PlacementMismatch as exc:
            return Outcome.FAILED, f"rank placement differs from the plan: {exc}"
        except (RayActorError, GetTimeoutError) as exc:
            return Outcome.FAILED, f"rank group set-up failed: {first_line(exc)}"
        finally:
            if not left:
                self._groups.shutdown()

    def _restarts_warm(self) -> bool:
        """Whether a failed generation's ranks are kept for the next one (an engine job, not being cancelled
        or preempted)."""
        return (
            self._cfg.warm_restarts and self._job.spec.command is None
            and not self._cancel.is_set() and self._watchdog.preemption is None
        )

    def _start(self, group: RankGroup) -> list[ray.ObjectRef]:
        """Start the engine, or a command job's program, on every rank; one result ref per rank."""
        cfg, spec = self._cfg, self._plan.body
        reporter = ray.get_runtime_context().current_actor
        if spec.command is None:
            routes = self._snapshot_routes() if spec.checkpoint.memory_interval_steps else None
            return group.start(
                spec.model_dump_json(), str(self._run.checkpoints), reporter, cfg.call_timeout, cfg.node_env,
                cfg.file_rule_json, load_timeout=cfg.startup_grace, snapshot_routes=routes,
            )
        command = spec.command
        return group.start_programs(
            [command.program, *command.args],
            command.working_dir or str(self._run.root),
            dict(command.env),
            node_env=cfg.node_env,
            grid=self._plan.resolved.grid,
            checkpoint_dir=str(self._run.checkpoints),
            log_dir=str(self._run.logs),
            restart_count=self._log.status(0, 1).restarts,
            max_restarts=spec.scheduling.max_restarts,
            reporter=reporter,
            timeout=cfg.call_timeout,
            host_memory_gib=spec.resources.host_memory_gib,
        )

    def _snapshot_routes(self) -> dict[int, SnapshotRoute]:
        """The ranks' routes to the snapshot keepers; after a change of layout (an elastic job resized) the keepers
        of the old one are stopped first: their snapshots hold another layout's shards."""
        keepers = self._groups.snapshot_keepers
        if self._snapshots_of not in (None, self._plan.body.parallelism):
            keepers.stop()
        self._snapshots_of = self._plan.body.parallelism
        return keepers.routes(self._plan.slots)

    def _create_group(self) -> RankGroup | tuple[Outcome, str]:
        """Reserve the plan's GPUs and create the ranks, or the outcome when that fails. A planned node
        that is gone (before, or while waiting for the reservation) is replaced by a new plan first."""
        while True:
            lost = missing_nodes(self._plan.slots)
            if lost:
                self._groups.shutdown()  # ranks kept from the failed generation hold GPUs a new plan may need
                why = self._plan.await_plan(lost, self._generation, self._cfg.replan_timeout, self._stopped)
                if why is not None:
                    return Outcome.UNPLACED, why
                continue  # check the new plan's nodes too
            try:
                group, line = self._groups.next_group(
                    self._generation, self._plan.slots,
                    stop=lambda: self._cancel.is_set() or self._watchdog.preemption is not None or bool(missing_nodes(self._plan.slots)),
                )
            except PlacementUnavailable as exc:
                if self._watchdog.preemption is not None:
                    return Outcome.PREEMPTED, "stopped while reserving its GPUs; resumes from its newest complete checkpoint"
                if self._cancel.is_set() or not missing_nodes(self._plan.slots):
                    return Outcome.FAILED, str(exc)
                continue
            if line is not None:
                self._log.append(EventKind.LOG, generation=self._generation, message=line)
            return group

    def _stopped(self) -> str | None:
        """Why a wait for a new plan ends now (a cancel or a preemption), or None."""
        if self._cancel.is_set():
            return "cancelled"
        return "stopped while waiting for a new placement" if self._watchdog.preemption is not None else None

    def _watch(self, refs: list[ray.ObjectRef]) -> tuple[Outcome, str]:
        """Wait for the generation's ranks to finish, fail, hang or be stopped; start the spares when due
        (`Watchdog.spares_due`)."""
        spares_wanted = self._restarts_warm()
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, dict[str, Any]] = {}
        pending = list(refs)
        while pending:
            if self._cancel.is_set():
                return Outcome.CANCELLED, "cancelled"
            if spares_wanted and self._watchdog.spares_due(self._cfg.spare_after):
                spares_wanted = False
                self._groups.ensure_spares(slot.node for slot in self._plan.slots)
            if self._plan.shrunk and self._watchdog.stepping:
                grown = self._plan.growth()
                if grown is not None:
                    self.resize(grown, self._cfg.use_gpu)
            done, pending = ray.wait(pending, num_returns=1, timeout=self._cfg.watch_interval)
            failures: list[tuple[int, BaseException]] = []
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    failures.append((rank_of[ref], exc))
            if failures:
                if self._watchdog.preemption is not None:  # a program ended by SIGTERM, or a rank by the teardown
                    return Outcome.PREEMPTED, f"stopped for the preemption: {first_line(failures[0][1])}"
                return root_cause(failures, pending, rank_of)
            overdue = self._watchdog.preemption_overdue() if pending else None
            if overdue is not None:
                return Outcome.PREEMPTED, overdue
            hung = self._watchdog.hung() if pending else None
            if hung is not None:
                return Outcome.HUNG, hung
        if self._watchdog.preemption is not None and results.get(0, {}).get("stopped_on_request", self._job.spec.command is not None):
            return Outcome.PREEMPTED, stopped_summary(results.get(0, {}), self._job.spec.command is not None)
        resize_to = self._plan.resize_to
        if resize_to is not None and results.get(0, {}).get("stopped_on_request"):
            return Outcome.RESIZED, self._plan.resize_line(len(resize_to))
        return Outcome.SUCCEEDED, finished_summary(results.get(0, {}), len(refs))

    # ---- helpers ---------------------------------------------------------------------------------

    def _state(self, state: JobState, reason: str) -> None:
        log.info("job %s: %s (%s)", self._cfg.job_id, state.value, reason)
        self._log.append(EventKind.STATE, state=state, reason=reason, generation=self._generation)


def _latest_plan(log: EventLog) -> list[RankAssignment] | None:
    """The plan of the newest PLAN event (a restarted supervisor continues with it), or None."""
    plan = log.latest_plan
    return None if plan is None else [RankAssignment(**slot) for slot in plan]
