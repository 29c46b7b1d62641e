"""The Sweep spec: the example is valid, parameter paths resolve to job fields, ranges and objectives are
checked naming the field, and a trial's job is the template with the parameters set."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.spec.sweep import (
    SWEEP_LABEL,
    TRIAL_LABEL,
    document_kind,
    load_sweep_file,
    parse_sweep_object,
    path_problem,
    sweep_violations,
    trial_job,
    trial_name,
)
from trainctl.spec.validate import SpecError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweeps" / "lr-warmup.yaml"


def sweep(**spec: object) -> dict:
    return {"metadata": {"name": "s"}, "spec": {
        "template": {"training": {"steps": 10, "global_batch_size": 4}, "resources": {"device": "cpu"}},
        "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2, "log": True}],
        **spec,
    }}


def test_the_example_is_a_valid_sweep() -> None:
    assert EXAMPLE.read_text().startswith("#") and document_kind(str(EXAMPLE)) == "Sweep"
    example = load_sweep_file(str(EXAMPLE))
    assert sweep_violations(example) == []
    job = trial_job(example, "lr-warmup-1234", 5, {"spec.training.lr": 0.01, "spec.training.warmup_steps": 3})
    assert (job.spec.training.lr, job.spec.training.warmup_steps) == (0.01, 3)
    assert job.spec.training.steps == example.spec.template.training.steps
    assert job.metadata.labels == {SWEEP_LABEL: "lr-warmup-1234", TRIAL_LABEL: "5"}
    assert job.metadata.name == "lr-warmup-t5"


@pytest.mark.parametrize(("path", "problem"), [
    ("spec.training.lr", None), ("spec.lora.rank", None), ("spec.model.moe.top_k", None),
    ("spec.command.env.LR", None), ("spec.training.learning_rate", "spec.training.learning_rate is not a field"),
    ("spec.training", "names a section, not a field"), ("training.lr", "starts with 'spec.'"),
    ("spec.data.paths", "not searchable"), ("spec.resources.gpus", "not searchable"),
    ("spec.command.env", "is a map: name one key"), ("spec.training.lr.x", "spec.training.lr is not a section"),
])
def test_parameter_paths(path: str, problem: str | None) -> None:
    found = path_problem(path)
    assert found == problem if problem is None else problem in (found or "")


@pytest.mark.parametrize(("parameter", "field", "words"), [
    ({"type": "float", "low": 0.1, "high": 0.01}, "spec.parameters[0].high", "inverted range"),
    ({"type": "int", "low": 3, "high": 3}, "spec.parameters[0].high", "empty range"),
    ({"type": "float", "low": 0.0, "high": 0.1, "log": True}, "spec.parameters[0].low", "log range must lie above 0"),
    ({"type": "float", "low": 1e-4}, "spec.parameters[0].high", "needs high"),
    ({"type": "int", "low": 0.5, "high": 3}, "spec.parameters[0].low", "not an integer"),
    ({"type": "choice", "values": []}, "spec.parameters[0].values", "at least one value"),
    ({"type": "choice", "values": [1, 1]}, "spec.parameters[0].values", "twice"),
    ({"type": "float", "low": -1.0, "high": 0.1}, "spec.parameters[0].low", "-1.0 makes an invalid job: spec.training.lr"),
])
def test_bad_parameters_name_the_field(parameter: dict, field: str, words: str) -> None:
    path = "spec.training.warmup_steps" if parameter["type"] != "float" else "spec.training.lr"
    found = sweep_violations(parse_sweep_object(sweep(parameters=[{"path": path, **parameter}])))
    assert any(v.field == field and words in v.description for v in found), found


def test_objective_and_limits() -> None:
    found = sweep_violations(parse_sweep_object(sweep(objective={"metric": "accuracy", "step": 20}, trials=2, parallel_trials=3)))
    fields = {v.field: v.description for v in found}
    assert "not reported by a built-in job" in fields["spec.objective.metric"]
    assert "beyond the 10 steps" in fields["spec.objective.step"]
    assert "more than spec.trials" in fields["spec.parallel_trials"]
    command = sweep(template={"command": {"program": "python"}, "resources": {"device": "cpu"}},
                    parameters=[{"path": "spec.command.env.LR", "type": "float", "low": 1e-4, "high": 1e-2}],
                    objective={"metric": "mfu"})
    found = sweep_violations(parse_sweep_object(command))
    assert [v.field for v in found] == ["spec.objective.metric"] and "trainctl.report" in found[0].description
    job = trial_job(parse_sweep_object(command), "x", 0, {"spec.command.env.LR": 0.001})
    assert job.spec.command is not None and job.spec.command.env == {"LR": "0.001"}


def test_eval_loss_is_an_objective_of_a_job_that_evaluates() -> None:
    found = sweep_violations(parse_sweep_object(sweep(objective={"metric": "eval_loss"})))
    assert [v.field for v in found] == ["spec.objective.metric"] and "spec.template.evaluation" in found[0].description
    evaluating = sweep(objective={"metric": "eval_loss", "step": 10}, template={
        "training": {"steps": 10, "global_batch_size": 4}, "resources": {"device": "cpu"},
        "evaluation": {"holdout_fraction": 0.1, "interval_steps": 5}})
    assert [v for v in sweep_violations(parse_sweep_object(evaluating)) if v.field.startswith("spec.objective")] == []
    command = sweep(template={"command": {"program": "python"}, "resources": {"device": "cpu"}},
                    parameters=[{"path": "spec.command.env.LR", "type": "float", "low": 1e-4, "high": 1e-2}],
                    objective={"metric": "eval_loss"})
    assert sweep_violations(parse_sweep_object(command)) == []  # a program passes it to trainctl.report


def test_template_violations_are_named_under_spec_template() -> None:
    found = sweep_violations(parse_sweep_object(sweep(template={"training": {"global_batch_size": 3, "micro_batch_size": 2}})))
    assert found and all(v.field.startswith("spec.template.") for v in found)


def test_schema_errors_name_the_field() -> None:
    with pytest.raises(SpecError) as caught:
        parse_sweep_object(sweep(parameters=[{"path": "spec.training.lr", "type": "normal"}]))
    assert caught.value.violations[0].field == "spec.parameters[0].type"


def test_trial_names_fit_a_dns_label() -> None:
    assert trial_name("a" * 63, 11) == "a" * 59 + "-t11"
    assert trial_name("ab-" + "c" * 60, 7).endswith("-t7") and len(trial_name("ab-" + "c" * 60, 7)) <= 63
