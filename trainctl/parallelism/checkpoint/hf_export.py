"""Export trained weights in the Hugging Face Llama layout: `model.safetensors` + `config.json`.

Names map one to one (`tok_embeddings` -> `model.embed_tokens`, `attention.wq` -> `self_attn.q_proj`,
`feed_forward.w1/w3/w2` -> `mlp.gate_proj/up_proj/down_proj`, `attention_norm` / `ffn_norm` ->
`input_layernorm` / `post_attention_layernorm`, `norm` -> `model.norm`, `output` -> `lm_head`).

RoPE: the engine rotates interleaved pairs (dims 2i, 2i+1 of a head share frequency i); HF Llama
rotates halves (`rotate_half`: dims i and i + head_dim/2). Both use frequency theta^(-2i/head_dim) for
pair i, so permuting the output rows of `wq` and `wk` within each head (pair i's two rows go to
positions i and i + head_dim/2) gives identical attention scores: q.k is a sum over dims, permuted
alike on both sides. LoRA runs are exported merged (`pretrained.load_weights`). MoE models have no
Llama form and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainctl.parallelism.checkpoint.pretrained import Pretrained, load_weights
from trainctl.spec.presets import ModelConfig

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class ExportError(ValueError):
    """The checkpoint cannot be written in the Llama layout (the message says why)."""


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows from interleaved-pair RoPE to rotate-half RoPE."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The engine's plain weights renamed (and q/k permuted) to the HF Llama names."""
    if config.moe is not None:
        raise ExportError("MoE models have no Hugging Face Llama form; export supports dense models only")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = tensor
            continue
        head, layer, rest = (name.split(".", 2) + ["", ""])[:3]
        if head != "layers" or rest not in LAYER_NAMES:
            raise ExportError(f"parameter {name!r} has no place in the Llama layout")
        if rest == "attention.wq.weight":
            tensor = interleaved_to_halves(tensor, config.n_heads)
        elif rest == "attention.wk.weight":
            tensor = interleaved_to_halves(tensor, config.n_kv_heads)
        out[f"model.layers.{layer}.{LAYER_NAMES[rest]}"] = tensor
    return {k: v.detach().contiguous() for k, v in out.items()}


def hf_config(config: ModelConfig, max_positions: int, dtype: torch.dtype) -> dict:
    """config.json for `LlamaForCausalLM` (rope_theta under both the v4 and the v5 key)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": None,
        "eos_token_id": None,
    }


def export_checkpoint(source: Pretrained, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write `model.safetensors` and `config.json` of `source` (merged weights) into `out_dir`."""
    out = Path(out_dir)
    weights = {k: v.to(dtype) for k, v in hf_state_dict(load_weights(source), source.config).items()}
    out.mkdir(parents=True, exist_ok=True)
    model_file = out / "model.safetensors"
    save_file(weights, str(model_file), metadata={"format": "pt", "source": str(source.path)})
    config_file = out / "config.json"
    max_positions = max(2048, source.job.data.seq_len)
    config_file.write_text(json.dumps(hf_config(source.config, max_positions, dtype), indent=2) + "\n")
    return [model_file, config_file]
