"""Fixtures of the service tests: `store_location` runs a test on both backends, a data directory (SQLite)
and a fresh database on the session's PostgreSQL server (`postgres`, tests/conftest.py); `api` is an API
server over a scripted runtime (`runtime`), which CLI commands find through TRAINCTL_SERVER, and
`api_client` a client of it (`client`, tests/conftest.py, is the Ray-backed service's).

The tests sit in sub-folders by the service's rooms (api/, store/, scheduling/, security/), plus hostile/
(hostile input), cli/ and e2e/ (whole jobs through a service on Ray); the hall's own tests stay here. The
helper modules beside this file (control_plane_fakes, secure_service) import by name from every sub-folder:
pytest's default `prepend` import mode puts this conftest's directory on sys.path, as it puts each test
file's own directory (a sub-folder's own helpers). No folder has an `__init__.py`, so a test file's name
must be unique under tests/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from control_plane_fakes import ApiServer, ScriptedRuntime, start_api_server
from postgres_server import PostgresServer

from trainctl.cli.client import TrainctlClient

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


@pytest.fixture
def runtime() -> ScriptedRuntime:
    return ScriptedRuntime()


@pytest.fixture
def api(tmp_path: Path, runtime: ScriptedRuntime, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    server = start_api_server(tmp_path / "data", runtime)
    monkeypatch.setenv("TRAINCTL_SERVER", server.target)  # commands find the server from the environment
    yield server
    server.stop()


@pytest.fixture
def api_client(api: ApiServer) -> Iterator[TrainctlClient]:
    with TrainctlClient(api.target, token="") as c:
        yield c
