"""Spares: one engine-loaded RankWorker per node of a job's plan, kept by its supervisor for restarts.

A rank that dies takes its process with it; its replacement would import torch and the engine before
the next generation can rendezvous (seconds of CPU, on a node whose other ranks wait for it). A spare
pays that ahead: an unbound `RankWorker` with ``gpu`` None on the node (no CPU, no slot resource, by
node label, like the warm pool's), which the next generation binds to the dead rank's slot
(`RankGroup.renewed`). The supervisor owns its spares (they die with it) and starts them only once the
job has trained for a while (`SupervisorConfig.spare_after`): a short job would pay the imports for
nothing. A spare used or gone is started again when the next generation starts.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import NOSET_CUDA_ENV
from trainctl.workers.rank_worker import RankWorker
from trainctl.workers.resources import NODE_LABEL

log = logging.getLogger(__name__)


def spare_name(job_id: str, node: str) -> str:
    """A new spare's actor name (a serial keeps names unique across replacements)."""
    return f"trainctl-spare-{job_id}-{node}-{uuid.uuid4().hex[:8]}"


@dataclass
class Spares:
    """The spares of one job's supervisor, by node."""

    job_id: str
    use_gpu: bool
    _by_node: dict[str, Any] = field(default_factory=dict)
    _worker_class: Any = field(default_factory=lambda: ray.remote(RankWorker), repr=False)
    """One remote class for every spare: Ray exports it once (`rank_group._fresh_worker`)."""

    def ensure(self, nodes: Iterable[str]) -> None:
        """A spare on each of ``nodes`` (starting one where there is none); spares elsewhere are killed."""
        wanted = set(nodes)
        for node in [node for node in self._by_node if node not in wanted]:
            _kill(self._by_node.pop(node))
        missing = sorted(wanted - self._by_node.keys())
        for node in missing:
            self._by_node[node] = self._create(node)
        if missing:
            log.info("job %s: starting spare rank processes on %s", self.job_id, ", ".join(missing))

    def take(self, slots: Sequence[RankAssignment], ranks: Iterable[int]) -> dict[int, Any]:
        """Rank -> its node's spare for each of ``ranks`` (one rank per spare); the caller binds or kills them."""
        by_rank = {slot.rank: slot for slot in slots}
        taken: dict[int, Any] = {}
        for rank in ranks:
            spare = self._by_node.pop(by_rank[rank].node, None)
            if spare is not None:
                taken[rank] = spare
        return taken

    def stop(self) -> None:
        """Kill every spare."""
        spares, self._by_node = list(self._by_node.values()), {}
        for spare in spares:
            _kill(spare)

    def _create(self, node: str) -> Any:
        options: dict[str, Any] = {
            "name": spare_name(self.job_id, node),
            "num_cpus": 0,
            "max_restarts": 0,
            "max_concurrency": 2,  # as a RankGroup's workers: `request_stop` / `settle` are served while the rank runs
            "label_selector": {NODE_LABEL: node},
        }
        if self.use_gpu:
            options["runtime_env"] = {"env_vars": {NOSET_CUDA_ENV: "1"}}
        return self._worker_class.options(**options).remote(node, None, self.use_gpu)


def _kill(handle: Any) -> None:
    with contextlib.suppress(RayError):  # already gone
        ray.kill(handle, no_restart=True)
