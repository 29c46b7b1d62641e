"""RayRuntime: what the service calls to run jobs on Ray.

``start_job`` creates the job's detached, named `JobSupervisor` (or, given a `Relaunch`, a new one for a
job whose supervisor ended with the Ray cluster it ran on); ``poll`` reads its event log from a
cursor; ``replace_plan`` hands a supervisor that lost a node its new plan; ``cancel`` stops it and
leaves no actor or placement group behind; ``running_jobs`` and ``attach`` let a restarted service
find and re-attach the supervisors that kept running, and ``lost_with_cluster`` tells a supervisor
that is gone for good (Ray gave up restarting it) from one that ended with the Ray cluster it ran on
(each run directory names the Ray session its supervisor was started in); ``cluster_nodes`` and
``live_nodes`` describe the Ray nodes trainctl can place ranks on.

Once a job is terminal and a poll has returned its last event, the runtime kills the supervisor;
later polls read the same log from its run directory (`RunDirectory.events`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from trainctl.parallelism.run_directory import RunDirectory, check_job_id
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import layout_on
from trainctl.workers.events import (
    EventKind,
    EventLog,
    JobState,
    JobStatus,
)
from trainctl.workers.nodes import ClusterNode, cluster_nodes
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import check_slots, owned_by
from trainctl.workers.relaunch import Relaunch
from trainctl.workers.resources import CONTROL_RESOURCE, NODE_LABEL, SUPERVISOR_SHARE
from trainctl.workers.supervisor import (
    SPARE_AFTER,
    SUPERVISOR_PREFIX,
    JobSupervisor,
    SupervisorConfig,
    supervisor_name,
)
from trainctl.workers.topology.model import TopologyMap
from trainctl.workers.warm_pool import WarmPool

SUPERVISOR_MAX_RESTARTS = 3
"""Times Ray restarts a supervisor whose process died; each restart resumes from the checkpoint."""
SESSION_NAME_BYTES = 256
"""Most bytes of a run directory's `ray_session` read (Ray's session names are about 40)."""


class JobNotFound(LookupError):
    """No supervisor and no event log for this job id."""


class JobAlreadyStarted(RuntimeError):
    """A supervisor for this job id exists already."""


class PlacementError(ValueError):
    """The placement does not fit the job or the cluster."""


LIVENESS_MAX_AGE = 1.0
"""Seconds one answer of Ray about which nodes are alive is reused (`RayRuntime.node_liveness`)."""


class _Placement(Protocol):
    @property
    def assignments(self) -> Sequence[RankAssignment]: ...


class RayRuntime:
    """Runs jobs on a Ray cluster. ``address`` None uses the Ray this process is connected to (or
    starts a local one); otherwise it connects to ``address``.

    ``placement_timeout``: seconds a rank group may wait for its planned GPUs; ``call_timeout``:
    seconds for set-up calls to ranks and for a cancel to finish; ``poll_timeout``: seconds a poll
    waits for the supervisor before answering from the event log file (a supervisor being created
    or restarted must not stall the caller's loop); ``replan_timeout``: seconds a job that lost a node
    waits for a new plan before it fails (None: until one comes or the job is cancelled);
    ``warm_pool``: keep an engine-loaded worker on every free GPU slot (`WarmPool`) and start jobs'
    ranks on them; ``warm_restarts`` and ``spare_after``: how a failed generation restarts
    (`SupervisorConfig`: on the surviving ranks' processes and spares, or all fresh).
    """

    def __init__(
        self,
        address: str | None = None,
        namespace: str = "trainctl",
        *,
        placement_timeout: float = 60.0,
        call_timeout: float = 30.0,
        poll_timeout: float = 5.0,
        replan_timeout: float | None = None,
        warm_pool: bool = False,
        warm_restarts: bool = True,
        spare_after: float = SPARE_AFTER,
    ) -> None:
        self.namespace = namespace
        self._placement_timeout = placement_timeout
        self._call_timeout = call_timeout
        self._poll_timeout = poll_timeout
        self._replan_timeout = replan_timeout
        self._warm_restarts = warm_restarts
        self._spare_after = spare_after
        self._run_dirs: dict[str, RunDirectory] = {}
        self._liveness: tuple[float, dict[str, bool]] = (-LIVENESS_MAX_AGE, {})
        self._liveness_lock = threading.Lock()
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            ray.init(address=address, namespace=namespace, log_to_driver=False, include_dashboard=False)
        self.warm_pool = WarmPool(namespace).start() if warm_pool else None

    def close(self) -> None:
        """Stop the warm pool (its idle workers) and disconnect from Ray if this runtime connected
        (supervisors and their ranks keep running: they are detached)."""
        if self.warm_pool is not None:
            self.warm_pool.stop()
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()

    # ---- jobs --------------------------------------------------------------------------------

    def start_job(
        self,
        job_id: str,
        job: TrainingJob,
        placement: _Placement,
        run_dir: RunDirectory | str | Path,
        *,
        topology: TopologyMap | None = None,
        node_env: dict[str, dict[str, str]] | None = None,
        file_rule: FileRule = FileRule(),
        relaunch: Relaunch | None = None,
    ) -> None:
        """Create the job's supervisor, which reserves the planned GPUs and starts training.

        ``node_env``: per node, environment variables its ranks get (the NCCL settings of the topology
        map, `topology.nccl.nccl_env`; the scheduler passes them for every node of its map).

        ``file_rule``: where the files the engine opens for the job may lie (trainctl.spec.files; the
        scheduler passes the service's rule for the job); a file it refuses fails the job on its ranks,
        before the file is read, without a restart. The default confines nothing but bounds the reads.

        After a node loss the supervisor re-places the ranks itself on ``topology`` over the GPU slots
        free in Ray when one is given (a caller that keeps no GPU accounting); without it, it waits
        for `replace_plan` from the caller (the service's scheduler, which owns the accounting).

        ``relaunch``: the job ran before and its supervisor ended with the Ray cluster it ran on
        (`lost_with_cluster`) or was preempted; the new supervisor continues the job's event log in ``run_dir``, records a
        restart with the relaunch's reason and resumes from the newest complete checkpoint.

        ``run_dir``: the job's run directory (the scheduler's `RunDirectory`, or a path), created here."""
        check_job_id(job_id)
        if self._supervisor(job_id) is not None:
            raise JobAlreadyStarted(f"job {job_id} already has a supervisor ({supervisor_name(job_id)})")
        slots = list(placement.assignments)
        use_gpu = self._check_placement(job, slots)
        run = RunDirectory.at(run_dir).create()
        config = SupervisorConfig(
            job_id=job_id,
            job_json=job.model_dump_json(),
            slots=slots,
            run_dir=str(run.root),
            use_gpu=use_gpu,
            placement_timeout=self._placement_timeout,
            call_timeout=self._call_timeout,
            topology_yaml=None if topology is None else topology.to_yaml(),
            node_env=dict(node_env or {}),
            replan_timeout=self._replan_timeout,
            # Pooled workers preload the engine: a command job starts its own.
            warm_workers=self.warm_pool.take(slots, use_gpu) if self.warm_pool is not None and job.spec.command is None else {},
            file_rule_json=file_rule.to_json(),
            relaunch=relaunch,
            warm_restarts=self._warm_restarts,
            spare_after=self._spare_after,
        )
        run.ray_session.write_text(self._session() + "\n", encoding="utf-8")
        actor_cls = ray.remote(concurrency_groups={"control": 4, "reports": 1})(JobSupervisor)
        actor_cls.options(
            name=supervisor_name(job_id),
            namespace=self.namespace,
            lifetime="detached",
            max_restarts=SUPERVISOR_MAX_RESTARTS,
            max_task_retries=-1,  # poll / cancel are idempotent: retry them across a restart
            num_cpus=0,
            # On a control node when the cluster has one, so it does not die with a GPU node it supervises.
            resources={CONTROL_RESOURCE: SUPERVISOR_SHARE} if self._has_control_node() else {},
        ).remote(config)
        self._run_dirs[job_id] = run

    def attach(self, job_id: str, run_dir: RunDirectory | str | Path) -> None:
        """Remember where a job's events live (a restarted service calls this for each known job)."""
        check_job_id(job_id)
        self._run_dirs[job_id] = RunDirectory.at(run_dir)

    def lost_with_cluster(self, job_id: str) -> bool:
        """Whether the job's supervisor was started in a Ray session other than this runtime's: the Ray
        cluster it ran on is gone (an embedded one ends with the service that started it), and nothing of
        the job runs anymore. False when its run directory names this session or none (a run from before
        sessions were recorded). Needs `attach` (or `start_job`) first."""
        run = self._run_dirs.get(job_id)
        if run is None:
            raise JobNotFound(f"job {job_id}: no run directory (call attach() with its run dir)")
        try:
            with run.ray_session.open("rb") as file:  # the run directory is the job's too: bounded
                started_in = file.read(SESSION_NAME_BYTES).decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return False
        return bool(started_in) and started_in != self._session()

    def stop_supervisors(self, timeout: float = 5.0) -> list[str]:
        """Kill every job's supervisor (Ray does not restart them; their ranks end with them) without
        recording an end, and wait up to ``timeout`` seconds until they are gone; returns their job ids.
        For a service about to stop the Ray cluster its jobs run on: a supervisor that saw its ranks die
        with the cluster first would record that as the job's failure, where the job is to be relaunched
        by the next start (`lost_with_cluster`)."""
        jobs = self.running_jobs()
        for job_id in jobs:
            supervisor = self._supervisor(job_id)
            if supervisor is not None:
                ray.kill(supervisor, no_restart=True)
        deadline = time.monotonic() + timeout
        while set(jobs) & set(self.running_jobs()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return jobs

    def running_jobs(self) -> list[str]:
        """Job ids of the supervisors alive in this namespace."""
        return sorted(
            name.removeprefix(SUPERVISOR_PREFIX) for name in self._actor_names() if name.startswith(SUPERVISOR_PREFIX)
        )

    def poll(self, job_id: str, cursor: int = 0, limit: int = 1000) -> JobStatus:
        """Events after ``cursor`` and the job's state. Releases the supervisor once the job is over
        and every event has been returned."""
        supervisor = self._supervisor(job_id)
        if supervisor is None:
            return self._poll_file(job_id, cursor, limit)
        try:
            status: JobStatus = ray.get(supervisor.poll.remote(cursor, limit), timeout=self._poll_timeout)
        except (RayActorError, GetTimeoutError):
            # Starting or being restarted by Ray: answer from the log file, without a verdict.
            return self._read_log(job_id, cursor, limit)
        if status.state.ends_run and status.drained:
            ray.kill(supervisor, no_restart=True)
        return status

    def preempt(self, job_id: str, reason: str, grace: float) -> JobStatus:
        """Ask the job's supervisor to stop its ranks at their next step boundary with a checkpoint (after
        ``grace`` seconds it tears them down) and end PREEMPTED (`JobSupervisor.preempt`); returns at once
        with its state. A job with no supervisor is answered from its log."""
        supervisor = self._supervisor(job_id)
        if supervisor is None:
            return self._poll_file(job_id, 0, 1)
        return ray.get(supervisor.preempt.remote(reason, grace), timeout=self._call_timeout)

    def replace_plan(self, job_id: str, job: TrainingJob, placement: _Placement) -> bool:
        """Hand a new plan to a supervisor that waits for one after a node loss (its status's ``replan``
        names the lost nodes). True once adopted; False when the job waits for none (or has no
        supervisor); PlacementError when the plan does not fit the job or the live cluster."""
        return self._hand_plan(job_id, job, placement, "replace_plan")

    def resize(self, job_id: str, job: TrainingJob, placement: _Placement) -> bool:
        """Hand a running elastic job's supervisor a plan of another size (growing back after a shrink,
        `JobSupervisor.resize`): its ranks stop at their next step boundary with a checkpoint and the next
        generation runs the plan's layout. True once taken; False when the job cannot take it now (not
        running, stopping, or waiting for a plan); PlacementError when the plan does not fit the job or
        the live cluster."""
        return self._hand_plan(job_id, job, placement, "resize")

    def _hand_plan(self, job_id: str, job: TrainingJob, placement: _Placement, method: str) -> bool:
        """Call the supervisor's `method` (replace_plan or resize) with the checked plan; False without a supervisor."""
        slots = list(placement.assignments)
        use_gpu = self._check_placement(job, slots)
        supervisor = self._supervisor(job_id)
        if supervisor is None:
            return False
        try:
            return bool(ray.get(getattr(supervisor, method).remote(slots, use_gpu), timeout=self._call_timeout))
        except ValueError as exc:  # the supervisor refused it (Ray's error is also the ValueError raised)
            raise PlacementError(str(getattr(exc, "cause", exc))) from None

    def cancel(self, job_id: str, timeout: float = 60.0) -> JobStatus:
        """Cancel the job and wait until none of its actors or placement groups is left; returns its
        final state (a job already finished keeps its state)."""
        supervisor = self._supervisor(job_id)
        if supervisor is None:
            return self._poll_file(job_id, 0, 1)
        try:
            ray.get(supervisor.cancel.remote(timeout), timeout=timeout + self._call_timeout)
        except RayActorError:  # `poll` released it as the cancel answered: fine once the job has ended
            if not self._poll_file(job_id, 0, 1).state.terminal:
                raise
        finally:
            ray.kill(supervisor, no_restart=True)
            self._wait_gone(job_id, timeout)
        return self._poll_file(job_id, 0, 1)

    # ---- cluster -----------------------------------------------------------------------------

    def cluster_nodes(self) -> list[ClusterNode]:
        """The Ray nodes, with their trainctl name, labels and GPU slots (free ones included)."""
        return cluster_nodes()

    def node_liveness(self) -> dict[str, bool]:
        """Whether a Ray node of each name is alive, as Ray said at most `LIVENESS_MAX_AGE` seconds ago: the
        scheduler asks on every pass and GetCluster on every call, and Ray itself takes seconds to
        declare a node dead, so one answer serves them all for a moment."""
        with self._liveness_lock:
            asked, known = self._liveness
            if time.monotonic() - asked >= LIVENESS_MAX_AGE:
                known = {}
                for node in cluster_nodes():  # a name may be on a dead node and on the live one replacing it
                    if node.name is not None:
                        known[node.name] = known.get(node.name, False) or node.alive
                self._liveness = (time.monotonic(), known)
            return dict(known)

    def live_nodes(self) -> set[str]:
        """Names (``trainctl.io/node``) of the Ray nodes that are alive (`node_liveness`)."""
        return {name for name, alive in self.node_liveness().items() if alive}

    # ---- internals ---------------------------------------------------------------------------

    def _supervisor(self, job_id: str) -> Any | None:
        try:
            return ray.get_actor(supervisor_name(job_id), namespace=self.namespace)
        except ValueError:
            return None

    def _session(self) -> str:
        """The name of the Ray session this runtime is connected to (new with every start of a cluster)."""
        return str(ray.get_runtime_context().get_session_name())

    def _has_control_node(self) -> bool:
        return any(n.alive and n.control for n in cluster_nodes())

    def _actor_names(self) -> list[str]:
        """Names of the live named actors in this runtime's namespace."""
        entries = ray.util.list_named_actors(all_namespaces=True)
        return [e["name"] for e in entries if e["namespace"] == self.namespace]

    def _read_log(self, job_id: str, cursor: int, limit: int) -> JobStatus:
        """The job's log file from ``cursor``; an empty SCHEDULED status while the file does not exist."""
        run = self._run_dirs.get(job_id)
        if run is None or not run.events.exists():
            return JobStatus(events=[], cursor=cursor, state=JobState.SCHEDULED, reason="supervisor starting", restarts=0)
        return EventLog.read(run.events).status(cursor, limit)

    def _poll_file(self, job_id: str, cursor: int, limit: int) -> JobStatus:
        """The log of a job whose supervisor is gone; a job it left unfinished is recorded FAILED."""
        run = self._run_dirs.get(job_id)
        path = run.events if run else None
        if path is None or not path.exists():
            raise JobNotFound(f"job {job_id}: no supervisor and no event log (call attach() with its run dir)")
        status = EventLog.read(path).status(0, 1)
        if not status.state.ends_run:
            # The supervisor is gone for good (Ray gave up restarting it) before the job ended.
            EventLog.open(path).append(
                EventKind.STATE,
                state=JobState.FAILED,
                reason=f"job supervisor {supervisor_name(job_id)} is gone (its process died and was not restarted)",
            )
        return EventLog.read(path).status(cursor, limit)

    def _check_placement(self, job: TrainingJob, slots: list[RankAssignment]) -> bool:
        """Validate the plan against the job and the cluster; returns whether ranks use CUDA."""
        try:
            check_slots(slots)
        except ValueError as exc:
            raise PlacementError(str(exc)) from None
        world = job.spec.parallelism.world_size
        if len(slots) != world and layout_on(job.spec, len(slots)) is None:
            raise PlacementError(f"placement has {len(slots)} ranks, the job's layout needs {world}" + (
                " (or one of its elastic layouts' sizes)" if job.spec.scheduling.elastic is not None else ""))
        nodes = {n.name: n for n in self.cluster_nodes() if n.name is not None and n.alive}
        for slot in slots:
            node = nodes.get(slot.node)
            if node is None:
                known = ", ".join(sorted(nodes)) or "none"
                raise PlacementError(f"rank {slot.rank}: no live Ray node labelled {NODE_LABEL}={slot.node} (known: {known})")
            if slot.gpu not in node.gpus:
                raise PlacementError(f"rank {slot.rank}: node {slot.node} has no GPU {slot.gpu} (it has {node.gpus})")
        return uses_cuda(job.spec.resources.device, {slot.node: nodes[slot.node].cuda_gpus > 0 for slot in slots})

    def _wait_gone(self, job_id: str, timeout: float) -> None:
        """Block until no actor or placement group of the job is alive (or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            groups = [
                info
                for info in ray.util.placement_group_table().values()
                if owned_by(info.get("name", ""), job_id) and info.get("state") != "REMOVED"
            ]
            actors = [
                name for name in self._actor_names() if name == supervisor_name(job_id) or owned_by(name, job_id)
            ]
            if not groups and not actors:
                return
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id}: actors or placement groups still alive {timeout:g}s after cancel")


def uses_cuda(device: str, node_has_cuda: dict[str, bool]) -> bool:
    """Whether the ranks use CUDA + NCCL (else CPU + gloo), from ``resources.device`` and whether each
    planned node has CUDA GPUs; raises PlacementError when no single backend can serve the plan."""
    if device == "cpu":
        return False
    without = sorted(node for node, cuda in node_has_cuda.items() if not cuda)
    if device == "cuda" and without:
        raise PlacementError(f"resources.device is cuda but planned node(s) {', '.join(without)} have no CUDA GPUs")
    if without and len(without) < len(node_has_cuda):
        raise PlacementError(
            f"the plan mixes nodes with CUDA GPUs and without ({', '.join(without)}); one backend must serve all ranks"
        )
    return not without
