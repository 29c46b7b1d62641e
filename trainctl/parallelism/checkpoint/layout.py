"""A job's checkpoints on disk, without torch: which `step_*` directories are complete (their `COMPLETE`
manifest written last, every file it lists present at its size), the newest intact one, and sizes.
`trainctl.parallelism.checkpoint.dcp` writes and reads them; the service checks them at submit time.

Checkpoints another run wrote (`spec.init_from`) are read under the job's `FileRule`
(trainctl.spec.files): the marker where it lies and bounded, each file its manifest lists a file of the
checkpoint directory; the default rule (a job's own checkpoints) only bounds the read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from trainctl.spec.files import MAX_JSON_BYTES, FileRule, FileRuleError, loads_bounded

FIELD = "spec.init_from"
"""The spec field naming checkpoints of another run, which errors of the rule name."""
COMPLETE = "COMPLETE"
METADATA = ".metadata"
"""DCP's metadata file in every checkpoint directory."""
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


def checkpoint_problem(path: str | Path, files: FileRule = FileRule()) -> str | None:
    """Why the checkpoint at `path` cannot be loaded (no marker, a file missing or of the wrong size),
    or None when it is intact; FileRuleError when the marker or a file it lists breaks `files`. A
    marker from before manifests only needs DCP's metadata file."""
    path = Path(path)
    marker = files.check(path / COMPLETE, FIELD)
    if not marker.is_file():
        return f"partial: no {COMPLETE} marker"
    raw = files.read_bytes(marker, FIELD, MAX_JSON_BYTES)
    try:
        listed = loads_bounded(raw, str(marker), FIELD)["files"]
    except (FileRuleError, KeyError, TypeError):  # not a JSON manifest (or one nested too deeply to decode)
        listed = {METADATA: None}
    if not isinstance(listed, dict):
        return f"its {COMPLETE} manifest is malformed"
    for name, size in sorted(listed.items()):
        file = files.member(path, name, FIELD, str(marker))
        if not file.is_file():
            return f"file {name} is missing"
        if size is not None and file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, {size} were written"
    return None


def checkpoint_size(path: str | Path) -> int:
    """Bytes of the complete checkpoint at `path`: the files its `COMPLETE` manifest lists, plus the marker."""
    path = Path(path)
    marker = path / COMPLETE
    return sum(json.loads(marker.read_text())["files"].values()) + marker.stat().st_size


def latest_checkpoint(
    root: str | Path, on_skip: Callable[[Path, str], None] | None = None, files: FileRule = FileRule()
) -> tuple[int, Path] | None:
    """The newest intact complete checkpoint, or None. Partial saves and damaged checkpoints are
    skipped; `on_skip(path, why)` hears about each one met on the way. A checkpoint that breaks
    `files` is not skipped: FileRuleError."""
    root = Path(root)
    skip = on_skip or (lambda _path, _why: None)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(".tmp_step_") or (STEP_DIR.match(child.name) and not (child / COMPLETE).is_file()):
                skip(child, "partial: the save did not finish")
    for step, path in reversed(complete_checkpoints(root)):
        problem = checkpoint_problem(path, files)
        if problem is None:
            return step, path
        skip(path, problem)
    return None
