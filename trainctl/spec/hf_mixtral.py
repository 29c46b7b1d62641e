"""The Hugging Face Mixtral `config.json` of an engine MoE model, without torch.

Reading a Mixtral config.json is the `mixtral` entry of `trainctl.spec.hf_config.FAMILIES`.
`mixtral_keys(config)` are the Mixtral keys `trainctl export` adds to the decoder's config.json
(`parallelism.checkpoint.hf_export.hf_config`) for an MoE model. Mixtral has every layer sparse and no shared expert, so a model with either
(`moe.interval` > 1, `moe.shared_expert`) or with top-1 routing is refused by name. The aux-loss
coefficient is written as `router_aux_loss_coef` unchanged for the `transformers` convention; for
`per_layer_sum` it is scaled by n_layers / top_k, the factor between the two conventions when every
layer routes alike (per_layer_sum sums n_layers values of 1 at balance, transformers gives top_k),
so the exported objective is close to, though not exactly, the one trained.
"""

from __future__ import annotations

from typing import Any

from trainctl.spec.presets import ModelConfig, MoEConfig


class MixtralConfigError(ValueError):
    """A model Mixtral cannot represent (the message names the spec field)."""


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


def mixtral_keys(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys of `MixtralForCausalLM` beyond the decoder's (which export writes for every
    family). `output_router_logits` is true when the aux loss is on, so training the export in
    transformers keeps the load-balancing term."""
    moe = check_mixtral_representable(config)
    coef = moe.aux_loss_coef if moe.aux_loss == "transformers" else moe.aux_loss_coef * config.n_layers / moe.top_k
    return {
        "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": coef,
        "output_router_logits": coef > 0,
        "router_jitter_noise": 0.0,
    }
