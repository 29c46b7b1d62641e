"""The one mapping between the engine's parameter names and Hugging Face's Llama-family names.

Shared by export (engine -> HF) and import (HF -> engine). Names map one to one
(`tok_embeddings` -> `model.embed_tokens`, `attention.wq` -> `self_attn.q_proj` (weight and bias),
`attention.q_norm` -> `self_attn.q_norm`, `feed_forward.w1/w3/w2` -> `mlp.gate_proj/up_proj/down_proj`,
`attention_norm` / `ffn_norm` -> `input_layernorm` / `post_attention_layernorm`, `norm` -> `model.norm`,
`output` -> `lm_head`).

RoPE: the engine rotates interleaved pairs (dims 2i, 2i+1 of a head share frequency i); HF rotates
halves (`rotate_half`: dims i and i + head_dim/2). Both use frequency theta^(-2i/head_dim) for pair i,
so permuting every per-head-dim quantity on the q and k side within each head (pair i's two entries go
to positions i and i + head_dim/2) gives identical attention scores: q.k is a sum over dims, permuted
alike on both sides. Permuted: wq / wk rows, their biases, and the q_norm / k_norm weights (the norm
itself is invariant under a permutation of the dims it normalises).
"""

from __future__ import annotations

import torch

from trainctl.spec.presets import ModelConfig

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
"""Names inside decoder layer i: `layers.{i}.<key>` <-> `model.layers.{i}.<value>`."""
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str | None:
    """The HF name of engine parameter `name`, or None if it has none."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    head, layer, rest = (name.split(".", 2) + ["", ""])[:3]
    if head != "layers" or rest not in LAYER_NAMES:
        return None
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def rope_heads(name: str, config: ModelConfig) -> int | None:
    """How many heads engine parameter `name` spans along its first dim if RoPE layout applies to it
    (q side: n_heads, k side: n_kv_heads, q/k norms: 1), else None."""
    rest = name.split(".", 2)[-1]
    if rest.startswith("attention.wq."):
        return config.n_heads
    if rest.startswith("attention.wk."):
        return config.n_kv_heads
    if rest in ("attention.q_norm.weight", "attention.k_norm.weight"):
        return 1
    return None


def interleaved_to_halves(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder dim 0 of a q/k-side tensor from interleaved-pair RoPE to rotate-half RoPE."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    head_dim = rows // n_heads
    return tensor.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def halves_to_interleaved(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder dim 0 of a q/k-side tensor from rotate-half RoPE to interleaved-pair RoPE (the inverse)."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    head_dim = rows // n_heads
    return tensor.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(tensor.shape)
