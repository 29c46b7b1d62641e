"""Finding the job or the sweep a caller names by id: a record of another tenant is NOT_FOUND to a user,
so ids cannot be probed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from trainctl.service.security.tenancy import Principal
from trainctl.wire.errors import bad_field, not_found

MAX_ID_LENGTH = 128
"""Longest id (of a job, a sweep or a request) a call may name."""


class _Owned(Protocol):
    @property
    def tenant(self) -> str: ...


R = TypeVar("R", bound=_Owned)


def owned_record(kind: str, record_id: str, principal: Principal, get: Callable[[str], R], missing: type[Exception]) -> R:
    """The `kind` ("job", "sweep") record `get(record_id)` when `principal` may see it; a missing id is
    INVALID_ARGUMENT, an unknown one (`get` raises `missing`) or another tenant's NOT_FOUND."""
    if not record_id:
        raise bad_field("id", f"a {kind} id is required")
    if len(record_id) > MAX_ID_LENGTH:
        raise bad_field("id", f"longer than {MAX_ID_LENGTH} characters")
    try:
        record = get(record_id)
    except missing:
        raise not_found(f"{kind} {record_id!r}") from None
    if not principal.can_access(record.tenant):
        raise not_found(f"{kind} {record_id!r}")
    return record
