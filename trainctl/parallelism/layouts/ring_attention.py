"""Causal ring attention for context parallelism, written for any backend (gloo on CPU included).

Each of the `cp` ranks of a context-parallel group holds the queries, keys and values of its own part
of the sequence. Key/value shards travel around the ring (rank r sends to r+1 and receives from r-1)
while every rank attends its queries to the shard it currently holds; the partial outputs are merged
with a numerically stable log-sum-exp rule. The backward pass is its own ring: keys and values travel
again (sent ahead, overlapping the compute), each followed by the running dK/dV of its shard to which
every rank adds its contribution; after a full turn one last hop hands every shard's dK/dV back to its
owner. Autograd never sees communication.

Which global positions a rank holds is a `SequenceLayout`: contiguous (rank r holds chunk r of `cp`)
or load-balanced zigzag (rank r holds chunks r and 2*cp-1-r of 2*cp), with lengths that need not
divide evenly. Causality is decided per pair of contiguous segments: a key segment entirely before a
query segment is attended fully, one entirely after is skipped, and only overlapping segments (the
diagonal) are masked element-wise. With zigzag every rank does the same amount of work per step.

Grouped-query attention is native: q has `n_heads` heads and k/v have `n_kv_heads` (a divisor), query
head h reading kv head h // (n_heads // n_kv_heads), and only the n_kv_heads-wide k/v travel.
Scores, softmax statistics and gradients are accumulated in fp32 (or fp64 for fp64 inputs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

_KV_TAG, _GRAD_TAG = 0, 1
"""Message tags of the backward ring, which has keys/values and gradients in flight at once."""

Segment = tuple[int, int]
"""A contiguous run of global positions: (start, length)."""


@dataclass(frozen=True)
class SequenceLayout:
    """Which global sequence positions each rank of a context-parallel group holds.

    The sequence is cut into `cp` chunks (or `2 * cp` with `load_balance`), as evenly as possible: the
    first `seq_len % n_chunks` chunks are one position longer. Rank r holds chunk r, and with
    `load_balance` also chunk `2 * cp - 1 - r` (head-tail / zigzag), in that order.
    """

    seq_len: int
    cp: int
    load_balance: bool

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be a positive integer, got {self.cp!r}")
        n_chunks = 2 * self.cp if self.load_balance else self.cp
        if not isinstance(self.seq_len, int) or self.seq_len < n_chunks:
            raise ValueError(
                f"seq_len={self.seq_len!r} is shorter than the {n_chunks} chunks that cp={self.cp} "
                f"{'with' if self.load_balance else 'without'} load balancing cuts it into"
            )

    @cached_property
    def _chunks(self) -> tuple[Segment, ...]:
        n_chunks = 2 * self.cp if self.load_balance else self.cp
        base, extra = divmod(self.seq_len, n_chunks)
        chunks, start = [], 0
        for index in range(n_chunks):
            length = base + (1 if index < extra else 0)
            chunks.append((start, length))
            start += length
        return tuple(chunks)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The (start, length) segments rank `rank` holds, in local order."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"context-parallel rank {rank} out of range [0, {self.cp})")
        if self.load_balance:
            return (self._chunks[rank], self._chunks[2 * self.cp - 1 - rank])
        return (self._chunks[rank],)

    def local_len(self, rank: int) -> int:
        """Number of positions rank `rank` holds."""
        return sum(length for _, length in self.segments(rank))

    def positions(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions held by `rank`, in local order (int64)."""
        return torch.cat(
            [torch.arange(start, start + length, device=device) for start, length in self.segments(rank)]
        )


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Log-sum-exp merge of two partial softmax-attention results over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(block_lse))
    return out * w_old.unsqueeze(-1) + block_out * w_new.unsqueeze(-1), new_lse


def _block_kind(q_seg: Segment, k_seg: Segment) -> str:
    """'full' when every key precedes every query, 'skip' when none does, else 'partial'."""
    q_start, q_len = q_seg
    k_start, k_len = k_seg
    if k_start + k_len - 1 <= q_start:
        return "full"
    if k_start > q_start + q_len - 1:
        return "skip"
    return "partial"


def _causal_mask(q_seg: Segment, k_seg: Segment, device: torch.device) -> Tensor:
    q_pos = torch.arange(q_seg[0], q_seg[0] + q_seg[1], device=device)
    k_pos = torch.arange(k_seg[0], k_seg[0] + k_seg[1], device=device)
    return q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)


def _pairs(
    q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...]
) -> Iterator[tuple[slice, slice, Segment, Segment, bool]]:
    """(local q slice, local k slice, q segment, k segment, needs a mask) for every pair of segments
    that is not entirely masked."""
    q_off = 0
    for q_seg in q_segs:
        k_off = 0
        for k_seg in k_segs:
            kind = _block_kind(q_seg, k_seg)
            if kind != "skip":
                yield (
                    slice(q_off, q_off + q_seg[1]),
                    slice(k_off, k_off + k_seg[1]),
                    q_seg,
                    k_seg,
                    kind == "partial",
                )
            k_off += k_seg[1]
        q_off += q_seg[1]


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """q [B, Hkv, G, Sq, D], k [B, Hkv, Sk, D] -> scores [B, Hkv, G, Sq, Sk] (masked = -inf)."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


class _Ring:
    """Point-to-point exchange with the ring neighbours of one context-parallel group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: Tensor, recv: Tensor, tag: int = 0) -> list[dist.Work]:
        """Send `send` to the next rank and receive into `recv` from the previous one, asynchronously."""
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)


def _compute_dtype(q: Tensor) -> torch.dtype:
    """fp32 for half-precision inputs, the input dtype when it is already wider."""
    return torch.promote_types(q.dtype, torch.float32)


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buffer: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        out.append(buffer[offset : offset + numel].view(shape))
        offset += numel
    return out


class _RingAttention(torch.autograd.Function):
    """Forward and backward rings; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SequenceLayout, group, scale: float):  # type: ignore[override]
        with torch.autocast(q.device.type, enabled=False):  # the fp32 statistics must stay fp32
            return _RingAttention._forward(ctx, q, k, v, layout, group, scale)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        with torch.autocast(grad_out.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, group: dist.ProcessGroup, scale: float
    ) -> Tensor:
        ring = _Ring(group)
        batch, n_heads, q_len, head_dim = q.shape
        n_kv = k.shape[1]
        groups = n_heads // n_kv
        compute = _compute_dtype(q)
        q5 = q.to(compute).reshape(batch, n_kv, groups, q_len, head_dim)
        q_segs = layout.segments(ring.rank)

        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        kv_buf = _pack(k, v)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            works = []
            if step + 1 < ring.size:
                incoming_len = layout.local_len((src - 1) % ring.size)
                recv = kv_buf.new_empty(2 * batch * n_kv * incoming_len * head_dim)
                works = ring.start(kv_buf, recv)
            src_len = layout.local_len(src)
            kv_shape = torch.Size((batch, n_kv, src_len, head_dim))
            k_cur, v_cur = (t.to(compute) for t in _unpack(kv_buf, [kv_shape, kv_shape]))
            for qs, ks, q_seg, k_seg, partial in _pairs(q_segs, layout.segments(src)):
                mask = _causal_mask(q_seg, k_seg, q.device) if partial else None
                scores = _scores(q5[..., qs, :], k_cur[:, :, ks], scale, mask)
                block_lse = torch.logsumexp(scores, dim=-1)
                safe = block_lse.masked_fill(~torch.isfinite(block_lse), 0.0)
                probs = torch.exp(scores - safe.unsqueeze(-1))
                block_out = torch.matmul(probs, v_cur[:, :, ks].unsqueeze(2))
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], block_out, block_lse)
            for work in works:
                work.wait()
            if works:
                kv_buf = recv

        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.scale = layout, group, scale
        return out.reshape(batch, n_heads, q_len, head_dim).to(q.dtype)

    @staticmethod
    def _backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        ring = _Ring(ctx.group)
        batch, n_heads, q_len, head_dim = q.shape
        n_kv = k.shape[1]
        groups = n_heads // n_kv
        compute = _compute_dtype(q)
        q5 = q.to(compute).reshape(batch, n_kv, groups, q_len, head_dim)
        do5 = grad_out.to(compute).reshape(batch, n_kv, groups, q_len, head_dim)
        delta = (do5 * out).sum(dim=-1)  # rowsum(dO * O), [B, Hkv, G, Sq]
        q_segs = layout.segments(ring.rank)
        dq = torch.zeros_like(q5)

        # k, v of shard `src` travel in their own dtype, ahead of the compute that uses them; the
        # running dK, dV of that shard (fp32 or wider) follow once this rank has added its part.
        kv_buf = _pack(k, v)
        dkv_buf = torch.zeros(2 * k.numel(), dtype=compute, device=k.device)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            shape = torch.Size((batch, n_kv, layout.local_len(src), head_dim))
            works, kv_next = [], None
            if step + 1 < ring.size:
                kv_next = kv_buf.new_empty(2 * batch * n_kv * layout.local_len((src - 1) % ring.size) * head_dim)
                works = ring.start(kv_buf, kv_next, tag=_KV_TAG)
            k_cur, v_cur = (t.to(compute) for t in _unpack(kv_buf, [shape, shape]))
            dk_cur, dv_cur = _unpack(dkv_buf, [shape, shape])
            for qs, ks, q_seg, k_seg, partial in _pairs(q_segs, layout.segments(src)):
                mask = _causal_mask(q_seg, k_seg, q.device) if partial else None
                q_blk = q5[..., qs, :]
                k_blk = k_cur[:, :, ks]
                scores = _scores(q_blk, k_blk, scale, mask)
                probs = torch.exp(scores - lse[..., qs].unsqueeze(-1))
                do_blk = do5[..., qs, :]
                dv_cur[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", probs, do_blk)
                dprobs = torch.matmul(do_blk, v_cur[:, :, ks].unsqueeze(2).transpose(-1, -2))
                dscores = probs * (dprobs - delta[..., qs].unsqueeze(-1)) * scale
                dq[..., qs, :] += torch.matmul(dscores, k_blk.unsqueeze(2))
                dk_cur[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", dscores, q_blk)
            if ring.size > 1:
                # After the last step the shard held is the next rank's own: its gradients go home.
                incoming = (src - 1) % ring.size if step + 1 < ring.size else ring.rank
                dkv_next = dkv_buf.new_empty(2 * batch * n_kv * layout.local_len(incoming) * head_dim)
                works += ring.start(dkv_buf, dkv_next, tag=_GRAD_TAG)
                for work in works:
                    work.wait()
                kv_buf, dkv_buf = kv_next, dkv_next

        own = torch.Size((batch, n_kv, layout.local_len(ring.rank), head_dim))
        dk, dv = _unpack(dkv_buf, [own, own])
        return (
            dq.reshape(q.shape).to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: SequenceLayout,
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> Tensor:
    """Causal attention over a sequence sharded across `group` as `layout` describes.

    q: [batch, n_heads, local_len, head_dim]; k, v: [batch, n_kv_heads, local_len, head_dim] where
    local_len is `layout.local_len(rank in group)`. Returns [batch, n_heads, local_len, head_dim] in
    q's dtype: this rank's rows of softmax(q k^T * scale + causal mask) v over the whole sequence.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"ring_attention expects 4-d q, k, v [batch, heads, seq, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, seq or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_heads={q.shape[1]} is not a multiple of n_kv_heads={k.shape[1]}")
    if dist.get_world_size(group) != layout.cp:
        raise ValueError(f"layout is for cp={layout.cp} but the group has {dist.get_world_size(group)} ranks")
    expected = layout.local_len(dist.get_rank(group))
    if q.shape[2] != expected:
        raise ValueError(
            f"local sequence length {q.shape[2]} does not match the layout's {expected} for this rank "
            f"(seq_len={layout.seq_len}, cp={layout.cp}, load_balance={layout.load_balance})"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), layout, group, scale)
