"""`teardown` leaves nothing of a finished run's process groups behind: a process (a test pool worker, a
pooled rank) that trains under a mesh and tears down holds no gloo threads afterwards."""

from __future__ import annotations

import gc
import os

from harness import tiny_job

from trainctl.parallelism.engine.distributed import teardown
from trainctl.spec.job import JobSpecBody


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo process groups."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return [name for name in names if "gloo" in name]


def train_then_teardown(rank: int, world_size: int, body_json: str) -> tuple[int, int]:
    """Gloo threads while a tp2 trainer runs, and after teardown."""
    from trainctl.parallelism.engine.trainer import Trainer

    trainer = Trainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu")
    trainer.global_loss(trainer.forward_backward(trainer.loader.next_batch()))
    trainer.optimizer_step()
    running = len(gloo_threads())
    del trainer
    teardown()
    gc.collect()
    return running, len(gloo_threads())


def test_teardown_releases_every_process_group(pool, corpus):
    body = tiny_job(corpus, tp=2)
    for running, after in pool.run(train_then_teardown, 2, body.model_dump_json()):
        assert running > 0 and after == 0
