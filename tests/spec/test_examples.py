"""Every example spec users copy is valid: schema, semantics, data paths; and the demo fits the demo pool.

The fine-tuning examples name the user's model directory and dataset by placeholder paths
(example_files.py): they are valid without reading files as written, and valid with every file check once
the placeholders point at stand-in files (a Hugging Face model directory with a chat-template tokenizer,
JSONL chat and text records)."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_files import PLACEHOLDERS, localized, needs_user_files, write_user_files

from trainctl.spec.validate import load_job_file, parse_yaml, semantic_violations

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples_for_every_layout() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "dp", "fsdp", "hybrid-3d", "moe", "long-context-cp", "finetune-hf-lora", "finetune-hf-full"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid(path: Path, tmp_path: Path) -> None:
    assert path.read_text().lstrip().startswith("#"), "examples start with a comment saying what they show"
    job = load_job_file(path)
    if needs_user_files(path):
        assert semantic_violations(job, check_data=False) == []
        job = parse_yaml(localized(path, write_user_files(tmp_path)))
        assert not any(p in job.model_dump_json() for p in PLACEHOLDERS)
    assert semantic_violations(job, check_data=True) == []


def test_finetune_examples_train_a_hugging_face_model(tmp_path: Path) -> None:
    files = write_user_files(tmp_path)
    lora, full = (parse_yaml(localized(EXAMPLES[0].parent / f"finetune-hf-{kind}.yaml", files)).spec for kind in ("lora", "full"))
    for spec in (lora, full):
        assert spec.model.from_pretrained == files[PLACEHOLDERS[0]] and spec.data.tokenizer == "auto"
        assert spec.data.format == "jsonl"
    assert lora.lora is not None and lora.data.messages_field == "messages"
    assert full.lora is None and full.data.messages_field is None and full.data.text_field == "text"


def test_demo_fits_the_demo_cluster_and_is_hybrid() -> None:
    job = load_job_file(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")
    assert semantic_violations(job, pool_gpus=8) == []
    par = job.spec.parallelism
    assert sum(d > 1 for d in (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp)) >= 3
