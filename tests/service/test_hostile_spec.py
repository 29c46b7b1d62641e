"""Property tests on job specs: any document is either a valid job or SpecError naming fields, never a crash."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.spec.validate import SpecError, parse_object, parse_yaml, semantic_violations

BASE: dict[str, Any] = {
    "apiVersion": "trainctl/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "hostile", "labels": {"team": "red"}},
    "spec": {
        "model": {"preset": "debug", "n_heads": 4, "n_kv_heads": 2},
        "data": {"paths": ["@stdlib"], "seq_len": 64, "seed": 1, "max_files": 5},
        "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 3},
        "training": {"steps": 3, "global_batch_size": 4, "micro_batch_size": 1, "lr": 0.001, "dtype": "float32"},
        "checkpoint": {"interval_steps": 0, "keep_last": 1},
        "resources": {"gpus": 2, "device": "cpu"},
        "scheduling": {"priority": 0, "max_restarts": 1},
    },
}
ROOTS = ("<document>", "apiVersion", "kind", "metadata", "spec")


def _leaf_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        out = [prefix] if prefix else []
        for key, value in node.items():
            out.extend(_leaf_paths(value, (*prefix, key)))
        return out
    return [prefix]


PATHS = _leaf_paths(BASE)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "..", "../../etc/passwd", "\x00", "debug", "1f1b", "bfloat16", "auto", "@stdlib"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=6)


@st.composite
def mutated_documents(draw: st.DrawFn) -> Any:
    """The base spec with a few fields replaced, deleted or added: near-valid, so deep rules are reached."""
    document = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(PATHS))
        parent = document
        for key in path[:-1]:
            if not isinstance(parent, dict) or not isinstance(parent.get(key), dict):
                parent = None
                break
            parent = parent[key]
        if parent is None:
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete":
            parent.pop(path[-1], None)
        else:
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
    return document


def check_outcome(document: Any) -> None:
    """Parse and validate; only SpecError may escape, and every violation names a field path."""
    try:
        job = parse_object(document) if isinstance(document, dict) else parse_yaml(document)
        violations = semantic_violations(job, pool_gpus=8, check_data=True)
    except SpecError as exc:
        violations = exc.violations
        assert violations, "SpecError without violations"
    for violation in violations:
        # The field is a path from the document root, or, for an unknown key, that key itself.
        assert violation.field.split(".")[0] in ROOTS or violation.description == "unknown field", violation
        assert violation.description.strip(), violation


def test_the_base_document_is_valid() -> None:
    job = parse_object(copy.deepcopy(BASE))
    assert semantic_violations(job, pool_gpus=8) == []


@settings(max_examples=150, deadline=None)
@given(mutated_documents())
def test_mutated_specs_are_accepted_or_rejected_by_field(document: dict) -> None:
    check_outcome(document)


@settings(max_examples=60, deadline=None)
@given(st.one_of(values, st.dictionaries(st.sampled_from(["apiVersion", "kind", "metadata", "spec", "x"]), values, max_size=5)))
def test_arbitrary_documents_never_crash_validation(document: Any) -> None:
    check_outcome(yaml.safe_dump(document) if not isinstance(document, dict) else document)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_yaml_text_never_crashes_the_parser(text: str) -> None:
    check_outcome(text)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", math.nan),
        ("grad_clip", math.nan),
        ("lr", math.inf),
        ("grad_clip", math.inf),
    ],
)
def test_nan_and_infinity_never_pass_as_numbers(field: str, value: float) -> None:
    document = copy.deepcopy(BASE)
    document["spec"]["training"][field] = value
    try:
        job = parse_object(document)
    except SpecError as exc:
        assert any(v.field == f"spec.training.{field}" for v in exc.violations)
    else:
        raise AssertionError(f"spec.training.{field}={value} was accepted: {job.spec.training}")
