"""Store fixtures for the service tests: `store_location` runs a test on both backends, a data directory
(SQLite) and a fresh database on the session's PostgreSQL server (`postgres`, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import PostgresServer

STORE_BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=STORE_BACKENDS)
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a JobStore opens: a data directory, or the URL of a new database on the session's server."""
    if request.param == "sqlite":
        yield str(tmp_path / "data")
        return
    server: PostgresServer = request.getfixturevalue("postgres")
    url = server.create_database()
    yield url
    server.drop_database(url)
