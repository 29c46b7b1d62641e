"""The access file's tokens, shared by `trainctl token` (which makes them) and the service (which checks
them, trainctl.service.security.auth): tenant names, roles, the token format and its hash.

Tokens are random 256-bit secrets (`generate_token`), so the access file stores only their SHA-256."""

from __future__ import annotations

import hashlib
import re
import secrets
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

TENANT_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""Tenant names are DNS-1123 labels, like job names, so they are safe in logs, labels and paths."""


class Role(StrEnum):
    """What a principal may do: `user` acts within its tenant, `admin` across all tenants."""

    USER = "user"
    ADMIN = "admin"


TOKEN_PREFIX = "trainctl_"
"""Generated tokens start with this, so secret scanners and humans recognise a leaked one."""
MIN_TOKEN_LENGTH = 32
"""Shortest token `hash_token` accepts: anything shorter is too guessable for an unsalted hash."""
_TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")


class TokenEntry(BaseModel):
    """One accepted token: who holds it, its tenant and role, and the SHA-256 of the token."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=128)
    """Who holds the token; shown in logs instead of the token."""
    tenant: str = Field(min_length=1, max_length=63)
    """Tenant whose jobs the holder sees (a DNS-1123 label)."""
    role: Role = Role.USER
    """user: own tenant only; admin: every tenant."""
    sha256: str
    """Lower-case hex SHA-256 of the token (`trainctl token new` or `trainctl token hash`)."""

    @field_validator("tenant")
    @classmethod
    def _tenant_label(cls, value: str) -> str:
        if not TENANT_PATTERN.match(value):
            raise ValueError("must be a DNS-1123 label: lower-case letters, digits and '-'")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError("must be 64 lower-case hex digits (the SHA-256 of the token, never the token)")
        return value


def generate_token() -> str:
    """A new random token: the prefix and 256 bits of URL-safe base64."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token, after checking it is long enough and fits in gRPC metadata."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"a token must be at least {MIN_TOKEN_LENGTH} characters; use `trainctl token new`")
    if not _TOKEN_CHARS.match(token):
        raise ValueError("a token may hold only printable ASCII without spaces")
    return hashlib.sha256(token.encode("ascii")).hexdigest()
