"""Sharded, reshardable checkpoints with DCP, written atomically, with retention.

Layout under the job's checkpoint directory:

    step_00000050/            a complete checkpoint (DCP files + .metadata)
        COMPLETE              written last, by rank 0, after every rank finished writing
    .tmp_step_00000100/       a checkpoint being written (ignored, removed on the next save)

Rank 0 creates the temporary directory (`begin_save`), every rank writes its shards with `dcp.save`
(or in the background, `async_writer`), and once every rank has written, rank 0 commits it
(`commit_checkpoint`): it calls the caller's `before_commit` hook (the trainer reports the step there, so no complete checkpoint is ahead of
the steps its job has reported), writes `COMPLETE` and renames the directory to its final name, then deletes all but the newest `keep_last`
complete checkpoints. A crash at any point leaves either the old set or the old set plus a complete new
one. `COMPLETE` holds a manifest (every file's size), so a checkpoint damaged after it was written (a
file truncated or gone) is detected; `latest_checkpoint` skips damaged and partial ones and says why.
Loading uses `dcp.load` into a template built by the *current* layout, so a checkpoint written under one
layout loads into any other (DCP reshards by fully-qualified name). It reads through `dcp_reader`, which
unpickles nothing but what DCP writes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainctl.parallelism.checkpoint.dcp_reader import CheckpointReader, load_dcp
from trainctl.parallelism.checkpoint.layout import COMPLETE as COMPLETE  # re-exported: the layout's names
from trainctl.parallelism.checkpoint.layout import METADATA as METADATA
from trainctl.parallelism.checkpoint.layout import STEP_DIR as STEP_DIR
from trainctl.parallelism.checkpoint.layout import checkpoint_problem as checkpoint_problem
from trainctl.parallelism.checkpoint.layout import checkpoint_size as checkpoint_size
from trainctl.parallelism.checkpoint.layout import complete_checkpoints as complete_checkpoints
from trainctl.parallelism.checkpoint.layout import latest_checkpoint as latest_checkpoint
from trainctl.parallelism.checkpoint.layout import step_dir_name as step_dir_name
from trainctl.spec.files import FileRule

RESUME_FIELD = "spec.checkpoint.resume"
"""The spec field that has a job load its own checkpoints, which errors of reading them name."""


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def begin_save(root: str | Path, step: int) -> Path:
    """Collectively prepare checkpoint `step`'s temporary directory (rank 0 removes partial saves left
    by crashes); returns its path."""
    root = Path(root)
    tmp = pending_dir(root, step)
    if _is_coordinator():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    return tmp


def pending_dir(root: str | Path, step: int) -> Path:
    """Where checkpoint `step` is written until it is committed."""
    return Path(root) / f".tmp_{step_dir_name(step)}"


def commit_checkpoint(
    root: str | Path, step: int, keep_last: int, before_commit: Callable[[int], Any] | None = None
) -> Path:
    """Rank 0 only, once every rank has written checkpoint `step`'s shards: call ``before_commit(size)``
    (``size`` is what `checkpoint_size` will report), write the `COMPLETE` manifest, rename the
    directory to its final name and delete all but the newest `keep_last` complete checkpoints. If
    ``before_commit`` raises, the checkpoint is never committed. Returns the final path."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = Path(root)
    tmp, final = pending_dir(root, step), root / step_dir_name(step)
    files = _manifest(tmp)
    marker = json.dumps({"step": step, "files": files}, sort_keys=True)
    if before_commit is not None:
        before_commit(sum(files.values()) + len(marker.encode()))
    (tmp / COMPLETE).write_text(marker)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for _, old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    keep_last: int,
    before_commit: Callable[[int], Any] | None = None,
) -> Path:
    """Collectively save `state` (a DCP state dict) as checkpoint `step`; returns its final path.

    ``before_commit(size)`` runs on rank 0 once every rank has written its shards and before the
    checkpoint becomes complete (see `commit_checkpoint`)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    tmp = begin_save(root, step)
    with quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    _barrier()
    final = Path(root) / step_dir_name(step)
    if _is_coordinator():
        final = commit_checkpoint(root, step, keep_last, before_commit)
    _barrier()
    return final


def _manifest(directory: Path) -> dict[str, int]:
    """Size of every file under `directory` (every rank has written its shards), by relative path."""
    return {
        str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()
    }


def load_checkpoint(
    path: str | Path, state: dict[str, Any], files: FileRule = FileRule(), field: str = RESUME_FIELD
) -> None:
    """Collectively load checkpoint `path` into `state` in place (resharding to `state`'s layout), read
    under `files` through `dcp_reader` (a refusal is a ConfigurationError naming `field`)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    with quiet_single_process():
        load_dcp(state, CheckpointReader(path, files, field), no_dist=not dist.is_initialized())
