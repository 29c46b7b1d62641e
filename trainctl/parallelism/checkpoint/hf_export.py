"""Export trained weights in the Hugging Face layout: `model.safetensors` + `config.json`.

Names and the RoPE permutation of the q/k side: `hf_names`. A model imported with
`spec.model.from_pretrained` is written back as its own family (`ModelConfig.hf_family`: llama,
mistral, qwen2, qwen3 or mixtral: `architectures`, `model_type`, q/k/v biases, q/k norms, head_dim, RoPE
scaling, sliding_window); trainctl presets are written as Llama. Tied embeddings are written once
(`model.embed_tokens`, no `lm_head`, `tie_word_embeddings: true`). LoRA runs are exported merged
(`pretrained.load_weights`). MoE models are written as Mixtral (`hf_moe`, `spec.hf_mixtral`); what
Mixtral cannot represent (a shared expert, dense layers between MoE layers, top-1) is refused by field.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainctl.parallelism.checkpoint.hf_moe import MixtralWeightsError, mixtral_tensors
from trainctl.parallelism.checkpoint.hf_names import hf_name, interleaved_to_halves, rope_heads
from trainctl.parallelism.checkpoint.pretrained import Pretrained, load_weights
from trainctl.spec.hf_config import ARCHITECTURES
from trainctl.spec.hf_mixtral import MixtralConfigError, check_mixtral_representable, mixtral_keys
from trainctl.spec.presets import ModelConfig

DEFAULT_FAMILY = "llama"


class ExportError(ValueError):
    """The checkpoint cannot be written in a Hugging Face layout (the message says why)."""


def hf_state_dict(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The engine's plain weights renamed (and the q/k side permuted) to the HF names; MoE routers and
    experts under Mixtral's per-expert names (`hf_moe`)."""
    out: dict[str, torch.Tensor] = {}
    try:
        if config.moe is not None:
            check_mixtral_representable(config)
        for name, tensor in weights.items():
            if name == "output.weight" and config.tie_embeddings:
                continue  # the embedding is the output head
            if ".moe." in name:
                out.update(mixtral_tensors(name, tensor))
                continue
            target = hf_name(name)
            if target is None:
                raise ExportError(f"parameter {name!r} has no place in the Hugging Face layout")
            heads = rope_heads(name, config)
            out[target] = tensor if heads is None else interleaved_to_halves(tensor, heads)
    except (MixtralConfigError, MixtralWeightsError) as exc:
        raise ExportError(str(exc)) from exc
    return {k: v.detach().contiguous() for k, v in out.items()}


def _rope_parameters(config: ModelConfig) -> dict:
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"rope_type": "llama3", "rope_theta": config.rope_theta, **asdict(config.rope_scaling)}


def hf_config(config: ModelConfig, max_positions: int, dtype: torch.dtype) -> dict:
    """config.json of the model's family (rope settings under both the v4 and the v5 keys)."""
    family = "mixtral" if config.moe is not None else config.hf_family or DEFAULT_FAMILY
    rope = _rope_parameters(config)
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
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
        "rope_parameters": rope,
        "rope_scaling": None if config.rope_scaling is None else rope,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if family in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if family == "llama":
        out.update(mlp_bias=False)
    if family in ("mistral", "mixtral"):
        out.update(sliding_window=config.sliding_window)
    if family == "mixtral":
        try:
            out.update(mixtral_keys(config))
        except MixtralConfigError as exc:
            raise ExportError(str(exc)) from exc
    if family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def export_checkpoint(source: Pretrained, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write `model.safetensors` and `config.json` of `source` (merged weights) into `out_dir`."""
    out = Path(out_dir)
    weights = {k: v.to(dtype) for k, v in hf_state_dict(load_weights(source), source.config).items()}
    max_positions = max(2048, source.job.data.seq_len)
    config = hf_config(source.config, max_positions, dtype)
    out.mkdir(parents=True, exist_ok=True)
    model_file = out / "model.safetensors"
    save_file(weights, str(model_file), metadata={"format": "pt", "source": str(source.path)})
    config_file = out / "config.json"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return [model_file, config_file]
