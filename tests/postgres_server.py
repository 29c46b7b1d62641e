"""A real PostgreSQL server for tests: Debian's binaries, a fresh cluster in a temporary directory, on
127.0.0.1 at a free port, stopped by its PID.

PostgreSQL refuses to run as root: a root test process runs initdb and the server as `nobody` (through
`setpriv`), in a directory that user owns; any other user runs them as itself. The server gets SIGINT
(fast shutdown) if the test process dies first (setpriv's parent-death signal), so none outlives it. Missing binaries raise
`PostgresMissing` naming the package, so the tests fail instead of skipping. The cluster trusts local
connections (user `trainctl`, no password) and runs with fsync off (tests stop the server, they never
pull its power) unless made `durable` (the load benchmark, bench/load, compares it with SQLite's
synced commits).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

SUPERUSER = "trainctl"
UNPRIVILEGED_USER = "nobody"
START_TIMEOUT_SECONDS = 60.0


class PostgresMissing(RuntimeError):
    """PostgreSQL's server binaries are not installed."""


def find_bindir() -> Path:
    """The directory holding `postgres` and `initdb` (the newest /usr/lib/postgresql/N/bin, else PATH)."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).parent)
    for bindir in candidates:
        if (bindir / "postgres").exists() and (bindir / "initdb").exists():
            return bindir
    raise PostgresMissing(
        "PostgreSQL's server binaries (postgres, initdb) were not found in /usr/lib/postgresql/*/bin or on PATH; "
        "install Debian's `postgresql` package (apt-get install postgresql) to run the PostgreSQL store tests"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One cluster; `start()` / `stop()` may alternate (the data directory and port are kept)."""

    def __init__(self, *, durable: bool = False) -> None:
        self.durable = durable
        self.bindir = find_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="trainctl-pg-"))
        self.data_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self.port = free_port()
        self._as_user = ["setpriv", "--pdeathsig=SIGINT"]
        if os.geteuid() == 0:
            user = pwd.getpwnam(UNPRIVILEGED_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as_user += [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        self.process: subprocess.Popen[bytes] | None = None
        initdb = subprocess.run(
            [*self._as_user, str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER,
             "--auth=trust", "--no-locale", "-E", "UTF8", "--no-sync"],
            capture_output=True, text=True, cwd=self.root,
        )
        if initdb.returncode != 0:
            shutil.rmtree(self.root, ignore_errors=True)
            raise RuntimeError(f"initdb failed ({initdb.returncode}):\n{initdb.stdout}{initdb.stderr}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        log = open(self.log_file, "ab")  # noqa: SIM115 -- the server writes to it until stopped
        self.process = subprocess.Popen(
            [*self._as_user, str(self.bindir / "postgres"), "-D", str(self.data_dir), "-k", str(self.root),
             "-h", "127.0.0.1", "-p", str(self.port), "-c", f"fsync={'on' if self.durable else 'off'}",
             "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PostgreSQL did not start; its log:\n{self.log_tail()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster's PID: sessions are ended, no data lost)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
