"""JobSupervisor: one detached, named Ray actor per job that keeps its rank group running.

The supervisor builds the rank group, records where every rank landed, starts training and
collects step reports and log lines into the job's event log. It watches the ranks: a dead rank
(its actor or process gone, its node removed) fails the rank's pending call within about a second,
and a group that makes no step progress for ``scheduling.step_timeout_seconds`` counts as hung.
Either tears the group down and starts a new generation, which resumes from the newest complete
checkpoint in the run directory's ``checkpoints/``, up to ``scheduling.max_restarts`` times; after
that the job FAILS with the reason. A rank that raised the engine's `ConfigurationError` (bad data,
checkpoint or tokenizer for this spec) or a `FileRuleError` (a file the job's `FileRule`, which the
ranks get from ``file_rule_json``, refuses), while no rank died, FAILS the job at once: a restart
cannot fix it. A cancel tears the group down and ends in CANCELLED.

A command job (``spec.command``) runs the user's program on every rank instead of the engine
(`RankGroup.start_programs`): a program that exits non-zero ends the generation like a dead rank, named
by the program that ended first ("rank R exited with code C" and its last stderr lines). Its log lines
count as progress: one that never calls `trainctl.report` is hung only after
``spec.command.no_progress_timeout_seconds`` without a report or a line; once it reports, the step
timeout applies.

When a planned node is gone from the Ray cluster, the next generation needs a new plan: the supervisor
records a REPLAN event naming the lost nodes and waits. The plan comes from `replace_plan` (the
service's scheduler, which owns the GPU accounting) or, when the supervisor was given a topology map,
from the placement solver over the GPU slots free in Ray; it is recorded as a PLAN event.

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
import re
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any

import ray
import yaml
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import TrainingJob
from trainctl.workers.command.program import ProgramExited
from trainctl.workers.events import EventKind, EventLog, JobState, JobStatus
from trainctl.workers.host_memory import HostMemoryExceeded
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import PlacementMismatch, PlacementUnavailable, RankGroup, owned_by
from trainctl.workers.relaunch import Relaunch, is_relaunch
from trainctl.workers.replan import describe_move, free_slots, missing_nodes, replacement
from trainctl.workers.step_stats import StepStats
from trainctl.workers.topology.model import TopologyMap, parse_topology

log = logging.getLogger(__name__)

SUPERVISOR_PREFIX = "trainctl-job-"
ROOT_CAUSE_WAIT = 2.0
"""Seconds to wait for the other ranks' outcomes when one fails, to name the rank that died."""
REASON_CHARS = 300
"""Longest cause quoted from an error in a reason."""
MEMORY_NOT_RESTARTED = "not restarted (the same allocation would fail again)"
"""How a reason ends when a rank exceeded its host-memory limit."""
RELAUNCHES = "relaunches"
LOG_TALLIES = {RELAUNCHES: is_relaunch}
"""What the supervisor's event log counts over its whole history: the service's relaunches."""
REPLAN_INTERVAL = 1.0
"""Seconds between looks for a new plan while waiting for one after a node loss."""


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


class _Outcome(Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNPLACED = "unplaced"
    """No new plan came in time after a node loss: the job fails without another restart."""
    MISCONFIGURED = "misconfigured"
    """A rank raised a configuration error: the job fails without another restart."""


class JobSupervisor:
    """The supervisor actor's class (made remote by `trainctl.workers.runtime`)."""

    def __init__(self, config: SupervisorConfig) -> None:
        self._cfg = config
        self._job = TrainingJob.model_validate_json(config.job_json)
        self._run = RunDirectory.at(config.run_dir)
        self._log = EventLog.open(self._run.events, tallies=LOG_TALLIES)
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        """Held while a rank group is torn down: a second `_shutdown_group` waits until it is gone."""
        self._cancel = threading.Event()
        self._group: RankGroup | None = None
        self._generation = 1 + self._log.max_generation
        self._warm = dict(config.warm_workers) if self._log.last_seq == 0 else {}
        self._slots = _latest_plan(self._log) or list(config.slots)
        self._topology: TopologyMap | None = (
            parse_topology(yaml.safe_load(config.topology_yaml), "supervisor config") if config.topology_yaml else None
        )
        self._awaiting: list[str] | None = None
        """Lost nodes while the driver waits for a new plan (None when it waits for none)."""
        self._plan_ready = threading.Event()
        self._progress_at = time.monotonic()
        self._output_at = time.monotonic()
        self._stepping = False
        self._stats = StepStats()
        self._thread: threading.Thread | None = None
        status = self.poll(0, 1)
        if status.state.terminal:
            return
        if self._log.last_seq > 0:  # Ray restarted this actor after its process died, or the service relaunched it
            self._remove_leftovers()
            if status.state is JobState.CANCELLING:
                self._state(JobState.CANCELLED, "cancelled by request")
                return
            relaunch = config.relaunch
            if relaunch is not None and ray.get_runtime_context().was_current_actor_reconstructed:
                relaunch = None  # Ray restarted the relaunched supervisor: its own process died
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
        """Stop the job: tear the group down and end CANCELLED (a finished job stays as it is)."""
        if not self.poll(0, 1).state.terminal and not self._cancel.is_set():
            self._state(JobState.CANCELLING, "cancel requested")
            self._cancel.set()
            self._shutdown_group()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.poll(0, 1)

    @ray.method(concurrency_group="control")
    def replace_plan(self, slots: list[RankAssignment], use_gpu: bool) -> bool:
        """A new plan while the supervisor waits for one after a node loss: True once adopted, False when
        it waits for none. ValueError when the plan uses a lost node or another backend (CUDA or CPU)."""
        if use_gpu != self._cfg.use_gpu:
            raise ValueError(f"the new plan needs {'CUDA' if use_gpu else 'CPU'} ranks; this job's ranks use the other")
        return self._adopt(list(slots))

    # ---- calls from the ranks --------------------------------------------------------------------

    @ray.method(concurrency_group="reports")
    def record_step(self, generation: int, rank: int, report: dict[str, Any]) -> None:
        """A rank's StepReport; the first report of each step becomes a STEP event."""
        if generation != self._generation:
            return
        self._progress_at = time.monotonic()
        self._stepping = True
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
    def record_step_time(self, generation: int, rank: int, step: int, seconds: float) -> None:
        """Another rank's wall time of a reported step (rank 0's comes with its StepReport)."""
        if generation == self._generation:
            self._stats.add(rank, step, seconds)

    @ray.method(concurrency_group="reports")
    def record_log(self, generation: int, rank: int, message: str) -> None:
        """A log line from a rank."""
        if generation == self._generation:
            self._output_at = time.monotonic()
        self._log.append(EventKind.LOG, rank=rank, generation=generation, message=message)

    # ---- the driver thread -----------------------------------------------------------------------

    def _drive(self) -> None:
        try:
            self._supervise()
        except Exception as exc:  # a bug here must still end the job with a reason
            log.exception("job %s: supervisor error", self._cfg.job_id)
            self._shutdown_group()
            self._state(JobState.FAILED, f"supervisor error: {type(exc).__name__}: {exc}")

    def _supervise(self) -> None:
        max_restarts = self._job.spec.scheduling.max_restarts
        relaunches = self._log.tally(RELAUNCHES)  # not the job's fault: not in its budget
        restarts = self.poll(0, 1).restarts - relaunches
        while True:
            outcome, detail = self._run_generation()
            if self._cancel.is_set():
                self._state(JobState.CANCELLED, "cancelled by request")
                return
            if outcome is _Outcome.SUCCEEDED:
                self._state(JobState.SUCCEEDED, detail)
                return
            if outcome in (_Outcome.UNPLACED, _Outcome.MISCONFIGURED):
                self._state(JobState.FAILED, detail)
                return
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

    def _run_generation(self) -> tuple[_Outcome, str]:
        cfg = self._cfg
        group = self._create_group()
        if not isinstance(group, RankGroup):
            return group
        with self._lock:
            self._group = group
        if self._cancel.is_set():
            self._shutdown_group()
            return _Outcome.CANCELLED, "cancelled"
        try:
            locations = group.locations(cfg.call_timeout)
            self._log.append(
                EventKind.PLACEMENT,
                generation=self._generation,
                placement=[loc.to_dict() for loc in locations],
            )
            self._progress_at = self._output_at = time.monotonic()
            self._stepping = False
            self._stats = StepStats()
            refs = self._start(group)
            nodes = sorted({loc.node or "?" for loc in locations})
            self._state(
                JobState.RUNNING,
                f"{len(refs)} ranks running on {', '.join(nodes)} (generation {self._generation})",
            )
            return self._watch(refs)
        except PlacementMismatch as exc:
            return _Outcome.FAILED, f"rank placement differs from the plan: {exc}"
        except (RayActorError, GetTimeoutError) as exc:
            return _Outcome.FAILED, f"rank group set-up failed: {_first_line(exc)}"
        finally:
            self._shutdown_group()

    @cached_property
    def _resolved(self) -> ResolvedJob:
        """The job's grid and model, resolved at first need (a command job's start, a re-placement)."""
        return ResolvedJob.resolve(self._job.spec)

    def _start(self, group: RankGroup) -> list[ray.ObjectRef]:
        """Start the engine, or a command job's program, on every rank; one result ref per rank."""
        cfg, spec = self._cfg, self._job.spec
        reporter = ray.get_runtime_context().current_actor
        if spec.command is None:
            return group.start(
                spec.model_dump_json(), str(self._run.checkpoints), reporter, cfg.call_timeout, cfg.node_env,
                cfg.file_rule_json,
            )
        command = spec.command
        return group.start_programs(
            [command.program, *command.args],
            command.working_dir or str(self._run.root),
            dict(command.env),
            node_env=cfg.node_env,
            grid=self._resolved.grid,
            checkpoint_dir=str(self._run.checkpoints),
            log_dir=str(self._run.logs),
            restart_count=self._log.status(0, 1).restarts,
            max_restarts=spec.scheduling.max_restarts,
            reporter=reporter,
            timeout=cfg.call_timeout,
            host_memory_gib=spec.resources.host_memory_gib,
        )

    def _create_group(self) -> RankGroup | tuple[_Outcome, str]:
        """Reserve the plan's GPUs and create the ranks, or the outcome when that fails. A planned node
        that is gone (before, or while waiting for the reservation) is replaced by a new plan first."""
        cfg = self._cfg
        while True:
            lost = missing_nodes(self._slots)
            if lost:
                why = self._await_plan(lost)
                if why is not None:
                    return _Outcome.UNPLACED, why
                continue  # check the new plan's nodes too
            try:
                warm, self._warm = self._warm, {}  # the group binds or kills them
                return RankGroup.create(
                    cfg.job_id,
                    self._generation,
                    self._slots,
                    use_gpu=cfg.use_gpu,
                    ready_timeout=cfg.placement_timeout,
                    stop=lambda: self._cancel.is_set() or bool(missing_nodes(self._slots)),
                    warm=warm,
                    bind_timeout=cfg.call_timeout,
                    programs=self._job.spec.command is not None,
                )
            except PlacementUnavailable as exc:
                if self._cancel.is_set() or not missing_nodes(self._slots):
                    return _Outcome.FAILED, str(exc)

    def _await_plan(self, lost: list[str]) -> str | None:
        """Record a REPLAN event and wait for a plan off the ``lost`` nodes: from `replace_plan`, or from
        the solver when the supervisor has a topology map. None once one is adopted, else why not."""
        cfg = self._cfg
        ranks = ",".join(str(slot.rank) for slot in self._slots if slot.node in lost)
        source = "on the GPUs free in Ray" if self._topology is not None else "from the scheduler"
        with self._lock:
            self._awaiting = lost
            self._plan_ready.clear()
        self._log.append(
            EventKind.REPLAN,
            generation=self._generation,
            lost_nodes=lost,
            message=f"node(s) {', '.join(lost)} left the Ray cluster; waiting for a new placement of rank(s) {ranks} {source}",
        )
        deadline = None if cfg.replan_timeout is None else time.monotonic() + cfg.replan_timeout
        waiting_logged = False
        while not self._plan_ready.wait(REPLAN_INTERVAL):
            if self._cancel.is_set():
                return "cancelled"
            if self._topology is not None:
                slots = replacement(self._resolved, self._topology, free_slots(cuda=cfg.use_gpu), lost)
                if slots is not None:
                    self._adopt(slots)
                    continue
                if not waiting_logged:
                    waiting_logged = True
                    self._log.append(
                        EventKind.LOG,
                        generation=self._generation,
                        message=f"no room for {len(self._slots)} ranks off node(s) {', '.join(lost)}; waiting for free GPUs",
                    )
            if deadline is not None and time.monotonic() > deadline:
                with self._lock:
                    if self._plan_ready.is_set():
                        return None
                    self._awaiting = None
                return f"no new placement without node(s) {', '.join(lost)} within {cfg.replan_timeout:g}s (replan_timeout)"
        return None

    def _adopt(self, slots: list[RankAssignment]) -> bool:
        """Make ``slots`` the plan when one is awaited (a PLAN event says what moved); False otherwise."""
        with self._lock:
            lost = self._awaiting
            if lost is None:
                return False
            on_lost = sorted({slot.node for slot in slots} & set(lost))
            if on_lost:
                raise ValueError(f"the new plan uses lost node(s) {', '.join(on_lost)}")
            ordered = sorted(slots, key=lambda slot: slot.rank)
            self._log.append(
                EventKind.PLAN,
                generation=self._generation,
                lost_nodes=lost,
                message=describe_move(self._slots, ordered, lost),
                placement=[s.model_dump() for s in ordered],
            )
            self._slots, self._awaiting = ordered, None
            self._plan_ready.set()
        return True

    def _watch(self, refs: list[ray.ObjectRef]) -> tuple[_Outcome, str]:
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, dict[str, Any]] = {}
        pending = list(refs)
        while pending:
            if self._cancel.is_set():
                return _Outcome.CANCELLED, "cancelled"
            done, pending = ray.wait(pending, num_returns=1, timeout=self._cfg.watch_interval)
            failures: list[tuple[int, BaseException]] = []
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    failures.append((rank_of[ref], exc))
            if failures:
                return self._root_cause(failures, pending, rank_of)
            hung = self._hung() if pending else None
            if hung is not None:
                return _Outcome.FAILED, hung
        return _Outcome.SUCCEEDED, _summary(results.get(0, {}), len(refs))

    def _hung(self) -> str | None:
        """Why the running ranks count as hung, or None: no step progress for the step timeout once steps
        are reported; before that, no first step within the start-up grace (engine), or no report and
        no output line for ``spec.command.no_progress_timeout_seconds`` (a command job, when set)."""
        now = time.monotonic()
        idle = now - self._progress_at
        step_timeout = self._job.spec.scheduling.step_timeout_seconds
        command = self._job.spec.command
        if self._stepping:
            if idle > step_timeout:
                return f"no step progress for {idle:.0f}s (scheduling.step_timeout_seconds={step_timeout:g}); ranks hung"
            return None
        if command is None:
            if idle > max(step_timeout, self._cfg.startup_grace):
                return f"no first step within {idle:.0f}s of starting the ranks; ranks hung"
            return None
        quiet = now - max(self._progress_at, self._output_at)
        limit = command.no_progress_timeout_seconds
        if limit is not None and quiet > limit:
            return (
                f"no report and no output line for {quiet:.0f}s "
                f"(spec.command.no_progress_timeout_seconds={limit:g}); program hung"
            )
        return None

    def _root_cause(
        self,
        failures: list[tuple[int, BaseException]],
        pending: list[ray.ObjectRef],
        rank_of: dict[ray.ObjectRef, int],
    ) -> tuple[_Outcome, str]:
        """Why the group failed, and whether restarting can help. A dead rank makes its peers'
        collectives fail too, often first; wait briefly for the others and name a dead rank (restart)
        before a rank that raised a configuration error (fail at once), before any other error (restart)."""
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT) if pending else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                failures.append((rank_of[ref], exc))
        return _failure_class(failures)

    # ---- helpers ---------------------------------------------------------------------------------

    def _state(self, state: JobState, reason: str) -> None:
        log.info("job %s: %s (%s)", self._cfg.job_id, state.value, reason)
        self._log.append(EventKind.STATE, state=state, reason=reason, generation=self._generation)

    def _shutdown_group(self) -> None:
        """Tear the rank group down; returns once it is gone, also when another thread (a cancel) is
        tearing it down, so a generation ends (and the job with it) only after its ranks and programs."""
        with self._shutdown_lock:
            with self._lock:
                group, self._group = self._group, None
            if group is not None:
                group.shutdown()

    def _remove_leftovers(self) -> None:
        """Remove placement groups a previous incarnation of this supervisor left behind."""
        for pg_id, info in ray.util.placement_group_table().items():
            if owned_by(info.get("name", ""), self._cfg.job_id) and info.get("state") != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def _latest_plan(log: EventLog) -> list[RankAssignment] | None:
    """The plan of the newest PLAN event (a restarted supervisor continues with it), or None."""
    plan = log.latest_plan
    return None if plan is None else [RankAssignment(**slot) for slot in plan]


def _failure_class(failures: list[tuple[int, BaseException]]) -> tuple[_Outcome, str]:
    """The outcome and reason of a generation whose ranks failed with `failures` (rank, error): a dead
    rank first (restart), then a command job's program that exited non-zero (restart; the one that ended
    first is named), then a rank's configuration error (fail at once), then any other error (restart);
    otherwise the lowest rank of the class is named. A rank past its host-memory limit (an engine rank's
    HostMemoryExceeded, a program whose stderr says an allocation failed) fails the job at once too."""
    dead = [(rank, exc) for rank, exc in failures if isinstance(exc, RayActorError)]
    if dead:
        rank, exc = min(dead, key=lambda item: item[0])
        return _Outcome.FAILED, f"rank {rank} died: {_first_line(exc)}"
    exited = [cause for _, exc in failures if isinstance(cause := getattr(exc, "cause", exc), ProgramExited)]
    if exited:
        first = min(exited, key=lambda cause: (cause.ended_at, cause.rank))
        if first.memory_limit is not None:
            return _Outcome.MISCONFIGURED, f"{first}; {MEMORY_NOT_RESTARTED}"
        return _Outcome.FAILED, str(first)
    misconfigured = [(rank, cause) for rank, exc in failures if (cause := _configuration_error(exc)) is not None]
    if misconfigured:
        rank, cause = min(misconfigured, key=lambda item: item[0])
        if isinstance(cause, HostMemoryExceeded):
            return _Outcome.MISCONFIGURED, f"{str(cause)[:REASON_CHARS]}; {MEMORY_NOT_RESTARTED}"
        return _Outcome.MISCONFIGURED, (
            f"configuration error on rank {rank}: {str(cause)[:REASON_CHARS]}; not restarted (a restart cannot fix it)"
        )
    rank, exc = min(failures, key=lambda item: item[0])
    return _Outcome.FAILED, f"rank {rank} failed: {_first_line(exc)}"


def _configuration_error(exc: BaseException) -> ConfigurationError | FileRuleError | None:
    """The engine's ConfigurationError, or a FileRuleError, a rank raised (the cause Ray's task error
    carries), or None."""
    cause = getattr(exc, "cause", exc)
    return cause if isinstance(cause, ConfigurationError | FileRuleError) else None


def _first_line(exc: BaseException) -> str:
    """A one-line cause: a task error's original "Type: message" line, an actor death's first sentence
    (plus Ray's worker exit type when it gives one)."""
    text = str(exc).strip()
    exit_type = None
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else type(exc).__name__
    else:
        exit_type = re.search(r"Worker exit type: (\w+)", text)
    sentence = text.split(". ", 1)[0].rstrip(".")[:REASON_CHARS]
    return sentence + (f" (worker exit type {exit_type.group(1)})" if exit_type else "")


def _summary(result: dict[str, Any], ranks: int) -> str:
    """The reason of a job whose ranks all finished: rank 0's result, numbers rounded for a person
    (`wall_seconds=18.24`, not `18.237455856999986`)."""
    details = ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in result.items() if isinstance(value, int | float | str))
    return f"all {ranks} ranks finished" + (f" ({details})" if details else "")
