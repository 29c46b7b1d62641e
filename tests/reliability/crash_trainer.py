"""Run `Trainer.run()` on one process and SIGKILL the process at a chosen point of one checkpoint save.

    python crash_trainer.py JOB_JSON CHECKPOINT_DIR CRASH_POINT CRASH_STEP

CRASH_POINT is where the process dies while saving the checkpoint of CRASH_STEP:
``shards-written`` (every shard on disk, no COMPLETE marker yet) or ``before-commit`` (COMPLETE
written in the temporary directory, not yet renamed to its final name). Used by
test_checkpoint_crash.py; the process must die by SIGKILL, so it is a separate process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import JobSpecBody

CRASH_POINTS = ("shards-written", "before-commit")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    job_json, checkpoint_dir, point, step = argv
    if point not in CRASH_POINTS:
        raise SystemExit(f"CRASH_POINT must be one of {CRASH_POINTS}, got {point!r}")
    crash_dir = ckpt.step_dir_name(int(step))
    torch.set_num_threads(1)
    if point == "shards-written":
        manifest = ckpt._manifest

        def manifest_then_die(directory: Path) -> dict[str, int]:
            if directory.name.endswith(crash_dir):
                _die()
            return manifest(directory)

        ckpt._manifest = manifest_then_die  # called after every shard is written, before the marker
    else:
        rename = Path.rename

        def die_before_commit(self: Path, target: str | Path) -> Path:
            if Path(target).name == crash_dir:
                _die()
            return rename(self, target)

        Path.rename = die_before_commit  # type: ignore[method-assign]
    Trainer(JobSpecBody.model_validate_json(Path(job_json).read_text()), device="cpu", checkpoint_dir=checkpoint_dir).run()
    return 0  # reached only when the crash step was never saved


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
