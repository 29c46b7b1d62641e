"""Fixtures for the reliability tests: Ray binds loopback only, and the small job every test trains."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
