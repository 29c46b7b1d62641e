"""Training options under parallel layouts reproduce the single-process run, gradients at every step.

bf16 under TP and PP, `torch.compile` and selective activation checkpointing: each case trains the
harness's 3 steps and compares every step's loss and every parameter's full gradient with a
single-process reference (fp32 tolerances unless stated).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from harness import (
    BF16_TP_GRAD_RTOL,
    BF16_TP_LOSS_RTOL,
    BF16_TP_TRAINING,
    assert_equivalent,
    run_layout,
    run_reference,
    tiny_job,
)

MICRO4 = {"micro_batch_size": 4}


def test_bf16_under_tensor_parallel_tracks_bf16_single_process(pool, corpus):
    body = tiny_job(corpus, training=BF16_TP_TRAINING, tp=2, sequence_parallel=True)
    assert_equivalent(run_layout(pool, body), run_reference(pool, body),
                      loss_rtol=BF16_TP_LOSS_RTOL, grad_rtol=BF16_TP_GRAD_RTOL)


def test_bf16_under_pipeline_parallel_matches_bf16_single_process(pool, corpus):
    """Pipeline stages do the single process's bf16 arithmetic exactly (measured: identical), so fp32
    tolerances apply. Clipping is off: the global norm sums the stages' squares in another order, and
    that last-bit change of the clip factor flips bf16 roundings of the cast weights from step 2 on."""
    body = tiny_job(corpus, training={"dtype": "bfloat16", "grad_clip": 0}, pp=2, pp_schedule="1f1b")
    assert_equivalent(run_layout(pool, body), run_reference(pool, body))


@contextlib.contextmanager
def compile_with_aot_eager() -> Iterator[None]:
    """Every torch.compile call uses the aot_eager backend (at least one call is required), then
    compiled code is dropped.

    aot_eager runs Dynamo's graph capture and AOTAutograd's joint forward/backward graphs, the parts
    that can break a layout's gradients; inductor's C++ code generation would add minutes per worker
    on this CPU runner and changes only kernels, not graphs.
    """
    calls: list[object] = []
    original = torch.compile

    def aot_eager(model: object, **kwargs: object) -> object:
        calls.append(model)
        return original(model, **{**kwargs, "backend": "aot_eager"})

    with mock.patch.object(torch, "compile", aot_eager):
        try:
            yield
        finally:
            torch._dynamo.reset()
    assert calls, "spec.training.compile=True compiled nothing"


def test_compiled_blocks_under_fsdp_match_eager_single_process(pool, corpus):
    body = tiny_job(corpus, training={"compile": True}, dp_shard=2)
    run = run_layout(pool, body, context="test_equivalence_training_options:compile_with_aot_eager")
    assert_equivalent(run, run_reference(pool, tiny_job(corpus, dp_shard=2)))


def test_selective_activation_checkpointing_under_tp_sp_matches_single_process(pool, corpus):
    body = tiny_job(corpus, training={"activation_checkpointing": "selective", **MICRO4}, tp=2, sequence_parallel=True)
    assert_equivalent(run_layout(pool, body), run_reference(pool, tiny_job(corpus, training=MICRO4)))
