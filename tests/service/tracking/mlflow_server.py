"""A real MLflow tracking server for tests: `mlflow server` on loopback with a SQLite backend and local
artifacts, started and stopped (by its PID's process group) by the test; `restart` reuses the port."""

from __future__ import annotations

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
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, (self.root / f"mlflow-{self.starts}.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mlflow server not up after {START_TIMEOUT:g} s"
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM its process group (the server and its workers), SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
