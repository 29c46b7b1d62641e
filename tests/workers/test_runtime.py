"""RayRuntime + JobSupervisor end to end on the embedded 3-node cluster: a solver plan on a fragmented
pool runs exactly where planned and succeeds; cancel leaves nothing; a killed rank (also one killed in
the middle of a checkpoint save), a killed supervisor, a hung rank and a lost node are detected, and
the job resumes from its checkpoint (with the same losses) or fails after max_restarts; a rank's
configuration error fails the job at once, with no restart; a job that
lost a node is re-placed off it (by the supervisor's own solver, or with a plan handed to
`replace_plan`) or fails when none comes in time; a new runtime re-attaches at its cursor; bad
placements get clear errors. Every fault test proves no actor or placement group of the job is left.

The scenarios' jobs run side by side on GPU slots none of them shares (most of each is waiting: ranks
starting, a death detected, a node declared dead), each started, faulted and followed by a thread of
its own (`runs`); each test checks one, its timing bounds measured from its own fault."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
import yaml
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.state import list_actors, list_placement_groups
from small_jobs import restartable_job, single_process_losses, small_job

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.job import ElasticSpec, TrainingJob
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.events import Event, EventKind, JobState, JobStatus
from trainctl.workers.nodes import ClusterNode
from trainctl.workers.placement import Placement, RankAssignment, place_job
from trainctl.workers.rank_group import owned_by
from trainctl.workers.resources import CONTROL_RESOURCE, NODE_LABEL, gpu_slot
from trainctl.workers.runtime import JobAlreadyStarted, JobNotFound, PlacementError, RayRuntime, uses_cuda
from trainctl.workers.supervisor import supervisor_name
from trainctl.workers.topology.model import TopologyMap, parse_topology, simulated_topology

SCENARIOS_AT_ONCE = 3
"""Scenario jobs running at a time. Starting ranks costs CPU (imports, model set-up): ten jobs at once on
a 2-core machine stretched a rank group's set-up past its 30 s call timeout and a restarted group's
rendezvous past the hung-rank job's 7 s store timeout."""


def plan(*slots: tuple[str, int]) -> Placement:
    return Placement(
        grid=f"dp_replicate{len(slots)}",
        assignments=[RankAssignment(rank=r, node=node, gpu=gpu) for r, (node, gpu) in enumerate(slots)],
    )


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


@pytest.fixture(scope="module")
def pool_partly_taken(embedded_ray):
    """Another tenant holds node-1 GPUs 0 and 1 and node-2 GPU 3 for the whole module."""
    taken = [("node-1", 0), ("node-1", 1), ("node-2", 3)]
    pg = placement_group(
        [{gpu_slot(g): 1} for _, g in taken], bundle_label_selector=[{NODE_LABEL: n} for n, _ in taken]
    )
    ray.get(pg.ready(), timeout=30)
    yield taken
    remove_placement_group(pg)


def follow(runtime: RayRuntime, job_id: str, until, timeout: float = 240.0, cursor: int = 0):
    """Poll from ``cursor`` until ``until(events_so_far, status)``; returns (events, status)."""
    events = []
    deadline = time.monotonic() + timeout
    while True:
        status: JobStatus = runtime.poll(job_id, cursor)
        events += status.events
        cursor = status.cursor
        if until(events, status):
            return events, status
        if status.state.terminal and status.drained:
            raise AssertionError(f"job {job_id} ended {status.state} ({status.reason}) before the condition held")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out following {job_id}; last state {status.state} ({status.reason})")
        time.sleep(0.2)


def finished(events, status) -> bool:
    return status.state.terminal and status.drained


def steps_of(events, generation=None) -> dict[int, float]:
    return {
        e.step["step"]: e.step["loss"]
        for e in events
        if e.kind is EventKind.STEP and (generation is None or e.generation == generation)
    }


def states_of(events) -> list[JobState]:
    return [e.state for e in events if e.kind is EventKind.STATE]


def succeeded_after_one_restart(events, status):
    """Assert the job succeeded after exactly one restart of its rank group; returns the RESTARTING event."""
    assert status.state is JobState.SUCCEEDED, status.reason
    assert states_of(events) == [
        JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.RUNNING, JobState.SUCCEEDED
    ]
    return next(e for e in events if e.state is JobState.RESTARTING)


def leftovers(job_id: str) -> tuple[list[str], list[str]]:
    """Alive actors and non-removed placement groups of a job, per Ray's state API."""
    actors = [
        a.name
        for a in list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "!=", "DEAD")])
        if a.name == supervisor_name(job_id) or owned_by(a.name or "", job_id)
    ]
    groups = [
        g.name for g in list_placement_groups(address=ray.get_runtime_context().gcs_address, filters=[("state", "!=", "REMOVED")]) if owned_by(g.name or "", job_id)
    ]
    return actors, groups


def spares_of(job_id: str) -> list[str]:
    """Alive spare rank processes of a job (`trainctl.workers.spares`)."""
    return [
        a.name
        for a in list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "!=", "DEAD")])
        if (a.name or "").startswith(f"trainctl-spare-{job_id}-")
    ]


def keepers_of(job_id: str) -> list[str]:
    """Alive snapshot keepers of a job (`trainctl.workers.snapshot_keepers`)."""
    return [
        a.name
        for a in list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "!=", "DEAD")])
        if (a.name or "").startswith(f"trainctl-snapshots-{job_id}-")
    ]


def assert_nothing_left(job_id: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(leftovers(job_id)):
        time.sleep(0.25)
    assert leftovers(job_id) == ([], [])


@dataclass(frozen=True)
class Run:
    """One scenario's job followed to its end: every event, the final status, and its fault."""

    job_id: str
    run_dir: Path
    events: list[Event]
    status: JobStatus
    fault_at: float = 0.0
    """time.time() when the scenario injected its fault (a kill, a stop, a node removed); 0 without one."""
    saving_step: int = 0
    """The step whose checkpoint save the fault interrupted (the mid-save scenario only)."""


@dataclass
class NodeChanges:
    """Adds and removes nodes of the embedded cluster one change at a time: the scenarios' threads remove
    nodes while others run, and Ray's `Cluster` is not made to change from several threads at once. Nodes
    are added from the main thread only (Ray's node start installs a signal handler)."""

    cluster: EmbeddedRay
    lock: threading.Lock = field(default_factory=threading.Lock)

    def remove(self, name: str) -> None:
        """Kill the node's processes, as if the machine died (a no-op for one already removed)."""
        with self.lock:
            if name in self.cluster.node_names:
                self.cluster.remove_node(name)

    @contextlib.contextmanager
    def extra(self, *names: str, gpus: int = 2) -> Iterator[None]:
        """Add nodes for the block; remove those not removed yet at its end."""
        try:
            for name in names:
                with self.lock:
                    self.cluster.add_node(name, gpus=gpus)
            yield
        finally:
            for name in names:
                self.remove(name)


def named_topology(*names: str, gpus: int = 2) -> TopologyMap:
    """A simulated map whose nodes are ``names`` (fewer than 10), e.g. spare nodes a test adds."""
    text = simulated_topology(len(names), gpus).to_yaml()
    for index, name in enumerate(names):
        text = text.replace(f"node-{index}", name)
    return parse_topology(yaml.safe_load(text))


def kinds_of(events, kind: EventKind) -> list:
    return [e for e in events if e.kind is kind]


def solver_job() -> TrainingJob:
    """The 4-rank tp=2 x dp_replicate=2 job the solver places on the fragmented pool."""
    job = restartable_job("tpdp", steps=4).model_copy(deep=True)
    job.spec.parallelism.tp = 2
    job.spec.resources.gpus = 4
    return job


def run_on_the_solver_plan(runtime: RayRuntime, placement: Placement, root: Path) -> Run:
    runtime.start_job("tpdp-1", solver_job(), placement, root / "tpdp-1")
    assert "tpdp-1" in runtime.running_jobs()
    events, status = follow(runtime, "tpdp-1", finished)
    return Run("tpdp-1", root / "tpdp-1", events, status)


def cancel_once_stepping(runtime: RayRuntime, root: Path) -> Run:
    """Cancel the job once it steps; asserts what holds right then (its group held, gone once cancel answers)."""
    runtime.start_job("cancel-1", restartable_job("cancel", steps=100_000), plan(("node-1", 2), ("node-2", 1)), root)
    follow(runtime, "cancel-1", lambda events, status: bool(steps_of(events)))
    assert leftovers("cancel-1")[1], "a running job holds its placement group"
    started = time.monotonic()
    final = runtime.cancel("cancel-1")
    assert final.state is JobState.CANCELLED and final.reason == "cancelled by request"
    assert time.monotonic() - started < 15
    assert leftovers("cancel-1") == ([], [])
    events, status = follow(runtime, "cancel-1", finished)
    return Run("cancel-1", root, events, status)


def kill_a_rank_at_step_3(root: Path) -> Run:
    """SIGKILL rank 1 at step 3, under a runtime whose supervisors start their spares at once."""
    runtime = RayRuntime(None, placement_timeout=30, spare_after=0)
    job_id = "kill-1"
    runtime.start_job(job_id, restartable_job("kill", steps=16), plan(("node-2", 0), ("node-3", 0)), root)
    events, _ = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
    [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    os.kill(where[1]["pid"], signal.SIGKILL)
    killed_at = time.time()
    more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    return Run(job_id, root, events + more, status, fault_at=killed_at)


def run_on_a_too_small_corpus(runtime: RayRuntime, root: Path) -> Run:
    job_id = "misconfigured-1"
    corpus = root / "small.txt"
    corpus.write_text("ten bytes!")  # fewer than one sample of seq_len + 1 = 33 tokens: only the ranks find out
    job = restartable_job("misconfigured", steps=4)
    job.spec.data.paths = [str(corpus)]
    runtime.start_job(job_id, job, plan(("node-2", 2), ("node-1", 3)), root / "run")
    events, status = follow(runtime, job_id, finished)
    return Run(job_id, root / "run", events, status)


def _freeze_mid_save(checkpoints, pids: list[int], deadline: float) -> int:
    """Wait for a checkpoint save in progress (its temporary directory there, its final one not yet) and
    stop every rank inside it with SIGSTOP; returns the step being saved. A save that completes before
    the ranks are stopped is let go, and the next one is tried."""
    missed: set[str] = set()
    while time.monotonic() < deadline:
        pending = [p.name for p in checkpoints.glob(".tmp_step_*") if p.name not in missed] if checkpoints.is_dir() else []
        if not pending:
            time.sleep(0.002)
            continue
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        step_dir = pending[0].removeprefix(".tmp_")
        if (checkpoints / pending[0]).is_dir() and not (checkpoints / step_dir).exists():
            return int(step_dir.removeprefix("step_"))
        missed.add(pending[0])
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    raise AssertionError("no checkpoint save was caught in progress")


def kill_a_rank_mid_save(runtime: RayRuntime, root: Path) -> Run:
    job_id = "midsave-1"
    runtime.start_job(job_id, restartable_job("midsave", steps=40), plan(("node-3", 1), ("node-4", 0)), root)
    events, _ = follow(runtime, job_id, lambda events, status: bool(steps_of(events)))
    [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    pids = [p["pid"] for p in where]
    saving = _freeze_mid_save(root / "checkpoints", pids, time.monotonic() + 120)
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies inside the save; rank 0 goes on and finds it gone
    os.kill(pids[0], signal.SIGCONT)
    more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    return Run(job_id, root, events + more, status, saving_step=saving)


def kill_the_supervisor_and_reattach(runtime: RayRuntime, root: Path) -> Run:
    """Kill the supervisor at step 3 and follow the job from a fresh runtime (a restarted service) at its cursor."""
    job_id = "sup-1"
    where = plan(("node-3", 2), ("node-4", 1))
    runtime.start_job(job_id, restartable_job("sup", steps=16), where, root)
    with pytest.raises(JobAlreadyStarted):
        runtime.start_job(job_id, restartable_job("sup", steps=16), where, root)
    events, status = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
    [supervisor] = list_actors(
        address=ray.get_runtime_context().gcs_address, filters=[("name", "=", supervisor_name(job_id))]
    )
    os.kill(supervisor.pid, signal.SIGKILL)
    fresh = RayRuntime(None)
    assert job_id in fresh.running_jobs()
    fresh.attach(job_id, root)
    more, status = follow(fresh, job_id, finished, cursor=status.cursor)
    return Run(job_id, root, events + more, status)


def stop_a_rank_at_step_3(runtime: RayRuntime, root: Path) -> Run:
    """SIGSTOP rank 1 at step 3 (alive, making no progress) under a 6 s step timeout."""
    job_id = "hang-1"
    job = restartable_job("hang", steps=12)
    job.spec.scheduling.step_timeout_seconds = 6
    runtime.start_job(job_id, job, plan(("node-4", 2), ("node-3", 3)), root)
    events, _ = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
    [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    hung = where[1]["pid"]
    os.kill(hung, signal.SIGSTOP)  # rank 0 waits in its all-reduce
    stopped_at = time.time()
    try:
        more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)
    return Run(job_id, root, events + more, status, fault_at=stopped_at)


def preempt_a_stopped_rank(runtime: RayRuntime, root: Path) -> Run:
    """SIGSTOP the only rank at step 3, then preempt the job with a 2 s grace: the rank cannot reach its
    step boundary, so the group is torn down when the grace is over."""
    job_id = "preempt-1"
    job = small_job("preempt", gpus=1, steps=100_000, checkpoint={"interval_steps": 2})
    runtime.start_job(job_id, job, plan(("node-4", 3)), root)
    events, _ = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
    [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    stopped = where[0]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    asked = time.time()
    try:
        assert not runtime.preempt(job_id, "preempted by job test (priority 10)", grace=2).state.ends_run
        assert not runtime.preempt(job_id, "asked again", grace=2).state.ends_run  # once only
        more, status = follow(runtime, job_id, lambda events, status: status.state.ends_run and status.drained,
                              cursor=events[-1].seq)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)
    return Run(job_id, root, events + more, status, fault_at=asked)


def lose_a_node_with_a_spare_in_the_map(runtime: RayRuntime, nodes: NodeChanges, root: Path) -> Run:
    """Remove spare-a under the job at step 3; its supervisor re-places the ranks on spare-b itself."""
    job_id = "node-loss-1"
    runtime.start_job(
        job_id, restartable_job("loss", steps=12), plan(("spare-a", 0), ("spare-a", 1)), root,
        topology=named_topology("spare-a", "spare-b"),  # the supervisor re-places the ranks itself
    )
    events, _ = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
    [supervisor] = list_actors(
        address=ray.get_runtime_context().gcs_address, filters=[("name", "=", supervisor_name(job_id))]
    )
    control = [n["NodeID"] for n in ray.nodes() if n["Alive"] and CONTROL_RESOURCE in n["Resources"]]
    assert supervisor.node_id in control, "the supervisor runs on the control node, not a GPU node"
    nodes.remove("spare-a")
    removed_at = time.time()
    more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    return Run(job_id, root, events + more, status, fault_at=removed_at)


def lose_a_node_and_hand_over_a_plan(runtime: RayRuntime, nodes: NodeChanges, root: Path) -> Run:
    """Remove spare-c under the job (no map: it waits for the caller), refuse a plan on the lost node,
    then hand over a plan on spare-d (free GPUs the caller knows of); asserts what holds at each of
    those moments."""
    job_id = "node-loss-2"
    job = restartable_job("handover", steps=6)
    runtime.start_job(job_id, job, plan(("spare-c", 0), ("spare-c", 1)), root)  # no map: the caller re-places
    events, _ = follow(runtime, job_id, lambda events, status: bool(steps_of(events)))
    nodes.remove("spare-c")
    more, status = follow(runtime, job_id, lambda events, status: bool(status.replan), cursor=events[-1].seq)
    events += more
    assert status.replan == ("spare-c",) and status.state is JobState.RESTARTING
    [replan] = kinds_of(events, EventKind.REPLAN)
    assert replan.message.endswith("waiting for a new placement of rank(s) 0,1 from the scheduler")
    with pytest.raises(PlacementError, match="no live Ray node labelled trainctl.io/node=spare-c"):
        runtime.replace_plan(job_id, job, plan(("spare-c", 0), ("spare-c", 1)))
    assert runtime.replace_plan(job_id, job, plan(("spare-d", 1), ("spare-d", 0)))
    assert not runtime.replace_plan(job_id, job, plan(("spare-d", 0), ("spare-d", 1))), "it waits for none now"
    more, status = follow(runtime, job_id, finished, cursor=status.cursor)
    return Run(job_id, root, events + more, status)


def lose_the_only_node_of_the_map(nodes: NodeChanges, root: Path) -> Run:
    """Remove spare-e, the map's only node, under a runtime that waits 2 s for a new placement."""
    runtime = RayRuntime(None, placement_timeout=30, replan_timeout=2)
    job_id = "node-loss-3"
    runtime.start_job(
        job_id, restartable_job("noroom", steps=100_000, max_restarts=1), plan(("spare-e", 0), ("spare-e", 1)), root,
        topology=named_topology("spare-e"),
    )
    events, _ = follow(runtime, job_id, lambda events, status: status.state is JobState.RUNNING)
    nodes.remove("spare-e")
    more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    return Run(job_id, root, events + more, status)


def snapshot_job(name: str, steps: int, interval: int) -> TrainingJob:
    """`restartable_job` taking an in-memory snapshot every step (a checkpoint every ``interval`` steps)."""
    job = restartable_job(name, steps=steps, interval=interval)
    job.spec.checkpoint.memory_interval_steps = 1
    return job


def lose_both_snapshot_copies_then_a_node(runtime: RayRuntime, nodes: NodeChanges, root: Path) -> tuple[Run, Run]:
    """On spare-f and spare-g, one job after the other. "snap-lost-1": at step 3 both keepers (every copy of
    every snapshot) are killed, then rank 1. "snap-node-1" (no checkpoint before its last step): at step 4
    spare-g is removed, rank 1 and its node's keeper with it; the supervisor re-places both ranks on spare-f."""
    runs = []
    for job_id, job, fault_step in (
        ("snap-lost-1", snapshot_job("snaplost", steps=8, interval=2), 3),
        ("snap-node-1", snapshot_job("snapnode", steps=10, interval=100), 4),
    ):
        runtime.start_job(job_id, job, plan(("spare-f", 0), ("spare-g", 0)), root / job_id,
                          topology=named_topology("spare-f", "spare-g"))
        events, _ = follow(runtime, job_id, lambda events, status, at=fault_step: max(steps_of(events), default=0) >= at)
        if job_id == "snap-lost-1":
            assert len(keepers_of(job_id)) == 2, "one keeper on each node of the plan"
            for actor in keepers_of(job_id):
                ray.kill(ray.get_actor(actor))
            [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
            os.kill(where[1]["pid"], signal.SIGKILL)
        else:
            nodes.remove("spare-g")
        fault_at = time.time()
        more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
        runs.append(Run(job_id, root / job_id, events + more, status, fault_at=fault_at))
    return runs[0], runs[1]


def elastic_job() -> TrainingJob:
    """`restartable_job` that may shrink to one rank (`scheduling.elastic`), on 12 steps, with an in-memory snapshot
    every step (of no use to another layout)."""
    job = restartable_job("elastic", steps=12, max_restarts=3)
    job.spec.scheduling.elastic = ElasticSpec(min_gpus=1)
    job.spec.checkpoint.memory_interval_steps = 1
    return job


def shrink_then_grow_back(runtime: RayRuntime, nodes: NodeChanges, root: Path) -> Run:
    """"elastic-1" on spare-h GPU 0 and spare-i GPU 0, spare-h's GPU 1 held by another tenant: at step 3 spare-i is
    removed and no GPU is free, so the supervisor shrinks the job to one rank on spare-h; once that plan is made,
    the other tenant lets its GPU go, and the job grows back to two ranks, on spare-h, at the shrunk generation's
    first step."""
    job_id = "elastic-1"
    blocker = placement_group([{gpu_slot(1): 1}], bundle_label_selector=[{NODE_LABEL: "spare-h"}])
    ray.get(blocker.ready(), timeout=30)
    try:
        runtime.start_job(job_id, elastic_job(), plan(("spare-h", 0), ("spare-i", 0)), root,
                          topology=named_topology("spare-h", "spare-i"))
        events, _ = follow(runtime, job_id, lambda events, status: max(steps_of(events), default=0) >= 3)
        nodes.remove("spare-i")
        fault_at = time.time()
        more, _ = follow(runtime, job_id, lambda events, status: bool(kinds_of(events, EventKind.PLAN)), cursor=events[-1].seq)
        events += more
    finally:
        remove_placement_group(blocker)
    more, status = follow(runtime, job_id, finished, cursor=events[-1].seq)
    return Run(job_id, root, events + more, status, fault_at=fault_at)


@pytest.fixture(scope="module")
def quiet_pool(runtime: RayRuntime, pool_partly_taken) -> dict[str, ClusterNode]:
    """The shared cluster's nodes as seen before any job of this module starts, by name."""
    return {n.name: n for n in runtime.cluster_nodes() if n.name in ("node-0", "node-1", "node-2")}


@pytest.fixture(scope="module")
def solver_placement(quiet_pool: dict[str, ClusterNode]) -> Placement:
    """The solver's plan for `solver_job` over the GPUs the quiet pool has free."""
    placement = place_job(
        ResolvedJob.resolve(solver_job().spec), simulated_topology(3, 4),
        {name: set(node.free_gpus) for name, node in quiet_pool.items()},
    )
    assert placement is not None
    return placement


@pytest.fixture(scope="module")
def runs(embedded_ray: EmbeddedRay, runtime: RayRuntime, solver_placement: Placement,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Every scenario's run, by job id, each driven by a thread of its own, `SCENARIOS_AT_ONCE` at a time
    in this order (each waiting for the nodes it plans on). No two share a GPU slot: the solver's job
    takes node-0 (asserted here), the others plan on node-1 and node-2 GPUs that `pool_partly_taken`
    leaves free, on two 4-GPU nodes added for the module (node-3, node-4), or on spare nodes of their
    own (spare-a to spare-i)."""
    assert {a.node for a in solver_placement.assignments} == {"node-0"}, "the other scenarios leave node-0 to it"
    nodes = NodeChanges(embedded_ray)

    def root(name: str) -> Path:
        return tmp_path_factory.mktemp(name)

    with ThreadPoolExecutor(SCENARIOS_AT_ONCE) as threads:
        futures = {
            "tpdp-1": threads.submit(run_on_the_solver_plan, runtime, solver_placement, root("tpdp")),
            "cancel-1": threads.submit(cancel_once_stepping, runtime, root("cancel")),
            "misconfigured-1": threads.submit(run_on_a_too_small_corpus, runtime, root("misconfigured")),
        }
        with nodes.extra("node-3", "node-4", gpus=4), nodes.extra("spare-f", "spare-g"):
            futures |= {
                "snapshots": threads.submit(lose_both_snapshot_copies_then_a_node, runtime, nodes, root("snapshots")),
                "kill-1": threads.submit(kill_a_rank_at_step_3, root("kill")),
                "midsave-1": threads.submit(kill_a_rank_mid_save, runtime, root("midsave")),
                "sup-1": threads.submit(kill_the_supervisor_and_reattach, runtime, root("sup")),
                "hang-1": threads.submit(stop_a_rank_at_step_3, runtime, root("hang")),
                "preempt-1": threads.submit(preempt_a_stopped_rank, runtime, root("preempt")),
            }
            with nodes.extra("spare-a", "spare-b", "spare-c", "spare-d", "spare-e"):
                futures |= {
                    "node-loss-1": threads.submit(lose_a_node_with_a_spare_in_the_map, runtime, nodes, root("loss")),
                    "node-loss-2": threads.submit(lose_a_node_and_hand_over_a_plan, runtime, nodes, root("handover")),
                    "node-loss-3": threads.submit(lose_the_only_node_of_the_map, nodes, root("noroom")),
                }
                with nodes.extra("spare-h", "spare-i"):
                    futures["elastic-1"] = threads.submit(shrink_then_grow_back, runtime, nodes, root("elastic"))
                    yield futures
                    wait(futures.values())  # every job ended before the nodes it ran on go


def test_cluster_nodes_report_labels_and_free_gpus(quiet_pool):
    nodes = quiet_pool
    assert len(nodes) == 3
    assert all(n.alive and n.gpus == [0, 1, 2, 3] and n.cuda_gpus == 0 for n in nodes.values())
    assert nodes["node-1"].labels[NODE_LABEL] == "node-1"
    assert nodes["node-1"].free_gpus == [2, 3] and nodes["node-2"].free_gpus == [0, 1, 2]


def test_solver_plan_on_a_fragmented_pool_runs_where_planned_and_succeeds(runtime, quiet_pool, solver_placement, runs):
    free = {name: set(node.free_gpus) for name, node in quiet_pool.items()}
    assert free["node-1"] == {2, 3} and free["node-2"] == {0, 1, 2}  # the pool is fragmented
    resolved = ResolvedJob.resolve(solver_job().spec)
    placement = solver_placement
    assert placement.split_groups == []
    assert all(a.gpu in free[a.node] for a in placement.assignments)

    run = runs["tpdp-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    assert states_of(events) == [JobState.SCHEDULED, JobState.RUNNING, JobState.SUCCEEDED]
    [where] = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    actual = {p["rank"]: (p["node"], p["gpu"]) for p in where}
    assert actual == {a.rank: (a.node, a.gpu) for a in placement.assignments}
    for tp_group in resolved.grid.groups("tp"):  # no TP group straddles two nodes, as observed by the ranks
        assert len({actual[r][0] for r in tp_group}) == 1
    assert sorted(steps_of(events)) == [1, 2, 3, 4]
    # Ranks 1-3 share node-0: their step times of step 1 reached the supervisor in one call from rank 1, the
    # node's relay, three steps before the last one's report.
    last = max((e for e in events if e.kind is EventKind.STEP), key=lambda e: e.step_report().step)
    assert last.straggler() is not None and last.straggler().ranks == 4, last.step
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert "steps_completed=4" in status.reason
    # Released once drained; the log stays readable from the run directory.
    assert_nothing_left("tpdp-1")
    again = runtime.poll("tpdp-1", 0)
    assert again.state is JobState.SUCCEEDED and [e.seq for e in again.events] == [e.seq for e in events]


def test_cancel_leaves_no_actor_or_placement_group(runtime, runs):
    run = runs["cancel-1"].result()
    assert states_of(run.events)[-2:] == [JobState.CANCELLING, JobState.CANCELLED]
    assert runtime.running_jobs().count("cancel-1") == 0


def test_killed_rank_restarts_from_checkpoint_with_identical_losses(runs):
    run = runs["kill-1"].result()
    events, status = run.events, run.status
    where = kinds_of(events, EventKind.PLACEMENT)[0].placement
    restart = succeeded_after_one_restart(events, status)
    assert restart.reason.startswith("rank 1 died") and "restart 1 of 2" in restart.reason
    assert restart.time - run.fault_at < 10  # detected within seconds
    first, second = steps_of(events, 0), steps_of(events, 1)
    resumed = min(second) - 1
    assert resumed >= 2 and resumed % 2 == 0, "resumes after a complete checkpoint (every 2 steps)"
    assert any("resumed from checkpoint" in e.message for e in events if e.generation == 1)
    assert max(second) == 16
    replayed = sorted(set(first) & set(second))
    for step in replayed:  # deterministic resume: the same step gives the same loss
        assert second[step] == pytest.approx(first[step], rel=1e-5)
    placements = [e.placement for e in events if e.kind is EventKind.PLACEMENT]
    assert [(p["node"], p["gpu"]) for p in placements[1]] == [("node-2", 0), ("node-3", 0)]
    # A warm restart: rank 0 survived and runs on in its process; rank 1 runs on node-3's spare.
    assert placements[1][0]["pid"] == where[0]["pid"]
    assert placements[1][1]["pid"] != where[1]["pid"]
    assert placements[1][1]["pooled"] and placements[1][1]["actor"].startswith("trainctl-spare-kill-1-node-3-")
    assert any(e.message == "warm restart: rank(s) 0 keep their processes; rank(s) 1 on spare processes" for e in events)
    assert_nothing_left(run.job_id)
    assert not spares_of(run.job_id), "the spares end with the job"


def test_a_configuration_error_on_the_ranks_fails_the_job_at_once_without_restarts(runs):
    run = runs["misconfigured-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.FAILED and status.restarts == 0
    assert status.reason.startswith("configuration error on rank 0: spec.data.paths: the 1 files hold 10 tokens"), status.reason
    assert "not restarted" in status.reason
    assert states_of(events) == [JobState.SCHEDULED, JobState.RUNNING, JobState.FAILED]
    assert_nothing_left(run.job_id)


def test_rank_killed_mid_checkpoint_resumes_from_the_previous_checkpoint(runs):
    run = runs["midsave-1"].result()
    events, status, saving = run.events, run.status, run.saving_step
    restart = succeeded_after_one_restart(events, status)
    assert restart.reason.startswith("rank 1 died"), restart.reason
    first, second = steps_of(events, 0), steps_of(events, 1)
    assert min(second) - 1 == saving - 2, f"resumes from the checkpoint before the interrupted step-{saving} save"
    for step in sorted(set(first) & set(second)):  # the resumed run equals the uninterrupted one
        assert second[step] == pytest.approx(first[step], rel=1e-5)
    assert max(second) == 40
    assert not list((run.run_dir / "checkpoints").glob(".tmp_step_*")), "the partial save is cleaned up by the next save"
    assert_nothing_left(run.job_id)


def test_killed_supervisor_resumes_and_a_restarted_service_reattaches_at_its_cursor(runs):
    run = runs["sup-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    assert [e.seq for e in events] == list(range(1, status.last_seq + 1)), "no event lost or repeated"
    restart = next(e for e in events if e.state is JobState.RESTARTING)
    assert restart.reason.startswith("job supervisor restarted")
    assert max(steps_of(events, restart.generation)) == 16
    assert min(steps_of(events, restart.generation)) > 1, "resumed from a checkpoint, not from scratch"
    assert_nothing_left(run.job_id)


def test_hung_rank_is_detected_within_the_step_timeout_and_restarted(runs):
    run = runs["hang-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    restart = next(e for e in events if e.state is JobState.RESTARTING)
    # Either the watchdog or the collective timeout (both step_timeout_seconds) catches it.
    assert "no step progress" in restart.reason or restart.reason.startswith("rank 0 failed"), restart.reason
    assert restart.time - run.fault_at < 6 + 10
    assert max(steps_of(events, 1)) == 12
    assert_nothing_left(run.job_id)


def test_a_preempted_job_that_cannot_reach_its_step_boundary_is_stopped_after_the_grace(runs):
    run = runs["preempt-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.PREEMPTED, status.reason
    assert status.reason == (
        "the ranks did not stop within the 2s grace period; stopped, resuming from the newest complete checkpoint"
    )
    preempted = next(e for e in events if e.state is JobState.PREEMPTED)
    assert 2 <= preempted.time - run.fault_at < 2 + 10
    logs = [e.message for e in events if e.kind is EventKind.LOG]
    assert logs.count("preempted by job test (priority 10); stopping at the next step boundary with a checkpoint "
                      "(grace 2s)") == 1
    assert_nothing_left(run.job_id)


def test_lost_node_restarts_on_a_spare_node_from_its_checkpoint(runs):
    run = runs["node-loss-1"].result()
    events, status = run.events, run.status
    restart = succeeded_after_one_restart(events, status)
    assert " died" in restart.reason and restart.time - run.fault_at < 10, restart.reason  # a rank death, at once
    [replan] = kinds_of(events, EventKind.REPLAN)
    assert replan.lost_nodes == ["spare-a"] and "waiting for a new placement of rank(s) 0,1" in replan.message
    [new_plan] = kinds_of(events, EventKind.PLAN)
    assert new_plan.message.startswith("node spare-a lost; re-placed ranks 0,1 on spare-b"), new_plan.message
    assert {p["node"] for p in new_plan.placement} == {"spare-b"}
    first, second = (e.placement for e in kinds_of(events, EventKind.PLACEMENT))
    assert {p["node"] for p in first} == {"spare-a"}
    assert [(p["node"], p["gpu"]) for p in second] == [(p["node"], p["gpu"]) for p in new_plan.placement]
    resumed = steps_of(events, 1)
    assert min(resumed) > 1 and max(resumed) == 12, "resumed from a checkpoint, not from scratch"
    assert any("resumed from checkpoint" in e.message for e in events if e.generation == 1)
    assert_nothing_left(run.job_id)


def test_a_lost_node_restores_its_ranks_from_the_peer_copy_of_their_in_memory_snapshots(runs):
    _, run = runs["snapshots"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    restart = next(e for e in events if e.state is JobState.RESTARTING)
    assert " died" in restart.reason and restart.time - run.fault_at < 10, restart.reason
    # Rank 0 survives, so a warm restart is tried before the node's loss is established (a restart more).
    [new_plan] = kinds_of(events, EventKind.PLAN)
    assert {p["node"] for p in new_plan.placement} == {"spare-f"}
    last = new_plan.generation
    first, second = steps_of(events, 0), steps_of(events, last)
    resumed = min(second) - 1
    # No checkpoint before the last step: only a snapshot can give this. Rank 1's own copy went with spare-g;
    # its peer copy (and rank 0's own) on spare-f is read.
    restored = [e.message for e in events if e.generation == last and "resumed from" in e.message]
    assert restored == [f"resumed from in-memory snapshot step {resumed} (rank 0: copy on spare-f; rank 1: copy on spare-f)"]
    # A snapshot every step, but a rank skips one while its previous one is still on its way to the keepers (on
    # a loaded machine, every other step), and the ranks may skip different ones: the newest common one may trail
    # the step the node went at (step 4 or later) by a few. Any step above 0 is a snapshot's: no checkpoint yet.
    assert resumed >= 1 and max(first) - resumed <= 4, (max(first), resumed)
    for step in sorted(set(first) & set(second)):
        assert second[step] == pytest.approx(first[step], rel=1e-5)
    assert max(second) == 10
    assert_nothing_left(run.job_id)
    assert not keepers_of(run.job_id), "the keepers end with the job"


def test_a_rank_that_lost_both_snapshot_copies_sends_the_job_to_its_checkpoint(runs):
    run, _ = runs["snapshots"].result()
    events, status = run.events, run.status
    restart = succeeded_after_one_restart(events, status)
    assert restart.reason.startswith("rank 1 died"), restart.reason
    first, second = steps_of(events, 0), steps_of(events, 1)
    resumed = min(second) - 1
    assert resumed >= 2 and resumed % 2 == 0, "resumes after a complete checkpoint (every 2 steps)"
    assert any(e.message.startswith("resumed from checkpoint") for e in events if e.generation == 1)
    assert not any("in-memory snapshot" in e.message for e in events if e.generation == 1)
    for step in sorted(set(first) & set(second)):
        assert second[step] == pytest.approx(first[step], rel=1e-5)
    assert max(second) == 8
    assert_nothing_left(run.job_id)
    assert not keepers_of(run.job_id)


def test_lost_node_waits_for_a_plan_from_replace_plan(runs):
    run = runs["node-loss-2"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    [new_plan] = kinds_of(events, EventKind.PLAN)
    assert new_plan.message.startswith("node spare-c lost; re-placed ranks 0,1 on spare-d"), new_plan.message
    second = kinds_of(events, EventKind.PLACEMENT)[-1].placement
    assert [(p["node"], p["gpu"]) for p in second] == [("spare-d", 1), ("spare-d", 0)]
    assert_nothing_left(run.job_id)


def test_lost_node_without_room_fails_at_the_replan_timeout(runs):
    run = runs["node-loss-3"].result()
    events, status = run.events, run.status
    assert status.state is JobState.FAILED and status.restarts == 1
    assert status.reason == "no new placement without node(s) spare-e within 2s (replan_timeout)", status.reason
    assert any(e.message == "no room for 2 ranks off node(s) spare-e; waiting for free GPUs" for e in events)
    assert kinds_of(events, EventKind.PLAN) == []
    assert_nothing_left(run.job_id)


def test_an_elastic_job_shrinks_to_the_gpus_left_and_grows_back_with_the_losses_of_one_process(runs):
    run = runs["elastic-1"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    shrink, grow = kinds_of(events, EventKind.PLAN)
    assert shrink.message.startswith("node spare-i lost; shrunk to 1 rank (new plan: rank 0 -> spare-h GPU 0)"), shrink.message
    assert grow.message.startswith("growing back to 2 GPUs: new plan rank 0 -> spare-h GPU "), grow.message
    lines = [e.message for e in events if e.kind is EventKind.LOG and e.message.startswith("layout ")]
    assert lines == [
        "layout 2 -> 1 GPUs (dp_replicate 2 -> 1): each replica accumulates 2 micro-batches instead of 1 micro-batch, the global "
        "batch of 4 unchanged; 1 of the job's 2 GPUs",
        "layout 1 -> 2 GPUs (dp_replicate 1 -> 2): each replica accumulates 1 micro-batch instead of 2 micro-batches, the global "
        "batch of 4 unchanged; 2 of the job's 2 GPUs",
    ]
    resized = [e for e in events if e.kind is EventKind.STATE and e.reason.startswith("resized: ")]
    assert [e.reason for e in resized] == ["resized: growing back to 2 GPUs; resuming from the checkpoint it saved"]
    placements = kinds_of(events, EventKind.PLACEMENT)
    assert [len(p.placement) for p in placements][-2:] == [1, 2]
    assert [(p["node"], p["gpu"]) for p in placements[-2].placement] == [("spare-h", 0)]
    assert {(p["node"], p["gpu"]) for p in placements[-1].placement} == {("spare-h", 0), ("spare-h", 1)}
    shrunk, grown = placements[-2].generation, placements[-1].generation
    for generation in (shrunk, grown):  # another layout's snapshots are dropped with their keepers, never offered
        resumed = [e.message for e in events if e.generation == generation and "resumed from" in e.message]
        assert len(resumed) == 1 and resumed[0].startswith("resumed from checkpoint"), resumed
    assert steps_of(events, shrunk) and max(steps_of(events, grown)) == 12
    assert min(steps_of(events, grown)) - 1 == max(steps_of(events, shrunk)), "grew back from the step it stopped at"
    # One process, the same global batch: every step of every generation, on 2, 1 and 2 ranks again.
    reference = single_process_losses(elastic_job())
    for generation in sorted({e.generation for e in events if e.kind is EventKind.STEP}):
        for step, loss in steps_of(events, generation).items():
            assert loss == pytest.approx(reference[step - 1], rel=1e-5), (generation, step)
    assert status.restarts - sum(1 for _ in resized) <= 2, "the resize is not a failure: the node loss took at most two"
    assert_nothing_left(run.job_id)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (plan(("node-0", 0)), "placement has 1 ranks, the job's layout needs 2"),
        (plan(("node-0", 0), ("node-7", 0)), r"rank 1: no live Ray node labelled trainctl.io/node=node-7"),
        (plan(("node-0", 0), ("node-1", 4)), r"rank 1: node node-1 has no GPU 4"),
        (plan(("node-0", 1), ("node-0", 1)), "ranks 0 and 1 are both placed on node-0 GPU 1"),
    ],
)
def test_bad_placements_are_rejected_before_anything_starts(runtime, tmp_path, placement, message):
    with pytest.raises(PlacementError, match=message):
        runtime.start_job("bad-1", restartable_job("bad", steps=2), placement, tmp_path)
    assert "bad-1" not in runtime.running_jobs()


def test_backend_choice_follows_the_device_and_the_planned_nodes():
    assert uses_cuda("auto", {"a": True, "b": True}) is True
    assert uses_cuda("auto", {"a": False, "b": False}) is False
    assert uses_cuda("cpu", {"a": True}) is False
    assert uses_cuda("cuda", {"a": True}) is True
    with pytest.raises(PlacementError, match="planned node.s. b have no CUDA GPUs"):
        uses_cuda("cuda", {"a": True, "b": False})
    with pytest.raises(PlacementError, match="mixes nodes with CUDA GPUs and without .b."):
        uses_cuda("auto", {"a": True, "b": False})


def test_unknown_jobs_and_bad_ids(runtime):
    with pytest.raises(JobNotFound, match="nope"):
        runtime.poll("nope")
    with pytest.raises(ValueError, match="job id"):
        runtime.start_job("../x", restartable_job("x", steps=1), plan(("node-0", 0), ("node-1", 0)), "/tmp")
