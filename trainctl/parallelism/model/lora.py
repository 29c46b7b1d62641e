"""Low-rank adapters (LoRA): freeze the model, train `W x + (alpha / r) B A dropout(x)` on chosen projections.

`apply_lora(model, spec, seed)` replaces each target `nn.Linear` (`wq`, `wk`, `wv`, `wo` under
`attention`, `w1`, `w2`, `w3` under `feed_forward`) of every dense block with a `LoRALinear` that keeps
the base weight under the same name (`layers.0.attention.wq.weight`) and adds `lora_a` [r, in] and
`lora_b` [out, r]; every other parameter is frozen. A starts from a seeded Kaiming-uniform draw (one
generator per parameter name, so every layout starts identically) and B from zeros, so the adapted
model starts equal to the base (`initial_adapter`; on a meta-device model the adapters stay empty
until the loader fills them from it). `merge_lora_state(state, spec)` folds adapters into plain weights for
export.

Composes with data parallelism (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP: adapters are ordinary parameters of
their block; frozen weights get no gradients and no optimizer state), activation checkpointing,
bf16 and compile. Not with TP, PP, CP or EP (refused by spec validation).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainctl.parallelism.model.lora_names import PARENTS, is_adapter
from trainctl.spec.job import LoRASpec


class LoRALinear(nn.Linear):
    """A linear layer with a frozen base weight (and bias, if any) and a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.weight.requires_grad_(False)
        if base.bias is not None:  # q/k/v biases (qkv_bias): frozen like the weight
            self.bias = base.bias
            self.bias.requires_grad_(False)
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_a = nn.Parameter(torch.zeros(rank, base.in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=device))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def target_names(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Qualified names of the linear layers `spec` adapts (dense blocks only; MoE experts are not)."""
    names = []
    for block_name, block in model.layers.items():
        for target in spec.target_modules:
            parent = getattr(block, PARENTS[target], None)
            if parent is not None and isinstance(getattr(parent, target, None), nn.Linear):
                names.append(f"layers.{block_name}.{PARENTS[target]}.{target}")
    return names


def apply_lora(model: nn.Module, spec: LoRASpec, seed: int) -> list[str]:
    """Freeze `model` and put adapters on the target projections (in place, before parallelizing);
    returns the names of the adapted layers."""
    names = target_names(model, spec)
    if not names:
        raise ValueError(f"spec.lora.target_modules: {spec.target_modules} match no dense projection of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        adapted = LoRALinear(getattr(parent, leaf), spec.rank, spec.alpha, spec.dropout)
        if not adapted.lora_a.is_meta:
            with torch.no_grad():
                adapted.lora_a.copy_(initial_adapter(f"{name}.lora_a", tuple(adapted.lora_a.shape), seed))
        setattr(parent, leaf, adapted)
    return names


def initial_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The starting value of adapter parameter `name` (`<layer>.lora_a` or `<layer>.lora_b`), float32:
    A Kaiming-uniform from a generator seeded by (seed, layer name), B zeros. A model built on the meta
    device (sharded loading) takes its adapters' regions from here."""
    if name.endswith(".lora_b"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(_seed(seed, name.removesuffix(".lora_a")))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator) * 2 * bound - bound


def merge_lora_state(state: dict[str, torch.Tensor], spec: LoRASpec) -> dict[str, torch.Tensor]:
    """A plain model state dict from one with adapters: W + (alpha / r) B A for each adapted weight."""
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_a"):
            prefix = key[: -len(".lora_a")]
            a, b = state[key].float(), state[f"{prefix}.lora_b"].float()
            weight = merged[f"{prefix}.weight"]
            merged[f"{prefix}.weight"] = (weight.float() + (spec.alpha / spec.rank) * (b @ a)).to(weight.dtype)
    return merged
