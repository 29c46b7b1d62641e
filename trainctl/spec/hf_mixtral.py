"""Hugging Face Mixtral `config.json` <-> `ModelConfig`, both ways, without torch.

`mixtral_model_config(config)` reads a Mixtral config.json (as a dict) into a `ModelConfig` with an
`MoEConfig` in the `transformers` aux-loss convention, so `aux_loss_coef` is Mixtral's
`router_aux_loss_coef` (the engine always trains with its aux loss; `aux_loss_coef: 0` turns it off).
What the engine cannot reproduce is refused by key with `MixtralConfigError`: a sliding window
shorter than the sequence, an activation other than silu, tied embeddings, a head_dim other than
hidden_size / num_attention_heads, RoPE scaling, attention dropout, router jitter noise, and top-1
routing (Mixtral renormalises the one weight to 1.0, the engine keeps the raw probability).

`mixtral_hf_config(config, ...)` is the config.json `trainctl export` writes for an MoE model: the
same keys the other way. Mixtral has every layer sparse and no shared expert, so a model with either
(`moe.interval` > 1, `moe.shared_expert`) or with top-1 routing is refused by name. The aux-loss
coefficient is written as `router_aux_loss_coef` unchanged for the `transformers` convention; for
`per_layer_sum` it is scaled by n_layers / top_k, the factor between the two conventions when every
layer routes alike (per_layer_sum sums n_layers values of 1 at balance, transformers gives top_k),
so the exported objective is close to, though not exactly, the one trained.
"""

from __future__ import annotations

from typing import Any

from trainctl.spec.presets import ModelConfig, MoEConfig

MIXTRAL_DEFAULT_ROPE_THETA = 1e6
"""transformers' MixtralConfig default when config.json names no rope theta."""


class MixtralConfigError(ValueError):
    """A Mixtral config.json the engine cannot reproduce, or a model Mixtral cannot represent."""


def _rope_theta(config: dict[str, Any], where: str) -> float:
    params = config.get("rope_parameters") or {}
    if config.get("rope_scaling"):
        raise MixtralConfigError(f"{where}: rope_scaling = {config['rope_scaling']!r}: RoPE scaling is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise MixtralConfigError(f"{where}: rope_parameters.rope_type = {rope_type!r}: only 'default' RoPE is supported")
    return float(params.get("rope_theta", config.get("rope_theta", MIXTRAL_DEFAULT_ROPE_THETA)))


def _required(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config or config[key] is None:
        raise MixtralConfigError(f"{where}: {key} is missing")
    return config[key]


def mixtral_model_config(
    config: dict[str, Any], *, seq_len: int | None = None, where: str = "config.json"
) -> ModelConfig:
    """The engine model a Mixtral config.json describes; `where` prefixes every error (e.g.
    `spec.model.from_pretrained: /path/config.json`). A sliding window is accepted only when it
    is at least `seq_len` (then it never masks anything); without `seq_len`, not at all."""
    if config.get("model_type") != "mixtral":
        raise MixtralConfigError(f"{where}: model_type = {config.get('model_type')!r}, expected 'mixtral'")
    dim = int(_required(config, "hidden_size", where))
    n_heads = int(_required(config, "num_attention_heads", where))
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    top_k = int(config.get("num_experts_per_tok", 2))
    num_experts = int(config.get("num_local_experts", 8))
    refusals = {
        "hidden_act": (config.get("hidden_act", "silu") != "silu", "only silu (SwiGLU experts) is supported"),
        "tie_word_embeddings": (bool(config.get("tie_word_embeddings", False)), "tied embeddings are not supported"),
        "head_dim": (
            config.get("head_dim") not in (None, dim // n_heads),
            f"must be hidden_size / num_attention_heads = {dim // n_heads}",
        ),
        "num_attention_heads": (dim % n_heads != 0, f"must divide hidden_size {dim}"),
        "num_key_value_heads": (n_heads % n_kv_heads != 0, f"must divide num_attention_heads {n_heads}"),
        "attention_dropout": (float(config.get("attention_dropout") or 0.0) != 0.0, "the engine has no dropout"),
        "router_jitter_noise": (float(config.get("router_jitter_noise") or 0.0) != 0.0, "router jitter is not supported"),
        "num_experts_per_tok": (
            not 2 <= top_k <= num_experts,
            f"must be in [2, num_local_experts = {num_experts}] (top-1: Mixtral renormalises the weight to 1.0, "
            "the engine keeps the router probability)",
        ),
    }
    window = config.get("sliding_window")
    if window is not None and (seq_len is None or int(window) < seq_len):
        refusals["sliding_window"] = (True, f"a window shorter than the sequence (seq_len {seq_len}) is not supported")
    for key, (bad, why) in refusals.items():
        if bad:
            raise MixtralConfigError(f"{where}: {key} = {config.get(key)!r}: {why}")
    return ModelConfig(
        vocab_size=int(_required(config, "vocab_size", where)),
        dim=dim,
        n_layers=int(_required(config, "num_hidden_layers", where)),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=int(_required(config, "intermediate_size", where)),
        rope_theta=_rope_theta(config, where),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
            aux_loss="transformers",
        ),
    )


def check_mixtral_representable(config: ModelConfig) -> MoEConfig:
    """`config.moe`, if Mixtral can represent the model; else MixtralConfigError naming the field."""
    moe = config.moe
    if moe is None:
        raise MixtralConfigError("spec.model.moe: a dense model has no Mixtral form (export it as Llama)")
    if moe.shared_expert:
        raise MixtralConfigError("spec.model.moe.shared_expert: Mixtral has no shared expert")
    if moe.interval != 1:
        raise MixtralConfigError(
            f"spec.model.moe.interval = {moe.interval}: Mixtral has no dense layers between MoE layers"
        )
    if moe.top_k < 2:
        raise MixtralConfigError(
            "spec.model.moe.top_k = 1: Mixtral renormalises a single routing weight to 1.0, the engine keeps the router probability"
        )
    return moe


def mixtral_hf_config(config: ModelConfig, *, max_positions: int, dtype: str) -> dict[str, Any]:
    """config.json for `MixtralForCausalLM` (rope theta under both the v4 and the v5 key).

    `output_router_logits` is true when the aux loss is on, so training the export in transformers
    keeps the load-balancing term."""
    moe = check_mixtral_representable(config)
    coef = moe.aux_loss_coef if moe.aux_loss == "transformers" else moe.aux_loss_coef * config.n_layers / moe.top_k
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": max_positions,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": coef,
        "output_router_logits": coef > 0,
        "router_jitter_noise": 0.0,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
    }
