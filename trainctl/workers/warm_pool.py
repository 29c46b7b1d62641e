"""WarmPool: one idle, engine-loaded RankWorker per free GPU slot, so a job's ranks start warm.

A fresh rank spends seconds importing torch and the engine before its first step. The pool pays
that ahead of time: for every GPU slot of every live trainctl node that no placement group holds,
it keeps one pooled `RankWorker` (a detached actor named ``trainctl-warm-<node>-<gpu>-<serial>``,
no CPU, no slot resource, on that node by label) that has imported the engine. `take` hands a job
the idle workers of its planned slots; the job's `RankGroup` still reserves the slots with its
placement group, binds the workers to their ranks and kills the ones it does not use. A bound
worker exits when its group's placement group is removed, so it lives exactly as long as a worker
created inside the group.

The keeper thread (`start`) refills a slot once it is free again, drops workers whose node is gone,
replaces idle workers that died, and kills a handed-out worker that was never bound (its supervisor
died first). On `start` the pool adopts idle workers a previous service left; `stop` kills the idle
ones (bound ones belong to their jobs, which outlive the service).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

from trainctl.workers.nodes import cluster_nodes
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_group import NOSET_CUDA_ENV
from trainctl.workers.rank_worker import RankWorker
from trainctl.workers.resources import NODE_LABEL

log = logging.getLogger(__name__)

WARM_PREFIX = "trainctl-warm-"


def warm_name(node: str, gpu: int) -> str:
    """A new pooled worker's actor name for one slot (a serial keeps names unique across refills)."""
    return f"{WARM_PREFIX}{node}-{gpu}-{uuid.uuid4().hex[:8]}"


def parse_warm_name(name: str) -> tuple[str, int] | None:
    """The (node, gpu) slot of a pooled worker's name, or None for other names."""
    if not name.startswith(WARM_PREFIX):
        return None
    node, _, rest = name[len(WARM_PREFIX) :].rpartition("-")  # strip the serial
    node, _, gpu = node.rpartition("-")
    return (node, int(gpu)) if node and gpu.isdigit() and rest else None


@dataclass(frozen=True)
class _SlotState:
    """What the keeper reads from Ray about one live slot."""

    node: str
    gpu: int
    free: bool
    use_gpu: bool


@dataclass
class WarmPool:
    """The pool of one Ray namespace."""

    namespace: str
    interval: float = 1.0
    """Seconds between keeper passes."""
    handed_out_grace: float = 120.0
    """A handed-out worker still unbound this long after `take` is killed (its job's supervisor is gone)."""
    taken_grace: float = 30.0
    """A slot handed to a job is not refilled until its placement group holds it, or for this long."""
    check_interval: float = 10.0
    """Seconds between checks that an idle worker is still alive (a dead one is replaced)."""
    _idle: dict[tuple[str, int], tuple[Any, bool]] = field(default_factory=dict)
    """(node, gpu) -> (worker handle, whether it uses CUDA)."""
    _handed_out: list[tuple[float, Any]] = field(default_factory=list)
    """(time of `take`, worker) for workers handed to a job and not yet seen bound."""
    _taken: dict[tuple[str, int], float] = field(default_factory=dict)
    """Slots handed to a job whose placement group has not been seen holding them: not refilled for
    ``taken_grace`` (a job that ends sooner gets its slots refilled after that)."""
    _checks: dict[Any, Any] = field(default_factory=dict)
    """Worker -> reply of its pending liveness check."""
    _checked_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _worker_class: Any = field(default_factory=lambda: ray.remote(RankWorker), repr=False)
    """One remote class for every pooled worker: Ray exports it once (`rank_group._fresh_worker`)."""

    def start(self) -> WarmPool:
        """Adopt idle pooled workers already in the namespace, fill the pool, start the keeper."""
        self._adopt()
        self.refill()
        self._thread = threading.Thread(target=self._keep, name="trainctl-warm-pool", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the keeper and kill the idle workers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        with self._lock:
            idle, self._idle = list(self._idle.values()), {}
        for handle, _ in idle:
            _kill(handle)

    def take(self, slots: Sequence[RankAssignment], use_gpu: bool) -> dict[int, Any]:
        """Rank -> idle worker for each planned slot that has one using the same backend (CUDA or
        not). The caller owns them from now on: bind them (`RankGroup.create`) or kill them."""
        taken: dict[int, Any] = {}
        with self._lock:
            for slot in slots:
                entry = self._idle.get((slot.node, slot.gpu))
                if entry is not None and entry[1] == use_gpu:
                    del self._idle[(slot.node, slot.gpu)]
                    taken[slot.rank] = entry[0]
            now = time.monotonic()
            self._handed_out.extend((now, handle) for handle in taken.values())
            self._taken.update({(slot.node, slot.gpu): now for slot in slots})
        return taken

    def idle_slots(self) -> list[tuple[str, int]]:
        """The slots with an idle worker (loaded or still loading)."""
        with self._lock:
            return sorted(self._idle)

    def wait_loaded(self, timeout: float) -> None:
        """Block until every idle worker has imported the engine (TimeoutError after ``timeout``)."""
        with self._lock:
            handles = [handle for handle, _ in self._idle.values()]
        refs = [handle.binding.remote() for handle in handles]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(refs)} pooled workers not loaded within {timeout:g}s")

    def refill(self) -> None:
        """One keeper pass: forget idle workers that died or whose slot is gone; a worker for each free
        live slot without one; kill handed-out workers their job never bound."""
        slots = {(s.node, s.gpu): s for s in _live_slots()}
        now = time.monotonic()
        self._drop_dead(now)
        with self._lock:
            for key in [key for key in self._idle if key not in slots]:
                _kill(self._idle.pop(key)[0])  # node gone (the worker with it) or relabelled
            self._taken = {
                key: at
                for key, at in self._taken.items()
                if key in slots and slots[key].free and now - at < self.taken_grace
            }
            missing = [s for key, s in slots.items() if s.free and key not in self._idle and key not in self._taken]
            for slot in missing:
                self._idle[(slot.node, slot.gpu)] = (self._create(slot), slot.use_gpu)
        if missing:
            log.info("warm pool: starting %d worker(s) (%s)", len(missing), ", ".join(f"{s.node}/{s.gpu}" for s in missing))
        self._reap_handed_out()

    # ---- internals -----------------------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refill()
            except Exception:  # the keeper must outlive a bad pass (GCS restart, node churn)
                log.exception("warm pool: keeper pass failed")

    def _drop_dead(self, now: float) -> None:
        """Every ``check_interval``, send each idle worker a liveness check; drop the idle workers whose
        check failed (died loading the engine, killed from outside), so the pass replaces them."""
        with self._lock:
            checks = list(self._checks.items())
        refs = [ref for _, ref in checks]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        with self._lock:
            for handle, ref in checks:
                if ref not in answered:
                    continue
                del self._checks[handle]
                try:
                    ray.get(ref)
                except RayError:
                    for slot in [slot for slot, (idle, _) in self._idle.items() if idle is handle]:
                        log.warning("warm pool: the idle worker of %s/%d is gone; replacing it", *slot)
                        del self._idle[slot]
            if now - self._checked_at >= self.check_interval:
                self._checked_at = now
                for handle, _ in self._idle.values():
                    self._checks.setdefault(handle, handle.binding.remote())

    def _create(self, slot: _SlotState) -> Any:
        options: dict[str, Any] = {
            "name": warm_name(slot.node, slot.gpu),
            "namespace": self.namespace,
            "lifetime": "detached",
            "num_cpus": 0,
            "max_restarts": 0,
            "max_concurrency": 2,  # as a RankGroup's workers: `request_stop` is served while the rank runs
            "label_selector": {NODE_LABEL: slot.node},
        }
        if slot.use_gpu:
            options["runtime_env"] = {"env_vars": {NOSET_CUDA_ENV: "1"}}
        return self._worker_class.options(**options).remote(slot.node, slot.gpu, slot.use_gpu)

    def _adopt(self) -> None:
        """Take over idle pooled workers left by a previous pool; kill duplicates of a slot."""
        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            slot = parse_warm_name(entry["name"]) if entry["namespace"] == self.namespace else None
            if slot is not None:
                found.append((slot, ray.get_actor(entry["name"], namespace=self.namespace)))
        refs = [handle.binding.remote() for _, handle in found]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0) if refs else ([], [])
        cuda = {(s.node, s.gpu): s.use_gpu for s in _live_slots()}
        with self._lock:
            for (slot, handle), ref in zip(found, refs, strict=True):
                if ref not in ready:
                    continue  # busy training (bound) or still loading: not ours to take
                try:
                    bound = ray.get(ref) is not None
                except RayError:
                    continue
                if bound:
                    continue
                if slot in self._idle or slot not in cuda:
                    _kill(handle)
                else:
                    self._idle[slot] = (handle, cuda[slot])
        if self._idle:
            log.info("warm pool: adopted %d idle worker(s)", len(self._idle))

    def _reap_handed_out(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [handle for at, handle in self._handed_out if now - at >= self.handed_out_grace]
            self._handed_out = [(at, h) for at, h in self._handed_out if now - at < self.handed_out_grace]
        refs = {handle.binding.remote(): handle for handle in due}
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0) if refs else ([], [])
        for ref in answered:  # the others are busy in their job's training loop: bound
            try:
                unbound = ray.get(ref) is None
            except RayError:  # gone
                continue
            if unbound:
                log.warning("warm pool: a worker handed to a job was never bound; killing it")
                _kill(refs[ref])


def _live_slots() -> list[_SlotState]:
    """Every GPU slot of every live named node, whether a placement group holds it, and whether the
    node has CUDA GPUs."""
    return [
        _SlotState(node.name, gpu, gpu in node.free_gpus, node.cuda_gpus > 0)
        for node in cluster_nodes()
        if node.alive and node.name is not None
        for gpu in node.gpus
    ]


def _kill(handle: Any) -> None:
    with contextlib.suppress(RayError):  # already gone
        ray.kill(handle, no_restart=True)
