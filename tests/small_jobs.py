"""Builders of the small jobs the tests submit: CPU ranks, a tiny model, a few steps on the built-in corpus."""

from __future__ import annotations

from typing import Any

from trainctl.spec.job import TrainingJob


def small_job(
    name: str = "small", *, gpus: int = 2, steps: int = 3, labels: dict[str, str] | None = None,
    **sections: dict[str, Any],
) -> TrainingJob:
    """A `gpus`-rank data-parallel (dp_shard) CPU job of `steps` steps that saves no checkpoint and is
    never restarted. Each keyword section (`training={"lr": 0.005}`, `scheduling={...}`) updates that
    section of the spec; `parallelism` replaces the layout instead."""
    spec: dict[str, dict[str, Any]] = {
        "data": {"seq_len": 32, "max_files": 10},
        "parallelism": {"dp_shard": gpus},
        "training": {"steps": steps, "global_batch_size": 2 * gpus, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 0},
        "resources": {"gpus": gpus, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }
    for section, values in sections.items():
        spec[section] = dict(values) if section == "parallelism" else {**spec.get(section, {}), **values}
    return TrainingJob.model_validate({"metadata": {"name": name, "labels": labels or {}}, "spec": spec})


def restartable_job(
    name: str, steps: int, *, max_restarts: int = 2, interval: int = 2, labels: dict[str, str] | None = None,
) -> TrainingJob:
    """A 2-rank dp_replicate job (2 micro-batches per step) that checkpoints every `interval` steps and
    may restart `max_restarts` times: what the rank-loss and node-loss tests kill."""
    return small_job(
        name, steps=steps, labels=labels, parallelism={"dp_replicate": 2}, training={"micro_batch_size": 2},
        checkpoint={"interval_steps": interval}, scheduling={"max_restarts": max_restarts},
    )


def trial_template(steps: int) -> dict[str, Any]:
    """A sweep's job template for its trials: one CPU rank of the debug model, `steps` steps, no checkpoint,
    no restart."""
    return {
        "model": {"preset": "debug"},
        "data": {"seq_len": 32, "max_files": 10},
        "training": {"steps": steps, "global_batch_size": 2, "warmup_steps": 0},
        "checkpoint": {"interval_steps": 0},
        "resources": {"gpus": 1, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    }


def single_process_losses(job: TrainingJob) -> list[float]:
    """Every step's loss of `job`'s spec trained in this process on one rank (no checkpoint): what
    every layout of the job must reproduce."""
    import torch

    from trainctl.parallelism.engine.trainer import Trainer

    body = job.spec.model_copy(deep=True)
    body.parallelism = type(body.parallelism)()
    body.resources.gpus = 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(body, device="cpu").run().losses
    finally:
        torch.set_num_threads(before)
