"""Export trained weights as a complete Hugging Face model directory: `model.safetensors`,
`config.json`, `generation_config.json` and the tokenizer files (`hf_files`), every file mode 0644.

Names and the RoPE permutation of the q/k side: `hf_names`. Tied embeddings are written once
(`model.embed_tokens`, no `lm_head`, `tie_word_embeddings: true`). LoRA runs are exported merged
(`pretrained.load_weights`). MoE models are written as Mixtral (`hf_moe`, `spec.hf_mixtral`); what
Mixtral cannot represent (a shared expert, dense layers between MoE layers, top-1) is refused by field.

config.json (`export_config`): a model imported with `spec.model.from_pretrained` keeps its source's
config.json key for key (its family, special-token ids, `max_position_embeddings`, RoPE settings, ...:
training changes the weights only), except the dtype keys (`dtype`, `torch_dtype`, those the source
has), which name the dtype the weights are written in. A trainctl preset is written as Llama
(`hf_config`), its special-token ids those of the job's tokenizer (null for the byte tokenizer or a
bare tokenizer.json) and `max_position_embeddings` max(2048, seq_len): a preset has no position limit
of its own (RoPE), so the export names at least the common 2048.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainctl.parallelism.checkpoint.hf_files import (
    FILE_MODE,
    GENERATION_CONFIG,
    SPECIAL_IDS,
    generation_config,
    tokenizer_files,
    tokenizer_special_ids,
    write_file,
    write_files,
)
from trainctl.parallelism.checkpoint.hf_moe import MixtralWeightsError, mixtral_tensors
from trainctl.parallelism.checkpoint.hf_names import hf_name, interleaved_to_halves, rope_heads
from trainctl.parallelism.checkpoint.pretrained import Pretrained, load_weights
from trainctl.spec.files import FileRule
from trainctl.spec.hf_config import ARCHITECTURES, load_config_json
from trainctl.spec.hf_mixtral import MixtralConfigError, check_mixtral_representable, mixtral_keys
from trainctl.spec.presets import ModelConfig

DEFAULT_FAMILY = "llama"
MIN_POSITIONS = 2048
"""`max_position_embeddings` of a preset's export when its seq_len is shorter."""
DTYPE_KEYS = ("dtype", "torch_dtype")
"""config.json's name for the weights' dtype (transformers v5, v4)."""


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


def hf_config(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, special_ids: dict[str, int | None] | None = None
) -> dict:
    """config.json of the model's family built from its shape (rope settings under both the v4 and the v5
    keys), with `special_ids` (bos / eos / pad token ids; default: all null)."""
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
        **dict.fromkeys(SPECIAL_IDS),
        **(special_ids or {}),
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


def export_config(
    source: Pretrained, dtype: torch.dtype, files: FileRule = FileRule(),
    special_ids: dict[str, int | None] | None = None,
) -> dict:
    """config.json of the export (module docstring): the source's with the dtype keys set to `dtype`, or
    a preset's built by `hf_config` with `special_ids` (default: the job's tokenizer's, loaded)."""
    dtype_name = str(dtype).removeprefix("torch.")
    directory = source.job.model.from_pretrained
    if directory is None:
        max_positions = max(MIN_POSITIONS, source.job.data.seq_len)
        ids = tokenizer_special_ids(source.job, files) if special_ids is None else special_ids
        return hf_config(source.config, max_positions, dtype, ids)
    config = load_config_json(directory, files)
    return {**config, **{key: dtype_name for key in DTYPE_KEYS if key in config}}


def export_checkpoint(
    source: Pretrained, out_dir: str | Path, dtype: torch.dtype = torch.float32, files: FileRule = FileRule()
) -> list[Path]:
    """Write the export of `source` (merged weights) into `out_dir`, reading the source model's and
    tokenizer's files under `files`; the files written."""
    out = Path(out_dir)
    weights = {k: v.to(dtype) for k, v in hf_state_dict(load_weights(source, files), source.config).items()}
    config = export_config(source, dtype, files)
    generation = generation_config(source, config, files)
    tokenizer = tokenizer_files(source.job, files)
    out.mkdir(parents=True, exist_ok=True)
    model_file = out / "model.safetensors"
    save_file(weights, str(model_file), metadata={"format": "pt", "source": str(source.path)})
    os.chmod(model_file, FILE_MODE)
    written = [model_file, write_file(out / "config.json", _json(config))]
    if generation is not None:
        written.append(write_file(out / GENERATION_CONFIG, _json(generation)))
    return written + write_files(out, tokenizer)


def _json(content: dict) -> bytes:
    return (json.dumps(content, indent=2) + "\n").encode()
