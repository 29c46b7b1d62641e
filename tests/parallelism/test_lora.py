"""LoRA fine-tuning from a base checkpoint: only adapters train and are saved, the loss falls on new
data, the merged weights are base + adapters, and DDP / FSDP compute what one process computes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import run_training, tiny_job

from trainctl.parallelism.checkpoint.dcp import save_checkpoint
from trainctl.parallelism.checkpoint.pretrained import (
    CheckpointNotFoundError,
    init_from_problem,
    load_weights,
    open_checkpoint,
    read_model_state,
    write_run_spec,
)
from trainctl.parallelism.data.corpus import PackedDataset
from trainctl.parallelism.engine.trainer import Trainer, TrainResult
from trainctl.parallelism.model.lora import LoRALinear
from trainctl.parallelism.model.lora_names import is_adapter
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.job import JobSpecBody, TrainingJob
from trainctl.spec.presets import resolve_model
from trainctl.spec.validate import semantic_violations

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["wq", "wv", "w2"]}


@pytest.fixture(scope="module")
def new_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Different text (digits and punctuation) than the base corpus."""
    root = tmp_path_factory.mktemp("new")
    rng = random.Random(5)
    for i in range(3):
        lines = [" ".join(f"{rng.randint(0, 999)}:{rng.choice('+-*/')}" for _ in range(8)) for _ in range(120)]
        (root / f"n{i}.txt").write_text("\n".join(lines) + "\n")
    return str(root / "*.txt")


def _lora_job(new_corpus: str, base: Path, steps: int = 6, **layout) -> JobSpecBody:
    job = tiny_job(new_corpus, steps=steps, training={"micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 1}, **layout)
    return JobSpecBody.model_validate({**job.model_dump(), "init_from": str(base), "lora": LORA})


def _eval_loss(weights: dict[str, torch.Tensor], job: JobSpecBody) -> float:
    model = build_model(open_checkpoint(job.init_from).config, 0)
    model.load_state_dict(weights)
    samples = PackedDataset(job.data, 256).samples(0, 16)
    with torch.no_grad():
        logits = model(samples[:, :-1])
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()))


def test_lora_trains_only_adapters_and_merges(base_run: Path, new_corpus: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    job = _lora_job(new_corpus, base_run)
    trainer = Trainer(job, device="cpu", checkpoint_dir=tmp_path)
    config = trainer.config
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(is_adapter(n) for n in trainable)
    per_layer = sum(4 * (i + o) for i, o in [(config.dim, config.n_heads * config.head_dim),
                                             (config.dim, config.n_kv_heads * config.head_dim),
                                             (config.ffn_dim, config.dim)])
    assert len(trainable) == 2 * 3 * config.n_layers
    assert sum(p.numel() for p in trainable.values()) == per_layer * config.n_layers
    assert sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"]) == per_layer * config.n_layers

    base = load_weights(open_checkpoint(base_run))
    result = trainer.run()

    # Checkpoints hold the adapters only.
    step_dir = Path(result.last_checkpoint)
    keys = [k for k in dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(is_adapter(k) for k in keys)
    # Frozen weights did not move.
    for name, param in trainer.model.named_parameters():
        if not is_adapter(name):
            assert torch.equal(param.detach(), base[name]), name

    # Merged = base + (alpha / r) B A, and the loss on the new data fell.
    adapters = read_model_state(step_dir)
    merged = load_weights(open_checkpoint(tmp_path))
    scale = LORA["alpha"] / LORA["rank"]
    for name, tensor in base.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.lora_a" in adapters:
            expected = tensor + scale * adapters[f"{prefix}.lora_b"] @ adapters[f"{prefix}.lora_a"]
            torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)
            assert not torch.equal(merged[name], tensor), f"{name}: the adapter did not train"
        else:
            assert torch.equal(merged[name], tensor), name
    assert _eval_loss(merged, job) < _eval_loss(base, job) - 0.05

    # The merged plain model computes what the adapted model computes.
    plain = build_model(config, 0)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 256, (2, 16))
    adapted = trainer.model.parts[0].eval()
    torch.testing.assert_close(plain(tokens), adapted(tokens), rtol=1e-5, atol=1e-5)
    assert isinstance(adapted.layers["0"].attention.wq, LoRALinear)


@pytest.fixture(scope="module")
def one_process_lora(base_run: Path, new_corpus: str, pool) -> TrainResult:
    """The 3-step LoRA run in one process: what every data-parallel layout must compute."""
    return run_training(pool, _lora_job(new_corpus, base_run, steps=3), None)


@pytest.mark.parametrize("layout", [{"dp_replicate": 2}, {"dp_shard": 2, "zero_stage": 3}], ids=["ddp", "fsdp"])
def test_lora_under_data_parallel_matches_one_process(layout: dict, base_run: Path, new_corpus: str, pool, tmp_path: Path,
                                                      one_process_lora: TrainResult) -> None:
    reference = one_process_lora
    got = run_training(pool, _lora_job(new_corpus, base_run, steps=3, **layout), str(tmp_path))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
    keys = [k for k in dcp.FileSystemReader(got.last_checkpoint).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(is_adapter(k) for k in keys)


def test_lora_and_init_from_errors(tmp_path: Path, corpus: str) -> None:
    with pytest.raises(CheckpointNotFoundError, match="spec.init_from: .*no complete checkpoint"):
        Trainer(JobSpecBody.model_validate({**tiny_job(corpus).model_dump(), "init_from": str(tmp_path)}), device="cpu")
    job = TrainingJob.model_validate(
        {"metadata": {"name": "x"}, "spec": {"lora": {}, "parallelism": {"tp": 2}, "resources": {"gpus": 2}}}
    )
    assert "spec.parallelism.tp" in [v.field for v in semantic_violations(job, check_data=False)]
    with pytest.raises(ValueError, match="target_modules"):
        TrainingJob.model_validate({"metadata": {"name": "x"}, "spec": {"lora": {"target_modules": ["wz"]}}})


def test_init_from_problem_checks_markers_manifest_and_shape_without_the_weights(tmp_path: Path) -> None:
    body = JobSpecBody()
    checkpoints = tmp_path / "run" / "checkpoints"
    step = save_checkpoint(checkpoints, 4, {"model": {"output.weight": torch.ones(8)}}, keep_last=1)
    write_run_spec(checkpoints, body)
    for path in (tmp_path / "run", checkpoints, step):
        assert init_from_problem(str(path), resolve_model(body.model)) is None
    other = JobSpecBody.model_validate({"model": {"dim": resolve_model(body.model).dim * 2}})
    assert "another shape: dim" in init_from_problem(str(step), resolve_model(other.model))
    assert "no complete checkpoint" in init_from_problem(str(tmp_path), resolve_model(body.model))
    shard = next(p for p in step.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1])
    problem = init_from_problem(str(step), resolve_model(body.model))
    assert problem is not None and "damaged" in problem and shard.name in problem
    with pytest.raises(CheckpointNotFoundError, match="damaged"):
        Trainer(JobSpecBody.model_validate({**body.model_dump(), "init_from": str(step)}), device="cpu")
