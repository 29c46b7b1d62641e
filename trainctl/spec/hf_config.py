"""A Hugging Face model directory's config.json as the fields of a trainctl `ModelConfig`.

Pure parsing (no torch, no transformers): the service runs it at submit for `spec.model.from_pretrained`
and the engine when it builds the model. `read_hf_config(directory, files)` returns a dict of `ModelConfig`
keyword arguments (`rope_scaling` and `moe` as plain dicts, or None) or raises `PretrainedConfigError`
saying what in config.json cannot be trained; the caller names the spec field. config.json is opened
through the job's `FileRule` (trainctl.spec.files: where it may lie, at most MAX_CONFIG_BYTES, depth
bounded); the default rule confines nothing (the CLI's offline checks). `weights_problem` says whether
the directory holds weights the engine can load (trainctl.parallelism.checkpoint.hf_import), checking
each file a safetensors index names against the rule without reading it.

Families are looked up by `model_type` in `FAMILIES` (one parser each, built on `dense_fields`); a
config naming `architectures` must name that family's causal-LM class. Both the transformers v4 keys
(`rope_theta`, `rope_scaling`) and the v5 key (`rope_parameters`) are read. Refused by name: other
model types and architectures, `hidden_act` other than silu, biases on o_proj or the MLP, RoPE scaling
other than `llama3`, sliding-window attention that is actually used (Qwen `use_sliding_window`,
non-full `layer_types`). A Mistral or Mixtral `sliding_window` is kept in the fields: a job whose
seq_len does not exceed it attends exactly as full causal attention (spec.model_checks checks that).
Mixtral's MoE settings come back as the `moe` dict (`MoEConfig` fields).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainctl.spec.bounds import (
    MAX_DIM,
    MAX_EXPERTS,
    MAX_FFN_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
)
from trainctl.spec.files import FileRule, FileRuleError, loads_bounded

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20
"""Largest config.json read (a real one is a few KiB)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
"""The weights of a Hugging Face model directory: one safetensors file, or an index whose `weight_map`
names the shard holding each tensor."""
FIELD = "spec.model.from_pretrained"


class PretrainedConfigError(ValueError):
    """The directory's config.json is missing, unreadable, or describes a model trainctl cannot train."""


Fields = dict[str, object]
FamilyParser = Callable[[dict], Fields]


def read_hf_config(directory: str | Path, files: FileRule = FileRule()) -> Fields:
    """The ModelConfig fields of the Hugging Face model in `directory` (see the module docstring)."""
    config = load_config_json(directory, files)
    model_type = config.get("model_type")
    parser = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if parser is None:
        raise PretrainedConfigError(
            f"{_config_path(directory)}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    architectures = config.get("architectures")
    expected = ARCHITECTURES[model_type]
    if architectures is not None and architectures != [expected]:
        raise PretrainedConfigError(
            f"{_config_path(directory)}: architectures {architectures!r} is not supported for model_type {model_type!r} "
            f"(expected [{expected!r}])"
        )
    positions = config.get("max_position_embeddings")
    known = isinstance(positions, int) and not isinstance(positions, bool) and positions >= 1
    try:
        return {**parser(config), "hf_family": model_type, "max_position_embeddings": positions if known else None}
    except PretrainedConfigError as exc:
        raise PretrainedConfigError(f"{_config_path(directory)}: {exc}") from None


def load_config_json(directory: str | Path, files: FileRule = FileRule()) -> dict:
    """The decoded config.json of `directory` (a JSON object) read under `files`, or
    PretrainedConfigError saying why not (a file the rule refuses is named, never read)."""
    path = _config_path(directory)
    try:
        files.check(directory, FIELD)
        if not Path(directory).expanduser().is_dir():
            raise PretrainedConfigError(f"{directory!r} is not a directory (expected a Hugging Face model directory)")
        files.check(path, FIELD)
        if not path.is_file():
            raise PretrainedConfigError(f"{directory!r} holds no {CONFIG_FILE} (expected a Hugging Face model directory)")
        config = loads_bounded(files.read_bytes(path, FIELD, MAX_CONFIG_BYTES), str(path), FIELD)
    except FileRuleError as exc:
        raise PretrainedConfigError(exc.message) from None
    if not isinstance(config, dict):
        raise PretrainedConfigError(f"{path}: expected a JSON object")
    return config


def weights_problem(directory: str | Path, files: FileRule = FileRule()) -> str | None:
    """Why `directory` holds no weights the engine can load (None: it does): neither SINGLE_FILE nor
    INDEX_FILE, a weight file the rule refuses, an index that is not an object with a `weight_map` of
    file names, or a shard it names that is missing. Index entries are checked, never opened."""
    root = Path(directory).expanduser()
    index, single = root / INDEX_FILE, root / SINGLE_FILE
    try:
        if files.check(index, FIELD).is_file():
            content = files.read_json(index, FIELD)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                return f"{index}: not a safetensors index (no weight_map object naming the shards)"
            seen: set[str] = set()
            for name in weight_map.values():
                if isinstance(name, str) and name in seen:
                    continue
                if not files.member(root, name, FIELD, str(index)).is_file():
                    return f"{index} names the shard {name!r}, which does not exist"
                seen.add(name)
            return None
        if files.check(single, FIELD).is_file():
            return None
    except FileRuleError as exc:
        return exc.message
    return f"{str(directory)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (the model's weights)"


def _config_path(directory: str | Path) -> Path:
    return Path(directory).expanduser() / CONFIG_FILE


def _int(config: dict, key: str, upper: int, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise PretrainedConfigError(f"{key} must be an integer in [1, {upper}], got {value!r}")
    return value


def _float(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PretrainedConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling fields or None) from `rope_parameters` (v5) or `rope_theta` /
    `rope_scaling` (v4)."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise PretrainedConfigError(f"rope_parameters must be an object, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise PretrainedConfigError(f"rope_scaling must be an object or null, got {scaling!r}")
    merged = {**(scaling or {}), **(params or {})}
    theta = _float(merged.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise PretrainedConfigError(f"RoPE scaling type {rope_type!r} is not supported (supported: default, llama3)")
    fields = {
        name: _float(merged.get(name), f"rope_parameters.{name}")
        for name in ("factor", "low_freq_factor", "high_freq_factor")
    }
    if fields["high_freq_factor"] <= fields["low_freq_factor"]:
        raise PretrainedConfigError("rope_parameters.high_freq_factor must exceed low_freq_factor")
    fields["original_max_position_embeddings"] = _int(merged, "original_max_position_embeddings", MAX_SEQ_LEN)
    return theta, fields


def dense_fields(config: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> Fields:
    """The fields every supported dense decoder shares (Llama layout, SwiGLU, RMSNorm, RoPE)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise PretrainedConfigError(f"hidden_act {act!r} is not supported (only silu: SwiGLU)")
    if config.get("attention_bias", False):
        raise PretrainedConfigError("attention_bias: true (a bias on o_proj) is not supported")
    if config.get("mlp_bias", False):
        raise PretrainedConfigError("mlp_bias: true is not supported")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise PretrainedConfigError(f"tie_word_embeddings must be true or false, got {tie!r}")
    n_heads = _int(config, "num_attention_heads", MAX_HEADS)
    n_kv_heads = _int(config, "num_key_value_heads", MAX_HEADS, default=n_heads)
    dim = _int(config, "hidden_size", MAX_DIM)
    head_dim = config.get("head_dim")
    head_dim = None if head_dim is None else _int(config, "head_dim", MAX_DIM)
    theta, scaling = _rope(config)
    return {
        "vocab_size": _int(config, "vocab_size", MAX_VOCAB),
        "dim": dim,
        "n_layers": _int(config, "num_hidden_layers", MAX_LAYERS),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "ffn_dim": _int(config, "intermediate_size", MAX_FFN_DIM),
        "rope_theta": theta,
        "norm_eps": _float(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        "tie_embeddings": tie,
        "qkv_bias": qkv_bias,
        "qk_norm": qk_norm,
        "explicit_head_dim": None if head_dim in (None, dim // n_heads) else head_dim,
        "rope_scaling": scaling,
        "sliding_window": None,
    }


def _full_attention_only(config: dict) -> None:
    """Refuse a Qwen config that uses sliding-window attention in any layer."""
    if config.get("use_sliding_window", False):
        raise PretrainedConfigError("use_sliding_window: true is not supported (the engine attends over the whole sequence)")
    layer_types = config.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or any(kind != "full_attention" for kind in layer_types)):
        raise PretrainedConfigError(f"layer_types {layer_types!r:.200} is not supported (only full_attention)")


def _llama(config: dict) -> Fields:
    return dense_fields(config)


def _mistral(config: dict) -> Fields:
    window = config.get("sliding_window")
    fields = dense_fields(config)
    fields["sliding_window"] = None if window is None else _int(config, "sliding_window", 2**62)
    return fields


def _qwen2(config: dict) -> Fields:
    _full_attention_only(config)
    return dense_fields({**config, "attention_bias": False}, qkv_bias=True)


def _qwen3(config: dict) -> Fields:
    _full_attention_only(config)
    return dense_fields(config, qk_norm=True)


MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "router_aux_loss_coef": 0.001}
"""transformers' MixtralConfig defaults for keys a config.json may leave out."""


def _mixtral(config: dict) -> Fields:
    """Mixtral: Mistral's attention, every layer a top-k MoE without shared expert. The router's
    auxiliary loss is taken in the transformers convention with `router_aux_loss_coef`. Refused by key:
    router jitter, attention dropout, tied embeddings, a head_dim other than hidden_size / heads, RoPE
    scaling, and top-1 routing (Mixtral renormalises the one weight to 1.0, the engine keeps the router
    probability)."""
    config = {**MIXTRAL_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
    for key, why in (("router_jitter_noise", "router jitter is not supported"), ("attention_dropout", "the engine has no dropout")):
        if config.get(key) not in (None, 0, 0.0):
            raise PretrainedConfigError(f"{key} = {config[key]!r}: {why}")
    fields = _mistral(config)
    if fields["tie_embeddings"]:
        raise PretrainedConfigError("tie_word_embeddings = true: not supported for Mixtral")
    if fields["explicit_head_dim"] is not None:
        raise PretrainedConfigError(f"head_dim = {config['head_dim']!r}: must be hidden_size / num_attention_heads")
    if fields["rope_scaling"] is not None:
        raise PretrainedConfigError("RoPE scaling is not supported for Mixtral")
    experts = _int(config, "num_local_experts", MAX_EXPERTS)
    top_k = config["num_experts_per_tok"]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 2 <= top_k <= experts:
        raise PretrainedConfigError(
            f"num_experts_per_tok = {top_k!r}: must be an integer in [2, num_local_experts = {experts}] (top-1: Mixtral "
            "renormalises the weight to 1.0, the engine keeps the router probability)"
        )
    coef = config["router_aux_loss_coef"]
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef <= 1:
        raise PretrainedConfigError(f"router_aux_loss_coef must be a number in [0, 1], got {coef!r}")
    fields["moe"] = {"num_experts": experts, "top_k": top_k, "aux_loss_coef": float(coef), "aux_loss": "transformers"}
    return fields


FAMILIES: dict[str, FamilyParser] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "mixtral": _mixtral,
}
"""Parsers of config.json by `model_type`."""

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
"""The causal-LM class of each family (`architectures` in config.json; export writes it)."""
