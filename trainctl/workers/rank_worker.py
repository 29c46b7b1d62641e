"""RankWorker: the Ray actor that runs one rank of a job's training loop.

A RankWorker is told its rank, its planned node and its local GPU index explicitly; nothing is
inferred from Ray's bundle order. It reports where it actually runs (the node label and the GPU
slot Ray reserved for it), offers rank 0's rendezvous endpoint, and runs
`trainctl.parallelism.trainer.Trainer`, forwarding step reports (rank 0), step times (the other
ranks) and log lines to the supervisor.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray

from trainctl.workers.resources import NODE_LABEL, slots_of


@dataclass(frozen=True)
class RankSlot:
    """Where the plan puts one rank: a node of the topology map and a local GPU index on it."""

    rank: int
    node: str
    gpu: int


@dataclass(frozen=True)
class RankLocation:
    """Where a rank actually runs, as the RankWorker itself observes it."""

    rank: int
    planned_node: str
    planned_gpu: int
    node: str | None
    """Value of the ``trainctl.io/node`` label of the Ray node the worker runs on."""
    gpu: int | None
    """Local GPU index of the slot resource Ray reserved for the worker."""
    node_id: str
    ip: str
    pid: int
    cuda_visible_devices: str

    @property
    def matches_plan(self) -> bool:
        """True when the worker runs on the planned node and holds the planned GPU slot."""
        return self.node == self.planned_node and self.gpu == self.planned_gpu

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (events, JSON)."""
        return dataclasses.asdict(self)


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RankWorker:
    """One rank of one job. Created by `RankGroup` inside the job's placement group."""

    def __init__(self, job_id: str, slot: RankSlot, world_size: int, use_gpu: bool) -> None:
        if not 0 <= slot.rank < world_size:
            raise ValueError(f"rank {slot.rank} is outside the world of {world_size} ranks")
        self._job_id = job_id
        self._slot = slot
        self._world_size = world_size
        self._use_gpu = use_gpu
        # Before torch is imported: the planned GPU only, or no CUDA at all on simulated GPUs.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(slot.gpu) if use_gpu else ""

    def location(self) -> RankLocation:
        """Where this worker runs, read from Ray's runtime context and the node's labels."""
        context = ray.get_runtime_context()
        slots = slots_of(context.get_assigned_resources())
        return RankLocation(
            rank=self._slot.rank,
            planned_node=self._slot.node,
            planned_gpu=self._slot.gpu,
            node=context.get_node_labels().get(NODE_LABEL),
            gpu=slots[0] if len(slots) == 1 else None,
            node_id=context.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        )

    def endpoint(self) -> tuple[str, int]:
        """Rendezvous address for the group: this node's IP and a port free on it (rank 0 only)."""
        if self._slot.rank != 0:
            raise RuntimeError(f"rank {self._slot.rank} asked for the rendezvous endpoint; only rank 0 hosts it")
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def train(
        self,
        master_addr: str,
        master_port: int,
        job_json: str,
        checkpoint_dir: str,
        reporter: Any,
        generation: int,
    ) -> dict[str, Any]:
        """Join the process group and run the training loop; returns the TrainResult as a dict.

        ``reporter`` is the supervisor's actor handle: rank 0's step reports go to its ``record_step``,
        the other ranks' step times (at the same steps) to ``record_step_time``, and log lines to
        ``record_log``, tagged with this rank and the group ``generation``.
        """
        from trainctl.parallelism.distributed import init_distributed, teardown
        from trainctl.parallelism.trainer import Trainer
        from trainctl.spec.job import JobSpecBody

        rank = self._slot.rank
        body = JobSpecBody.model_validate_json(job_json)
        device = init_distributed(
            rank,
            self._world_size,
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
                world_size=self._world_size,
                device=device,
                checkpoint_dir=checkpoint_dir,
                on_step=lambda report: reporter.record_step.remote(generation, rank, _as_dict(report)),
                on_event=lambda message: reporter.record_log.remote(generation, rank, str(message)),
                # Rank 0's step time comes with its StepReport.
                on_step_time=None if rank == 0 else (
                    lambda step, seconds: reporter.record_step_time.remote(generation, rank, step, seconds)
                ),
            )
            return _as_dict(trainer.run())
        finally:
            teardown()


def _as_dict(value: Any) -> dict[str, Any]:
    """A dataclass (StepReport, TrainResult) or a pydantic model as a plain dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(f"expected a dataclass or a dict, got {type(value).__name__}")
