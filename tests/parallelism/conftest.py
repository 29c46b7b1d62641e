"""Fixtures for engine tests: one pool of worker processes for the session, and a small corpus."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import WorkerPool, run_training, tiny_job

from trainctl.parallelism.data.dataset import CACHE_ENV
from trainctl.parallelism.engine.trainer import Trainer, TrainResult

WORDS = ["the", "model", "trains", "on", "text", "and", "every", "rank", "must", "agree", "on", "the", "loss", "while", "gradients", "flow", "through", "shards", "stages", "and", "rings", "of", "attention", "so", "that", "one", "process", "and", "many", "compute", "the", "same", "numbers"]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """In-process torch work on one thread: on a small shared machine, intra-op threads only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Cached token shards (data formats jsonl / parquet / arrow) under the session's temporary
    directory, for this process and the worker processes it starts after (autouse: before `pool`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("data-cache")))
        yield


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool()
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A glob over 6 deterministic text files (~60 KB in all)."""
    root: Path = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1234)
    for i in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(150)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    return str(root / "*.txt")


@pytest.fixture(scope="session")
def base_run(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A debug model (4 query, 2 kv heads) trained for 3 steps on `corpus`; its run's checkpoint root."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("base") / "checkpoints"
    Trainer(tiny_job(corpus, steps=3, training={"micro_batch_size": 4}), device="cpu", checkpoint_dir=root).run()
    return root


DP4_STEPS = 4
DP4_INTERVAL = 2


@pytest.fixture(scope="session")
def dense_dp4_run(pool: WorkerPool, corpus: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    """The debug model trained uninterrupted under FSDP dp4 (`tiny_job`, 4 steps, checkpoints at steps 2 and 4):
    its checkpoint root and rank 0's result. The resume-under-another-layout tests copy its step-2 checkpoint:
    the 2 steps after the resume point check the resharded parameters (the first loss) and the optimizer and
    schedule state (the second). One run for every such test, as each would train this same job."""
    root = tmp_path_factory.mktemp("dense-dp4") / "ckpt"
    body = tiny_job(corpus, steps=DP4_STEPS, dp_shard=4, zero_stage=3)
    body.checkpoint.interval_steps = DP4_INTERVAL
    result = run_training(pool, body, str(root))
    assert result.resumed_from_step is None and len(result.losses) == DP4_STEPS
    return root, result
