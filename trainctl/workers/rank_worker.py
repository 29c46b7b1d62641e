"""RankWorker: the Ray actor that runs one rank of a job's training loop.

A RankWorker is told its rank, its planned node and its local GPU index explicitly; nothing is
inferred from Ray's bundle order. It reports where it actually runs (the node label and the GPU
slot Ray reserved for it), offers rank 0's rendezvous endpoint, and runs
`trainctl.parallelism.engine.trainer.Trainer`, forwarding step reports (rank 0), step times (the other
ranks) and log lines to the supervisor. For a command job it runs the user's program instead
(`run_program`, `trainctl.workers.command`): its lines and `trainctl.report` calls go to the supervisor
the same way, and `stop_program` kills its process tree. Workers are threaded (two calls at once), so
`stop_program`, and `request_stop` (preemption: the engine checkpoints at its next step boundary and
returns), are served while `train` or `run_program` runs.

A worker is either created for its rank inside the job's placement group (``binding`` given), or
pooled: created ahead of any job for one GPU slot of one node, it imports the engine while idle and
is bound to a rank later (`bind`, see `trainctl.workers.warm_pool`). A pooled worker sits outside
the job's placement group, so once bound it watches that group and exits when it is removed, as a
worker inside it would be killed. A spare (``gpu`` None) is a pooled worker for any slot of its node, kept
by a job's supervisor to replace a dead rank there (`trainctl.workers.spares`): it takes its GPU when bound.

A worker outlives a failed generation of its job when it `settle`s (its call returned and no checkpoint
writer of it is still running): it then runs the next generation (`rebind`) with new process groups,
so a restart does not pay its imports again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from trainctl.workers.command.rank_program import ProgramLaunch, ProgramSlot, run_program
from trainctl.workers.host_memory import (
    HostMemoryExceeded,
    HostMemoryLimit,
    limit_this_process,
    node_memory_bytes,
    ran_out_of_memory,
    rank_limit,
)
from trainctl.workers.nodes import cluster_nodes
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.resources import NODE_LABEL, RANK_OPENMP_THREADS, slots_of
from trainctl.workers.snapshot_keepers import KeeperSnapshots, SnapshotRoute
from trainctl.workers.step_time_sending import StepTimeBatcher, StepTimeRelay, StepTimeRoute

if TYPE_CHECKING:
    from trainctl.parallelism.engine.step_report import StepReport


@dataclass(frozen=True)
class RankBinding:
    """The rank a worker runs: its job, the group generation, its rank in the world, and the
    placement group holding its slot (by id, hex)."""

    job_id: str
    generation: int
    rank: int
    world_size: int
    placement_group_id: str


@dataclass(frozen=True)
class RankLocation:
    """Where a rank actually runs, as the RankWorker itself observes it, next to where it was planned."""

    planned: RankAssignment
    """The rank and the node and GPU the plan gave it."""
    node: str | None
    """Value of the ``trainctl.io/node`` label of the Ray node the worker runs on."""
    gpu: int | None
    """Local GPU index of the slot resource Ray reserved for the worker (a pooled worker: the slot it
    was started for, whose reservation is its group's bundle; `RankGroup.locations` checks the node)."""
    node_id: str
    ip: str
    pid: int
    cuda_visible_devices: str
    actor: str = ""
    """The worker's Ray actor name."""
    pooled: bool = False
    """The worker came from the warm pool (engine imported before the job started)."""

    @property
    def rank(self) -> int:
        """The rank (the planned one: a worker never changes rank)."""
        return self.planned.rank

    @property
    def matches_plan(self) -> bool:
        """True when the worker runs on the planned node and holds the planned GPU slot."""
        return self.node == self.planned.node and self.gpu == self.planned.gpu

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (PLACEMENT events, JSON): ``rank``, ``planned_node``, ``planned_gpu`` and the
        observed fields."""
        observed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "planned"}
        return {"rank": self.rank, "planned_node": self.planned.node, "planned_gpu": self.planned.gpu, **observed}


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


ENGINE_MODULE = "trainctl.parallelism.engine.trainer"
"""The module whose import loads the engine (`preload_engine`)."""
ABORT_AFTER = 1.0
"""Seconds a failed generation's rank may take to return by itself before `settle` aborts its process groups."""
PLACEMENT_GROUP_CHECK_SECONDS = 2.0
"""How often a bound pooled worker checks that its group's placement group still exists."""

log = logging.getLogger(__name__)


def preload_engine() -> None:
    """Import the training engine (torch, torch.distributed, torch._dynamo and the layouts): the seconds
    a fresh rank spends before its first step, paid by a pooled worker or a spare while it waits.

    The import creates some 300,000 objects that live as long as the process, so the cyclic collector
    is off while it runs (its collections on the way cost a fifth of the import's CPU time) and they are
    frozen out of later collections: the full one `settle` runs after a failed generation, and those
    during training, then walk only what was made since. A no-op once loaded."""
    if ENGINE_MODULE in sys.modules:
        return
    gc.disable()
    try:
        # The first call of a function torch wraps in `torch._disable_dynamo` (every optimizer's `step`,
        # so every job's first step) imports torch._dynamo: 0.5-1 s of CPU, which a spare or pooled worker
        # would otherwise pay after its group's rendezvous, with every other rank waiting for it.
        import torch._dynamo  # noqa: F401

        import trainctl.parallelism.engine.distributed  # noqa: F401
        import trainctl.parallelism.engine.trainer  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()


def _one_call_counted(method: Callable[..., Any]) -> Callable[..., Any]:
    """A RankWorker method that `settle` waits for (`RankWorker._call`)."""

    @functools.wraps(method)
    def counted(self: RankWorker, *args: Any, **kwargs: Any) -> Any:
        with self._call():
            return method(self, *args, **kwargs)

    return counted


class RankWorker:
    """One GPU slot's process: runs one rank of one job. `RankGroup` creates it bound, inside the
    job's placement group; `WarmPool` creates it unbound (``binding`` None) and preloads the engine."""

    def __init__(self, node: str, gpu: int | None, use_gpu: bool, binding: RankBinding | None = None) -> None:
        self._node = node
        self._gpu = gpu
        self._use_gpu = use_gpu
        self._pooled = binding is None
        self._binding: RankBinding | None = None
        self._program = ProgramSlot()
        self._stop_requested = threading.Event()
        self._calls = threading.Condition()
        self._running = 0
        """`train` / `run_program` calls running (a worker runs one at a time)."""
        self._relay: StepTimeRelay | None = None
        """The node's step-time batches this worker collects while it trains as its node's relay rank."""
        # Before torch is imported: the planned GPU only, or no CUDA at all on simulated GPUs. A spare's
        # GPU is set when it is bound: the engine's import does not initialise CUDA (tests/workers).
        if gpu is not None or not use_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu) if use_gpu else ""
        os.environ.setdefault("OMP_NUM_THREADS", RANK_OPENMP_THREADS)
        if binding is None:
            preload_engine()
        else:
            if gpu is None:
                raise ValueError("a worker created for a rank needs its planned GPU")
            self._bind(binding)

    def bind(self, binding: RankBinding, slot: RankAssignment) -> bool:
        """Take ``binding``'s rank, planned on ``slot`` (pooled workers and spares only); False when this
        worker has a rank already or was started for another slot (a spare: another node, or CUDA already
        initialised so its GPU can no longer be chosen)."""
        if self._binding is not None or slot.node != self._node or self._gpu not in (None, slot.gpu):
            return False
        if self._gpu is None:
            if self._use_gpu and _cuda_initialised():
                return False
            self._gpu = slot.gpu
            if self._use_gpu:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(slot.gpu)
        self._bind(binding)
        threading.Thread(target=_exit_with_group, args=(binding,), name="placement-group-watch", daemon=True).start()
        return True

    def load_engine(self) -> None:
        """Import the engine now, before the rendezvous: ranks that start loaded (kept, pooled, spares)
        would otherwise wait at it for a fresh rank's imports, past their timeout."""
        preload_engine()

    def rebind(self, generation: int) -> None:
        """Run ``generation`` of the same rank next (a worker kept after its group's failed generation)."""
        self._binding = dataclasses.replace(self._bound(), generation=generation)

    def settle(self, timeout: float) -> bool:
        """Whether this worker can run its rank's next generation: its `train` call has returned and no
        checkpoint writer it started is still writing, within ``timeout`` seconds. A call still running after
        `ABORT_AFTER` seconds is blocked in a collective: its process groups are aborted (that unblocks
        NCCL's communicators; a gloo collective raises only once its peer's connections close). Then the
        failed call's garbage is collected: its Trainer, model and device mesh sit in reference cycles of
        its traceback and hold its process groups, whose gloo connections close only once freed (a peer
        blocked in a collective with this rank waits until then). A kept worker's stop request (a
        preemption of the failed generation) is forgotten."""
        from trainctl.parallelism.checkpoint.async_writer import WRITER_THREAD_PREFIX

        deadline = time.monotonic() + timeout
        with self._calls:
            returned = self._calls.wait_for(lambda: self._running == 0, min(timeout, ABORT_AFTER))
        if not returned:
            _abort_collectives()
            with self._calls:
                if not self._calls.wait_for(lambda: self._running == 0, max(0.0, deadline - time.monotonic())):
                    return False
        gc.collect()
        for thread in threading.enumerate():
            if thread.name.startswith(WRITER_THREAD_PREFIX):
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    return False
        self._stop_requested.clear()
        return True

    def binding(self) -> RankBinding | None:
        """The rank this worker runs, or None while it waits in the pool."""
        return self._binding

    def _bind(self, binding: RankBinding) -> None:
        if not 0 <= binding.rank < binding.world_size:
            raise ValueError(f"rank {binding.rank} is outside the world of {binding.world_size} ranks")
        self._binding = binding

    def _bound(self) -> RankBinding:
        if self._binding is None:
            raise RuntimeError(f"the pooled worker for {self._node} GPU {self._gpu} has no rank yet")
        return self._binding

    def location(self) -> RankLocation:
        """Where this worker runs, read from Ray's runtime context and the node's labels."""
        context = ray.get_runtime_context()
        slots = slots_of(context.get_assigned_resources())
        reserved = self._gpu if self._pooled else (slots[0] if len(slots) == 1 else None)
        return RankLocation(
            planned=RankAssignment(rank=self._bound().rank, node=self._node, gpu=self._gpu),
            node=context.get_node_labels().get(NODE_LABEL),
            gpu=reserved,
            node_id=context.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            actor=context.get_actor_name() or "",
            pooled=self._pooled,
        )

    def endpoint(self) -> tuple[str, int]:
        """Rendezvous address for the group: this node's IP and a port free on it (rank 0 only)."""
        rank = self._bound().rank
        if rank != 0:
            raise RuntimeError(f"rank {rank} asked for the rendezvous endpoint; only rank 0 hosts it")
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    @_one_call_counted
    def train(
        self,
        master_addr: str,
        master_port: int,
        job_json: str,
        checkpoint_dir: str,
        reporter: Any,
        generation: int,
        env: dict[str, str],
        file_rule_json: str,
        step_time_route: StepTimeRoute | None,
        snapshot_route: SnapshotRoute | None = None,
    ) -> dict[str, Any]:
        """Join the process group and run the training loop; returns the TrainResult as a dict.

        ``env`` (this node's NCCL settings from the topology map) is set in the process before the
        process group is created. ``file_rule_json`` is the job's `FileRule` (trainctl.spec.files), under
        which the engine opens every file of the job.

        ``reporter`` is the supervisor's actor handle: rank 0's step reports go to its ``record_step``
        (a checkpoint's step waits until it is recorded, so the checkpoint commits after its report),
        and log lines to ``record_log``, tagged with this rank and the group ``generation``. The other ranks'
        step times (at the same steps) go by ``step_time_route`` (None on rank 0): batched
        (`StepTimeBatcher`) to their node's relay rank, which sends its node's batches to
        ``record_step_times`` in one call (`StepTimeRelay`). ``snapshot_route``: the job's snapshot keepers
        (`trainctl.workers.snapshot_keepers`) when it takes in-memory snapshots.

        The process's data (``RLIMIT_DATA``) is limited to the rank's host-memory limit first; an
        allocation that fails at it raises HostMemoryExceeded (the job fails without a restart).
        """
        from trainctl.parallelism.engine.distributed import init_distributed, teardown
        from trainctl.parallelism.engine.trainer import Trainer
        from trainctl.spec.files import FileRule
        from trainctl.spec.job import JobSpecBody

        binding = self._bound()
        rank, world_size = binding.rank, binding.world_size
        body = JobSpecBody.model_validate_json(job_json)
        memory = self._host_memory_limit(body.resources.host_memory_gib)
        limit_this_process(memory)  # before the engine allocates: the job's limit, never a previous one's
        os.environ.update(env)
        route = step_time_route
        # Before the first step, from which the node's batches may come.
        self._relay = StepTimeRelay(
            lambda batches: reporter.record_step_times.remote(generation, batches), route.node_ranks, generation
        ) if route is not None and route.relay == rank else None
        device = init_distributed(
            rank,
            world_size,
            master_addr,
            master_port,
            "nccl" if self._use_gpu else "gloo",
            # The only visible GPU is the planned one, so it is cuda:0 in this process.
            device="cuda" if self._use_gpu else "cpu",
            timeout_seconds=body.scheduling.step_timeout_seconds,
        )
        try:
            trainer = Trainer(
                body,
                rank=rank,
                world_size=world_size,
                device=device,
                checkpoint_dir=checkpoint_dir,
                on_step=lambda report: _send_step(reporter, generation, rank, report, body.scheduling.step_timeout_seconds),
                on_event=lambda message: reporter.record_log.remote(generation, rank, str(message)),
                # Rank 0's step time comes with its StepReport. The others': one call per node per
                # STEP_TIME_INTERVAL seconds, not one per rank per step (that costs the supervisor a core from
                # about 2,000 ranks at 1 s steps; bench/scale/rank_path.py).
                on_step_time=None if route is None else StepTimeBatcher(
                    lambda times: route.worker.relay_step_times.remote(generation, rank, times), route.stagger
                ),
                file_rule=FileRule.from_json(file_rule_json),
                stop_requested=self._stop_requested.is_set,
                snapshots=KeeperSnapshots(snapshot_route, rank) if snapshot_route is not None else None,
            )
            return _as_dict(trainer.run())
        except Exception as exc:
            _abort_collectives()  # its peers' collectives with this rank raise now, not at their timeout
            if ran_out_of_memory(exc):
                raise HostMemoryExceeded(rank, str(memory), _one_line(exc)) from exc
            raise
        finally:
            teardown()

    def relay_step_times(self, generation: int, rank: int, times: dict[int, float]) -> None:
        """A step-time batch of a rank of this node (this one included), for this relay rank to send on with
        the node's others (`StepTimeRelay`); a batch of another generation than the one training is dropped."""
        relay = self._relay
        if relay is not None and relay.generation == generation:
            relay.add(rank, times)

    @_one_call_counted
    def run_program(self, launch: ProgramLaunch, reporter: Any, generation: int) -> dict[str, Any]:
        """Run a command job's program for this rank until it exits (``{"exit_code": 0}``); a failed
        program raises ProgramExited (rank, exit code, last stderr lines). Lines and `trainctl.report`
        calls go to ``reporter`` (the supervisor) like the engine's, tagged with the rank and ``generation``.
        The program and what it starts run with the rank's host-memory limit (``RLIMIT_DATA``)."""
        memory = self._host_memory_limit(launch.host_memory_gib)
        return run_program(self._program, self._bound().rank, launch, reporter, generation, memory)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Count a running `train` / `run_program` call (`settle` waits for none)."""
        with self._calls:
            self._running += 1
        try:
            yield
        finally:
            with self._calls:
                self._running -= 1
                self._calls.notify_all()

    def _host_memory_limit(self, spec_gib: float | None) -> HostMemoryLimit:
        """The rank's host-memory limit: this node's memory over its GPU slots, or ``spec_gib`` up to that
        (`rank_limit`). A worker runs one job (a pooled one is bound once), so the limit is always its job's."""
        slots = next((len(node.gpus) for node in cluster_nodes() if node.name == self._node), 1)
        return rank_limit(spec_gib, node_memory_bytes(), slots)

    def request_stop(self) -> None:
        """Ask the engine to save a checkpoint at its next step boundary and return (every rank agrees on
        the step, `Trainer`'s ``stop_requested``); served while `train` runs."""
        self._stop_requested.set()

    def stop_program(self, grace: float) -> None:
        """Kill the program's process tree (SIGTERM, SIGKILL after ``grace`` seconds); a program not
        started yet never starts."""
        with self._program.lock:
            self._program.stopped = True
            process = self._program.process
        if process is not None:
            process.kill_tree(grace)


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception, at most 300 characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}".rstrip(": ")[:300]


def _abort_collectives() -> None:
    """Abort every process group of this process (torch's `_abort_process_group`: NCCL communicators and
    gloo contexts), so that a collective blocked on a peer that is gone raises."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    if not dist.is_initialized():
        return
    try:
        _abort_process_group()
    except Exception:  # the rank tore its groups down meanwhile
        log.warning("aborting the process groups failed", exc_info=True)


def _cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (then CUDA_VISIBLE_DEVICES can no longer choose its GPU)."""
    import torch

    return bool(torch.cuda.is_initialized())


def _exit_with_group(binding: RankBinding) -> None:
    """Exit this process once the binding's placement group is removed (a pooled worker is not in
    it, so Ray would not kill it with the group)."""
    group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(binding.placement_group_id)))
    while True:
        time.sleep(PLACEMENT_GROUP_CHECK_SECONDS)
        try:
            state = placement_group_table(group).get("state")
        except Exception:  # GCS briefly unreachable: check again later
            log.warning("could not read placement group %s", binding.placement_group_id, exc_info=True)
            continue
        if state == "REMOVED":
            log.info("job %s: placement group removed; this pooled rank exits", binding.job_id)
            os._exit(1)


def _send_step(reporter: Any, generation: int, rank: int, report: StepReport, timeout: float) -> None:
    """Send rank 0's StepReport to the supervisor; a step that saved a checkpoint waits until it is
    recorded (at most ``timeout`` seconds), since its checkpoint is committed after this returns."""
    sent = reporter.record_step.remote(generation, rank, _as_dict(report))
    if report.checkpoint_bytes is not None:
        ray.get(sent, timeout=timeout)


def _as_dict(value: Any) -> dict[str, Any]:
    """A dataclass (StepReport, TrainResult) or a pydantic model as a plain dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(f"expected a dataclass or a dict, got {type(value).__name__}")
