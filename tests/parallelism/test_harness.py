"""The equivalence harness is sensitive: subtle injected errors are reported, naming step and parameter.

Each case trains the dense debug job under FSDP (dp_shard 2) for the harness's 3 steps with one error
injected on every rank, and compares it with the single-process reference as every layout test does.
The errors are ones Adam hides from the losses: one parameter's gradient scaled by 1.01 at one step,
and one sample's tokens shifted by one position at one step. The last case repeats the scaled
gradient under bf16 TP, whose comparison uses a looser tolerance.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    BF16_TP_GRAD_RTOL,
    BF16_TP_LOSS_RTOL,
    BF16_TP_TRAINING,
    assert_equivalent,
    mismatches,
    run_layout,
    run_reference,
    tiny_job,
)

from trainctl.parallelism.data.corpus import MicroBatch

LAYOUT = {"dp_shard": 2}
SCALED_PARAMETER = "layers.1.ffn_norm.weight"
NOISIEST_BF16_TP_PARAMETER = "layers.2.attention.wq.weight"
"""The gradient that bf16 under TP moves most (0.56 %) from the bf16 single-process run."""
SCALED_STEP = 2
SHIFTED_STEP = 1


def _scale_gradient(trainer, step: int, parameter: str) -> None:
    """At SCALED_STEP, multiply `parameter`'s gradient (this rank's shard of it) by 1.01."""
    if step != SCALED_STEP:
        return
    for name, param in trainer.model.named_parameters():
        if name == parameter and param.grad is not None:
            param.grad.mul_(1.01)


def scale_one_gradient(trainer, step: int) -> None:
    _scale_gradient(trainer, step, SCALED_PARAMETER)


def scale_noisiest_bf16_gradient(trainer, step: int) -> None:
    _scale_gradient(trainer, step, NOISIEST_BF16_TP_PARAMETER)


def shift_one_sample(trainer, step: int, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """At SHIFTED_STEP, the first sample of data-parallel rank 0 is read one token later (rotated by one)."""
    if step != SHIFTED_STEP or trainer.loader.dp_rank != 0:
        return micro_batches
    first = micro_batches[0]
    inputs, targets = first.inputs.clone(), first.targets.clone()
    inputs[0] = torch.roll(inputs[0], -1)
    targets[0] = torch.roll(targets[0], -1)
    return [MicroBatch(inputs=inputs, targets=targets), *micro_batches[1:]]


@pytest.fixture
def reference(pool, corpus):
    return run_reference(pool, tiny_job(corpus, **LAYOUT))


def test_gradient_scaled_by_one_percent_is_reported(pool, corpus, reference):
    run = run_layout(pool, tiny_job(corpus, **LAYOUT), edit_grads="test_harness:scale_one_gradient")
    with pytest.raises(AssertionError) as failure:
        assert_equivalent(run, reference)
    found = mismatches(run, reference)
    assert found[0].startswith(f"step {SCALED_STEP}: {SCALED_PARAMETER}: gradient relative error 1.00e-02"), found
    assert found[0] in str(failure.value)
    # Nothing before the injected step differs, and at that step only the scaled parameter does.
    assert [m for m in found if int(m.split(":")[0].split()[1]) <= SCALED_STEP] == [found[0]], found


def test_sample_shifted_by_one_token_is_reported(pool, corpus, reference):
    run = run_layout(pool, tiny_job(corpus, **LAYOUT), edit_batch="test_harness:shift_one_sample")
    with pytest.raises(AssertionError, match=f"step {SHIFTED_STEP}: "):
        assert_equivalent(run, reference)
    found = mismatches(run, reference)
    assert all(not m.startswith("step 0:") for m in found), found
    assert any(m.startswith(f"step {SHIFTED_STEP}: layers.") for m in found), found


def test_one_percent_is_caught_under_the_bf16_tolerance(pool, corpus):
    """bf16 under TP is compared with a looser tolerance; 1 % on its noisiest gradient still fails it."""
    body = tiny_job(corpus, training=BF16_TP_TRAINING, tp=2, sequence_parallel=True)
    run = run_layout(pool, body, edit_grads="test_harness:scale_noisiest_bf16_gradient")
    found = mismatches(run, run_reference(pool, body), loss_rtol=BF16_TP_LOSS_RTOL, grad_rtol=BF16_TP_GRAD_RTOL)
    assert found and found[0].startswith(f"step {SCALED_STEP}: {NOISIEST_BF16_TP_PARAMETER}: gradient relative error"), found


def abort_on_rank_1(rank: int, world_size: int) -> int:
    """A worker body that dies natively on rank 1, as a crash in torch or gloo would."""
    if rank == 1:
        import os

        os.abort()
    return rank


def test_a_worker_that_dies_fails_the_call_naming_it_instead_of_waiting_out_the_timeout(pool):
    with pytest.raises(AssertionError, match=r"abort_on_rank_1: worker\(s\) of rank \[1\] died, exit codes \{1: -6\}"):
        pool.run(abort_on_rank_1, 2, timeout=600)  # a TimeoutError (after 600 s) would be the old behaviour
    assert pool.run(abort_on_rank_1, 1) == [0]  # the pool starts fresh workers afterwards
