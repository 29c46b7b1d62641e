"""Tensor/sequence and context parallel layouts reproduce the single-process run (CPU, gloo, fp32).

Each layout case trains the debug model (its MoE variant for `moe_*`) for 4 optimizer steps from
identical weights and data: at every step the global loss within 1e-5 relative of the single-process
reference and every parameter's gradient within 5e-5 relative error (per tensor). Then: a checkpoint
saved under dp4 (FSDP) resumed under tp2 + SP; model-level checks of CP's default positions, SP pipeline-stage boundaries and MoE
blocks under TP.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import EVAL_AFTER, assert_equivalent, run_layout, run_reference, run_training, tiny_job
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from trainctl.parallelism.layouts.context_parallel import (
    apply_context_parallel,
    make_layout,
    shard_batch_for_cp,
    shard_sequence,
)
from trainctl.parallelism.layouts.pipeline import split_pipeline_stages
from trainctl.parallelism.layouts.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    loss_context,
)
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.presets import PRESETS, ModelConfig

# tp4 needs the kv heads divisible by 4 (the debug preset has 2): the reference uses the same model.
KV4 = {"n_kv_heads": 4}
# Two micro-batches of 4 per step (gradient accumulation stays exercised) keeps the matrix fast.
MICRO4 = {"micro_batch_size": 4}

CASES = {
    "tp2": ({"tp": 2}, None),
    "tp2_sp": ({"tp": 2, "sequence_parallel": True}, None),
    "tp4": ({"tp": 4}, KV4),
    "cp2_zigzag": ({"cp": 2, "cp_load_balance": True}, None),
    "cp4_zigzag": ({"cp": 4, "cp_load_balance": True}, None),
    "moe_tp2_sp": ({"tp": 2, "sequence_parallel": True}, {"preset": "debug-moe"}),
    "moe_transformers_aux_tp2_sp": (
        {"tp": 2, "sequence_parallel": True},
        {"preset": "debug-moe", "moe": {"num_experts": 4, "top_k": 2, "aux_loss": "transformers", "aux_loss_coef": 0.5}},
    ),
    "fsdp2_tp2_sp_cp2": (
        {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "cp": 2, "cp_load_balance": True, "zero_stage": 3}, None
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(pool, corpus, case):
    parallelism, model = CASES[case]
    body = tiny_job(corpus, model=model, training=MICRO4, **parallelism)
    reference = run_reference(pool, body, eval_after=EVAL_AFTER)
    run = run_layout(pool, body, eval_after=EVAL_AFTER)
    assert_equivalent(run, reference)


def test_resume_dp4_checkpoint_under_tp2(pool, corpus, tmp_path, dense_dp4_run):
    """The FSDP dp4 run's step-2 checkpoint (conftest `dense_dp4_run`) resumed under tp2 + SP: its 2 steps and the
    resumed 2 (parameters, then optimizer and schedule state) are the single-process run's 4 losses."""
    saved, uninterrupted = dense_dp4_run
    shutil.copytree(saved / "step_00000002", tmp_path / "ckpt" / "step_00000002")
    resume_body = tiny_job(corpus, steps=4, tp=2, sequence_parallel=True)
    resume_body.checkpoint.interval_steps = 2
    resumed = run_training(pool, resume_body, str(tmp_path / "ckpt"))
    assert resumed.resumed_from_step == 2
    reference = run_reference(pool, tiny_job(corpus, steps=4, dp_shard=4), steps=4)

    for step, (got, want) in enumerate(zip(uninterrupted.losses[:2] + resumed.losses, reference.losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got!r} != single-process {want!r}"


def _cp_logits(rank: int, world_size: int, load_balance: bool) -> list[float]:
    """Max |difference| of this CP rank's logits from the full model's rows at the same positions,
    with positions passed explicitly and left to the model's CP default."""
    torch.manual_seed(0)
    full = build_model(PRESETS["debug"], seed=3)
    model = apply_context_parallel(build_model(PRESETS["debug"], seed=3), init_device_mesh("cpu", (world_size,)), load_balance)
    tokens = torch.randint(0, PRESETS["debug"].vocab_size, (2, 32))
    layout = make_layout(32, world_size, load_balance)
    local = shard_sequence(tokens, layout, rank)
    positions = layout.positions(rank)
    want = full(tokens)[:, positions]
    with torch.no_grad():
        return [float((model(local, positions) - want).abs().max()), float((model(local) - want).abs().max())]


@pytest.mark.parametrize("load_balance", [False, True])
def test_cp_model_defaults_to_its_shard_positions(pool, load_balance):
    for explicit, default in pool.run(_cp_logits, 2, load_balance):
        assert explicit < 1e-5 and default < 1e-5, (explicit, default)


def _full_model_step(config: ModelConfig) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The single-process reference: a model (seed 3) after one backward on a seed-0 batch; with its batch."""
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    full = build_model(config, seed=3)
    F.cross_entropy(full(inputs).flatten(0, 1), labels.flatten()).backward()
    return full, inputs, labels


def _largest_grad_rel_err(model: nn.Module, full: nn.Module, cp_mesh: DeviceMesh | None = None) -> float:
    """Largest relative difference of `model`'s gradients from `full`'s (averaged over `cp_mesh` first)."""
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if cp_mesh is not None:
            dist.all_reduce(grad, group=cp_mesh.get_group())
            grad = grad / cp_mesh.size()
        want = full.get_parameter(name).grad
        worst = max(worst, float((grad - want).abs().max() / want.abs().max()))
    return worst


def _sp_pipeline_stages(rank: int, world_size: int, cp: int) -> dict[str, float]:
    """Two pipeline stages of one model under tp x cp with SP, run back to back on every rank.

    Returns the stage-0 output type and the largest relative differences from the full model.
    """
    config = PRESETS["debug"]
    full, inputs, labels = _full_model_step(config)

    mesh = init_device_mesh("cpu", (cp, world_size // cp), mesh_dim_names=("cp", "tp"))
    model = build_model(config, seed=3)
    stages = [split_pipeline_stages(model, pp_rank=r, pp=2)[0].module for r in (0, 1)]
    for stage in stages:
        apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=True)
        if cp > 1:
            apply_context_parallel(stage, mesh["cp"], load_balance=True)
    if cp > 1:
        inputs, labels, positions = shard_batch_for_cp(inputs, labels, mesh["cp"], load_balance=True)
    hidden = stages[0](inputs)
    with loss_context(True):
        loss = F.cross_entropy(stages[1](hidden).flatten(0, 1), labels.flatten())
        loss.backward()
    worst = _largest_grad_rel_err(model, full, mesh["cp"] if cp > 1 else None)
    return {
        "plain_boundary": float(not isinstance(hidden, DTensor) and hidden.shape[1] == 32 // world_size),
        "grad_rel_err": worst,
    }


@pytest.mark.parametrize("cp", [1, 2])
def test_sp_pipeline_stage_boundaries_carry_local_shards(pool, cp):
    for result in pool.run(_sp_pipeline_stages, 2 * cp, cp):
        assert result["plain_boundary"] == 1.0
        assert result["grad_rel_err"] < 1e-4, result


def _moe_tp_grads(rank: int, world_size: int, sequence_parallel: bool) -> float:
    """Largest relative gradient difference of a TP-sharded MoE model from the full one (one step)."""
    config = PRESETS["debug-moe"]
    full, inputs, labels = _full_model_step(config)
    model = apply_tensor_parallel(build_model(config, seed=3), init_device_mesh("cpu", (world_size,)), sequence_parallel)
    with loss_context(True):
        F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    return _largest_grad_rel_err(model, full)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_moe_blocks_under_tensor_parallel(pool, sequence_parallel):
    assert max(pool.run(_moe_tp_grads, 2, sequence_parallel)) < 1e-4


def test_tensor_parallel_names_the_indivisible_dimension():
    model = build_model(PRESETS["debug"], seed=0)
    check_tensor_parallel(model, 2)
    with pytest.raises(ValueError, match="tp=4 must divide model n_kv_heads=2"):
        check_tensor_parallel(model, 4)
    with pytest.raises(ValueError, match="tp=3 must divide model n_heads=4"):
        check_tensor_parallel(model, 3)
