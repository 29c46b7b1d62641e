"""Chat data (assistant-only loss) reproduces the single-process run under every layout.

The objective with a loss mask is the sum of token losses over the global batch divided by the
global batch's loss tokens (engine/loss.py). Checked here: the single-process step equals that
quantity computed directly from the model's logits over the whole batch; gradient accumulation does
not change it (micro-batch 8 vs 1: a mean of per-micro-batch means would); and DP (DDP, FSDP, ZeRO-1),
TP, CP and PP reproduce the single-process losses and gradients at every step (fp32 tolerances of the
harness).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from data_sources import build_tokenizer, conversations, write_jsonl
from harness import EVAL_AFTER, assert_equivalent, run_layout, run_reference, tiny_job

from trainctl.parallelism.data.corpus import IGNORE_INDEX
from trainctl.parallelism.engine.trainer import Trainer

CASES = {
    "ddp2": {"dp_replicate": 2},
    "fsdp2": {"dp_shard": 2, "zero_stage": 3},
    "zero1_dp2": {"dp_shard": 2, "zero_stage": 1},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "cp2_zigzag": {"cp": 2, "cp_load_balance": True},
    "pp2": {"pp": 2},
    "dp2_pp2": {"dp_shard": 2, "pp": 2},
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """spec.data of a chat JSONL corpus with a local tokenizer directory (vocabulary < 256)."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer = build_tokenizer(root / "tokenizer")
    path = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in conversations(120, seed=5)])
    return {"paths": [str(path)], "format": "jsonl", "messages_field": "messages", "tokenizer": str(tokenizer)}


def test_step_objective_is_global_token_sum_over_global_loss_tokens(chat_data):
    trainer = Trainer(tiny_job("", data=chat_data, training={"micro_batch_size": 2}), device="cpu")
    batch = trainer.loader.next_batch()
    inputs = torch.cat([m.inputs for m in batch])
    targets = torch.cat([m.targets for m in batch])
    assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
    (part,) = trainer.model.parts
    with torch.no_grad():
        want = F.cross_entropy(part(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    got = trainer.forward_backward(batch)
    assert abs(float(got) - float(want)) <= 1e-5 * float(want)


def test_gradient_accumulation_does_not_change_the_masked_objective(pool, chat_data):
    whole = run_reference(pool, tiny_job("", data=chat_data, training={"micro_batch_size": 8}))
    accumulated = run_reference(pool, tiny_job("", data=chat_data, training={"micro_batch_size": 1}))
    assert_equivalent(accumulated, whole)


@pytest.mark.parametrize("case", list(CASES))
def test_masked_layout_matches_single_process(pool, chat_data, case):
    body = tiny_job("", data=chat_data, **CASES[case])
    assert_equivalent(run_layout(pool, body, eval_after=EVAL_AFTER), run_reference(pool, body, eval_after=EVAL_AFTER))
