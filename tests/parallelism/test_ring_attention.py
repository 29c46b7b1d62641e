"""Ring attention alone against full causal attention: outputs and gradients, on gloo.

One 4-rank process group runs every case: cp=4 over the world and cp=2 over two pairs of ranks,
with and without load balancing, for fp64 (tight), fp32 and bf16, GQA / MQA / MHA with uneven head
counts, and sequence lengths that do not split evenly into chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainctl.parallelism.layouts.context_parallel import (
    make_layout,
    shard_sequence,
    unshard_sequence,
)
from trainctl.parallelism.layouts.ring_attention import SequenceLayout, ring_attention

# (batch, n_heads, n_kv_heads, seq_len, head_dim, dtype, tolerance on max |error| / max |reference|)
CASES = [
    (2, 4, 2, 32, 8, torch.float64, 1e-12),  # GQA, even length: exact up to fp64 rounding
    (1, 6, 2, 37, 5, torch.float64, 1e-12),  # 3 q heads per kv head, odd length and head_dim
    (2, 4, 2, 32, 8, torch.float32, 1e-5),
    (2, 3, 3, 26, 4, torch.float32, 1e-5),  # plain multi-head, 3 heads, uneven chunks
    (2, 4, 1, 40, 8, torch.bfloat16, 2e-2),  # multi-query, bf16
    (1, 6, 3, 29, 8, torch.bfloat16, 2e-2),  # uneven everything, bf16
]
WORLD = 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _check_case(case, cp: int, group, load_balance: bool, autocast: bool = False) -> list[str]:
    batch, heads, kv_heads, seq, head_dim, dtype, tol = case
    gen = torch.Generator().manual_seed(seq * 100 + heads)
    # Inputs are drawn in fp64 and rounded to the case's dtype; the reference uses the rounded values.
    q, k, v, grad = (
        torch.randn(batch, h, seq, head_dim, generator=gen, dtype=torch.float64).to(dtype).double()
        for h in (heads, kv_heads, kv_heads, heads)
    )
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    _reference(q_ref, k_ref, v_ref).backward(grad)
    out_ref = _reference(q, k, v)

    layout = SequenceLayout(seq_len=seq, cp=cp, load_balance=load_balance)
    rank = dist.get_rank(group)
    pos = layout.positions(rank)
    q_loc, k_loc, v_loc = (t[:, :, pos].to(dtype).requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ring_attention(q_loc, k_loc, v_loc, layout, group)
    out.backward(grad[:, :, pos].to(dtype))

    failures = []
    if out.dtype != dtype:
        failures.append(f"output dtype {out.dtype}, expected {dtype}")
    for name, got, want in (
        ("out", out, out_ref[:, :, pos]),
        ("dq", q_loc.grad, q_ref.grad[:, :, pos]),
        ("dk", k_loc.grad, k_ref.grad[:, :, pos]),
        ("dv", v_loc.grad, v_ref.grad[:, :, pos]),
    ):
        err = _rel_err(got, want)
        if not err <= tol:
            failures.append(
                f"cp={cp} lb={load_balance} autocast={autocast} case={case[:6]} cp_rank={rank}: "
                f"{name} rel err {err:.2e} > {tol}"
            )
    return failures


def _all_cases(rank: int, world_size: int) -> list[str]:
    """Every case on this rank of the 4-rank pool: cp=2 over two pairs of ranks, and cp=4."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    failures: list[str] = []
    for cp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
        for load_balance in (False, True):
            for case in CASES:
                failures += _check_case(case, cp, group, load_balance)
        # fp32 inputs under bf16 autocast: the ring keeps its own fp32 arithmetic.
        failures += _check_case(CASES[2], cp, group, load_balance=True, autocast=True)
    return failures


def test_ring_attention_matches_full_causal_attention(pool):
    failures = [line for rank_failures in pool.run(_all_cases, WORLD) for line in rank_failures]
    assert not failures, "\n".join(failures)


# ---- the layout and the sharding helpers, without processes ---------------------------------------
@pytest.mark.parametrize("seq_len", [8, 37, 64])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", [False, True])
def test_layout_covers_every_position_once(seq_len, cp, load_balance):
    layout = SequenceLayout(seq_len=seq_len, cp=cp, load_balance=load_balance)
    held = torch.cat([layout.positions(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))
    lengths = [layout.local_len(r) for r in range(cp)]
    assert max(lengths) - min(lengths) <= (2 if load_balance else 1)


def test_zigzag_layout_is_the_head_tail_split():
    layout = SequenceLayout(seq_len=16, cp=4, load_balance=True)
    assert layout.segments(0) == ((0, 2), (14, 2))
    assert layout.segments(3) == ((6, 2), (8, 2))
    assert layout.positions(1).tolist() == [2, 3, 12, 13]


def test_load_balancing_equalises_causal_work():
    # Query at global position p attends to p + 1 keys; zigzag gives every rank the same total.
    def work(layout: SequenceLayout) -> list[int]:
        return [int((layout.positions(r) + 1).sum()) for r in range(layout.cp)]

    balanced = work(SequenceLayout(seq_len=64, cp=4, load_balance=True))
    contiguous = work(SequenceLayout(seq_len=64, cp=4, load_balance=False))
    assert len(set(balanced)) == 1
    assert contiguous[-1] > 5 * contiguous[0]


@pytest.mark.parametrize("load_balance", [False, True])
def test_shard_and_unshard_are_inverse(load_balance):
    layout = make_layout(24, 3, load_balance)
    x = torch.arange(2 * 24 * 5).reshape(2, 24, 5)
    shards = [shard_sequence(x, layout, r) for r in range(3)]
    assert all(s.shape == (2, 8, 5) for s in shards)
    assert torch.equal(shards[1][:, :, 0] // 5 % 24, layout.positions(1).expand(2, -1))
    assert torch.equal(unshard_sequence(shards, layout), x)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match="divisible by 8"):
        make_layout(20, 4, True)
    with pytest.raises(ValueError, match="shorter than the 8 chunks"):
        SequenceLayout(seq_len=6, cp=4, load_balance=True)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        SequenceLayout(seq_len=6, cp=0, load_balance=False)
    with pytest.raises(ValueError, match="out of range"):
        SequenceLayout(seq_len=8, cp=2, load_balance=False).segments(2)
    with pytest.raises(ValueError, match="expected 2 shards"):
        unshard_sequence([torch.zeros(1, 4)], make_layout(8, 2, False))
