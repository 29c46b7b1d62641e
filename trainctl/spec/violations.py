"""What is wrong with a spec: one record per offending field, and the error that carries them.

Its own module, free of pydantic, so that code that only reports violations (the CLI's error paths)
loads without the spec models; `trainctl.spec.validate` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldViolation:
    """One problem with a spec: the dotted path of the field and what is wrong with it."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


class SpecError(ValueError):
    """A spec that cannot be accepted; `violations` lists every offending field."""

    def __init__(self, violations: list[FieldViolation]):
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))
