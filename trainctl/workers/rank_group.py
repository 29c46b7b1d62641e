"""RankGroup: one placement group pinned to the planned nodes and GPUs, one RankWorker per rank.

Pinning: bundle ``i`` holds rank ``i`` and asks for the custom resource of the planned GPU slot
(``trainctl_gpu_<gpu>``) plus, on nodes with real GPUs, one Ray ``GPU``; its bundle label selector
requires ``trainctl.io/node == <planned node>``. Ray can therefore only reserve that slot on that node.
Each RankWorker is created in its rank's bundle and told its rank; it reports the node label and the
slot Ray actually reserved, and the group refuses to train when either differs from the plan.

Warm workers: a rank whose planned slot comes with an idle pooled worker (`trainctl.workers.warm_pool`)
binds that worker instead of creating one. The bundle still reserves the slot; the group checks the
worker runs on the node Ray reserved the bundle on. Handed-over workers the group does not use are
killed; a rank whose worker cannot be bound gets a fresh one in its bundle.

Warm restarts: after a failed generation of an engine job, `release` keeps the workers that settle (the
surviving ranks, whose calls returned when a peer died) and the placement group; `renewed` is the next
generation on them, a dead rank replaced by a spare of its node (bound like a pooled worker) or a fresh
worker in its bundle. Each generation joins new process groups at a new rendezvous.

Rendezvous: every rank loads the engine first (`RankWorker.load_engine`: a loaded rank would otherwise
wait at the rendezvous for a fresh one's imports, past its timeout); then rank 0 picks its node IP and a
free port, and every rank joins ``init_distributed`` with it (NCCL on GPUs, gloo on CPU). A command job's group (``programs=True``) hands the endpoint to the user's
program instead, in the torchrun environment (`start_programs`); workers are threaded so that
`shutdown` can kill each program's process tree before it kills the workers, and `request_stop` (a
preemption) reaches a rank while it trains.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.workers.command.environment import rank_environment
from trainctl.workers.command.program import PROGRAM_STOP_GRACE
from trainctl.workers.command.rank_program import ProgramLaunch
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_worker import RankBinding, RankLocation, RankWorker
from trainctl.workers.resources import NODE_LABEL, gpu_slot
from trainctl.workers.settling import collect_settled
from trainctl.workers.snapshot_keepers import SnapshotRoute
from trainctl.workers.step_time_sending import step_time_routes

log = logging.getLogger(__name__)

NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class PlacementUnavailable(RuntimeError):
    """The planned GPUs could not all be reserved in time (taken, or a node is gone)."""


class PlacementMismatch(RuntimeError):
    """A RankWorker runs somewhere other than the plan says."""


_GROUP_NAME = re.compile(r"^trainctl-pg-(?P<job>.+)-g(?P<generation>\d+)$")
_RANK_NAME = re.compile(r"^trainctl-rank-(?P<job>.+)-g(?P<generation>\d+)-(?P<rank>\d+)$")


def group_name(job_id: str, generation: int) -> str:
    """Name of a job's placement group for one generation of its rank group."""
    return f"trainctl-pg-{job_id}-g{generation}"


def rank_name(job_id: str, generation: int, rank: int) -> str:
    """Ray actor name of one RankWorker."""
    return f"trainctl-rank-{job_id}-g{generation}-{rank}"


def owned_by(name: str, job_id: str) -> bool:
    """True when ``name`` is one of ``job_id``'s placement groups or RankWorker actors."""
    match = _GROUP_NAME.match(name) or _RANK_NAME.match(name)
    return match is not None and match.group("job") == job_id


def check_slots(slots: Sequence[RankAssignment]) -> None:
    """Raise ValueError naming the problem unless ranks are 0..n-1 once each on distinct (node, gpu)."""
    if not slots:
        raise ValueError("placement has no ranks")
    ranks = sorted(slot.rank for slot in slots)
    if ranks != list(range(len(slots))):
        raise ValueError(f"placement must name ranks 0..{len(slots) - 1} exactly once, got {ranks}")
    seen: dict[tuple[str, int], int] = {}
    for slot in slots:
        if slot.gpu < 0:
            raise ValueError(f"rank {slot.rank}: GPU index must be >= 0, got {slot.gpu}")
        other = seen.setdefault((slot.node, slot.gpu), slot.rank)
        if other != slot.rank:
            raise ValueError(f"ranks {other} and {slot.rank} are both placed on {slot.node} GPU {slot.gpu}")


@dataclass
class RankGroup:
    """A running rank group. Create it with `RankGroup.create`; always `shutdown` it."""

    job_id: str
    generation: int
    slots: list[RankAssignment]
    use_gpu: bool
    pg: PlacementGroup
    workers: list[Any]
    programs: bool = False
    """The ranks run a command job's program (threaded workers, `start_programs`)."""

    @classmethod
    def create(
        cls,
        job_id: str,
        generation: int,
        slots: Sequence[RankAssignment],
        *,
        use_gpu: bool,
        ready_timeout: float,
        stop: Callable[[], bool] = lambda: False,
        warm: dict[int, Any] | None = None,
        bind_timeout: float = 30.0,
        programs: bool = False,
    ) -> RankGroup:
        """Reserve the planned slots and start one RankWorker per rank (ordered by rank).

        ``warm`` maps ranks to idle pooled workers of their planned slots; the group takes ownership
        (each is bound or killed). Waiting for the reservation gives up early (PlacementUnavailable)
        once ``stop()`` is true. ``programs``: the ranks will run a command job's program."""
        warm = dict(warm or {})
        try:
            check_slots(slots)
            ordered = sorted(slots, key=lambda slot: slot.rank)
            pg = _reserve(job_id, generation, ordered, use_gpu, ready_timeout, stop)
            pooled = _bind_warm(warm, job_id, generation, ordered, pg, bind_timeout)
        finally:
            for handle in warm.values():  # not bound: nobody else will use them
                ray.kill(handle, no_restart=True)
        worker_class = ray.remote(RankWorker)  # one per group: exported once, not once per rank (`_fresh_worker`)
        workers = [
            pooled[slot.rank] if slot.rank in pooled
            else _fresh_worker(worker_class, job_id, generation, slot, len(ordered), pg, use_gpu)
            for slot in ordered
        ]
        return cls(job_id, generation, list(ordered), use_gpu, pg, workers, programs)

    def release(self, timeout: float) -> list[int]:
        """After a failed generation of an engine job: keep the workers that `settle` within ``timeout``
        seconds (their calls returned: the peers of a rank that died), and not later than `BLOCKED_GRACE`
        after the last of them (`collect_settled`); kill the others (dead, or still blocked in a
        collective). The ranks kept, in order; the placement group stays."""
        if self.programs:
            raise ValueError("a command job's rank group is not kept between generations")
        replies = {worker.settle.remote(timeout): rank for rank, worker in enumerate(self.workers)}
        kept = collect_settled(replies, _ready, _settled, timeout + 1.0)
        for rank, worker in enumerate(self.workers):
            if rank not in kept:
                ray.kill(worker, no_restart=True)
        return kept

    def renewed(
        self, generation: int, kept: Sequence[int], spares: dict[int, Any], bind_timeout: float
    ) -> tuple[RankGroup, list[int]]:
        """The group's next generation on the same placement group, and the ranks that took a spare: the
        ``kept`` ranks' workers (from `release`) run it; a rank not kept takes its spare from ``spares`` (rank
        -> an engine-loaded spare on its node, `trainctl.workers.spares`; the group binds each or kills it)
        or a fresh worker in its bundle."""
        size = len(self.slots)
        spares = dict(spares)
        try:
            bound = _bind_warm(spares, self.job_id, generation, self.slots, self.pg, bind_timeout)
        finally:
            for handle in spares.values():  # not bound: nobody else will use them
                ray.kill(handle, no_restart=True)
        ray.get([self.workers[rank].rebind.remote(generation) for rank in kept], timeout=bind_timeout)
        worker_class = ray.remote(RankWorker)
        workers = [
            self.workers[slot.rank] if slot.rank in kept
            else bound.get(slot.rank) or _fresh_worker(worker_class, self.job_id, generation, slot, size, self.pg, self.use_gpu)
            for slot in self.slots
        ]
        group = RankGroup(self.job_id, generation, self.slots, self.use_gpu, self.pg, workers, self.programs)
        return group, sorted(bound)

    def locations(self, timeout: float) -> list[RankLocation]:
        """Each rank's actual location, in rank order; raises PlacementMismatch if any is off-plan."""
        found: list[RankLocation] = ray.get([w.location.remote() for w in self.workers], timeout=timeout)
        wrong = [
            f"rank {loc.rank} planned {loc.planned.node} GPU {loc.planned.gpu}, runs on {loc.node} GPU {loc.gpu}"
            for loc in found
            if not loc.matches_plan
        ]
        bundle_nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        wrong += [
            f"pooled rank {loc.rank} runs on Ray node {loc.node_id}, its slot is reserved on {bundle_nodes.get(loc.rank)}"
            for loc in found
            if loc.pooled and bundle_nodes.get(loc.rank) != loc.node_id
        ]
        if wrong:
            raise PlacementMismatch("; ".join(wrong))
        return found

    def start(
        self,
        job_json: str,
        checkpoint_dir: str,
        reporter: Any,
        timeout: float,
        node_env: dict[str, dict[str, str]],
        file_rule_json: str,
        load_timeout: float,
        snapshot_routes: dict[int, SnapshotRoute] | None = None,
    ) -> list[ray.ObjectRef]:
        """Load the engine on every rank (within ``load_timeout`` seconds), rendezvous on rank 0 and start
        training on every rank, each with its node's ``node_env`` (NCCL settings), the job's `FileRule`
        (``file_rule_json``) and its route to the snapshot keepers (None: no in-memory snapshots); one result
        ref per rank."""
        ray.get([worker.load_engine.remote() for worker in self.workers], timeout=load_timeout)
        host, port = ray.get(self.workers[0].endpoint.remote(), timeout=timeout)
        log.info("job %s generation %d: rendezvous at %s:%d", self.job_id, self.generation, host, port)
        routes = step_time_routes(self.slots, self.workers)
        return [
            w.train.remote(
                host, port, job_json, checkpoint_dir, reporter, self.generation, node_env.get(slot.node, {}), file_rule_json,
                routes.get(slot.rank), (snapshot_routes or {}).get(slot.rank),
            )
            for slot, w in zip(self.slots, self.workers, strict=True)
        ]

    def start_programs(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        *,
        node_env: dict[str, dict[str, str]],
        grid: RankGrid,
        checkpoint_dir: str,
        log_dir: str,
        restart_count: int,
        max_restarts: int,
        reporter: Any,
        timeout: float,
        host_memory_gib: float | None = None,
    ) -> list[ray.ObjectRef]:
        """Start a command job's program on every rank, with its node's ``node_env`` (NCCL settings),
        then ``env`` (the spec's, which may override them), then each rank's torchrun environment
        (rendezvous on rank 0's endpoint), under ``host_memory_gib`` (None: the node's default); one
        result ref per rank."""
        host, port = ray.get(self.workers[0].endpoint.remote(), timeout=timeout)
        log.info("job %s generation %d: programs rendezvous at %s:%d", self.job_id, self.generation, host, port)
        refs = []
        for slot, worker in zip(self.slots, self.workers, strict=True):
            ranked = rank_environment(
                self.slots, slot.rank, grid=grid, master_addr=host, master_port=port, restart_count=restart_count,
                max_restarts=max_restarts, job_id=self.job_id, checkpoint_dir=checkpoint_dir, use_gpu=self.use_gpu,
            )
            launch = ProgramLaunch(
                argv=argv, cwd=cwd, env={**node_env.get(slot.node, {}), **env, **ranked}, log_dir=log_dir,
                host_memory_gib=host_memory_gib,
            )
            refs.append(worker.run_program.remote(launch, reporter, self.generation))
        return refs

    def request_stop(self, grace: float) -> None:
        """Ask every rank to stop for a preemption, without waiting: the engine saves a checkpoint at its
        next step boundary and returns; a command job's program gets SIGTERM, and SIGKILL after ``grace``
        seconds (it saves what it needs to resume in $TRAINCTL_CHECKPOINT_DIR meanwhile)."""
        for worker in self.workers:
            if self.programs:
                worker.stop_program.remote(grace)
            else:
                worker.request_stop.remote()

    def shutdown(self) -> None:
        """Kill every rank's program tree (command jobs), every RankWorker, and remove the placement group."""
        if self.programs:
            stops = [worker.stop_program.remote(PROGRAM_STOP_GRACE) for worker in self.workers]
            try:
                ray.wait(stops, num_returns=len(stops), timeout=PROGRAM_STOP_GRACE + 5.0)
            except RayError as exc:  # a worker already gone: its program died with it
                log.warning("job %s: stopping the programs: %s", self.job_id, exc)
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self.pg)


def _reserve(
    job_id: str,
    generation: int,
    ordered: list[RankAssignment],
    use_gpu: bool,
    ready_timeout: float,
    stop: Callable[[], bool],
) -> PlacementGroup:
    """The group's placement group, ready: bundle i reserves rank i's slot on its node."""
    bundles = [_bundle(slot, use_gpu) for slot in ordered]
    selectors = [{NODE_LABEL: slot.node} for slot in ordered]
    pg = placement_group(
        bundles, strategy="PACK", name=group_name(job_id, generation), bundle_label_selector=selectors
    )
    ready = pg.ready()
    deadline = time.monotonic() + ready_timeout
    while not ray.wait([ready], timeout=min(0.5, ready_timeout))[0]:
        if stop() or time.monotonic() >= deadline:
            remove_placement_group(pg)
            wanted = ", ".join(f"rank {s.rank} -> {s.node} GPU {s.gpu}" for s in ordered)
            why = "stopped" if stop() else f"not within {ready_timeout:g}s; a GPU is taken or a node is missing"
            raise PlacementUnavailable(f"could not reserve the planned GPUs ({wanted}): {why}")
    return pg


def _bind_warm(
    warm: dict[int, Any],
    job_id: str,
    generation: int,
    ordered: list[RankAssignment],
    pg: PlacementGroup,
    timeout: float,
) -> dict[int, Any]:
    """Bind the handed-over pooled workers to their ranks; returns those that took their rank (and
    removes them from ``warm``). A worker that is gone, slow, already bound or started for another
    slot (the plan changed since it was handed over) is left in ``warm``."""
    calls = {
        slot.rank: warm[slot.rank].bind.remote(
            RankBinding(job_id, generation, slot.rank, len(ordered), pg.id.hex()), slot
        )
        for slot in ordered
        if slot.rank in warm
    }
    bound: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    for rank, ref in calls.items():
        try:
            taken = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except RayError as exc:  # gone, or still busy past the timeout
            log.warning("job %s rank %d: pooled worker not bound (%s); starting a fresh one", job_id, rank, exc)
            continue
        if taken:
            bound[rank] = warm.pop(rank)
    return bound


def _fresh_worker(
    worker_class: Any, job_id: str, generation: int, slot: RankAssignment, world_size: int, pg: PlacementGroup,
    use_gpu: bool,
) -> Any:
    """A new RankWorker for ``slot``'s rank, created in its bundle of ``pg`` from ``worker_class``
    (``ray.remote(RankWorker)``: Ray exports a remote class at its first actor, about 35 ms of CPU that
    disassembles the class, so a group makes one for all its ranks rather than one per rank)."""
    options: dict[str, Any] = {
        "num_cpus": 0,
        "resources": {gpu_slot(slot.gpu): 1},
        "max_restarts": 0,
        "max_concurrency": 2,  # `request_stop` / `stop_program` / `settle` are served while a rank runs
        "name": rank_name(job_id, generation, slot.rank),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.rank),
    }
    if use_gpu:
        options["num_gpus"] = 1
        options["runtime_env"] = {"env_vars": {NOSET_CUDA_ENV: "1"}}
    binding = RankBinding(job_id, generation, slot.rank, world_size, pg.id.hex())
    return worker_class.options(**options).remote(slot.node, slot.gpu, use_gpu, binding)


def _ready(pending: list[Any], seconds: float) -> list[Any]:
    """The replies of ``pending`` ready within ``seconds``: the first, and every other ready by then."""
    ready, rest = ray.wait(pending, num_returns=1, timeout=seconds)
    if ready and rest:
        ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
    return ready


def _settled(reply: Any) -> bool:
    """A `settle` reply: True when the worker can run the next generation (False for a dead one)."""
    try:
        return ray.get(reply) is True
    except RayError:
        return False


def _bundle(slot: RankAssignment, use_gpu: bool) -> dict[str, float]:
    bundle = {gpu_slot(slot.gpu): 1.0}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle
