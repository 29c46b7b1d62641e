"""Model shapes: named presets and the resolved `ModelConfig` the engine builds from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainctl.spec.job import ModelSpec, MoEAuxLoss


@dataclass(frozen=True)
class MoEConfig:
    """Resolved mixture-of-experts settings."""

    num_experts: int
    top_k: int
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    interval: int = 1
    aux_loss: MoEAuxLoss = "per_layer_sum"


@dataclass(frozen=True)
class ModelConfig:
    """A fully resolved Llama-style decoder shape (optionally with MoE feed-forward layers)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: MoEConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses an MoE feed-forward."""
        return self.moe is not None and (layer + 1) % self.moe.interval == 0


PRESETS: dict[str, ModelConfig] = {
    # CPU-sized shapes for tests and the demo.
    "debug": ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "tiny": ModelConfig(vocab_size=256, dim=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=384),
    "small": ModelConfig(vocab_size=256, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=704),
    "debug-moe": ModelConfig(
        vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
        moe=MoEConfig(num_experts=4, top_k=2),
    ),
    # GPU shapes (Llama 3 family); used by `plan` and GPU benchmarks.
    "llama-1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0
    ),
    "llama3-70b": ModelConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, rope_theta=500000.0
    ),
    "moe-8x1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=4096, rope_theta=500000.0,
        moe=MoEConfig(num_experts=8, top_k=2, shared_expert=True),
    ),
}


class UnknownPresetError(ValueError):
    """The spec names a preset that does not exist."""


def resolve_model(spec: ModelSpec) -> ModelConfig:
    """The preset named by `spec`, with every field the spec sets overriding it."""
    if spec.preset not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {spec.preset!r}; known: {', '.join(sorted(PRESETS))}")
    config = PRESETS[spec.preset]
    overrides = {
        name: getattr(spec, name)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps")
        if getattr(spec, name) is not None
    }
    if spec.moe is not None:
        overrides["moe"] = MoEConfig(**spec.moe.model_dump())
    return replace(config, **overrides)
