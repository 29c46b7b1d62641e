"""A real MLflow tracking server for tests: `mlflow server` on loopback with a SQLite backend and local
artifacts (no job runner), started and stopped (by its PID's process group) by the test; `restart`
reuses the port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
START_TIMEOUT = 240.0
"""`mlflow server` (gunicorn/uvicorn, its database migrated) took 123 s to answer on the 2-core machine
under other test runs (load 15)."""
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""MLflow's job runner (huey consumer processes, each importing mlflow: a start took 34 CPU-s with it and
21 without, 10 processes against 2) runs MLflow's own server-side jobs, which trainctl never asks for."""


class MlflowServer:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> MlflowServer:
        self.starts += 1
        log = (self.root / f"mlflow-{self.starts}.log").open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root, env=SERVER_ENV,
        )
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()  # a server that did not come up leaves nothing running either
            raise
        return self

    def _wait_until_up(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, (self.root / f"mlflow-{self.starts}.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mlflow server not up after {START_TIMEOUT:g} s"
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM its process group (the server, its uvicorn worker, its job runner and that runner's huey
        consumers), then SIGKILL whatever of the group is left once the server has exited or 20 s have
        passed: the consumers outlive a server that exits first (seen: two groups left running)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
