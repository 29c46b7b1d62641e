"""Data-parallel layouts reproduce the single-process run: every step's loss and gradients."""

from __future__ import annotations

import pytest
from harness import EVAL_AFTER, assert_equivalent, run_layout, run_reference, tiny_job

DP_LAYOUTS = {
    "ddp-dp2": {"dp_replicate": 2},
    "zero1-dp2": {"dp_shard": 2, "zero_stage": 1},
    "zero2-dp2": {"dp_shard": 2, "zero_stage": 2},
    "fsdp-dp4": {"dp_shard": 4, "zero_stage": 3},
    "hsdp-2x2": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
}


@pytest.mark.parametrize("layout", DP_LAYOUTS.values(), ids=DP_LAYOUTS.keys())
def test_data_parallel_matches_single_process(pool, corpus, layout):
    body = tiny_job(corpus, **layout)
    reference = run_reference(pool, body, eval_after=EVAL_AFTER)
    run = run_layout(pool, body, eval_after=EVAL_AFTER)
    assert_equivalent(run, reference)


def test_activation_checkpointing_composes_with_fsdp(pool, corpus):
    body = tiny_job(corpus, dp_shard=2, training={"activation_checkpointing": "full"})
    reference = run_reference(pool, tiny_job(corpus, dp_shard=2), eval_after=EVAL_AFTER)
    assert_equivalent(run_layout(pool, body, eval_after=EVAL_AFTER), reference)


@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"dp_replicate": 2}], ids=["fsdp-bf16", "ddp-bf16"])
def test_bf16_mixed_precision_tracks_fp32(pool, corpus, layout):
    """bf16 compute (FSDP2 bf16 all-gather / autocast) with fp32 master weights stays near fp32."""
    run = run_layout(pool, tiny_job(corpus, training={"dtype": "bfloat16"}, **layout))
    reference = run_reference(pool, tiny_job(corpus, **layout), eval_after=EVAL_AFTER)  # the matrix's, cached
    assert run.losses == pytest.approx(reference.losses, rel=5e-3)
    assert run.losses != reference.losses
