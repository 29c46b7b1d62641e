"""The Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), free of parallelism.

Module names are a contract: tensor-parallel plans, pipeline splitting, checkpoints and the estimator
refer to them (see docs/architecture.md):

    tok_embeddings, layers["0".."n-1"]{attention_norm, attention{wq, wk, wv, [q_norm, k_norm], wo, core},
    ffn_norm, feed_forward{w1, w2, w3} | moe}, norm, output

Optional features (ModelConfig): `qkv_bias` gives wq/wk/wv a bias; `qk_norm` adds `attention.q_norm` /
`k_norm`, RMSNorms over each head's head_dim applied to q and k before RoPE; `explicit_head_dim` sets the
head size; `rope_scaling` rescales the RoPE frequencies (Llama 3.1 `llama3` rule); `tie_embeddings`
makes `output.weight` the very Parameter `tok_embeddings.weight` (both names stay in the state dict;
`tie_embeddings` re-ties them after a layout replaced parameters, and pipeline stages keep one copy on
the first and one on the last stage, whose gradients layouts/tied_embeddings.py sums).

A pipeline stage deletes the layers it does not own (names stay) and sets `tok_embeddings`, `norm`
and `output` to None where absent; `forward` then takes / returns hidden states.

Initialisation is layout-independent: every parameter is drawn from its own generator seeded by
(seed, fully-qualified name), so the full model, a pipeline stage, or a model later sharded by TP/FSDP
all start from bit-identical weights. The engine builds the full model (or the stage's part of it) on
CPU, initialises it, and only then parallelizes it.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainctl.parallelism.model.feed_forward import FeedForward
from trainctl.parallelism.model.moe import MoEFeedForward
from trainctl.spec.presets import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """Per rotary pair i, its angular frequency theta^(-2i/head_dim), rescaled by `scaling` (Llama 3.1:
    wavelengths above original_max / low_freq_factor divided by `factor`, those below original_max /
    high_freq_factor kept, the band between interpolated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables for explicit `positions` ([seq] or [batch, seq]) -> [..., seq, head_dim/2]."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [batch, seq, heads, head_dim] by interleaved-pair RoPE; cos/sin [seq|batch,seq, head_dim/2]."""
    if cos.dim() == 2:  # [seq, hd/2] -> broadcast over batch and heads
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:  # [batch, seq, hd/2]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand key/value heads [batch, kv_heads, seq, hd] to [batch, kv_heads * n_rep, seq, hd] (GQA)."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


class CausalAttentionCore(nn.Module):
    """Causal scaled-dot-product attention from q [b, hq, s, hd] and k, v [b, hkv, s, hd] (hq % hkv == 0).

    Returns [b, hq, s, hd]. Key/value heads are *not* pre-expanded, so a replacement (ring attention
    for context parallel) can move the smaller k/v tensors and expand locally with `repeat_kv`.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


class Attention(nn.Module):
    """Grouped-query attention. Head counts come from tensor shapes (`-1`), so TP-local shards work."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        bias = config.qkv_bias
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.core = CausalAttentionCore()

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [batch, seq, heads, head_dim] of `x`: projected, q/k normed (qk_norm) and rotated."""
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.project(x, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(x)) (dense `feed_forward` or `moe`)."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if config.is_moe_layer(layer_id):
            self.moe = MoEFeedForward(config.dim, config.ffn_dim, config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. `forward(tokens, positions=None)` returns logits [batch, seq, vocab].

    On a pipeline stage without `tok_embeddings` the input is hidden states [batch, seq, dim]; without
    `output` the result is hidden states. `positions` ([seq] or [batch, seq]) default to arange(seq);
    context parallel passes the positions of its shard.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        tie_embeddings(self)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos/sin tables of `positions` for this model."""
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = self.rope(positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def tie_embeddings(model: nn.Module) -> None:
    """With `config.tie_embeddings`, make `output.weight` the Parameter `tok_embeddings.weight` (when the
    model or stage holds both); call again after a layout replaced parameters (tensor parallel)."""
    config = getattr(model, "config", None)
    if config is None or not config.tie_embeddings:
        return
    if getattr(model, "tok_embeddings", None) is not None and getattr(model, "output", None) is not None:
        model.output.weight = model.tok_embeddings.weight


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(model: nn.Module, seed: int, n_layers: int) -> None:
    """Initialise every parameter from a generator seeded by (seed, its fully-qualified name).

    Norm weights are ones, biases zeros; embeddings and projections N(0, 0.02); the residual-output projections
    (attention.wo, feed_forward.w2 and anything named w2/wo under moe) are scaled by 1/sqrt(2 n_layers).
    Parameters must be plain full tensors (call before parallelizing).
    """
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            residual = {"wo", "w2"} & set(name.split(".")[-2:])
            std = residual_std if residual else 0.02
            generator = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))


def build_model(config: ModelConfig, seed: int) -> Transformer:
    """The full model on CPU in float32, initialised deterministically from `seed`."""
    model = Transformer(config)
    init_weights(model, seed, config.n_layers)
    return model
