"""The `spec.model` section: a named preset with shape overrides, or a Hugging Face model directory
(`from_pretrained`), and its mixture-of-experts settings. `trainctl.spec.presets.resolve_model` turns it
into the shape the engine builds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainctl.spec.bounds import MAX_DIM, MAX_EXPERTS, MAX_FFN_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB
from trainctl.spec.strict_model import PathText, StrictModel, count

MoEAuxLoss = Literal["per_layer_sum", "transformers"]
"""Conventions for the MoE load-balancing loss (`MoESpec.aux_loss`)."""


class MoESpec(StrictModel):
    num_experts: count(MAX_EXPERTS) = 8
    """Routed experts per MoE layer (at most 1024)."""
    top_k: count(MAX_EXPERTS) = 2
    """Experts each token is sent to."""
    shared_expert: bool = False
    """Add one always-on expert beside the routed ones (DeepSeek-style)."""
    aux_loss_coef: float = Field(default=0.01, ge=0.0)
    """Weight of the Switch-style load-balancing loss added to the language-model loss (its meaning
    depends on `aux_loss`)."""
    aux_loss: MoEAuxLoss = "per_layer_sum"
    """How the load-balancing loss is formed per micro-batch. `per_layer_sum`: each MoE layer's
    `E * sum_e f_e * P_e` (1.0 when balanced), summed over layers. `transformers`: Hugging Face
    Mixtral's `load_balancing_loss_func`, one `E * sum_e f_e * P_e` over all layers' router
    statistics together, with `f_e` per top-k slot (top_k when balanced), so `aux_loss_coef` is
    Mixtral's `router_aux_loss_coef`."""
    interval: count(MAX_LAYERS) = 1
    """Every `interval`-th decoder layer is an MoE layer (1 = all of them)."""


DEFAULT_PRESET = "debug"
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "moe")
"""The ModelSpec fields that override a preset's shape."""


class ModelSpec(StrictModel):
    preset: str = Field(default=DEFAULT_PRESET, max_length=64)
    """Named model shape (see `trainctl.spec.presets.PRESETS`); fields below override it."""
    vocab_size: count(MAX_VOCAB) | None = None
    """Vocabulary size (at most 4,194,304); the byte tokenizer needs at least 256."""
    dim: count(MAX_DIM) | None = None
    """Hidden size (at most 65,536)."""
    n_layers: count(MAX_LAYERS) | None = None
    """Decoder layers (at most 1024)."""
    n_heads: count(MAX_HEADS) | None = None
    """Query heads (at most 1024)."""
    n_kv_heads: count(MAX_HEADS) | None = None
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: count(MAX_FFN_DIM) | None = None
    """SwiGLU hidden size (at most 262,144)."""
    rope_theta: float | None = Field(default=None, gt=0)
    """RoPE base frequency."""
    norm_eps: float | None = Field(default=None, gt=0)
    """RMSNorm epsilon."""
    moe: MoESpec | None = None
    """Mixture-of-experts settings; None keeps the preset's (dense presets have none)."""
    from_pretrained: PathText | None = None
    """A local Hugging Face model directory (config.json + model.safetensors or a sharded index): the
    model's shape comes from its config.json and its initial weights from its safetensors files
    (families llama, mistral, qwen2, qwen3, mixtral). Excludes `preset` and the shape fields above, and
    `spec.init_from`."""

    @model_validator(mode="after")
    def _pretrained_excludes_shape(self) -> ModelSpec:
        if self.from_pretrained is None:
            return self
        set_fields = [name for name in SHAPE_FIELDS if getattr(self, name) is not None]
        if self.preset != DEFAULT_PRESET:
            set_fields.insert(0, "preset")
        if set_fields:
            named = ", ".join(f"spec.model.{name}" for name in set_fields)
            raise ValueError(
                f"spec.model.from_pretrained and {named} are mutually exclusive: the shape comes from the "
                "directory's config.json"
            )
        return self
