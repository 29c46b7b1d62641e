"""Context parallel inside pipeline stages reproduces the single-process run (CPU, gloo, fp32).

Each stage holds its CP rank's shard of every micro-batch ([batch, seq / cp, dim] between stages),
applies RoPE at the shard's global positions, and the last stage's loss is over the CP-local tokens,
averaged over CP like the gradients. Every case trains the harness's optimizer steps: each step's
global loss and every parameter's gradient at every step match the single-process reference within
the harness's fp32 tolerances.
"""

from __future__ import annotations

import pytest
from harness import EVAL_AFTER, assert_equivalent, run_layout, run_reference, tiny_job

# Micro-batch sizes that give every data-parallel rank 2 micro-batches of its share of the batch of 8,
# enough to fill a 2-stage pipeline.
MICRO4 = {"micro_batch_size": 4}
MICRO2 = {"micro_batch_size": 2}

CASES = {
    "cp2_zigzag_pp2_1f1b": ({"cp": 2, "cp_load_balance": True, "pp": 2, "pp_schedule": "1f1b"}, MICRO4),
    "cp2_pp2_interleaved_v2": (
        {"cp": 2, "pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, MICRO4
    ),
    "cp2_zigzag_pp2_tp2_sp": (
        {"cp": 2, "cp_load_balance": True, "pp": 2, "pp_schedule": "1f1b", "tp": 2, "sequence_parallel": True},
        MICRO4,
    ),
    "fsdp2_cp2_zigzag_pp2": (
        {"dp_shard": 2, "zero_stage": 3, "cp": 2, "cp_load_balance": True, "pp": 2, "pp_schedule": "gpipe"}, MICRO2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_pp_layout_matches_single_process(pool, corpus, case):
    parallelism, training = CASES[case]
    body = tiny_job(corpus, training=training, **parallelism)
    reference = run_reference(pool, body, eval_after=EVAL_AFTER)
    run = run_layout(pool, body, eval_after=EVAL_AFTER)
    assert_equivalent(run, reference)
