"""Hugging Face Mixtral router and expert tensors <-> the engine's MoE parameters, both ways.

Checkpoint names (what transformers 5's `MixtralForCausalLM.save_pretrained` writes, and what
`trainctl export` writes): attention, norms, embeddings and head as in Llama (`hf_names`), and per
MoE layer `model.layers.N.block_sparse_moe.gate.weight` [E, dim] (the engine's `moe.router.weight`)
and `model.layers.N.block_sparse_moe.experts.J.w1/w3.weight` [ffn, dim], `...w2.weight` [dim, ffn]
(expert J's gate, up and down projections: `moe.experts.w1[J].T`, `w3[J].T`, `w2[J].T`).
transformers 5 holds experts fused in memory (`mlp.experts.gate_up_proj` [E, 2 ffn, dim] = the
concatenation of w1 and w3 per expert, `mlp.experts.down_proj` [E, dim, ffn]) and converts from and
to the per-expert names when loading and saving; `from_pretrained` accepts both forms, and so does
`moe_state_dict` (under `block_sparse_moe.` or `mlp.`); `mixtral_tensors` writes per-expert names.

Routing is the same computation on both sides for top_k >= 2 (float32 softmax of the linear gate,
top-k, weights divided by their sum). Reading a directory's tensors: `hf_import`; writing them:
`hf_export`. Config mapping and refusals: `trainctl.spec.hf_mixtral`.
"""

from __future__ import annotations

import re

import torch

from trainctl.spec.hf_mixtral import check_mixtral_representable
from trainctl.spec.presets import ModelConfig

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_MOE = re.compile(r"(?:block_sparse_moe|mlp)\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj|experts\.(\d+)\.(w[123])\.weight)")
EXPERT_MATRICES = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


class MixtralWeightsError(ValueError):
    """Mixtral weights that do not fit the model (the message names the tensor)."""


def mixtral_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Engine MoE parameter `name` (`layers.N.moe.router.weight` or `layers.N.moe.experts.w1/w2/w3`)
    under the per-expert Mixtral checkpoint names."""
    _, layer, rest = (name.split(".", 2) + ["", ""])[:3]
    prefix = f"model.layers.{layer}.block_sparse_moe."
    if rest == "moe.router.weight":
        return {prefix + "gate.weight": tensor}
    if rest in EXPERT_MATRICES:
        which = rest.rsplit(".", 1)[1]
        return {f"{prefix}experts.{expert}.{which}.weight": matrix.T for expert, matrix in enumerate(tensor)}
    raise MixtralWeightsError(f"parameter {name!r} has no place in the Mixtral layout")


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise MixtralWeightsError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model needs {shape}")
    return tensor


def moe_state_dict(hf_weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Mixtral router and expert tensors (per-expert or fused names) as the engine's MoE parameters,
    float32 (attention, norms and embeddings map through `hf_names`).

    Every tensor given must be a router or expert tensor and each layer's experts must be complete;
    router and expert shapes are checked against `config` (the `mixtral` family of `spec.hf_config`).
    Errors name the HF tensor."""
    moe = check_mixtral_representable(config)
    dim, ffn, n_experts = config.dim, config.ffn_dim, moe.num_experts
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in hf_weights.items():
        tensor = tensor.float()
        layer_match = _HF_LAYER.fullmatch(name)
        if layer_match is None or int(layer_match.group(1)) >= config.n_layers:
            raise MixtralWeightsError(f"tensor {name!r} has no place in a {config.n_layers}-layer Mixtral model")
        layer, rest = layer_match.groups()
        prefix = f"layers.{int(layer)}."
        moe_match = _HF_MOE.fullmatch(rest)
        if moe_match is None:
            raise MixtralWeightsError(f"tensor {name!r} is not a Mixtral router or expert tensor")
        elif moe_match.group(1) == "gate.weight":
            out[prefix + "moe.router.weight"] = _expect(name, tensor, (n_experts, dim))
        elif moe_match.group(1) == "experts.gate_up_proj":
            fused = _expect(name, tensor, (n_experts, 2 * ffn, dim))
            out[prefix + "moe.experts.w1"] = fused[:, :ffn].transpose(1, 2)
            out[prefix + "moe.experts.w3"] = fused[:, ffn:].transpose(1, 2)
        elif moe_match.group(1) == "experts.down_proj":
            out[prefix + "moe.experts.w2"] = _expect(name, tensor, (n_experts, dim, ffn)).transpose(1, 2)
        else:
            expert, which = int(moe_match.group(2)), moe_match.group(3)
            if expert >= n_experts:
                raise MixtralWeightsError(f"tensor {name!r}: expert {expert} beyond num_local_experts {n_experts}")
            experts.setdefault((prefix, which), {})[expert] = _expect(name, tensor, (dim, ffn) if which == "w2" else (ffn, dim)).T
    for (prefix, which), per_expert in experts.items():
        missing = sorted(set(range(n_experts)) - set(per_expert))
        if missing:
            raise MixtralWeightsError(f"{prefix}: experts {missing} have no {which} tensor")
        out[f"{prefix}moe.experts.{which}"] = torch.stack([per_expert[e] for e in range(n_experts)])
    return {k: v.contiguous() for k, v in out.items()}
