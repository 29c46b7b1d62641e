"""Bearer-token authentication: the access file, token hashing, principals. Every TrainingService call
is authenticated before its payload is decoded (trainctl.service.api.rpc_calls); health checks and reflection
are served without a token.

Tokens are random 256-bit secrets (`generate_token`), so the access file stores only their SHA-256
(a slow password hash adds nothing against a 256-bit secret and would cost every request a KDF run).
A presented token is hashed and compared with every stored hash by `hmac.compare_digest`, without
stopping at a match. Tokens are never logged; entries are named so logs and audit can say who called.

The access file (YAML) also holds the per-tenant quotas:

    tokens:
      - name: alice                 # who holds it (appears in logs)
        tenant: vision              # DNS-1123 label
        role: user                  # user | admin
        sha256: 5e884898da28...     # `trainctl token new` (trainctl/cli/token_cmd.py) prints this line
    tenants:
      vision: {running_gpus: 16, queued_jobs: 50}
    default_quota: {running_gpus: 8, queued_jobs: 20}
    command_tenants: [vision]       # may submit command jobs (programs of their own); admins always may
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainctl.service.security.tenancy import ANONYMOUS, Principal, Quota
from trainctl.spec import strict_yaml
from trainctl.spec.pydantic_violations import violations_from_pydantic
from trainctl.wire.tokens import TENANT_PATTERN, TokenEntry

log = logging.getLogger(__name__)

_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)

RELOAD_SECONDS = 5.0
"""How often, at most, the access file's modification time is checked for a reload."""



class AuthConfigError(ValueError):
    """The access file cannot be used; the message names the file and the offending field."""


class AuthenticationError(Exception):
    """A call that carries no usable bearer token. The message never contains the token."""


class AccessConfig(BaseModel):
    """The access file: tokens, and quotas per tenant."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tokens: list[TokenEntry] = Field(min_length=1)
    """Accepted tokens; at least one."""
    tenants: dict[str, Quota] = Field(default_factory=dict)
    """Quota of each named tenant."""
    default_quota: Quota = Field(default_factory=Quota)
    """Quota of tenants not listed under `tenants` (unlimited unless set)."""
    command_tenants: list[str] = Field(default_factory=list)
    """Tenants whose users may submit command jobs (`spec.command`: a program of their own). Its ranks
    run on the workers as the service's user and can read what that user can, other tenants' run
    directories included, so list only tenants trusted that far. Admins always may."""

    @model_validator(mode="after")
    def _unique(self) -> AccessConfig:
        for key in ("name", "sha256"):
            seen: dict[str, int] = {}
            for i, entry in enumerate(self.tokens):
                value = getattr(entry, key)
                if value in seen:
                    raise ValueError(f"tokens[{i}].{key} repeats tokens[{seen[value]}].{key}")
                seen[value] = i
        for tenant in self.tenants:
            if not TENANT_PATTERN.match(tenant):
                raise ValueError(f"tenants.{tenant}: tenant names must be DNS-1123 labels")
        for i, tenant in enumerate(self.command_tenants):
            if not TENANT_PATTERN.match(tenant):
                raise ValueError(f"command_tenants[{i}]: {tenant!r} is not a tenant name (a DNS-1123 label)")
        return self


def load_access_config(path: str | Path) -> AccessConfig:
    """Read and validate an access file, naming the file and the field of any problem."""
    try:
        document = strict_yaml.load(Path(path).read_text())
    except OSError as exc:
        raise AuthConfigError(f"cannot read access file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise AuthConfigError(f"access file {path} is not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise AuthConfigError(f"access file {path} must be a mapping with a 'tokens' list")
    try:
        return AccessConfig.model_validate(document)
    except ValidationError as exc:
        problems = "; ".join(map(str, violations_from_pydantic(exc)))
        raise AuthConfigError(f"access file {path}: {problems}") from exc


def _mtime_ns(path: Path) -> int:
    return os.stat(path).st_mtime_ns




@dataclass(frozen=True)
class _Loaded:
    """One version of the access file, swapped in whole so readers never see half of a reload."""

    config: AccessConfig
    entries: tuple[tuple[bytes, TokenEntry], ...]
    mtime_ns: int | None

    @classmethod
    def of(cls, config: AccessConfig, mtime_ns: int | None = None) -> _Loaded:
        return cls(config, tuple((bytes.fromhex(e.sha256), e) for e in config.tokens), mtime_ns)


class Authenticator:
    """Turns call metadata into a Principal. Without an access file, authentication is off.

    Built `from_file`, it re-reads the file when its modification time changes (checked at most every
    `reload_seconds`, on the next call), so tokens are added and revoked without a restart. A changed
    file that does not validate is logged and ignored: the previous version stays in force.
    """

    def __init__(
        self,
        config: AccessConfig | None,
        *,
        path: Path | None = None,
        mtime_ns: int | None = None,
        reload_seconds: float = RELOAD_SECONDS,
    ):
        self._loaded = _Loaded.of(config, mtime_ns) if config else None
        self._path = path
        self._reload_seconds = reload_seconds
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path | None, *, reload_seconds: float = RELOAD_SECONDS) -> Authenticator:
        """Authentication from an access file; with None it is off, and a warning says so."""
        if path is None:
            log.warning(
                "authentication is OFF: no access file configured (--tokens-file). Every caller is an "
                "admin of tenant %r, and the service listens on loopback only.",
                ANONYMOUS.tenant,
            )
            return cls(None)
        try:
            mtime = _mtime_ns(Path(path))  # before reading: a change in between is picked up by the next check
        except OSError as exc:
            raise AuthConfigError(f"cannot read access file {path}: {exc.strerror}") from exc
        config = load_access_config(path)
        log.info("authentication on: %d tokens, %d tenants with quotas", len(config.tokens), len(config.tenants))
        return cls(config, path=Path(path), mtime_ns=mtime, reload_seconds=reload_seconds)

    @property
    def enabled(self) -> bool:
        """Whether calls must carry a valid bearer token."""
        return self._loaded is not None

    def _current(self) -> _Loaded | None:
        """The access file in force, re-read first if it changed on disk."""
        loaded = self._loaded
        if loaded is None or self._path is None or time.monotonic() - self._checked < self._reload_seconds:
            return loaded
        with self._lock:
            if time.monotonic() - self._checked < self._reload_seconds:
                return self._loaded
            self._checked = time.monotonic()
            try:
                mtime = _mtime_ns(self._path)
            except OSError as exc:
                log.error("access file %s unreadable (%s); keeping the loaded version", self._path, exc.strerror)
                return self._loaded
            if mtime == self._loaded.mtime_ns:
                return self._loaded
            try:
                config = load_access_config(self._path)
            except AuthConfigError as exc:
                log.error("%s; keeping the previously loaded version", exc)
                self._loaded = replace(self._loaded, mtime_ns=mtime)  # do not re-parse the bad file each call
                return self._loaded
            self._loaded = _Loaded.of(config, mtime)
            log.info("access file reloaded: %d tokens, %d tenants with quotas", len(config.tokens), len(config.tenants))
            return self._loaded

    def quota(self, tenant: str) -> Quota:
        """The quota of `tenant` (unlimited when authentication is off)."""
        loaded = self._current()
        if loaded is None:
            return Quota()
        return loaded.config.tenants.get(tenant, loaded.config.default_quota)

    def may_run_commands(self, principal: Principal) -> bool:
        """Whether `principal` may submit command jobs: an admin, a tenant under `command_tenants`, or
        anyone when authentication is off (one user on loopback)."""
        loaded = self._current()
        return loaded is None or principal.is_admin or principal.tenant in loaded.config.command_tenants

    def authenticate_token(self, token: str | None) -> Principal:
        """The principal holding `token` (None: the call carried none); AuthenticationError if none does."""
        loaded = self._current()
        if loaded is None:
            return ANONYMOUS
        if token is None:
            raise AuthenticationError("missing credentials: send metadata 'authorization: Bearer <token>'")
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for digest, entry in loaded.entries:  # no early exit: the time spent does not depend on which entry matches
            if hmac.compare_digest(presented, digest):
                found = entry
        if found is None:
            raise AuthenticationError("invalid token")
        return Principal(name=found.name, tenant=found.tenant, role=found.role)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The principal of a call's metadata (`authorization: Bearer <token>`); AuthenticationError if none."""
        if not self.enabled:
            return ANONYMOUS
        values = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if len(values) > 1:
            raise AuthenticationError("more than one 'authorization' metadata entry")
        if not values:
            return self.authenticate_token(None)
        value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
        match = _BEARER.match(value)
        if match is None:
            raise AuthenticationError("malformed 'authorization' metadata: expected 'Bearer <token>'")
        return self.authenticate_token(match.group(1))


def is_loopback(address: str) -> bool:
    """Whether a HOST:PORT listen address is reachable from this machine only."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(address: str, authenticator: Authenticator) -> None:
    """Refuse to listen beyond loopback with authentication off (AuthConfigError naming the fix)."""
    if not authenticator.enabled and not is_loopback(address):
        raise AuthConfigError(
            f"refusing to serve {address} without authentication: only a loopback address "
            "(127.0.0.1, ::1, localhost) may run without --tokens-file"
        )
