"""Issue 34, point 7: a `seq_len` past the imported model's `max_position_embeddings` is allowed but
said, naming both numbers, wherever a spec is checked: `trainctl validate` (stderr), the plan's notes
(offline and the service's PlanJob) and, for an accepted CreateJob, a WARNING line in the job's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import main
from trainctl.planning.plan import plan_on_map
from trainctl.spec.job import TrainingJob
from trainctl.spec.model_checks import pretrained_warnings
from trainctl.spec.presets import resolve_model
from trainctl.workers.topology import simulated_topology

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32,
}
WARNING = "spec.data.seq_len: 64 exceeds the model's max_position_embeddings 32"


def model_dir(tmp_path: Path, **config: object) -> Path:
    """A Hugging Face model directory: config.json, and a weights file (never read by these checks)."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA, **config}))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def spec(directory: Path, seq_len: int) -> dict:
    return {"metadata": {"name": "long"}, "spec": {
        "model": {"from_pretrained": str(directory)}, "data": {"seq_len": seq_len, "tokenizer": "byte"},
        "resources": {"gpus": 1, "device": "cpu"}}}


def job(directory: Path, seq_len: int) -> TrainingJob:
    return TrainingJob.model_validate(spec(directory, seq_len))


def warnings_of(job: TrainingJob) -> list:
    """`pretrained_warnings` of `job` with its model resolved as the callers do."""
    return pretrained_warnings(job, resolve_model(job.spec.model))


def said(warnings: list) -> list[str]:
    return [f"{w.field}: {w.description}" for w in warnings]


def test_a_seq_len_past_max_position_embeddings_is_a_warning_naming_both(tmp_path: Path) -> None:
    directory = model_dir(tmp_path)
    [warning] = said(warnings_of(job(directory, 64)))
    assert warning.startswith(WARNING) and "seq_len <= 32" in warning
    assert warnings_of(job(directory, 32)) == []  # at the limit: nothing to say
    (directory / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}))
    assert warnings_of(job(directory, 64)) == []  # no limit stated
    assert warnings_of(TrainingJob.model_validate({"metadata": {"name": "p"}, "spec": {}})) == []  # a preset


def test_validate_and_the_offline_plan_say_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = model_dir(tmp_path)
    path = tmp_path / "job.json"  # JSON is YAML
    path.write_text(json.dumps(spec(directory, 64)))
    assert main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "valid (1 ranks)" in out and f"warning: {WARNING}" in err
    plan = plan_on_map(job(directory, 64), simulated_topology(1, 1), "test")
    assert plan.valid and any(note.startswith(f"warning: {WARNING}") for note in plan.notes)
    assert not any("warning" in n for n in plan_on_map(job(directory, 32), simulated_topology(1, 1), "test").notes)


def test_the_service_plans_and_accepts_the_job_and_says_it(tmp_path: Path, api_client: TrainctlClient) -> None:
    directory = model_dir(tmp_path)
    plan = api_client.plan_job(job(directory, 64))
    assert plan.valid and any(note.startswith(f"warning: {WARNING}") for note in plan.notes)
    created = api_client.create_job(job(directory, 64))
    logged = [e.log for e in api_client.watch(created.id, follow=False) if e.WhichOneof("payload") == "log"]
    assert [line.message[: len(WARNING)] for line in logged if line.level == "WARNING"] == [WARNING]
