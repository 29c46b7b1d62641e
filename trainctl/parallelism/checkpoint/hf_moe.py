"""Hugging Face Mixtral weights <-> the engine's MoE model: export, and the import name mapping.

Checkpoint names (what transformers 5's `MixtralForCausalLM.save_pretrained` writes, and what
`trainctl export` writes): attention, norms, embeddings and head as in Llama (`hf_export`), and per
MoE layer `model.layers.N.block_sparse_moe.gate.weight` [E, dim] (the engine's `moe.router.weight`)
and `model.layers.N.block_sparse_moe.experts.J.w1/w3.weight` [ffn, dim], `...w2.weight` [dim, ffn]
(expert J's gate, up and down projections: `moe.experts.w1[J].T`, `w3[J].T`, `w2[J].T`).
transformers 5 holds experts fused in memory (`mlp.experts.gate_up_proj` [E, 2 ffn, dim] = the
concatenation of w1 and w3 per expert, `mlp.experts.down_proj` [E, dim, ffn]) and converts from and
to the per-expert names when loading and saving; `from_pretrained` accepts both forms, and so does
`engine_state_dict` (under `block_sparse_moe.` or `mlp.`).

Routing is the same computation on both sides for top_k >= 2 (float32 softmax of the linear gate,
top-k, weights divided by their sum); q/k rows are permuted between interleaved-pair and
rotate-half RoPE as in `hf_export`. Config mapping and refusals: `trainctl.spec.hf_mixtral`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainctl.parallelism.checkpoint.hf_export import (
    LAYER_NAMES,
    TOP_NAMES,
    ExportError,
    interleaved_to_halves,
)
from trainctl.parallelism.checkpoint.pretrained import Pretrained, load_weights
from trainctl.spec.hf_mixtral import MixtralConfigError, check_mixtral_representable, mixtral_hf_config
from trainctl.spec.presets import ModelConfig

ATTENTION_NAMES = {k: v for k, v in LAYER_NAMES.items() if not k.startswith("feed_forward.")}
"""Engine -> HF names inside a decoder layer shared with Llama (attention and the two norms)."""
HF_ATTENTION_NAMES = {v: k for k, v in ATTENTION_NAMES.items()}
HF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_MOE = re.compile(r"(?:block_sparse_moe|mlp)\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj|experts\.(\d+)\.(w[123])\.weight)")


class MixtralWeightsError(ValueError):
    """Mixtral weights that do not fit the model (the message names the tensor)."""


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `hf_export.interleaved_to_halves`: rotate-half q/k rows back to interleaved pairs."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def mixtral_state_dict(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The engine's plain weights under the per-expert Mixtral checkpoint names (q/k permuted)."""
    try:
        check_mixtral_representable(config)
    except MixtralConfigError as exc:
        raise ExportError(str(exc)) from exc
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = tensor
            continue
        head, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        prefix = f"model.layers.{layer}."
        if head != "layers":
            raise ExportError(f"parameter {name!r} has no place in the Mixtral layout")
        if rest in ATTENTION_NAMES:
            if rest == "attention.wq.weight":
                tensor = interleaved_to_halves(tensor, config.n_heads)
            elif rest == "attention.wk.weight":
                tensor = interleaved_to_halves(tensor, config.n_kv_heads)
            out[prefix + ATTENTION_NAMES[rest]] = tensor
        elif rest == "moe.router.weight":
            out[prefix + "block_sparse_moe.gate.weight"] = tensor
        elif rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
            which = rest.rsplit(".", 1)[1]
            for expert, matrix in enumerate(tensor):
                out[f"{prefix}block_sparse_moe.experts.{expert}.{which}.weight"] = matrix.T
        else:
            raise ExportError(f"parameter {name!r} has no place in the Mixtral layout")
    return {k: v.detach().contiguous() for k, v in out.items()}


def export_mixtral(source: Pretrained, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write `model.safetensors` and `config.json` (MixtralForCausalLM) of `source` into `out_dir`."""
    try:
        hf_config = mixtral_hf_config(
            source.config, max_positions=max(2048, source.job.data.seq_len), dtype=str(dtype).removeprefix("torch.")
        )
    except MixtralConfigError as exc:
        raise ExportError(str(exc)) from exc
    weights = {k: v.to(dtype) for k, v in mixtral_state_dict(load_weights(source), source.config).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_file = out / "model.safetensors"
    save_file(weights, str(model_file), metadata={"format": "pt", "source": str(source.path)})
    config_file = out / "config.json"
    config_file.write_text(json.dumps(hf_config, indent=2) + "\n")
    return [model_file, config_file]


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise MixtralWeightsError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model needs {shape}")
    return tensor


def engine_state_dict(hf_weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Mixtral weights (per-expert or fused names) as the engine MoE model's state dict, float32.

    Every tensor must be used and every engine parameter filled; shapes are checked against `config`
    (from `spec.hf_mixtral.mixtral_model_config`). Errors name the HF tensor."""
    moe = check_mixtral_representable(config)
    dim, ffn, n_experts = config.dim, config.ffn_dim, moe.num_experts
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in hf_weights.items():
        tensor = tensor.float()
        if name in HF_TOP_NAMES:
            out[HF_TOP_NAMES[name]] = tensor
            continue
        layer_match = _HF_LAYER.fullmatch(name)
        if layer_match is None or int(layer_match.group(1)) >= config.n_layers:
            raise MixtralWeightsError(f"tensor {name!r} has no place in a {config.n_layers}-layer Mixtral model")
        layer, rest = layer_match.groups()
        prefix = f"layers.{int(layer)}."
        moe_match = _HF_MOE.fullmatch(rest)
        if rest in HF_ATTENTION_NAMES:
            engine = HF_ATTENTION_NAMES[rest]
            if engine == "attention.wq.weight":
                tensor = halves_to_interleaved(_expect(name, tensor, (config.n_heads * config.head_dim, dim)), config.n_heads)
            elif engine == "attention.wk.weight":
                tensor = halves_to_interleaved(_expect(name, tensor, (config.n_kv_heads * config.head_dim, dim)), config.n_kv_heads)
            out[prefix + engine] = tensor
        elif moe_match is None:
            raise MixtralWeightsError(f"tensor {name!r} has no place in the engine's Mixtral model")
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


def read_safetensors_dir(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory: `model.safetensors`, or the shards its
    `model.safetensors.index.json` lists."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise MixtralWeightsError(f"{root}: neither model.safetensors nor model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(root / shard)))
    return weights
