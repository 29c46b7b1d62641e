"""A real `trainctl serve` process joined to an embedded Ray cluster, that tests can SIGKILL and restart.

    with ServeProcess(cluster.address, topology_file, data_dir) as serve:
        serve.start()          # waits for "serving on HOST:PORT"; same port on every start
        serve.kill()           # SIGKILL of its process group (the service and nothing else)
        serve.start()          # the same data dir: the restarted service recovers from its store
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
START_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`trainctl serve --ray-address ADDRESS --topology FILE --data-dir DIR` on a fixed loopback port
    (no --ray-address / --topology where None: the service starts its own embedded Ray)."""

    def __init__(self, ray_address: str | None, topology: Path | None, data_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self._args = [
            str(BIN / "trainctl"), "serve", f"--address={self.target}", f"--data-dir={data_dir}",
            "--metrics-port=0",
            *([f"--ray-address={ray_address}"] if ray_address is not None else []),
            *([f"--topology={topology}"] if topology is not None else []),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"serve-{self.starts}.log"

    def start(self) -> None:
        """Start the service and wait until it serves."""
        self.starts += 1
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self._args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not re.search(r"serving on 127\.0\.0\.1:\d+", self.log_path.read_text()):
            assert self.proc.poll() is None, f"trainctl serve exited:\n{self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"trainctl serve not up after {START_TIMEOUT:g} s"
            time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL the service (its whole process group), as a crash or an evicted pod would."""
        assert self.proc is not None and self.proc.poll() is None, "the service is not running"
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM (graceful stop), SIGKILL after 30 s; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
