"""GroupKeeper: a job's rank group from one generation to the next, for its supervisor.

It holds the current generation's `RankGroup` (a cancel or a preemption reaches it from the supervisor's
control threads) and makes the next one: on the ranks kept from a failed generation when restarts are warm
(`keep_survivors`, then `next_group`: the same placement group, a dead rank on its node's spare or a fresh
process), else a new group (`RankGroup.create`, the first one with the warm pool's workers). It keeps the
job's spares (`trainctl.workers.spares`) and snapshot keepers (`trainctl.workers.snapshot_keepers`), and
tears the group down (`shutdown`): a second teardown waits until the first is done, so a generation, and
the job with it, ends only after its ranks are gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import RankGroup, owned_by
from trainctl.workers.snapshot_keepers import SnapshotKeepers
from trainctl.workers.spares import Spares

log = logging.getLogger(__name__)

SETTLE_TIMEOUT = 2.0
"""Seconds a failed generation's ranks have to return from their calls to be kept for the next one: the
peers of a dead rank raise within a second; a rank still blocked then (in a collective with a peer that
is alive but left it) gets a spare or a fresh process, which costs about as much as waiting longer. Once
a peer has settled, the others are waited for `trainctl.workers.settling.BLOCKED_GRACE` more at most."""


@dataclass
class GroupKeeper:
    """The rank groups of one job's generations. Build it once per supervisor."""

    job_id: str
    use_gpu: bool
    programs: bool
    """The ranks run a command job's program (never kept between generations)."""
    placement_timeout: float
    call_timeout: float
    warm: dict[int, Any] = field(default_factory=dict)
    """Rank -> idle pooled worker of its planned slot, for the first group (`RankGroup.create` binds or kills them)."""
    spares: Spares = field(init=False)
    snapshot_keepers: SnapshotKeepers = field(init=False)
    """The job's in-memory snapshot keepers (started by the supervisor when its spec takes snapshots)."""
    _group: RankGroup | None = None
    _kept: list[int] | None = None
    """Ranks of the failed generation's group (still `_group`) kept for the next generation."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _shutdown_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a group is torn down or its survivors settle: a teardown waits until it is done."""

    def __post_init__(self) -> None:
        self.spares = Spares(self.job_id, self.use_gpu)
        self.snapshot_keepers = SnapshotKeepers(self.job_id)

    @property
    def current(self) -> RankGroup | None:
        """The group of the current generation (kept ranks included), or None."""
        with self._lock:
            return self._group

    def hold(self, group: RankGroup) -> None:
        """Make ``group`` the current one (from `next_group`)."""
        with self._lock:
            self._group = group

    def next_group(
        self, generation: int, slots: list[RankAssignment], stop: Callable[[], bool]
    ) -> tuple[RankGroup, str | None]:
        """The group for ``generation`` on ``slots`` (`hold` it next), and a line saying which ranks kept their
        processes, took spares or started new ones when it runs on kept ranks (None for a new group).
        A new group raises `PlacementUnavailable` as `RankGroup.create` does (``stop`` ends its wait)."""
        renewed = self._renewed(generation, slots)
        if renewed is not None:
            return renewed
        warm, self.warm = self.warm, {}
        group = RankGroup.create(
            self.job_id, generation, slots, use_gpu=self.use_gpu, ready_timeout=self.placement_timeout, stop=stop,
            warm=warm, bind_timeout=self.call_timeout, programs=self.programs,
        )
        return group, None

    def keep_survivors(self) -> None:
        """After the current generation failed: keep its ranks that settle (`RankGroup.release`) and its
        placement group for `next_group`; none settled (or a command job's group): tear it down."""
        if not self.programs:
            with self._shutdown_lock:
                with self._lock:
                    group = self._group
                if group is None:  # a cancel tore it down already
                    return
                kept = group.release(SETTLE_TIMEOUT)
                if kept:
                    with self._lock:
                        self._kept = kept
                    return
        self.shutdown()

    def ensure_spares(self, nodes: Iterable[str]) -> None:
        """A spare on each of ``nodes`` (`Spares.ensure`)."""
        self.spares.ensure(nodes)

    def shutdown(self) -> None:
        """Tear the current group down; returns once it is gone, also when another thread (a cancel) is
        tearing it down."""
        with self._shutdown_lock:
            with self._lock:
                group, self._group, self._kept = self._group, None, None
            if group is not None:
                group.shutdown()

    def stop(self) -> None:
        """The job has ended: tear the group down and kill the spares and the snapshot keepers."""
        self.shutdown()
        self.spares.stop()
        self.snapshot_keepers.stop()

    def remove_leftovers(self) -> None:
        """Remove placement groups a previous incarnation of the job's supervisor left behind (their ranks
        with them; its spares died with it)."""
        for pg_id, info in ray.util.placement_group_table().items():
            if owned_by(info.get("name", ""), self.job_id) and info.get("state") != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

    def _renewed(self, generation: int, slots: list[RankAssignment]) -> tuple[RankGroup, str] | None:
        """The next generation on the kept ranks when there are some and the plan is unchanged (else the
        kept group is torn down): a dead rank on its node's spare or a fresh process."""
        with self._lock:
            group, kept, self._kept = self._group, self._kept, None
        if group is None or kept is None:
            return None
        if group.slots != slots:
            self.shutdown()
            return None
        replaced = [slot.rank for slot in slots if slot.rank not in kept]
        try:
            renewed, bound = group.renewed(generation, kept, self.spares.take(slots, replaced), self.call_timeout)
        except RayError as exc:  # a kept worker died since: the generation starts on a new group
            log.warning("job %s: kept ranks unusable (%s); starting new ones", self.job_id, exc)
            self.shutdown()
            return None
        fresh = [rank for rank in replaced if rank not in bound]
        line = (
            f"warm restart: rank(s) {_ranks(kept)} keep their processes"
            + (f"; rank(s) {_ranks(bound)} on spare processes" if bound else "")
            + (f"; rank(s) {_ranks(fresh)} in new processes" if fresh else "")
        )
        return renewed, line


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(rank) for rank in ranks)
