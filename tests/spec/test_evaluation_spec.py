"""`spec.evaluation`'s rules: one data source, a schedule that evaluates, the training data's seq_len,
a format whose documents can be held out, no command job; its data paths are path fields (the
service's confinement walks them) and its data is checked like `spec.data`, under its own field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainctl.spec.data_checks import evaluation_data_violations
from trainctl.spec.job import JobSpecBody, TrainingJob
from trainctl.spec.path_fields import path_fields
from trainctl.spec.validate import semantic_violations


def job(spec: dict) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": "trainctl/v1", "kind": "TrainingJob", "metadata": {"name": "e"}, "spec": spec})


def engine_spec(evaluation: dict, data: dict | None = None) -> dict:
    return {
        "model": {"preset": "debug"},
        "data": {"paths": ["@stdlib"], "seq_len": 32, **(data or {})},
        "training": {"steps": 4, "global_batch_size": 8, "micro_batch_size": 2},
        "evaluation": evaluation,
    }


def messages(spec: dict) -> list[str]:
    return [str(v) for v in semantic_violations(job(spec), check_data=False)]


@pytest.mark.parametrize(
    "evaluation, message",
    [
        ({}, "spec.evaluation: set exactly one of data and holdout_fraction"),
        ({"holdout_fraction": 0.1, "data": {"paths": ["@stdlib"]}}, "set exactly one of data and holdout_fraction"),
        ({"holdout_fraction": 0.1, "at_end": False}, "interval_steps 0 and at_end false never evaluate"),
        ({"holdout_fraction": 0.9}, "less than or equal to 0.5"),
        ({"holdout_fraction": 0.1, "batches": 0}, "greater than or equal to 1"),
    ],
)
def test_malformed_evaluation_is_refused(evaluation, message):
    with pytest.raises(ValidationError, match=message):
        JobSpecBody.model_validate(engine_spec(evaluation))


def test_eval_data_seq_len_must_equal_the_training_seq_len():
    got = messages(engine_spec({"data": {"paths": ["@stdlib"], "seq_len": 64}}))
    assert "spec.evaluation.data.seq_len: 64 must equal spec.data.seq_len = 32" in got


def test_prepared_token_shards_cannot_be_held_out():
    got = messages(engine_spec({"holdout_fraction": 0.1}, data={"paths": ["/shards"], "format": "tokens"}))
    assert any(m.startswith("spec.evaluation.holdout_fraction: spec.data.format tokens") for m in got), got


def test_a_valid_evaluation_passes():
    assert messages(engine_spec({"holdout_fraction": 0.1, "interval_steps": 2})) == []
    assert messages(engine_spec({"data": {"paths": ["@stdlib"], "seq_len": 32}, "batches": 2})) == []


def test_a_command_job_cannot_evaluate():
    spec = {"command": {"program": "python", "args": ["train.py"]}, "evaluation": {"holdout_fraction": 0.1}}
    assert messages(spec) == [
        "spec.evaluation: a command job evaluates in its own program and reports eval_loss through trainctl.report"
    ]


def test_eval_data_paths_are_path_fields():
    body = JobSpecBody.model_validate(engine_spec({"data": {"paths": ["/data/eval/*.jsonl"], "format": "jsonl",
                                                            "tokenizer": "/models/tok", "seq_len": 32}}))
    fields = {f.field: (f.value, f.glob) for f in path_fields(body)}
    assert fields["spec.evaluation.data.paths[0]"] == ("/data/eval/*.jsonl", True)
    assert fields["spec.evaluation.data.tokenizer"] == ("/models/tok", False)


def test_eval_data_is_checked_under_its_own_field(tmp_path: Path):
    body = JobSpecBody.model_validate(engine_spec({"data": {"paths": [str(tmp_path / "*.txt")], "seq_len": 32}}))
    got = [str(v) for v in evaluation_data_violations(body)]
    assert got == [f"spec.evaluation.data.paths[0]: {str(tmp_path / '*.txt')!r} matches no files"]
