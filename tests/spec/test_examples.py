"""Every example spec users copy is valid and plans as shipped, from any directory: schema, semantics and
every file it names (the fine-tuning examples name the tiny model and datasets kept in examples/, the
command job the scripts in examples/command/, all by paths relative to the spec file); and the demo fits
the demo pool.

The examples that run: the fine-tuning ones in tests/parallelism/test_examples_finetune.py (engine, CPU),
the command job in tests/service/e2e/test_command_jobs_e2e.py (a service on Ray)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainctl.cli.main import main
from trainctl.spec.hf_config import read_hf_config
from trainctl.spec.path_fields import is_relative, path_fields
from trainctl.spec.validate import load_job_file, semantic_violations

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
GPUS_PER_NODE = 8
"""Of the `hgx-h100` cluster preset each example is planned on (as many nodes as it needs)."""


def test_there_are_examples_for_every_layout() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "dp", "fsdp", "hybrid-3d", "moe", "long-context-cp", "finetune-hf-lora", "finetune-hf-full",
            "command-job"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid_as_shipped_from_any_directory(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert path.read_text().lstrip().startswith("#"), "examples start with a comment saying what they show"
    monkeypatch.chdir(tmp_path)  # relative paths in the file resolve against examples/, not here
    job = load_job_file(path)
    assert semantic_violations(job, check_data=True) == []
    for field in path_fields(job.spec):
        assert not is_relative(field.value), field
        assert Path(field.value).is_relative_to(EXAMPLES_DIR), f"{field.field} names {field.value}, outside examples/"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_plans_offline_with_the_cli(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`trainctl validate FILE` and `trainctl plan FILE --cluster hgx-h100:N` (no server) from another
    directory, N the nodes of 8 GPUs the example needs."""
    monkeypatch.chdir(tmp_path)
    gpus = load_job_file(path).spec.resources.gpus
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"{path}: valid ({gpus} ranks)\n"
    assert main(["plan", str(path), "--cluster", f"hgx-h100:{math.ceil(gpus / GPUS_PER_NODE)}"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"valid: {gpus} ranks")


def test_finetune_examples_train_the_tiny_model_in_the_repository() -> None:
    lora, full = (load_job_file(EXAMPLES_DIR / f"finetune-hf-{kind}.yaml").spec for kind in ("lora", "full"))
    model = EXAMPLES_DIR / "tiny-qwen2"
    for spec in (lora, full):
        assert spec.model.from_pretrained == str(model) and spec.data.tokenizer == "auto" and spec.data.format == "jsonl"
        assert spec.resources.device == "cpu"
        assert spec.data.seq_len <= json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert lora.lora is not None and lora.data.messages_field == "messages"
    evaluation = lora.evaluation  # held-out conversations, evaluated on schedule and at the end (issue 37)
    assert evaluation is not None and evaluation.holdout_fraction and evaluation.interval_steps and evaluation.at_end
    assert lora.data.paths == [str(EXAMPLES_DIR / "data" / "tiny-chat.jsonl")]
    assert full.lora is None and full.data.messages_field is None and full.data.text_field == "text"
    assert full.data.paths == [str(EXAMPLES_DIR / "data" / "tiny-text.jsonl")]
    assert read_hf_config(model)["hf_family"] == "qwen2"


def test_the_tiny_model_and_datasets_are_small_and_chat_shaped() -> None:
    files = [p for d in ("tiny-qwen2", "data") for p in (EXAMPLES_DIR / d).iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 500_000, "kept in the repository: under 500 KB"
    chat = [json.loads(line) for line in (EXAMPLES_DIR / "data" / "tiny-chat.jsonl").read_text().splitlines()]
    assert len(chat) >= 24 and all(r["messages"][-1]["role"] == "assistant" for r in chat)
    config = json.loads((EXAMPLES_DIR / "tiny-qwen2" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert "{% generation %}" in (EXAMPLES_DIR / "tiny-qwen2" / "chat_template.jinja").read_text()


def test_the_command_job_example_runs_the_example_scripts() -> None:
    command = load_job_file(EXAMPLES_DIR / "command-job.yaml").spec.command
    assert command is not None and command.working_dir == str(EXAMPLES_DIR / "command")
    assert (Path(command.working_dir) / command.args[0]).is_file()


def test_demo_fits_the_demo_cluster_and_is_hybrid() -> None:
    job = load_job_file(EXAMPLES_DIR / "demo.yaml")
    assert semantic_violations(job, pool_gpus=8) == []
    par = job.spec.parallelism
    assert sum(d > 1 for d in (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp)) >= 3
