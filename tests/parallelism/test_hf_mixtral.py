"""Mixtral in and out: a trained engine MoE model exports as `MixtralForCausalLM` (same logits, same
greedy text), and a transformers-made Mixtral checkpoint maps into the engine with the same logits and
the same aux loss, in one process and under expert parallelism (ep2 over dp_shard 2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import tiny_job
from safetensors.torch import load_file

from trainctl.cli.main import main as trainctl_main
from trainctl.parallelism.checkpoint.hf_export import ExportError, hf_config, hf_state_dict
from trainctl.parallelism.checkpoint.hf_import import read_model_weights
from trainctl.parallelism.checkpoint.hf_moe import MixtralWeightsError, moe_state_dict
from trainctl.parallelism.checkpoint.hf_names import halves_to_interleaved, interleaved_to_halves
from trainctl.parallelism.checkpoint.pretrained import load_weights, open_checkpoint
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.model.generate import encode, generate
from trainctl.parallelism.model.moe import pop_aux_loss
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.hf_config import PretrainedConfigError
from trainctl.spec.hf_mixtral import MixtralConfigError, mixtral_keys
from trainctl.spec.model_spec import ModelSpec
from trainctl.spec.presets import PRESETS, MoEConfig, resolve_model

transformers = pytest.importorskip("transformers")

LOGITS_RTOL = 1e-5
"""fp32: ||ours - theirs|| / ||theirs|| over all logits."""
HF_MIXTRAL = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "router_aux_loss_coef": 0.02,
    "initializer_range": 0.1, "rms_norm_eps": 1e-6,
}
"""A tiny Mixtral: initializer_range 0.1 so routing and attention are far from uniform."""


def _moe_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The router and expert tensors of a Mixtral state dict (HF names)."""
    return {k: v for k, v in weights.items() if ".block_sparse_moe." in k or ".mlp." in k}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


@pytest.fixture(scope="module")
def moe_run(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A debug-moe model (4 experts, top-2) trained for 3 steps; its checkpoint root."""
    root = tmp_path_factory.mktemp("moe") / "checkpoints"
    job = tiny_job(corpus, steps=3, model={"preset": "debug-moe"}, training={"micro_batch_size": 4})
    Trainer(job, device="cpu", checkpoint_dir=root).run()
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny MixtralForCausalLM, as `save_pretrained` writes it."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_MIXTRAL))
    out = tmp_path_factory.mktemp("hf-mixtral")
    model.save_pretrained(str(out))
    return out


def _engine_from_hf(directory: Path) -> torch.nn.Module:
    """The model `spec.model.from_pretrained: directory` trains (shape from config.json, weights read)."""
    config = resolve_model(ModelSpec(from_pretrained=str(directory)))
    model = build_model(config, 0)
    model.load_state_dict(read_model_weights(directory, model, config))
    return model.eval()


def _config_dir(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


# ---- export ----------------------------------------------------------------------------------------
def test_export_loads_as_mixtral_with_the_same_logits_and_greedy_text(moe_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(moe_run), "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"] and written["num_local_experts"] == 4
    hf = transformers.MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf.config.num_experts_per_tok == 2 and hf.config.output_router_logits

    source = open_checkpoint(moe_run)
    ours = build_model(source.config, 0)
    ours.load_state_dict(load_weights(source))
    ours.eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(input_ids=tokens).logits
    assert rel_err(got, expected) <= LOGITS_RTOL
    assert not torch.allclose(expected[:, 0], expected[:, -1])  # positions matter: RoPE is exercised

    prompt = torch.tensor([encode("byte", "the model trains")])
    mine = generate(ours, prompt, max_new_tokens=16)
    theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    ("moe", "field"),
    [
        (MoEConfig(num_experts=4, top_k=2, shared_expert=True), "spec.model.moe.shared_expert"),
        (MoEConfig(num_experts=4, top_k=2, interval=2), "spec.model.moe.interval = 2"),
        (MoEConfig(num_experts=4, top_k=1), "spec.model.moe.top_k = 1"),
    ],
)
def test_export_refuses_what_mixtral_cannot_represent(moe: MoEConfig, field: str) -> None:
    config = replace(PRESETS["debug-moe"], moe=moe)
    with pytest.raises(ExportError, match=field):
        hf_state_dict(build_model(config, 0).state_dict(), config)
    with pytest.raises(MixtralConfigError, match=field):
        mixtral_keys(config)


def test_per_layer_sum_coefficient_is_exported_at_the_balanced_equivalent() -> None:
    per_layer = replace(PRESETS["debug-moe"], moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.01))
    assert mixtral_keys(per_layer)["router_aux_loss_coef"] == pytest.approx(0.01 * 4 / 2)
    native = replace(per_layer, moe=replace(per_layer.moe, aux_loss="transformers"))
    assert mixtral_keys(native)["router_aux_loss_coef"] == 0.01


# ---- import ----------------------------------------------------------------------------------------
def test_saved_mixtral_maps_into_the_engine_with_the_same_logits_and_aux_loss(hf_dir: Path) -> None:
    names = set(load_file(str(hf_dir / "model.safetensors")))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names  # what save_pretrained writes
    hf = transformers.MixtralForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = _engine_from_hf(hf_dir)
    assert ours.config.moe.aux_loss == "transformers" and ours.config.moe.aux_loss_coef == 0.02
    tokens = _tokens(1)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, output_router_logits=True)
        mine = ours(tokens)
        aux = pop_aux_loss(ours)
    assert rel_err(mine, theirs.logits) <= LOGITS_RTOL
    torch.testing.assert_close(aux, 0.02 * theirs.aux_loss, rtol=1e-5, atol=0.0)

    # transformers' in-memory (fused) names map to the same model.
    fused = moe_state_dict(_moe_only(dict(hf.state_dict())), ours.config)
    assert any("gate_up_proj" in name for name in hf.state_dict())
    for name, tensor in ours.state_dict().items():
        if ".moe." in name:
            assert torch.equal(fused[name], tensor), name


def test_export_and_import_mappings_are_inverse() -> None:
    config = replace(PRESETS["debug-moe"], moe=replace(PRESETS["debug-moe"].moe, aux_loss="transformers"))
    weights = build_model(config, 3).state_dict()
    back = moe_state_dict(_moe_only(hf_state_dict(weights, config)), config)
    assert set(back) == {name for name in weights if ".moe." in name}
    for name, tensor in back.items():
        assert torch.equal(tensor, weights[name]), name
    wq = weights["layers.0.attention.wq.weight"]
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(wq, 4), 4), wq)


def test_bad_weights_are_named(hf_dir: Path) -> None:
    config = resolve_model(ModelSpec(from_pretrained=str(hf_dir)))
    weights = _moe_only(load_file(str(hf_dir / "model.safetensors")))
    with pytest.raises(MixtralWeightsError, match="model.layers.0.block_sparse_moe.gate.weight.*shape"):
        moe_state_dict({**weights, "model.layers.0.block_sparse_moe.gate.weight": torch.zeros(3, 64)}, config)
    with pytest.raises(MixtralWeightsError, match="experts \\[1\\] have no w2"):
        moe_state_dict({k: v for k, v in weights.items() if k != "model.layers.2.block_sparse_moe.experts.1.w2.weight"}, config)
    with pytest.raises(MixtralWeightsError, match="'model.layers.0.mlp.shared_expert.weight'"):
        moe_state_dict({**weights, "model.layers.0.mlp.shared_expert.weight": torch.zeros(1)}, config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok = 1"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings = true"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"head_dim": 32}, "head_dim = 32"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "RoPE scaling type 'yarn'"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ],
)
def test_unsupported_mixtral_settings_are_refused_by_key(tmp_path: Path, change: dict, message: str) -> None:
    directory = _config_dir(tmp_path, {"model_type": "mixtral", **HF_MIXTRAL, **change})
    with pytest.raises(PretrainedConfigError, match=f"config.json: {message}"):
        resolve_model(ModelSpec(from_pretrained=str(directory)))


def test_config_keys_map_both_ways(tmp_path: Path) -> None:
    config = resolve_model(ModelSpec(from_pretrained=str(_config_dir(tmp_path / "in", {"model_type": "mixtral", **HF_MIXTRAL, "sliding_window": 4096}))))
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim) == (64, 3, 4, 2, 96)
    assert (config.rope_theta, config.norm_eps, config.moe.num_experts, config.moe.top_k) == (1e4, 1e-6, 4, 2)
    assert (config.moe.aux_loss, config.moe.aux_loss_coef, config.sliding_window) == ("transformers", 0.02, 4096)
    written = hf_config(config, 64, torch.float32)
    # The written config.json also states the positions exported (64), which the import reads back.
    assert resolve_model(ModelSpec(from_pretrained=str(_config_dir(tmp_path / "out", written)))) == replace(
        config, max_position_embeddings=64)


def _ep_logits(rank: int, world_size: int, hf_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ep2 x dp_shard2: the mapped model with experts sharded over both ranks; this rank's logits."""
    from trainctl.parallelism.layouts.expert_parallel import apply_expert_parallel
    from trainctl.parallelism.layouts.grid import RankGrid
    from trainctl.parallelism.layouts.mesh import build_mesh

    job = tiny_job("unused", model={"preset": "debug-moe"}, dp_shard=2, ep=2)
    pmesh = build_mesh(RankGrid.from_spec(job.parallelism), "cpu")
    model = apply_expert_parallel(_engine_from_hf(Path(hf_dir)), pmesh, job)
    assert model.layers["0"].moe.experts.w1.to_local().shape[0] == 2  # two of the four experts here
    tokens = _tokens(10 + rank)  # different tokens per rank: the all-to-all moves real traffic
    with torch.no_grad():
        return tokens, model(tokens)


def test_saved_mixtral_runs_under_expert_parallel_with_the_same_logits(pool, hf_dir: Path) -> None:
    hf = transformers.MixtralForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for tokens, logits in pool.run(_ep_logits, 2, str(hf_dir)):
        with torch.no_grad():
            assert rel_err(logits, hf(input_ids=tokens).logits) <= LOGITS_RTOL


@pytest.mark.parametrize("top_k", [2, 3])
def test_routing_is_mixtrals_bit_for_bit(top_k: int) -> None:
    from trainctl.parallelism.model.moe import route

    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    config = transformers.MixtralConfig(**{**HF_MIXTRAL, "num_experts_per_tok": top_k})
    router = modeling.MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    logits, weights, indices = router(x)
    ours = route(torch.nn.functional.linear(x, router.weight), top_k)
    assert torch.equal(ours.indices, indices) and torch.equal(ours.weights, weights)
    assert torch.equal(ours.probs, torch.softmax(logits.float(), dim=-1))
