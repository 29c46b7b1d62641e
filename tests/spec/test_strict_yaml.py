"""Strict YAML and strict typing (issue 32): a key given twice is an error naming the key and its lines in
every document trainctl loads from a user; booleans, numbers and strings are not coerced into one another
in the job and sweep specs (an int stays a valid float); NUL and lone surrogates in any string of a spec
are refused naming the field, the character shown escaped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trainctl.service.security.auth import AuthConfigError, load_access_config
from trainctl.spec import strict_yaml
from trainctl.spec.sweep import parse_sweep_object, path_problem, sweep_violations
from trainctl.spec.validate import SpecError, parse_object, parse_yaml
from trainctl.workers.topology.merge import load_switch_tree
from trainctl.workers.topology.model import TopologyError, load_topology, simulated_topology

JOB = "apiVersion: trainctl/v1\nkind: TrainingJob\nmetadata:\n  name: a\nspec:\n  training:\n    steps: 5\n"


def violations(call: Any, *args: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        call(*args)
    return [str(v) for v in info.value.violations]


# ---- duplicate keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "line", "first"), [
    (JOB + "metadata:\n  name: b\n", "'metadata'", 8, 3),
    (JOB + "    steps: 6\n", "'steps'", 8, 7),
    ("metadata: {name: a, name: b}\n", "'name'", 1, 1),
    (JOB + "  training: {}\n", "'training'", 8, 6),
])
def test_a_key_given_twice_in_a_job_spec_is_refused_naming_it_and_its_lines(text: str, key: str, line: int, first: int) -> None:
    [problem] = violations(parse_yaml, text)
    assert problem.startswith(f"<document>: malformed YAML at line {line}, column "), problem
    assert f"key {key} is given twice in one mapping (first at line {first})" in problem


def test_the_same_key_in_different_mappings_is_no_duplicate() -> None:
    job = parse_yaml(JOB + "  data:\n    seed: 1\n  checkpoint:\n    keep_last: 2\n  scheduling:\n    max_restarts: 1\n")
    assert (job.spec.data.seed, job.spec.checkpoint.keep_last, job.spec.scheduling.max_restarts) == (1, 2, 1)


@pytest.mark.parametrize("fast", [False, True])
def test_the_loader_refuses_duplicates_with_either_parser_but_not_merge_keys(fast: bool) -> None:
    with pytest.raises(yaml.YAMLError, match=r"key 'b' is given twice in one mapping \(first at line 2\)"):
        strict_yaml.load("a:\n  b: 1\n  b: 2\n", fast=fast)
    merged = strict_yaml.load("base: &base {x: 1, y: 2}\nmine:\n  <<: *base\n  x: 3\n", fast=fast)
    assert merged["mine"] == {"x": 3, "y": 2}  # what a mapping says itself overrides what it merges


def test_a_sweep_spec_with_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    from trainctl.spec.sweep import load_sweep_file

    path = tmp_path / "sweep.yaml"
    path.write_text("kind: Sweep\nmetadata: {name: s}\nspec:\n  trials: 3\n  trials: 4\n")
    [problem] = violations(load_sweep_file, str(path))
    assert "line 5" in problem and "key 'trials' is given twice in one mapping (first at line 4)" in problem


def test_a_topology_map_switch_tree_or_access_file_with_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    topology = tmp_path / "map.yaml"
    topology.write_text(simulated_topology(1, 2).to_yaml() + "kind: TopologyMap\n")
    with pytest.raises(TopologyError, match=r"key 'kind' is given twice in one mapping \(first at line 2\)"):
        load_topology(topology)
    tree = tmp_path / "tree.yaml"
    tree.write_text("kind: SwitchTree\nmetadata: {name: t}\nmetadata: {name: u}\n")
    with pytest.raises(TopologyError, match=r"key 'metadata' is given twice in one mapping \(first at line 2\)"):
        load_switch_tree(tree)
    access = tmp_path / "access.yaml"
    access.write_text("tokens: []\ntokens: []\n")
    with pytest.raises(AuthConfigError, match=r"key 'tokens' is given twice in one mapping \(first at line 1\)"):
        load_access_config(access)


# ---- no coercion between booleans, numbers and strings -----------------------------------------------


def job(**training: Any) -> dict[str, Any]:
    return {"metadata": {"name": "a"}, "spec": {"training": training}}


@pytest.mark.parametrize(("document", "field", "message"), [
    (job(steps=True), "spec.training.steps", "Input should be a valid integer, got a boolean"),
    (job(steps="5"), "spec.training.steps", "Input should be a valid integer, got a string"),
    (job(lr="0.001"), "spec.training.lr", "Input should be a valid number, got a string"),
    (job(lr=True), "spec.training.lr", "Input should be a valid number, got a boolean"),
    (job(compile="yes"), "spec.training.compile", "Input should be a valid boolean, got a string"),
    (job(compile=1), "spec.training.compile", "Input should be a valid boolean, got a number"),
    (job(micro_batch_size="3"), "spec.training.micro_batch_size", "Input should be a valid integer or 'auto', got a string"),
    (job(micro_batch_size=True), "spec.training.micro_batch_size", "Input should be a valid integer or 'auto', got a boolean"),
    ({"metadata": {"name": 123}}, "metadata.name", "Input should be a valid string, got a number"),
    ({"metadata": {"name": "a", "labels": {"team": True}}}, "metadata.labels.team", "Input should be a valid string, got a boolean"),
    ({"metadata": {"name": "a"}, "spec": {"parallelism": {"zero_stage": True}}}, "spec.parallelism.zero_stage",
     "Input should be 0, 1, 2 or 3, got a boolean"),
    ({"metadata": {"name": "a"}, "spec": {"data": {"seed": "7"}}}, "spec.data.seed", "Input should be a valid integer, got a string"),
    ({"metadata": {"name": "a"}, "spec": {"command": {"program": "p", "args": ["x", 2]}}}, "spec.command.args[1]",
     "Input should be a valid string, got a number"),
])
def test_a_value_of_another_kind_is_refused_naming_the_field(document: dict, field: str, message: str) -> None:
    assert violations(parse_object, document) == [f"{field}: {message}"]


def test_numbers_stay_numbers_and_literals_keep_their_text() -> None:
    accepted = parse_object(job(lr=1, steps=2.0, micro_batch_size="auto", compile=True))
    assert accepted.spec.training.lr == 1.0 and isinstance(accepted.spec.training.lr, float)  # an int is a valid float
    assert accepted.spec.training.steps == 2  # a float without a fraction is a valid int, as pydantic checks it
    assert accepted.spec.training.micro_batch_size == "auto" and accepted.spec.training.compile is True
    assert violations(parse_object, job(steps=2.5)) == [
        "spec.training.steps: Input should be a valid integer, got a number with a fractional part"
    ]


def test_yaml_text_is_refused_the_same_way() -> None:
    text = JOB.replace("steps: 5", "steps: true\n    lr: \"0.001\"\n    warmup_steps: 1")
    assert violations(parse_yaml, text) == [
        "spec.training.steps: Input should be a valid integer, got a boolean",
        "spec.training.lr: Input should be a valid number, got a string",
    ]
    assert parse_yaml(JOB.replace("steps: 5", "steps: 5\n    lr: 1")).spec.training.lr == 1.0


@pytest.mark.parametrize(("written", "value"), [("3e-4", 3e-4), ("1E-3", 1e-3), ("-2.5e+1", None), ("1e5", 1e5)])
def test_an_exponent_without_a_dot_is_a_number_as_in_yaml_1_2(written: str, value: float | None) -> None:
    """PyYAML (YAML 1.1) reads `3e-4` as text; the spec's loader reads it as the float YAML 1.2 says it is."""
    text = JOB.replace("steps: 5", f"steps: 5\n    lr: {written}")
    if value is None:
        assert violations(parse_yaml, text) == ["spec.training.lr: Input should be greater than 0"]
    else:
        assert parse_yaml(text).spec.training.lr == value
    assert strict_yaml.load(f"a: {written}", fast=True) == strict_yaml.load(f"a: {written}") == {"a": float(written)}
    assert violations(parse_yaml, JOB.replace("steps: 5", f'steps: 5\n    lr: "{written}"')) == [
        "spec.training.lr: Input should be a valid number, got a string"
    ]


def sweep(parameter: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s"}, "spec": {
        "template": {"training": {"steps": 10, "global_batch_size": 4}, "resources": {"device": "cpu"}},
        "parameters": [{"path": "spec.training.lr", **parameter}], **spec,
    }}


def test_a_sweep_spec_is_typed_as_strictly() -> None:
    assert violations(parse_sweep_object, sweep({"type": "float", "low": True, "high": 0.1})) == [
        "spec.parameters[0].low: Input should be a valid number, got a boolean"
    ]
    assert violations(parse_sweep_object, sweep({"type": "float", "low": 0.001, "high": 0.1}, trials="3")) == [
        "spec.trials: Input should be a valid integer, got a string"
    ]
    assert violations(parse_sweep_object, sweep({"type": "float", "low": 0.001, "high": 0.1, "log": "yes"})) == [
        "spec.parameters[0].log: Input should be a valid boolean, got a string"
    ]
    # a choice's values may be of any kind, but the trial's job is typed: text for lr makes no valid job
    texts = parse_sweep_object(sweep({"type": "choice", "values": ["1e-3", 0.01]}))
    assert [str(v) for v in sweep_violations(texts)] == [
        "spec.parameters[0].values[0]: '1e-3' makes an invalid job: spec.training.lr: Input should be a valid "
        "number, got a string"
    ]
    assert sweep_violations(parse_sweep_object(sweep({"type": "float", "low": 1, "high": 2}))) == []


def test_a_sweep_value_over_the_proto_is_typed_as_strictly() -> None:
    """The proto's SweepValue carries a bound or choice of any kind: only the spec's types decide."""
    from trainctl.wire.sweep_convert import sweep_from_proto, sweep_to_proto

    message = sweep_to_proto(parse_sweep_object(sweep({"type": "float", "low": 0.001, "high": 0.1})))
    for kind, value, got in (("string_value", "0.001", "a string"), ("bool_value", True, "a boolean")):
        setattr(message.spec.parameters[0].low, kind, value)
        assert violations(sweep_from_proto, message) == [f"spec.parameters[0].low: Input should be a valid number, got {got}"]
    message.spec.parameters[0].low.int_value = 0
    assert sweep_from_proto(message).spec.parameters[0].low == 0


# ---- text the store cannot hold ------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "field", "shown"), [
    ({"command": {"program": "py\x00thon"}}, "spec.command.program", "a NUL character (\\x00) at character 3"),
    ({"command": {"program": "python", "args": ["a\x00"]}}, "spec.command.args[0]", "a NUL character (\\x00) at character 2"),
    ({"command": {"program": "python", "env": {"X": "\x00"}}}, "spec.command.env.X", "a NUL character (\\x00) at character 1"),
    ({"data": {"text_field": "te\x00xt"}}, "spec.data.text_field", "a NUL character (\\x00) at character 3"),
    ({"data": {"paths": ["a\udc80"]}}, "spec.data.paths[0]", "a lone surrogate (\\udc80, not UTF-8) at character 2"),
    ({"init_from": "job:x\x00y"}, "spec.init_from", "a NUL character (\\x00) at character 6"),
])
def test_unstorable_text_is_refused_naming_the_field_and_showing_the_character(spec: dict, field: str, shown: str) -> None:
    [problem] = violations(parse_object, {"metadata": {"name": "a"}, "spec": spec})
    assert problem == f"{field}: contains {shown}; trainctl cannot store one"
    assert "\x00" not in problem


def test_unstorable_label_and_variable_names_are_refused_with_the_name_escaped() -> None:
    found = violations(parse_object, {"metadata": {"name": "a", "labels": {"t\x00": "v"}},
                                      "spec": {"command": {"program": "p", "env": {"A\x00": "1"}}}})
    assert "metadata.labels.t\\x00: the key contains a NUL character (\\x00) at character 2; trainctl cannot store one" in found
    assert any(v.startswith("spec.command.env.A\\x00: the key contains a NUL character") for v in found)


def test_nul_escapes_in_yaml_are_refused_naming_the_field() -> None:
    text = JOB.replace("  training:\n    steps: 5\n", '  command:\n    program: "python"\n    args: ["ok", "a\\0b"]\n    env: {X: "\\uDC80"}\n')
    assert violations(parse_yaml, text) == [
        "spec.command.args[1]: contains a NUL character (\\x00) at character 2; trainctl cannot store one",
        "spec.command.env.X: contains a lone surrogate (\\udc80, not UTF-8) at character 1; trainctl cannot store one",
    ]


def test_a_sweep_parameter_path_with_a_nul_is_refused_with_it_escaped() -> None:
    document = sweep({"type": "float", "low": 0.001, "high": 0.1})
    document["spec"]["parameters"][0]["path"] = "spec.training.l\x00r"
    assert violations(parse_sweep_object, document) == [
        "spec.parameters[0].path: contains a NUL character (\\x00) at character 16; trainctl cannot store one"
    ]
    assert path_problem("spec.training.l\x00r") == "contains a NUL character (\\x00) at character 16; trainctl cannot store one"
    assert path_problem("spec.tra\nining") == "spec.tra\\nining is not a field"
