"""Pipeline and expert-parallel layouts reproduce the single-process run: losses and gradients.

Every case trains 5 optimizer steps through the real Trainer (shared worker pool, gloo, fp32) and
compares the global losses (1e-5 relative) and one step's gradients (1e-4) with the single-process
run of the same job.
"""

from __future__ import annotations

import pytest
from harness import assert_equivalent, run_layout, run_reference, tiny_job

MOE = {"preset": "debug-moe"}

LAYOUTS = {
    "pp2-1f1b": ({}, {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2-interleaved-v2": ({}, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}),
    "pp4-zero-bubble": ({}, {"pp": 4, "pp_schedule": "zero_bubble"}),
    "moe-ep2": (MOE, {"dp_shard": 2, "ep": 2}),
    "moe-ep4": (MOE, {"dp_shard": 4, "ep": 4}),
    "dp2-tp2-pp2": ({}, {"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
    "moe-pp2-tp2-ep2": (MOE, {"dp_shard": 2, "ep": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
}


@pytest.mark.parametrize("case", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_process(pool, corpus, case):
    model, layout = case
    body = tiny_job(corpus, model=model, **layout)
    reference = run_reference(pool, body)
    run = run_layout(pool, body)
    assert len(run.losses) == 5
    assert_equivalent(run, reference)
