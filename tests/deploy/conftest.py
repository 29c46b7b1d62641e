"""Fixtures for the deploy tests."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
from deploy_support import require_tool  # noqa: E402


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "`make promtool` installs Debian's prometheus package")
