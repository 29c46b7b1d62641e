"""Every spec in the bad catalogue is rejected locally with a violation naming its field."""

from __future__ import annotations

import pytest
from bad_specs import POOL_GPUS, catalogue

from trainctl.spec.validate import SpecError, load_job_file, semantic_violations

CASES = catalogue()


def test_the_catalogue_covers_at_least_fifteen_kinds() -> None:
    assert len({c.name for c in CASES}) >= 15
    assert len(CASES) - sum(c.local_only for c in CASES) >= 15  # also over gRPC


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_spec_names_its_field(case) -> None:
    try:
        job = load_job_file(case.path)
    except SpecError as exc:
        violations = exc.violations
    else:
        violations = semantic_violations(job, pool_gpus=POOL_GPUS, check_data=True)
    fields = [v.field for v in violations]
    assert case.field in fields, f"{case.name}: expected {case.field} among {violations}"
    assert all(v.description for v in violations)
