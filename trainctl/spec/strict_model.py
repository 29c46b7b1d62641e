"""The base of every spec block and the field types the blocks share (trainctl.spec.job, sweep)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from trainctl.spec.bounds import INT64_MAX, INT64_MIN, MAX_PATH_LENGTH
from trainctl.spec.strict_input import input_errors, type_members

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
PathText = Annotated[str, Field(max_length=MAX_PATH_LENGTH)]


def count(upper: int, lower: int = 1) -> type[int]:
    """An integer field in [lower, upper]."""
    return Annotated[int, Field(ge=lower, le=upper)]  # type: ignore[return-value]


class StrictModel(BaseModel):
    """Base for every spec block: unknown keys are errors, NaN and infinity are refused, values are re-validated
    on assignment, booleans, numbers and text are not coerced into one another and no text holds a
    character the store cannot keep (NUL, a lone surrogate): trainctl.spec.strict_input."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    _field_members: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Field name -> the types its value may have (trainctl.spec.strict_input.type_members), per model."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._field_members = {name: type_members(info.annotation) for name, info in cls.model_fields.items()}

    @field_validator("*", mode="before")
    @classmethod
    def _as_written(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse `value` where it is not of a kind the field's type names, or holds unstorable text. JSON
        input is left alone: trainctl reads only its own dumps of validated specs as JSON (the store, the
        supervisor, the ranks), and re-checking them would double the cost of every read."""
        if info.mode == "json" or info.field_name is None:
            return value
        errors = input_errors(cls._field_members[info.field_name], value)
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return value
