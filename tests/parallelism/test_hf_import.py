"""Hugging Face models in the engine (`spec.model.from_pretrained`): import gives transformers' own
logits for every family, export of an imported model reloads in transformers unchanged, sharded
checkpoints load, every bad file is a ConfigurationError naming the field, file and tensor, and a
tp2 x dp2 or a pp2 layout trains each family's imported model exactly as one process does (losses
and gradients, each step), each layout under two families."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import assert_equivalent, run_layout, run_reference, run_training, tiny_job
from hf_models import BYTES, FAMILIES, build_family, save_family
from safetensors.torch import load_file, save_file

from trainctl.parallelism.checkpoint.hf_export import hf_config, hf_state_dict
from trainctl.parallelism.checkpoint.pretrained import pretrained_skeleton
from trainctl.parallelism.engine.model_setup import fill_pretrained
from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.model.transformer import Transformer, build_model
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_family(name, root / name) for name in FAMILIES}


def imported(directory: Path, seq_len: int = 32) -> Transformer:
    """What one process trains: the meta-device skeleton, given storage, filled from the directory."""
    job = JobSpecBody.model_validate({"model": {"from_pretrained": str(directory)}, "data": {"seq_len": seq_len}})
    config = resolve_model(job.model)
    model = pretrained_skeleton(config, job)
    fill_pretrained([model], job, config, torch.device("cpu"))
    return model.eval()


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_the_logits_of_transformers(hf_dirs: dict[str, Path], family: str) -> None:
    with torch.no_grad():
        ours = imported(hf_dirs[family])(TOKENS)
    assert relative(ours, hf_logits(hf_dirs[family])) <= 1e-5


def test_features_are_what_the_family_declares(hf_dirs: dict[str, Path]) -> None:
    llama, qwen2, qwen3 = (imported(hf_dirs[f]) for f in ("llama", "qwen2", "qwen3"))
    assert llama.output.weight is llama.tok_embeddings.weight and llama.config.rope_scaling is not None
    assert qwen2.layers["0"].attention.wq.bias is not None and qwen2.output.weight is qwen2.tok_embeddings.weight
    assert qwen3.layers["0"].attention.wq.weight.shape == (4 * 24, 64) and hasattr(qwen3.layers["0"].attention, "q_norm")


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_an_imported_model_reloads_in_transformers(hf_dirs: dict[str, Path], family: str, tmp_path: Path) -> None:
    model = imported(hf_dirs[family])
    out = tmp_path / "export"
    out.mkdir()
    weights = hf_state_dict(model.state_dict(), model.config)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.config, 128, torch.float32)))
    written = json.loads((out / "config.json").read_text())
    original = json.loads((hf_dirs[family] / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (original["model_type"], original["architectures"])
    assert written["tie_word_embeddings"] == original["tie_word_embeddings"]
    assert ("lm_head.weight" in weights) == (not original["tie_word_embeddings"])
    assert set(weights) == set(load_file(str(hf_dirs[family] / "model.safetensors")))  # every tensor, no other
    assert relative(hf_logits(out), hf_logits(hf_dirs[family])) <= 1e-6


def test_sharded_checkpoints_load(tmp_path: Path) -> None:
    directory = tmp_path / "sharded"
    build_family("qwen3").save_pretrained(str(directory), max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").is_file() and not (directory / "model.safetensors").exists()
    with torch.no_grad():
        assert relative(imported(directory)(TOKENS), hf_logits(directory)) <= 1e-5


def _sharded_copy(source: Path, target: Path) -> tuple[Path, dict[str, str]]:
    build_family("mistral").save_pretrained(str(target), max_shard_size="100KB")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    return target, index["weight_map"]


def test_bad_weight_files_name_the_field_file_and_tensor(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory, weight_map = _sharded_copy(hf_dirs["mistral"], tmp_path / "m")
    shard = sorted(set(weight_map.values()))[-1]
    tensor = next(name for name, file in weight_map.items() if file == shard)

    (directory / shard).rename(directory / "moved")
    with pytest.raises(ConfigurationError, match=rf"spec.model.from_pretrained: .*{shard}: the shard file named in"):
        imported(directory)
    raw = (directory / "moved").read_bytes()
    (directory / shard).write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(ConfigurationError, match=rf"spec.model.from_pretrained: .*{shard}.*truncated or corrupt"):
        imported(directory)

    weights = load_file(str(directory / "moved"))
    weights[tensor] = weights[tensor][:-1]  # wrong shape
    save_file(weights, str(directory / shard), metadata={"format": "pt"})
    with pytest.raises(ConfigurationError, match=rf"spec.model.from_pretrained: .*{shard}: tensor '{tensor}' has shape"):
        imported(directory)

    del weights[tensor]  # missing
    save_file(weights, str(directory / shard), metadata={"format": "pt"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    del index["weight_map"][tensor]
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigurationError, match=rf"spec.model.from_pretrained: .*tensor '{tensor}' .* is missing"):
        imported(directory)

    (directory / "model.safetensors.index.json").unlink()
    with pytest.raises(ConfigurationError, match="spec.model.from_pretrained: .* holds neither model.safetensors"):
        imported(directory)


def test_sliding_window_shorter_than_the_sequence_is_refused(hf_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigurationError, match="spec.data.seq_len: 65 exceeds config.json sliding_window 64"):
        imported(hf_dirs["mistral"], seq_len=65)


LAYOUTS = {
    "tp2_fsdp2": {"tp": 2, "dp_shard": 2},
    "tp2_sp_ddp2": {"tp": 2, "sequence_parallel": True, "dp_replicate": 2},
    "pp2": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2_fsdp2": {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"},
}


CASES = [
    ("llama", "pp2"),  # tied embeddings synced across stages; llama3 RoPE scaling in each stage
    ("mistral", "tp2_sp_ddp2"),  # untied output under TP + SP
    ("qwen2", "tp2_fsdp2"), ("qwen2", "pp2_fsdp2"),  # q/k/v biases sharded with their rows; tied under TP and PP
    ("qwen3", "tp2_sp_ddp2"), ("qwen3", "pp2"),  # q/k norms per head under TP + SP
    ("mixtral", "tp2_fsdp2"), ("mixtral", "pp2_fsdp2"),
]
"""Every family under a layout and each layout under two families; the tied, biased family (qwen2) under TP
and under PP. The families' import is the same code under every layout (their logits are checked above), so
a family under each layout would repeat what these cases show."""


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_imported_models_train_alike_under_tp_dp_and_pp(pool, corpus, hf_dirs: dict[str, Path], family: str, layout: str) -> None:
    body = tiny_job(corpus, model={"from_pretrained": str(hf_dirs[family])}, data=BYTES, **LAYOUTS[layout])
    assert_equivalent(run_layout(pool, body), run_reference(pool, body))


def _engine_logits(run: Path) -> torch.Tensor:
    from trainctl.parallelism.checkpoint.pretrained import load_weights, open_checkpoint

    source = open_checkpoint(run)
    model = build_model(source.config, 0)
    model.load_state_dict(load_weights(source))
    with torch.no_grad():
        return model.eval()(TOKENS)


def test_tied_pp_checkpoints_resume_in_one_process_and_export(pool, corpus, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """qwen2 (tied, biased) trained under pp2 x dp2 checkpoints at step 2; one process resumes it exactly; the
    run exports as qwen2 and reloads in transformers with the engine's logits."""
    from trainctl.cli.main import main as trainctl_main
    from trainctl.parallelism.checkpoint import dcp as ckpt

    body = tiny_job(corpus, steps=4, model={"from_pretrained": str(hf_dirs["qwen2"])}, data=BYTES, pp=2, dp_shard=2)
    body.checkpoint.interval_steps = 2
    full = run_training(pool, body, str(tmp_path / "full"))
    resume_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "step_00000002", resume_dir / "step_00000002")
    single = tiny_job(corpus, steps=4, model={"from_pretrained": str(hf_dirs["qwen2"])}, data=BYTES)
    single.checkpoint.interval_steps = 2
    resumed = run_training(pool, single, str(resume_dir))
    assert resumed.resumed_from_step == 2
    assert resumed.losses == pytest.approx(full.losses[2:], rel=1e-5)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path / "full")] == [2, 4]

    out = tmp_path / "hf"
    assert trainctl_main(["export", str(tmp_path / "full"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert relative(hf_logits(out), _engine_logits(tmp_path / "full")) <= 1e-5


def test_lora_on_a_hugging_face_base_exports_merged(pool, corpus, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The adapters' checkpoint names no base; load_weights finds it in from_pretrained (q/k/v biases kept)."""
    from trainctl.cli.main import main as trainctl_main

    body = tiny_job(corpus, steps=2, model={"from_pretrained": str(hf_dirs["qwen2"])}, data=BYTES, dp_shard=2)
    body.lora = {"rank": 4, "target_modules": ["wq", "wv", "w2"]}
    body = JobSpecBody.model_validate(body.model_dump())
    result = run_training(pool, body, str(tmp_path / "run"))
    assert result.steps_completed == 2
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    merged = _engine_logits(tmp_path / "run")
    assert relative(hf_logits(out), merged) <= 1e-5
    assert relative(merged, hf_logits(hf_dirs["qwen2"])) > 1e-4  # the adapters changed the model


def test_tokenizer_auto_needs_tokenizer_files_in_the_model_directory(corpus, hf_dirs: dict[str, Path]) -> None:
    """`tokenizer: auto` is the model's tokenizer; a model directory without one is refused at submit."""
    from trainctl.spec.job import TrainingJob
    from trainctl.spec.validate import semantic_violations

    body = tiny_job(corpus, model={"from_pretrained": str(hf_dirs["llama"])})
    problems = semantic_violations(TrainingJob.model_validate({"metadata": {"name": "hf"}, "spec": body.model_dump()}), check_data=True)
    assert [(v.field, "auto names the from_pretrained model directory" in v.description) for v in problems] == [
        ("spec.data.tokenizer", True)
    ]
