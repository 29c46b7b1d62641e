"""Property tests on job specs: any document is either a valid job or SpecError naming fields, never a crash."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from spec_strategies import BASE, ROOTS, mutated_documents, values

from trainctl.spec.validate import SpecError, parse_object, parse_yaml, semantic_violations


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
@example("?")  # a null key (found by this test on CI): refused as malformed YAML, not as field "None"
@example("spec: {1: x}")
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
