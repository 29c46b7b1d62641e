"""Fixtures for the deploy tests."""

from __future__ import annotations

import pytest
from deploy_support import require_tool


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "`make promtool` installs Debian's prometheus package")
