"""Model shapes: named presets and the resolved `ModelConfig` the engine builds from.

`resolve_model` gives a preset (with the spec's overrides) or, for `spec.model.from_pretrained`, the
shape a Hugging Face model directory's config.json describes (`trainctl.spec.hf_config`), read under
the job's `FileRule` (trainctl.spec.files; the default confines nothing but bounds the read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainctl.spec.files import FileRule
from trainctl.spec.hf_config import PretrainedConfigError, read_hf_config
from trainctl.spec.model_spec import ModelSpec, MoEAuxLoss

__all__ = ["PRESETS", "ModelConfig", "MoEConfig", "PretrainedConfigError", "RopeScaling", "UnknownPresetError", "resolve_model"]


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
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: llama3`): low frequencies divided by `factor`,
    high ones kept, the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """A fully resolved Llama-style decoder shape (optionally with MoE feed-forward layers).

    Features beyond Llama 2 (all off in the presets): `tie_embeddings` (the output projection is the
    token embedding), `qkv_bias` (bias on the q/k/v projections, Qwen2), `qk_norm` (RMSNorm over each
    query/key head before RoPE, Qwen3), `explicit_head_dim` (head size independent of dim / n_heads),
    `rope_scaling`. `hf_family` is the Hugging Face `model_type` an imported model came from (export
    writes that family back; None: a trainctl preset, exported as Llama) and `sliding_window` the
    window its config.json declares (the engine attends causally over the whole sequence, so a job's
    seq_len must not exceed it). `max_position_embeddings` is the context an imported model trained on, as
    its config.json states it (None: a preset, or a config naming no positive integer; a longer seq_len is
    a warning, `spec.model_checks.pretrained_warnings`).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: MoEConfig | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    explicit_head_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    hf_family: str | None = None
    sliding_window: int | None = None
    max_position_embeddings: int | None = None

    @property
    def head_dim(self) -> int:
        """Size of one attention head: `explicit_head_dim`, else dim // n_heads."""
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

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
    # Llama 3.2 3B's shape with untied embeddings (as llama-1b and torchtitan's llama3): 3.6 B parameters.
    "llama-3b": ModelConfig(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0
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


def resolve_model(spec: ModelSpec, files: FileRule = FileRule()) -> ModelConfig:
    """The shape of `spec.from_pretrained`'s config.json, read under `files` (`PretrainedConfigError` if
    it has none usable), else the preset named by `spec` with every field the spec sets overriding it."""
    if spec.from_pretrained is not None:
        fields = read_hf_config(spec.from_pretrained, files)
        rope, moe = fields.pop("rope_scaling"), fields.pop("moe", None)
        return ModelConfig(
            **fields, rope_scaling=None if rope is None else RopeScaling(**rope), moe=None if moe is None else MoEConfig(**moe)
        )
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

