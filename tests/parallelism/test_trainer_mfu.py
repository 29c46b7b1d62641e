"""The Trainer's MFU in both conventions (Megatron's, causal attention halved; torchtitan's, attention
unmasked), with a LoRA job's frozen weights counted as frozen."""

from __future__ import annotations

import pytest
from harness import tiny_job

from trainctl.parallelism.engine.trainer import StepReport, Trainer
from trainctl.parallelism.sizing.flops import full_attention_flops_per_token, training_flops_per_token
from trainctl.spec.job import LoRASpec
from trainctl.spec.presets import resolve_model


@pytest.mark.parametrize("lora", [None, LoRASpec(rank=4, target_modules=["wq", "wv", "w2"])])
def test_reports_mfu_in_both_conventions(corpus, lora):
    body = tiny_job(corpus, steps=2).model_copy(update={"lora": lora})
    config = resolve_model(body.model)
    reports: list[StepReport] = []
    trainer = Trainer(body, device="cpu", on_step=reports.append)
    assert trainer.reporter.flops_per_token == training_flops_per_token(config, 32, lora)
    assert trainer.reporter.flops_per_token_full_attention == full_attention_flops_per_token(config, 32, lora)
    if lora is not None:
        assert trainer.reporter.flops_per_token < training_flops_per_token(config, 32)
    trainer.reporter.peak_flops = 1e12  # a CPU has no known peak: pretend one to see the arithmetic
    trainer.run()
    assert len(reports) == 2
    for r in reports:
        assert r.mfu == pytest.approx(trainer.reporter.flops_per_token * r.tokens_per_second / 1e12)
        assert r.mfu_full_attention == pytest.approx(trainer.reporter.flops_per_token_full_attention * r.tokens_per_second / 1e12)
        assert r.mfu_full_attention > r.mfu
