"""In-memory snapshots: each rank's own shard of the training state, kept in host memory outside the rank.

Every `checkpoint.memory_interval_steps` steps a rank turns its part of the state (model, optimizer,
schedule, RNG, data offset: what a checkpoint holds, DTensors as their local shards) into one byte string
(`snapshot_payload`: each tensor copied once) and hands it to a `SnapshotStore`, which keeps copies where the rank's death does not
take them (the workers' keepers: one on the rank's node, one on a peer node). A restarted generation of the
same layout restores from the newest step every rank still has a copy of (`agreed_snapshot_step`), when it
is newer than the newest durable checkpoint; any rank that cannot read its copy sends every rank to the
durable checkpoint instead. A snapshot restores only into the layout that took it (the same rank grid:
each rank reads back its own shard); the durable checkpoint stays the ground truth, and resharding.

A payload is a JSON header and the tensors' bytes (`snapshot_format`): nothing in it is unpickled or run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainctl.parallelism.checkpoint.snapshot_format import pack, unpack


class SnapshotMismatch(ValueError):
    """A snapshot does not fit the state it is restored into (another layout or model); the message says where."""


class SnapshotStore(Protocol):
    """Where one rank's snapshots are kept (the rank is the store's; every call is about it alone)."""

    def put(self, step: int, payload: bytearray) -> None:
        """Keep ``payload`` as the snapshot of ``step``: what it keeps is copied or written before this
        returns (the caller reuses ``payload`` for its next snapshot); the copies elsewhere may be made later."""

    def steps(self) -> set[int]:
        """Steps of which some copy of this rank's snapshot is held now."""

    def fetch(self, step: int) -> tuple[bytes | bytearray, str] | None:
        """This rank's snapshot of ``step`` and where it was read from (None: no copy answers)."""

    def discard_after(self, step: int) -> None:
        """Drop this rank's snapshots of steps after ``step`` (a restart went back to it)."""


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (a view: `pack` copies it, from any device)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(item) for item in value)
    return value


def snapshot_payload(state: dict[str, Any], reuse: bytearray | None = None) -> bytearray:
    """This rank's part of ``state`` (a checkpoint's state dict) as one payload (`snapshot_format`: each
    tensor copied once, into it; into ``reuse``, the previous payload, when the layout is the same)."""
    return pack(_local(state), reuse)


def _restored(template: Any, saved: Any, where: str, fill: bool) -> Any:
    """``template`` filled from ``saved`` when ``fill`` (tensors copied in place, a DTensor into its local
    shard; other values taken), else only checked: a key, length, shape or dtype that differs raises
    SnapshotMismatch naming ``where``."""
    if isinstance(template, torch.Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            got = f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise SnapshotMismatch(f"{where}: the snapshot has {got}, this layout {tuple(local.shape)} {local.dtype}")
        if fill:
            with torch.no_grad():
                local.copy_(saved)
        return template
    if isinstance(template, dict):
        if not isinstance(saved, dict) or saved.keys() != template.keys():
            missing = sorted(set(template) - set(saved)) if isinstance(saved, dict) else ["(not a mapping)"]
            extra = sorted(set(saved) - set(template)) if isinstance(saved, dict) else []
            raise SnapshotMismatch(f"{where}: keys differ (missing {missing[:3]}, unexpected {extra[:3]})")
        for key in template:
            value = _restored(template[key], saved[key], f"{where}.{key}", fill)
            if fill:
                template[key] = value
        return template
    if isinstance(template, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(template):
            raise SnapshotMismatch(f"{where}: the snapshot's length differs")
        return type(template)(_restored(t, s, f"{where}[{i}]", fill) for i, (t, s) in enumerate(zip(template, saved, strict=True)))
    return saved if fill else template


def restore_payload(payload: bytes | bytearray, state: dict[str, Any]) -> None:
    """Fill ``state`` (built by the current layout) in place from ``payload`` (`snapshot_payload` of the
    same layout); SnapshotMismatch when it does not fit and SnapshotFormatError when it is not a snapshot,
    and then nothing of ``state`` has changed."""
    saved = unpack(payload)
    _restored(state, saved, "state", fill=False)
    _restored(state, saved, "state", fill=True)


def agreed_snapshot_step(steps: Iterable[int], newer_than: int | None) -> int | None:
    """Collectively: the newest step of which every rank holds a snapshot (each passes its own ``steps``),
    if it is newer than ``newer_than`` (the durable checkpoint's step; None: none). Every rank gets the same
    answer."""
    mine = sorted(steps)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        common = set(mine).intersection(*(set(theirs or ()) for theirs in everyone))
    else:
        common = set(mine)
    candidates = [step for step in common if newer_than is None or step > newer_than]
    return max(candidates) if candidates else None


def every_rank_agrees(ok: bool, device: torch.device) -> bool:
    """Collectively: whether ``ok`` holds on every rank."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
