"""Run `Trainer.run()` with `checkpoint.async_save` on one process and SIGKILL it while the background
thread writes the checkpoint of a chosen step (its shards on disk, the training loop going on).

    python async_crash_trainer.py JOB_JSON CHECKPOINT_DIR CRASH_STEP

Used by test_checkpoint_async_crash.py; the process must die by SIGKILL, so it is a separate process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from trainctl.parallelism.checkpoint import async_writer
from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import JobSpecBody


def main(argv: list[str]) -> int:
    job_json, checkpoint_dir, step = argv
    crash_dir = f".tmp_{ckpt.step_dir_name(int(step))}"
    save = async_writer.dcp.save

    def save_then_die(state: dict[str, Any], *, checkpoint_id: str, **kwargs: Any) -> Any:
        result = save(state, checkpoint_id=checkpoint_id, **kwargs)
        if Path(checkpoint_id).name == crash_dir:
            os.kill(os.getpid(), signal.SIGKILL)  # from the writer thread, mid-run
        return result

    async_writer.dcp.save = save_then_die  # type: ignore[assignment]
    torch.set_num_threads(1)
    job = JobSpecBody.model_validate_json(Path(job_json).read_text())
    Trainer(job, device="cpu", checkpoint_dir=checkpoint_dir).run()
    return 0  # reached only when the crash step was never saved in the background


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
