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
    assert quiet.communication == 0 and quiet.total == pytest.approx(busy + quiet.kernel_efficiency)
    hidden = modelled_step_time(config, job, PEAK, {"tp": 0.5, "dp": busy / 2})
    assert hidden.communication == pytest.approx(0.5) and hidden.overlapped == pytest.approx(busy / 2)
    spilled = modelled_step_time(config, job, PEAK, {"tp": 0.5, "dp": busy + 2.0, "cp": 1.0})
    assert spilled.communication == pytest.approx(0.5 + 3.0) and spilled.overlapped == pytest.approx(busy)
    assert spilled.mfu == pytest.approx(spilled.compute_at_peak / spilled.total)
    assert list(spilled.terms()) == ["compute_at_peak", "kernel_efficiency", "recompute", "optimizer", "pipeline_bubble",
                                     "communication"]
    assert "recompute" not in modelled_step_time(config, body("none", dp_shard=4), PEAK, {}).terms()


def test_a_lora_job_is_modelled_with_frozen_weight_flops() -> None:
    """A LoRA job's compute and recompute use the frozen-weight FLOPs (no weight-gradient GEMM for frozen
    weights), so it models faster than the same job training every weight."""
    from trainctl.spec.job import LoRASpec

    config = PRESETS["llama3-8b"]
    plain = body("full", dp_shard=4)
    lora = plain.model_copy(update={"lora": LoRASpec(rank=16)})
    tokens_per_rank = 64 * 4096 / 4
    full, adapted = modelled_step_time(config, plain, PEAK, {}), modelled_step_time(config, lora, PEAK, {})
    assert adapted.compute_at_peak == pytest.approx(
        training_flops_per_token(config, 4096, lora.lora) * tokens_per_rank / PEAK)
    assert adapted.recompute == pytest.approx(
        recompute_flops_per_token(config, 4096, "full", lora.lora) * tokens_per_rank / PEAK)
    assert adapted.compute_at_peak < 0.8 * full.compute_at_peak
    assert full.compute_at_peak == pytest.approx(training_flops_per_token(config, 4096) * tokens_per_rank / PEAK)


def test_kernels_below_peak_float8_and_the_optimizer_step_are_priced() -> None:
    """kernel_efficiency: forward, backward and recompute at SUSTAINED_FRACTION of the peak, float8's share
    of the FLOPs FLOAT8_SPEEDUP times faster; optimizer: OPTIMIZER_BYTES per updated parameter at
    HBM_FRACTION of the bandwidth (all of them under DDP, a shard under ZeRO, none without a bandwidth)."""
    from trainctl.parallelism.sizing.flops import float8_flops_per_token
    from trainctl.parallelism.sizing.step_time import (
        FLOAT8_SPEEDUP,
        HBM_FRACTION,
        OPTIMIZER_BYTES,
        SUSTAINED_FRACTION,
        updated_parameters,
    )

    config = PRESETS["llama3-8b"]
    job = body("full", dp_shard=4, zero_stage=0)
    eager = modelled_step_time(config, job, PEAK, {}, memory_bandwidth=3e12)
    busy = eager.compute_at_peak + eager.recompute
    assert eager.kernel_efficiency == pytest.approx(busy / SUSTAINED_FRACTION[False] - busy)
    params = updated_parameters(config, job)
    assert params == pytest.approx(8_030_261_248, rel=1e-6)  # Llama 3 8B, every rank steps all of it (DDP)
    assert eager.optimizer == pytest.approx(params * OPTIMIZER_BYTES["adamw"] / (3e12 * HBM_FRACTION))
    zero = job.model_copy(update={"parallelism": job.parallelism.model_copy(update={"zero_stage": 3})})
    assert updated_parameters(config, zero) == pytest.approx(params / 4)
    assert modelled_step_time(config, job, PEAK, {}).optimizer == 0

    training = job.training.model_copy(update={"compile": True, "fp8": "tensorwise", "activation_checkpointing": "none"})
    fp8 = modelled_step_time(config, job.model_copy(update={"training": training}), PEAK, {})
    share = float8_flops_per_token(config, "tensorwise") / training_flops_per_token(config, 4096)
    assert 0.6 < share < 0.9  # wq, wo and the feed-forward of every block; wk, wv and the head stay bf16
    compiled = fp8.compute_at_peak / SUSTAINED_FRACTION[True]
    assert fp8.total == pytest.approx(compiled * (1 - share + share / FLOAT8_SPEEDUP))


@pytest.mark.parametrize("results", ["results-gpu.json", "results-gpu-fp8.json"])
def test_the_model_is_within_a_quarter_of_every_step_measured_on_a_gpu(monkeypatch, results) -> None:
    """`trainctl plan`'s step time for the jobs bench/gpu.py measured on one H200 (eager, compiled,
    checkpointed, float8; llama-1b and llama-3b, seq 2048 and 8192) within 25 %, as issue 31 asks.
    The LoRA row is the exception the model names: its memory-bound adapter work is not priced."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from trainctl.parallelism.sizing.device_memory import gpu_memory_bandwidth
    from trainctl.parallelism.sizing.flops import peak_flops
    from trainctl.spec.presets import resolve_model

    root = Path(__file__).resolve().parents[2]
    loader = importlib.util.spec_from_file_location("bench_gpu", root / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(loader)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)
    loader.loader.exec_module(bench)
    saved = json.loads((root / "bench" / results).read_text())
    checked = 0
    for row in saved["rows"]:
        run = next((r for r in bench.RUNS if r.name == row["run"]), None)
        if run is None or "step_seconds" not in row or run.lora:
            continue
        job = JobSpecBody.model_validate(bench.job_spec(run, False, row["ranks"], saved["steps"], saved["micro_batch"],
                                                        row.get("seq_len", saved.get("seq_len")), row.get("preset", "llama-1b")))
        device = row["device"]
        step = modelled_step_time(resolve_model(job.model), job, peak_flops(device, "bfloat16"), {},
                                  memory_bandwidth=gpu_memory_bandwidth(device))
        assert row["step_seconds"] == pytest.approx(step.total, rel=0.25), f"{row.get('case', '')} {row['run']}"
        checked += 1
    assert checked >= 4

