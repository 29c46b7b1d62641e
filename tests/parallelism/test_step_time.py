"""The modelled step time (sizing/step_time.py): recomputation follows the engine's checkpointed blocks,
data- and context-parallel communication hides behind compute up to its length, the rest is exposed."""

from __future__ import annotations

import pytest

from trainctl.parallelism.sizing.flops import recompute_flops_per_token, training_flops_per_token
from trainctl.parallelism.sizing.step_time import modelled_step_time
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import PRESETS

PEAK = 1e15


def body(ac: str, **parallelism: int) -> JobSpecBody:
    return JobSpecBody.model_validate({
        "model": {"preset": "llama3-8b"}, "data": {"seq_len": 4096}, "parallelism": parallelism,
        "training": {"global_batch_size": 64, "activation_checkpointing": ac, "dtype": "bfloat16"},
    })


def test_recompute_is_one_forward_of_the_checkpointed_blocks() -> None:
    config = PRESETS["llama3-8b"]
    full = recompute_flops_per_token(config, 4096, "full")
    blocks = training_flops_per_token(config, 4096) - 6 * config.dim * config.vocab_size
    assert full == pytest.approx(blocks / 3)
    # selective checkpoints the even-numbered blocks (parallelize.apply_activation_checkpointing)
    even = len(range(0, config.n_layers, 2))
    assert recompute_flops_per_token(config, 4096, "selective") == pytest.approx(full * even / config.n_layers)
    assert recompute_flops_per_token(config, 4096, "none") == 0


def test_data_and_context_parallel_traffic_hides_behind_compute_up_to_its_length() -> None:
    config = PRESETS["llama3-8b"]
    job = body("full", dp_shard=4, tp=2)
    quiet = modelled_step_time(config, job, PEAK, {})
    busy = quiet.compute_at_peak + quiet.recompute
    assert quiet.communication == 0 and quiet.total == pytest.approx(busy)
    hidden = modelled_step_time(config, job, PEAK, {"tp": 0.5, "dp": busy / 2})
    assert hidden.communication == pytest.approx(0.5) and hidden.overlapped == pytest.approx(busy / 2)
    spilled = modelled_step_time(config, job, PEAK, {"tp": 0.5, "dp": busy + 2.0, "cp": 1.0})
    assert spilled.communication == pytest.approx(0.5 + 3.0) and spilled.overlapped == pytest.approx(busy)
    assert spilled.mfu == pytest.approx(spilled.compute_at_peak / spilled.total)
    assert list(spilled.terms()) == ["compute_at_peak", "recompute", "pipeline_bubble", "communication"]
    assert "recompute" not in modelled_step_time(config, body("none", dp_shard=4), PEAK, {}).terms()
