"""`spec.model.from_pretrained`: config.json parsing (both transformers v4 and v5 keys) and every
submit-time refusal, named by field. Pure: config.json files are written by hand here (the engine
tests in tests/parallelism/test_hf_import.py use transformers' own save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainctl.spec.hf_config import read_hf_config
from trainctl.spec.job import TrainingJob
from trainctl.spec.presets import RopeScaling, resolve_model
from trainctl.spec.validate import SpecError, parse_object, semantic_violations

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
V4_LLAMA31 = {
    **{k: v for k, v in LLAMA.items() if k != "rope_parameters"}, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def model_dir(tmp_path: Path, config: dict | str, name: str = "model") -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(directory)


def job(directory: str, seq_len: int = 32, **spec) -> TrainingJob:
    return parse_object({"metadata": {"name": "hf"}, "spec": {"model": {"from_pretrained": directory},
                                                             "data": {"seq_len": seq_len}, **spec}})


def violations(document: TrainingJob) -> dict[str, str]:
    return {v.field: v.description for v in semantic_violations(document, check_data=True)}


def test_llama_v5_and_v4_keys(tmp_path: Path) -> None:
    v5 = resolve_model(job(model_dir(tmp_path, LLAMA, "v5")).spec.model)
    assert (v5.dim, v5.n_layers, v5.n_heads, v5.n_kv_heads, v5.ffn_dim, v5.rope_theta) == (64, 2, 4, 2, 128, 500000.0)
    assert (v5.hf_family, v5.tie_embeddings, v5.rope_scaling, v5.head_dim) == ("llama", False, None, 16)
    v4 = resolve_model(job(model_dir(tmp_path, V4_LLAMA31, "v4")).spec.model)
    assert v4.tie_embeddings and v4.rope_theta == 500000.0
    assert v4.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_family_features(tmp_path: Path) -> None:
    qwen2 = read_hf_config(model_dir(tmp_path, {**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                "use_sliding_window": False, "sliding_window": 4096}, "q2"))
    assert qwen2["qkv_bias"] and not qwen2["qk_norm"] and qwen2["sliding_window"] is None
    qwen3 = read_hf_config(model_dir(tmp_path, {**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                "head_dim": 24}, "q3"))
    assert qwen3["qk_norm"] and qwen3["explicit_head_dim"] == 24 and not qwen3["qkv_bias"]
    mistral = read_hf_config(model_dir(tmp_path, {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                                  "sliding_window": 64}, "m"))
    assert mistral["sliding_window"] == 64


def test_mistral_sliding_window_against_seq_len(tmp_path: Path) -> None:
    mistral = {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    directory = model_dir(tmp_path, mistral)
    assert "spec.data.seq_len" not in violations(job(directory, seq_len=64))
    got = violations(job(directory, seq_len=65))["spec.data.seq_len"]
    assert "sliding_window 64" in got and "from_pretrained" in got
    unbounded = model_dir(tmp_path, {**mistral, "sliding_window": None}, "unbounded")
    assert "spec.data.seq_len" not in violations(job(unbounded, seq_len=4096))


@pytest.mark.parametrize(("change", "needle"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn' is not supported"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path: Path, change: dict, needle: str) -> None:
    got = violations(job(model_dir(tmp_path, {**LLAMA, **change})))
    assert needle in got["spec.model.from_pretrained"], got


def test_missing_or_invalid_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in violations(job(str(empty)))["spec.model.from_pretrained"]
    assert "not a directory" in violations(job(str(tmp_path / "absent")))["spec.model.from_pretrained"]
    assert "not valid JSON" in violations(job(model_dir(tmp_path, "{not json")))["spec.model.from_pretrained"]
    assert "JSON object" in violations(job(model_dir(tmp_path, "[1, 2]", "list")))["spec.model.from_pretrained"]


def test_the_service_path_reads_nothing_before_the_path_rule(tmp_path: Path) -> None:
    """check_data False (the service, before its path policy) must not open the directory."""
    assert semantic_violations(job(str(tmp_path / "absent")), check_data=False) == []


def test_from_pretrained_excludes_shape_overrides_and_init_from(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, LLAMA)
    for extra, named in (({"model": {"from_pretrained": directory, "dim": 128}}, "spec.model.dim"),
                         ({"model": {"from_pretrained": directory, "preset": "tiny"}}, "spec.model.preset"),
                         ({"model": {"from_pretrained": directory}, "init_from": "/ckpt"}, "spec.init_from")):
        with pytest.raises(SpecError) as err:
            parse_object({"metadata": {"name": "hf"}, "spec": extra})
        assert "spec.model.from_pretrained" in str(err.value) and named in str(err.value)


def test_layout_rules_use_the_imported_shape(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, {**LLAMA, "num_key_value_heads": 1})
    got = violations(job(directory, parallelism={"tp": 2}, resources={"gpus": 2}))
    assert "spec.model.n_kv_heads" in got
