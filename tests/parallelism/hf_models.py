"""Tiny random Hugging Face models of each supported family, written with `save_pretrained` (no hub).

`save_family(name, directory)` writes one; `FAMILIES` lists the cases: llama with tied embeddings
and llama3 RoPE scaling, mistral with a sliding window longer than the tests' sequences, qwen2 (q/k/v
biases, tied embeddings), qwen3 (q/k norms, head_dim independent of hidden_size / heads), mixtral (4 experts, top-2). Every
parameter, norms and biases included, is drawn at random so each permutation and mapping is
exercised. vocab 256 (the byte tokenizer), 4 layers, 4 heads, 2 key/value heads: tp2 and pp2 fit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

BYTES = {"tokenizer": "byte"}
"""spec.data for jobs on these directories: they hold no tokenizer files, so `tokenizer: auto` (the
model's) would be refused; the byte tokenizer fits vocab 256."""

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64, "rope_theta": 5000.0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "router_aux_loss_coef": 0.02, "sliding_window": None}),
}


def build_family(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's random model in float32 (eval mode)."""
    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def save_family(name: str, directory: Path, seed: int = 0) -> Path:
    """Write the family's random model into `directory` (created); returns it."""
    build_family(name, seed).save_pretrained(str(directory))
    return directory
