"""Paths and tool lookup shared by the deploy tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCHEMAS = REPO / "tests" / "fixtures" / "schemas"


def require_tool(name: str, install_hint: str) -> str:
    """The tool's path; a missing tool fails the test (it is part of `make test`'s setup), never skips it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: {install_hint}")
    return path
