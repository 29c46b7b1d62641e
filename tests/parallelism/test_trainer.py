"""The Trainer in one process: reports, schedule, clipping, activation checkpointing, bf16, model init."""

from __future__ import annotations

import math

import pytest
import torch
from harness import tiny_job

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.engine.optim import clip_gradients, lr_multiplier
from trainctl.parallelism.engine.trainer import StepReport, Trainer
from trainctl.parallelism.layouts.pipeline import split_pipeline_stages
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.presets import resolve_model


def losses_of(body, steps: int = 3) -> list[float]:
    trainer = Trainer(body, device="cpu")
    return [trainer.train_step()[0] for _ in range(steps)]


def test_run_reports_every_step_and_the_loss_falls(corpus, tmp_path):
    body = tiny_job(corpus, steps=12, training={"warmup_steps": 2})
    reports: list[StepReport] = []
    result = Trainer(body, device="cpu", checkpoint_dir=tmp_path, on_step=reports.append).run()
    assert [r.step for r in reports] == list(range(1, 13)) and result.steps_completed == 12
    assert reports[-1].loss < reports[0].loss - 0.5
    assert all(r.mfu is None and r.tokens == 8 * 32 and r.peak_memory_bytes > 0 for r in reports)
    assert set(reports[0].breakdown) == {"data", "forward_backward", "optimizer"}
    assert "checkpoint" in reports[-1].breakdown and result.last_checkpoint.endswith("step_00000012")
    assert [r.lr for r in reports[:3]] == pytest.approx([1.5e-3, 3e-3, 3e-3 * lr_multiplier(2, body.training)])


def test_checkpoint_steps_are_reported_with_their_size_and_timed_by_every_rank(corpus, tmp_path):
    body = tiny_job(corpus, steps=6, training={"log_interval": 4})
    body = body.model_copy(update={"checkpoint": body.checkpoint.model_copy(update={"interval_steps": 3})})
    reports: list[StepReport] = []
    times: list[tuple[int, float]] = []
    events: list[str] = []
    Trainer(body, device="cpu", checkpoint_dir=tmp_path, on_step=reports.append, on_event=events.append,
            on_step_time=lambda step, seconds: times.append((step, seconds))).run()
    # log_interval 4, checkpoints at 3 and 6 (the last step): a save is reported off the interval too
    assert [r.step for r in reports] == [3, 4, 6]
    assert times == [(r.step, r.step_time_seconds) for r in reports]
    assert ["checkpoint" in r.breakdown for r in reports] == [True, False, True]
    assert reports[1].checkpoint_bytes is None
    newest = tmp_path / "step_00000006"
    on_disk = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    assert reports[2].checkpoint_bytes == ckpt.checkpoint_size(newest) == on_disk > 0
    assert f"checkpoint saved at step 6: {newest} ({on_disk} bytes)" in events


def test_a_checkpoint_commits_only_after_its_step_is_reported(corpus, tmp_path):
    """A rank killed after the save leaves no complete checkpoint whose step the job never reported."""
    body = tiny_job(corpus, steps=4, training={"log_interval": 1})
    body = body.model_copy(update={"checkpoint": body.checkpoint.model_copy(update={"interval_steps": 2})})
    committed_when_reported: dict[int, list[int]] = {}

    def on_step(report: StepReport) -> None:
        committed_when_reported[report.step] = [step for step, _ in ckpt.complete_checkpoints(tmp_path)]
        if report.step == 4:
            raise ConnectionError("the supervisor is gone")

    with pytest.raises(ConnectionError):
        Trainer(body, device="cpu", checkpoint_dir=tmp_path, on_step=on_step).run()
    assert committed_when_reported == {1: [], 2: [], 3: [2], 4: [2]}
    assert [step for step, _ in ckpt.complete_checkpoints(tmp_path)] == [2]


def test_schedule_warms_up_then_decays_to_the_floor(corpus):
    train = tiny_job(corpus, steps=100, training={"warmup_steps": 10, "min_lr_ratio": 0.1}).training
    assert lr_multiplier(0, train) == pytest.approx(0.1) and lr_multiplier(9, train) == 1.0
    assert lr_multiplier(55, train) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(100, train) == pytest.approx(0.1)


def test_clipping_scales_to_the_global_norm():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert clip_gradients(params, 1.0) == pytest.approx(5.0)
    assert torch.linalg.vector_norm(torch.cat([p.grad for p in params])) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_computes_the_same(corpus, mode):
    base = losses_of(tiny_job(corpus))
    assert losses_of(tiny_job(corpus, training={"activation_checkpointing": mode})) == pytest.approx(base, rel=1e-6)


def test_bf16_autocast_tracks_fp32_with_fp32_master_weights(corpus):
    body = tiny_job(corpus, training={"dtype": "bfloat16"})
    trainer = Trainer(body, device="cpu")
    bf16 = [trainer.train_step()[0] for _ in range(3)]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert bf16 == pytest.approx(losses_of(tiny_job(corpus)), rel=2e-2)


def test_initial_weights_do_not_depend_on_how_the_model_is_cut():
    config = resolve_model(tiny_job("unused").model)
    full = dict(build_model(config, seed=5).named_parameters())
    stages = split_pipeline_stages(build_model(config, seed=5), pp_rank=1, pp=2)
    for name, param in stages[0].module.named_parameters():
        assert torch.equal(param, full[name]), name
    other = dict(build_model(config, seed=6).named_parameters())
    assert not torch.equal(other["layers.0.attention.wq.weight"], full["layers.0.attention.wq.weight"])
    assert torch.equal(full["norm.weight"], torch.ones(64))


def test_layout_and_world_size_must_agree(corpus):
    with pytest.raises(ValueError, match="needs 2 ranks but world_size is 1"):
        Trainer(tiny_job(corpus, dp_replicate=2), device="cpu")
