"""Sharded, reshardable checkpoints with DCP, written atomically, with retention.

Layout under the job's checkpoint directory:

    step_00000050/            a complete checkpoint (DCP files + .metadata)
        COMPLETE              written last, by rank 0, after every rank finished writing
    .tmp_step_00000100/       a checkpoint being written (ignored, removed on the next save)

Rank 0 creates the temporary directory, every rank writes its shards with `dcp.save`, rank 0 writes
`COMPLETE` and renames the directory to its final name, then deletes all but the newest `keep_last`
complete checkpoints. A crash at any point leaves either the old set or the old set plus a complete new
one. Loading uses `dcp.load` into a template built by the *current* layout, so a checkpoint written
under one layout loads into any other (DCP reshards by fully-qualified name).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Collectively save `state` (a DCP state dict) as checkpoint `step`; returns its final path."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{step_dir_name(step)}"
    if _is_coordinator():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    _barrier()
    if _is_coordinator():
        (tmp / COMPLETE).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Collectively load checkpoint `path` into `state` in place (resharding to `state`'s layout)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
