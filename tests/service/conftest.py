"""Store fixtures for the service tests: one real PostgreSQL server per test session (started on first
use), `store_location`, which runs a test on both backends: a data directory (SQLite) and a fresh
PostgreSQL database, and `private_postgres`, a server of the test's own for tests that stop it
(postgres_server.py says how the servers run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import PostgresMissing, PostgresServer

STORE_BACKENDS = ("sqlite", "postgresql")


def running_postgres() -> Iterator[PostgresServer]:
    """A started server, removed afterwards; missing binaries fail the test (CI installs them)."""
    try:
        server = PostgresServer()
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server on 127.0.0.1 (tests must not stop it)."""
    yield from running_postgres()


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this test alone, which it may stop and start."""
    yield from running_postgres()


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
