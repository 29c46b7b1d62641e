"""Sharded loading of Hugging Face models: under every kind of sharding, each rank's parameters hold
exactly its region of the whole model that `transformers`' files describe, and a rank holds only its
share (about 1/k of the model under a k-way TP x FSDP layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import tiny_job
from hf_models import BYTES, save_family
from torch.distributed.tensor import DTensor

from trainctl.parallelism.checkpoint.hf_import import read_model_weights
from trainctl.parallelism.checkpoint.sharded_load import owned_region
from trainctl.parallelism.layouts.parallelize import canonical_name
from trainctl.parallelism.model.lora import apply_lora
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.job import JobSpecBody

LORA = {"rank": 4, "target_modules": ["wq", "wv", "w2"]}
CASES = {
    # family, parallelism, lora: which sharding each case exercises
    "llama-tp2-fsdp2": ("llama", {"tp": 2, "dp_shard": 2}, None),  # strided TP x FSDP, tied embedding re-tied
    "qwen3-tp2-sp": ("qwen3", {"tp": 2, "sequence_parallel": True}, None),  # TP only, q/k norms replicated
    "mistral-ddp2": ("mistral", {"dp_replicate": 2}, None),  # torch DDP: filled before wrapping
    "qwen2-zero1": ("qwen2", {"dp_shard": 2, "zero_stage": 1}, None),  # DDP + ZeRO-1, biases
    "qwen2-pp2-fsdp2": ("qwen2", {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"}, None),  # tied across stages
    "mixtral-ep2": ("mixtral", {"dp_shard": 2, "ep": 2}, None),  # experts sharded over EP, router over FSDP
    "llama-lora-fsdp2": ("llama", {"dp_shard": 2}, LORA),  # adapters from their seeded start, sharded
}


def _whole_model(body: JobSpecBody, config) -> dict[str, torch.Tensor]:
    """The reference: the whole model read from the directory, adapters added as one process adds them."""
    model = build_model(config, body.training.seed)
    model.load_state_dict(read_model_weights(body.model.from_pretrained, model, config))
    if body.lora is not None:
        apply_lora(model, body.lora, body.training.seed)
    return {name: tensor.detach() for name, tensor in model.named_parameters(remove_duplicate=False)}


def _owned_against_whole(rank: int, world_size: int, body_json: str) -> tuple[list[str], int, int]:
    """(parameters whose gathered value differs from the whole model, elements this rank holds,
    elements of the model)."""
    from trainctl.parallelism.engine.trainer import Trainer

    body = JobSpecBody.model_validate_json(body_json)
    trainer = Trainer(body, rank=rank, world_size=world_size, device="cpu")
    whole = _whole_model(body, trainer.config)
    wrong, held = [], 0
    for part in trainer.model.parts:
        head, embedding = getattr(part, "output", None), getattr(part, "tok_embeddings", None)
        if trainer.config.tie_embeddings and head is not None and embedding is not None and head.weight is not embedding.weight:
            wrong.append("output.weight is no longer tok_embeddings.weight")
        for fqn, param in part.named_parameters():
            name = canonical_name(fqn)
            full = param.data.full_tensor() if isinstance(param.data, DTensor) else param.data  # gathered
            if not torch.equal(full, whole[name]):
                wrong.append(name)
            held += owned_region(param.data)[0].numel()
    return wrong, held, sum(t.numel() for t in build_model(trainer.config, 0).parameters())


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_family(name, root / name) for name in {family for family, _, _ in CASES.values()}}


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_exactly_its_region_of_the_whole_model(pool, corpus: str, hf_dirs: dict[str, Path], case: str) -> None:
    family, layout, lora = CASES[case]
    body = tiny_job(corpus, model={"from_pretrained": str(hf_dirs[family])}, data=BYTES, **layout)
    if lora is not None:
        body = JobSpecBody.model_validate({**body.model_dump(), "lora": lora})
    results = pool.run(_owned_against_whole, body.parallelism.world_size, body.model_dump_json())
    for rank, (wrong, _, _) in enumerate(results):
        assert wrong == [], f"rank {rank}: {wrong}"
    if case == "llama-tp2-fsdp2":  # 4-way TP x FSDP: every rank holds a quarter of every matrix
        held, total = results[0][1], results[0][2]
        assert held <= total / 4 + 1024  # the norms' shares are uneven by at most a few elements
