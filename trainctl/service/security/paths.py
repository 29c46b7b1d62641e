"""The one confinement rule for every path a job names.

A job spec names files the service's workers read: `spec.data.paths` (globs of text files, or token-shard
directories), `spec.data.tokenizer`, `spec.init_from`, `spec.model.from_pretrained` and `spec.command.working_dir`
(trainctl.spec.path_fields lists them). `JobPathPolicy` applies one rule to all of them:

- With data roots (`--data-root`), a path must be absolute, have no `..` component, its fixed (non-glob)
  part must lie under a root, and every file a glob matches must still lie under a root once symlinks are
  resolved (`os.path.realpath`). Globs are expanded only after their fixed part is known to lie under a
  root. Without roots (single-user set-ups, or `--allow-any-data-path`) this part is skipped, but a
  relative path is still refused: a spec sent to the service has no directory to resolve it against
  (the CLI resolves a spec file's relative paths against the file's directory before sending it).
- Whatever the roots, a path must not lie inside the run directory (`<data-dir>/runs/<job id>`, which
  holds the job's checkpoints) of a job the caller may not read: another tenant's, or one that does not
  exist (the message is the same, so ids cannot be probed). A glob whose pattern could reach into run
  directories that are not the caller's is refused without being expanded.
- `init_from: job:<id>` names the checkpoints of an earlier job by id: accepted only for a job the caller
  may read (otherwise refused exactly as an unknown id), and `resolve` replaces it by that job's run
  directory before the job is stored.

Whether the files exist, are readable and hold enough data is checked afterwards (spec.data_checks), only
for paths this rule let through.

Residual risk, documented in docs/security.md: validation happens at CreateJob; a tenant who can write
inside a data root could swap a validated file for a symlink later, so data roots must not be
writable by tenants (or must be mounted read-only into the workers).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.security.tenancy import Principal
from trainctl.spec.data_checks import resolve_data_paths
from trainctl.spec.files import FileRule
from trainctl.spec.job import JobSpecBody
from trainctl.spec.path_fields import JOB_REFERENCE_PREFIX, is_relative, path_fields
from trainctl.spec.violations import FieldViolation

log = logging.getLogger(__name__)

_GLOB_MAGIC = re.compile(r"[*?\[]")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _static_prefix(pattern: str) -> str:
    """The leading components of a glob pattern that contain no glob characters."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts:
        if _GLOB_MAGIC.search(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or os.sep


class ConfinementConfigError(ValueError):
    """The service's confinement settings are unsafe for how it is exposed (the message names the fix)."""


def check_confinement(authenticated: bool, roots: Sequence[object], allow_any_path: bool) -> None:
    """A server with tenants (authentication on) confines job paths to data roots: refuse to start
    without one, unless `allow_any_path` (`--allow-any-data-path`) says otherwise, which logs a WARNING."""
    if not authenticated or roots:
        return
    if not allow_any_path:
        raise ConfinementConfigError(
            "refusing to serve with authentication on and no --data-root: every tenant's jobs could read any "
            "file the service can; pass --data-root DIR (repeatable), or --allow-any-data-path to accept that"
        )
    log.warning(
        "--allow-any-data-path: authentication is on but job paths are not confined to data roots; every "
        "tenant's jobs may read any file the service can read (other tenants' run directories excepted)"
    )


def job_reference(init_from: str | None) -> str | None:
    """The job id of an `init_from: job:<id>` reference, or None when `init_from` is not one."""
    if init_from is None or not init_from.startswith(JOB_REFERENCE_PREFIX):
        return None
    return init_from.removeprefix(JOB_REFERENCE_PREFIX).strip()


@dataclass(frozen=True)
class _Caller:
    """Who names the paths: their principal, and the tenant of a job id (None: no such job)."""

    principal: Principal
    tenant_of: Callable[[str], str | None]

    def may_read(self, job_id: str) -> bool:
        """Whether the caller may read job `job_id` (False for an unknown or empty id)."""
        tenant = self.tenant_of(job_id) if job_id else None
        return tenant is not None and self.principal.can_access(tenant)


class JobPathPolicy:
    """Which paths jobs may name: under `roots` (none: anywhere) and never inside a run directory under
    `runs_dir` of a job the caller may not read. `@stdlib` is always allowed."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]], runs_dir: str | os.PathLike[str]):
        resolved = []
        for root in roots:
            if not os.path.isabs(root):
                raise ValueError(f"data root {root!s} must be an absolute path")
            if not os.path.isdir(root):
                raise ValueError(f"data root {root!s} is not a directory")
            resolved.append(os.path.realpath(root))
        self.roots: tuple[str, ...] = tuple(resolved)
        self.runs_dir = os.path.realpath(runs_dir)

    def run_dir(self, job_id: str) -> RunDirectory:
        """The run directory of job `job_id`."""
        return RunDirectory.of_job(self.runs_dir, job_id)

    # ---- the rule ------------------------------------------------------------------------------------

    def _outside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return bool(self.roots) and not any(_within(real, root) for root in self.roots)

    def _foreign_run(self, path: str, may_read_job: Callable[[str], bool]) -> bool:
        """Whether `path` (symlinks resolved) lies in the run directory of a job the caller may not read."""
        real = os.path.realpath(path)
        if not _within(real, self.runs_dir) or real == self.runs_dir:
            return False
        return not may_read_job(Path(os.path.relpath(real, self.runs_dir)).parts[0])

    def _spans_runs(self, fixed: str) -> bool:
        """Whether a glob with fixed part `fixed` could match inside run directories of several jobs."""
        return _within(self.runs_dir, os.path.realpath(fixed))

    def _path_problem(self, value: str, caller: _Caller, *, glob: bool) -> str | None:
        roots = ", ".join(self.roots)
        foreign = (
            f"lies in the service's run directory ({self.runs_dir}) of a job that is not yours; "
            f"name your own jobs' checkpoints as {JOB_REFERENCE_PREFIX}<id>"
        )
        if not value:
            return "is empty"
        if "\x00" in value:
            return "contains a NUL character"
        if self.roots:
            if not os.path.isabs(value):
                return f"{value!r} must be an absolute path under a data root ({roots})"
            if ".." in Path(value).parts:
                return f"{value!r} must not contain '..' components"
        elif is_relative(value):
            return (f"{value!r} is a relative path, and a spec sent to the service has no directory to resolve it "
                    "against: name it absolutely (trainctl validate, plan and submit resolve a spec file's relative "
                    "paths against the file's directory)")
        path = os.path.expanduser(value)
        glob = glob and bool(_GLOB_MAGIC.search(path))
        fixed = _static_prefix(path) if glob else path
        if self._outside(fixed):
            return f"{value!r} is outside the data roots ({roots})"
        if self._foreign_run(fixed, caller.may_read):
            return f"{value!r} {foreign}"
        if glob and self._spans_runs(fixed) and not caller.principal.is_admin:
            return f"{value!r} is a glob over the service's run directory ({self.runs_dir}), which holds other jobs' checkpoints"
        if not glob:
            if self._outside(path):
                return f"{value!r} resolves outside the data roots ({roots}) through a symlink"
            return None
        for match in resolve_data_paths([path]):
            if self._outside(str(match)):
                return f"{value!r} matches {str(match)!r}, which resolves outside the data roots ({roots}) through a symlink"
            if self._foreign_run(str(match), caller.may_read):
                return f"{value!r} matches a file that {foreign}"
        return None

    def violations(
        self, spec: JobSpecBody, principal: Principal, tenant_of: Callable[[str], str | None]
    ) -> list[FieldViolation]:
        """One FieldViolation per path field of `spec` that breaks the rule for `principal`;
        `tenant_of(id)` is the tenant of job `id` (None: no such job). It runs before the spec's own data
        check, which would expand a hostile glob such as `/**` over the whole filesystem unconfined."""
        caller = _Caller(principal, tenant_of)
        out = []
        reference = job_reference(spec.init_from)
        if reference is not None and not caller.may_read(reference):
            out.append(FieldViolation("spec.init_from", f"no job {reference!r} of yours"))
        for path in path_fields(spec):
            problem = self._path_problem(path.value, caller, glob=path.glob)
            if problem:
                out.append(FieldViolation(path.field, problem))
        return out

    def file_rule(self, spec: JobSpecBody, job_id: str | None, may_read_job: Callable[[str], bool]) -> FileRule:
        """The rule every file opened for job `job_id` (None: not yet created) obeys
        (trainctl.spec.files): this policy's roots, and the run directories the job may read: its own,
        and those its (resolved) path fields lie in when `may_read_job(id)` says they are its tenant's."""
        readable = {job_id} if job_id else set()
        for path in path_fields(spec):
            if not path.value:
                continue
            real = os.path.realpath(_static_prefix(os.path.expanduser(path.value)))
            if _within(real, self.runs_dir) and real != self.runs_dir:
                job = Path(os.path.relpath(real, self.runs_dir)).parts[0]
                if may_read_job(job):
                    readable.add(job)
        return FileRule(self.roots, self.runs_dir, frozenset(readable))

    def resolve(self, spec: JobSpecBody) -> JobSpecBody:
        """`spec` with an `init_from: job:<id>` reference replaced by that job's run directory (call once
        `violations` found none: the reference is the caller's)."""
        reference = job_reference(spec.init_from)
        if reference is None:
            return spec
        return spec.model_copy(update={"init_from": str(self.run_dir(reference).root)})
