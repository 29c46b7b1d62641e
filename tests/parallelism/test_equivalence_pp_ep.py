"""Pipeline and expert-parallel layouts reproduce the single-process run: losses and gradients.

Every case trains 4 optimizer steps through the real Trainer (shared worker pool, gloo, fp32) and
compares, at every step, the global loss (1e-5 relative) and every parameter's full gradient (5e-5
relative error per tensor) with the single-process run of the same job. Covered: every pipeline
schedule (GPipe, 1F1B, interleaved, zero-bubble with one and with two stages per rank) and MoE with
top-2 and top-1 routing, a shared expert, dense layers between MoE layers (moe.interval 2), and the
`transformers` aux-loss convention (one statistic over all layers, carried across pipeline stages),
with a large coefficient so a wrong aux loss shows in the loss and the router gradients.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness import (
    EVAL_AFTER,
    WorkerPool,
    assert_equivalent,
    run_layout,
    run_reference,
    run_training,
    tiny_job,
)

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.engine.trainer import TrainResult

MOE = {"preset": "debug-moe"}
MOE8 = {"preset": "debug-moe", "moe": {"num_experts": 8, "top_k": 2}}
MOE_SHARED = {"preset": "debug-moe", "moe": {"num_experts": 4, "top_k": 2, "shared_expert": True}}
MOE_TOP1 = {"preset": "debug-moe", "moe": {"num_experts": 4, "top_k": 1}}
MOE_EVERY_OTHER = {"preset": "debug-moe", "moe": {"num_experts": 4, "top_k": 2, "interval": 2}}
MOE_HF_AUX = {"preset": "debug-moe", "moe": {"num_experts": 4, "top_k": 2, "aux_loss": "transformers", "aux_loss_coef": 0.5}}

LAYOUTS = {
    "pp2-gpipe": ({}, {"pp": 2, "pp_schedule": "gpipe"}),
    "pp2-1f1b": ({}, {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2-interleaved-v2": ({}, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}),
    "pp4-zero-bubble": ({}, {"pp": 4, "pp_schedule": "zero_bubble"}),
    "pp2-zero-bubble-v2": ({}, {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2}),
    "moe-ep2": (MOE, {"dp_shard": 2, "ep": 2}),
    "moe-shared-expert-ep2": (MOE_SHARED, {"dp_shard": 2, "ep": 2}),
    "moe-top1-ep2": (MOE_TOP1, {"dp_shard": 2, "ep": 2}),
    "moe-every-other-layer-ep2": (MOE_EVERY_OTHER, {"dp_shard": 2, "ep": 2}),
    "moe-ep4": (MOE8, {"dp_shard": 4, "ep": 4}),
    "dp2-tp2-pp2": ({}, {"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
    "moe-pp2-tp2-ep2": (MOE, {"dp_shard": 2, "ep": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
    "moe-transformers-aux-ep2": (MOE_HF_AUX, {"dp_shard": 2, "ep": 2}),
    "moe-transformers-aux-pp2-interleaved-v2": (
        MOE_HF_AUX, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}
    ),
    "moe-transformers-aux-pp2-tp2-ep2": (MOE_HF_AUX, {"dp_shard": 2, "ep": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
}


@pytest.mark.parametrize("case", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_process(pool, corpus, case):
    model, layout = case
    body = tiny_job(corpus, model=model, **layout)
    reference = run_reference(pool, body, eval_after=EVAL_AFTER)
    run = run_layout(pool, body, eval_after=EVAL_AFTER)
    assert_equivalent(run, reference)


RESUMES = {
    # Dense: FSDP dp4 -> tp2 x pp2 (the pipeline stages reload their layers' shards by name).
    "dp4-to-tp2-pp2": ({}, {"dp_shard": 4}, {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
    # Dense: FSDP dp4 -> cp2 x pp2 (stages run ring attention on their CP shards).
    "dp4-to-cp2-pp2": ({}, {"dp_shard": 4}, {"cp": 2, "cp_load_balance": True, "pp": 2, "pp_schedule": "1f1b"}),
    # MoE: experts over ep4 -> pp2 x ep2 (DCP reshards the expert-dim DTensors).
    "moe-ep4-to-pp2-ep2": (MOE8, {"dp_shard": 4, "ep": 4}, {"pp": 2, "dp_shard": 2, "ep": 2}),
}


def saved_run(request: pytest.FixtureRequest, pool: WorkerPool, corpus: str, tmp_path: Path, model: dict,
              saved_layout: dict) -> tuple[Path, TrainResult]:
    """An uninterrupted 4-step run of the saved layout that checkpoints at steps 2 and 4: its checkpoint root and
    result. The dense FSDP dp4 one is the session's (conftest `dense_dp4_run`: the same job)."""
    if not model and saved_layout == {"dp_shard": 4}:
        return request.getfixturevalue("dense_dp4_run")
    first = tiny_job(corpus, steps=4, model=model, **saved_layout)
    first.checkpoint.interval_steps = 2
    return tmp_path / "saved", run_training(pool, first, str(tmp_path / "saved"))


@pytest.mark.parametrize("case", RESUMES.values(), ids=RESUMES.keys())
def test_resume_under_another_layout_continues_the_run(request, pool, corpus, tmp_path, case):
    model, saved_layout, resumed_layout = case
    saved, uninterrupted = saved_run(request, pool, corpus, tmp_path, model, saved_layout)
    assert [s for s, _ in ckpt.complete_checkpoints(saved)] == [2, 4]

    resume_dir = tmp_path / "resume"
    shutil.copytree(saved / "step_00000002", resume_dir / "step_00000002")
    second = tiny_job(corpus, steps=4, model=model, **resumed_layout)
    second.checkpoint.interval_steps = 2
    resumed = run_training(pool, second, str(resume_dir))
    assert resumed.resumed_from_step == 2 and resumed.steps_completed == 4
    # The first resumed loss checks the resharded parameters, the second the optimizer and schedule state.
    assert resumed.losses == pytest.approx(uninterrupted.losses[2:], rel=1e-5)
