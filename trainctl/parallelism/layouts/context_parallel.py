"""Context parallelism: shard each sequence across the `cp` ranks and attend with ring attention.

Sharding (`SequenceLayout`): without load balancing rank r holds the r-th of `cp` contiguous chunks;
with it (zigzag / head-tail) the sequence is cut into `2 * cp` chunks and rank r holds chunks r and
`2 * cp - 1 - r`, so under a causal mask every rank has the same amount of attention work. Tokens,
labels and positions are sharded identically; the model receives the positions of its shard, so RoPE
and the causal mask of ring attention see true global positions.

Where the trainer calls it: for every micro-batch, after the data loader yields the full `[batch,
seq]` tokens and labels of this data-parallel rank and before the forward,

    tokens, labels, positions = shard_batch_for_cp(tokens, labels, pmesh["cp"], par.cp_load_balance)
    logits = model(tokens, positions)          # loss: mean over the local tokens, as usual

Every CP rank of a group must receive the same full micro-batch (the data loader splits over dp, not
cp). Each rank holds seq/cp tokens, so the local mean loss averaged over the CP ranks — which the
gradient averaging over dp_shard x cp (data_parallel) does — is the global mean. Under pipeline
parallelism the first stage's inputs and the last stage's labels are sharded the same way; a stage
called without positions gets its shard's positions from a pre-hook `apply_context_parallel` installs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from trainctl.parallelism.layouts.ring_attention import SequenceLayout, ring_attention


def _check_divisible(seq_len: int, cp: int, load_balance: bool) -> None:
    n_chunks = 2 * cp if load_balance else cp
    if seq_len % n_chunks:
        raise ValueError(
            f"sequence length {seq_len} must be divisible by {n_chunks} (cp={cp}"
            f"{' x 2 chunks per rank for load balancing' if load_balance else ''})"
        )


def make_layout(seq_len: int, cp: int, load_balance: bool) -> SequenceLayout:
    """The layout for a full sequence of `seq_len`, which must split into equal chunks."""
    _check_divisible(seq_len, cp, load_balance)
    return SequenceLayout(seq_len=seq_len, cp=cp, load_balance=load_balance)


def shard_sequence(x: Tensor, layout: SequenceLayout, cp_rank: int, dim: int = 1) -> Tensor:
    """This CP rank's part of `x` along `dim` (whose size must be `layout.seq_len`)."""
    if x.shape[dim] != layout.seq_len:
        raise ValueError(f"dimension {dim} of a {tuple(x.shape)} tensor is not the sequence of {layout.seq_len}")
    return torch.cat([x.narrow(dim, start, length) for start, length in layout.segments(cp_rank)], dim=dim)


def unshard_sequence(shards: list[Tensor], layout: SequenceLayout, dim: int = 1) -> Tensor:
    """Inverse of `shard_sequence`: the full tensor from every CP rank's shard (in CP-rank order)."""
    if len(shards) != layout.cp:
        raise ValueError(f"expected {layout.cp} shards (one per CP rank), got {len(shards)}")
    pieces: list[tuple[int, Tensor]] = []
    for rank, shard in enumerate(shards):
        if shard.shape[dim] != layout.local_len(rank):
            raise ValueError(
                f"shard of CP rank {rank} has {shard.shape[dim]} positions on dim {dim}, "
                f"the layout gives it {layout.local_len(rank)}"
            )
        offset = 0
        for start, length in layout.segments(rank):
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda item: item[0])], dim=dim)


def shard_batch_for_cp(
    tokens: Tensor, labels: Tensor, cp_mesh: DeviceMesh, load_balance: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, labels, positions) of this CP rank from a full `[batch, seq]` micro-batch.

    positions is 1-d `[seq / cp]` (int64, on the tokens' device): what `model(tokens, positions)` takes.
    """
    if tokens.dim() != 2 or tokens.shape != labels.shape:
        raise ValueError(
            f"tokens and labels must both be [batch, seq]; got {tuple(tokens.shape)} and {tuple(labels.shape)}"
        )
    layout = make_layout(tokens.shape[1], cp_mesh.size(), load_balance)
    rank = cp_mesh.get_local_rank()
    return (
        shard_sequence(tokens, layout, rank),
        shard_sequence(labels, layout, rank),
        layout.positions(rank, device=tokens.device),
    )


class RingAttentionCore(nn.Module):
    """Drop-in for a block's `attention.core`: causal ring attention over the CP group.

    Takes q [b, hq, s_local, hd], k, v [b, hkv, s_local, hd] of this rank's shard (laid out by
    `shard_batch_for_cp` with the same `load_balance`) and returns [b, hq, s_local, hd].
    """

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool) -> None:
        super().__init__()
        self.cp = cp_mesh.size()
        self.group = cp_mesh.get_group()
        self.load_balance = load_balance

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        layout = make_layout(q.shape[2] * self.cp, self.cp, self.load_balance)
        return ring_attention(q, k, v, layout, self.group)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, load_balance={self.load_balance}"


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, load_balance: bool) -> nn.Module:
    """Replace every decoder block's `attention.core` with `RingAttentionCore`; returns `model`.

    Parameters are untouched (CP ranks hold the same weights; data_parallel reduces their gradients
    over dp_shard x cp). Feed the model batches from `shard_batch_for_cp` with the same `load_balance`;
    a forward called without positions defaults to this rank's shard positions (not arange).
    """
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_context_parallel needs a 1-d CP mesh, got {cp_mesh.ndim} dims")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError("context parallel needs a model with its decoder blocks in a ModuleDict `layers`")
    for name, block in layers.items():
        attention = getattr(block, "attention", None)
        if attention is None or not hasattr(attention, "core"):
            raise TypeError(f"layers.{name} has no attention.core to replace with ring attention")
        attention.core = RingAttentionCore(cp_mesh, load_balance)
    model.register_forward_pre_hook(_ShardPositions(cp_mesh, load_balance), with_kwargs=True)
    return model


class _ShardPositions:
    """Forward pre-hook: a call without `positions` gets this CP rank's shard positions, not arange.

    Callers that pass no positions (a pipeline stage's schedule, for example) thereby still apply RoPE
    at the true global positions of the shard the layout gives this rank.
    """

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool) -> None:
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.load_balance = load_balance

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        given = args[1] if len(args) > 1 else kwargs.get("positions")
        if given is not None:
            return None
        x = args[0] if args else kwargs["tokens"]
        layout = make_layout(x.shape[1] * self.cp, self.cp, self.load_balance)
        return args[:1], {**kwargs, "positions": layout.positions(self.rank, device=x.device)}
