"""Confinement of file paths to configured roots.

A job spec names files the service's workers will read (`spec.data.paths`, `spec.data.tokenizer`).
Without confinement a tenant could train on, and so learn about, any file the service account can
read. `DataPathPolicy` accepts a path only when it is absolute, has no `..` component, its fixed
(non-glob) part lies under a data root, and every file it matches still lies under a data root once
symlinks are resolved (`os.path.realpath`). Globs are expanded only after their fixed part is known to
lie under a root. (Paths the service writes, `<data-dir>/runs/<job id>` with its checkpoints, take no
user input but the job name, a DNS-1123 label.)

Residual risk, documented in docs/security.md: validation happens at CreateJob; a tenant who can write
inside a data root could swap a validated file for a symlink later, so data roots must not be
writable by tenants (or must be mounted read-only into the workers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from trainctl.spec.job import DataSpec
from trainctl.spec.validate import STDLIB_CORPUS, FieldViolation, resolve_data_paths

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


class DataPathPolicy:
    """Which files jobs may read: everything under `roots` (after resolving symlinks), and `@stdlib`."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]]):
        if not roots:
            raise ValueError("DataPathPolicy needs at least one data root")
        resolved = []
        for root in roots:
            if not os.path.isabs(root):
                raise ValueError(f"data root {root!s} must be an absolute path")
            if not os.path.isdir(root):
                raise ValueError(f"data root {root!s} is not a directory")
            resolved.append(os.path.realpath(root))
        self.roots: tuple[str, ...] = tuple(resolved)

    def _outside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return not any(_within(real, root) for root in self.roots)

    def _path_problem(self, value: str, *, glob: bool) -> str | None:
        roots = ", ".join(self.roots)
        if not value:
            return "is empty"
        if "\x00" in value:
            return "contains a NUL character"
        if not os.path.isabs(value):
            return f"{value!r} must be an absolute path under a data root ({roots})"
        if ".." in Path(value).parts:
            return f"{value!r} must not contain '..' components"
        fixed = _static_prefix(value) if glob else value
        if self._outside(fixed):
            return f"{value!r} is outside the data roots ({roots})"
        if not glob:
            return None if not self._outside(value) else f"{value!r} resolves outside the data roots ({roots}) through a symlink"
        matches = resolve_data_paths([value])
        if not matches:
            return f"{value!r} matches no files"
        for match in matches:
            if self._outside(str(match)):
                return f"{value!r} matches {str(match)!r}, which resolves outside the data roots ({roots}) through a symlink"
        unreadable = [m for m in matches if not os.access(m, os.R_OK)]
        if unreadable:
            return f"{len(unreadable)} matched files are unreadable, e.g. {unreadable[0]}"
        return None

    def violations(self, data: DataSpec) -> list[FieldViolation]:
        """One FieldViolation per data path or tokenizer path that escapes the roots, or (data paths)
        matches nothing readable. It replaces the spec's own data check (`check_data=False`), which
        would expand a hostile glob such as `/**` over the whole filesystem before confinement."""
        out = []
        for i, pattern in enumerate(data.paths):
            if pattern == STDLIB_CORPUS:
                continue
            problem = self._path_problem(pattern, glob=True)
            if problem:
                out.append(FieldViolation(f"spec.data.paths[{i}]", problem))
        if data.tokenizer != "byte":
            problem = self._path_problem(data.tokenizer, glob=False)
            if problem:
                out.append(FieldViolation("spec.data.tokenizer", problem))
        return out

