"""Optimizer choice: each optimizer lowers the loss and resumes bit-for-bit, also with sharded state."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import run_training, tiny_job

from trainctl.parallelism.checkpoint.pretrained import read_model_state
from trainctl.parallelism.engine.optim import build_optimizer
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import TrainingSpec

STEPS = 6
OPTIMIZERS = {
    "adamw-foreach": {"optimizer": "adamw", "optimizer_impl": "foreach"},
    "adamw-fused": {"optimizer": "adamw", "optimizer_impl": "fused"},
    "adafactor": {"optimizer": "adafactor", "lr": 1e-2},
    "sgd-momentum": {"optimizer": "sgd", "lr": 0.3, "beta1": 0.9},
}


def _job(corpus: str, training: dict, steps: int = STEPS, **par):
    return tiny_job(
        corpus, steps=steps, training={"micro_batch_size": 4, "warmup_steps": 1, **training}, **par
    ).model_copy(update={"checkpoint": tiny_job(corpus).checkpoint.model_copy(update={"interval_steps": steps // 2, "keep_last": 5})})


def _resume_matches(run_dir: Path, first, resumed) -> None:
    """The resumed second half has the same losses and ends on the same weights, bit for bit."""
    assert resumed.resumed_from_step == STEPS // 2
    assert resumed.losses == first.losses[STEPS // 2 :]
    final = read_model_state(Path(first.last_checkpoint + ".first"))
    again = read_model_state(Path(resumed.last_checkpoint))
    assert final.keys() == again.keys()
    for name, tensor in final.items():
        assert torch.equal(tensor, again[name]), name


def _drop_last_checkpoint(result) -> None:
    last = Path(result.last_checkpoint)
    shutil.copytree(last, Path(str(last) + ".first"))
    shutil.rmtree(last)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_trains_and_resumes_bit_for_bit(name: str, corpus: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    job = _job(corpus, OPTIMIZERS[name])
    first = Trainer(job, device="cpu", checkpoint_dir=tmp_path).run()
    assert first.losses[-1] < first.losses[0] - 0.1, first.losses
    _drop_last_checkpoint(first)
    resumed = Trainer(job, device="cpu", checkpoint_dir=tmp_path).run()
    _resume_matches(tmp_path, first, resumed)


def test_optimizer_kernels_are_the_ones_asked_for() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    fused = build_optimizer(params, TrainingSpec(optimizer="adamw", optimizer_impl="fused"))
    assert fused.defaults["fused"] and not fused.defaults["foreach"]
    auto = build_optimizer(params, TrainingSpec(optimizer="sgd"))  # CPU parameters: foreach
    assert auto.defaults["foreach"] and not auto.defaults["fused"]
    assert isinstance(build_optimizer(params, TrainingSpec(optimizer="adafactor")), torch.optim.Adafactor)


@pytest.mark.parametrize(
    ("name", "layout"),
    [("adamw-foreach", {"dp_shard": 2, "zero_stage": 3}), ("sgd-momentum", {"dp_shard": 2, "zero_stage": 3}),
     ("adafactor", {"dp_shard": 2, "zero_stage": 1})],
    ids=["adamw-fsdp", "sgd-fsdp", "adafactor-zero1"],
)
def test_sharded_optimizer_state_round_trips(name: str, layout: dict, pool, corpus: str, tmp_path: Path) -> None:
    """Optimizer state sharded over 2 ranks (FSDP shards; ZeRO-1 ownership) is saved with DCP and
    resumed bit-for-bit by the same layout."""
    job = _job(corpus, OPTIMIZERS[name], **layout)
    first = run_training(pool, job, str(tmp_path))
    assert first.losses[-1] < first.losses[0]
    _drop_last_checkpoint(first)
    resumed = run_training(pool, job, str(tmp_path))
    _resume_matches(tmp_path, first, resumed)
