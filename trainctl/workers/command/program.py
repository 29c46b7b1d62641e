"""The user's program as a grandchild of its rank worker, below a launcher (`launcher`, a child
subreaper) that stops every process the program started, including those that left its process group
or session, when the program ends, when it is stopped, and when the rank worker dies outright (``ray.kill``,
a crash, its node's OOM killer: the launcher's ``PR_SET_PDEATHSIG``). The program runs in a session of
its own with ``RLIMIT_DATA`` at the rank's host-memory limit (`trainctl.workers.host_memory`). stdout
and stderr are read line by line into a `RankOutput`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from trainctl.workers.command import launcher
from trainctl.workers.command.output import RankOutput

PROGRAM_STOP_GRACE = 5.0
"""Seconds a stopped program's processes (or those an ended program left) have between SIGTERM and SIGKILL."""
STDERR_TAIL_IN_REASON = 10
"""Last stderr lines quoted in the reason of a program that failed."""
LAUNCHER_KILL_SECONDS = launcher.KILL_SECONDS + 5.0
"""How long `ProgramProcess.kill_tree` waits for the launcher once it asked it to SIGKILL the tree."""


class ProgramExited(RuntimeError):
    """A rank's program ended with a non-zero exit code (negative: killed by that signal);
    ``memory_limit`` (the rank's host-memory limit, as text) is set when its stderr says an allocation
    failed."""

    def __init__(
        self, rank: int, code: int, stderr_tail: list[str], ended_at: float, memory_limit: str | None = None
    ) -> None:
        super().__init__(rank, code, stderr_tail, ended_at, memory_limit)
        self.rank, self.code, self.stderr_tail, self.ended_at = rank, code, stderr_tail, ended_at
        self.memory_limit = memory_limit

    def __str__(self) -> str:
        how = f"was killed by {signal.Signals(-self.code).name}" if self.code < 0 else f"exited with code {self.code}"
        tail = self.stderr_tail[-STDERR_TAIL_IN_REASON:]
        lines = "; last stderr lines:\n" + "\n".join(tail) if tail else "; it wrote nothing to stderr"
        if self.memory_limit is not None:
            return f"rank {self.rank} exceeded its host-memory limit of {self.memory_limit}: its program {how}{lines}"
        return f"rank {self.rank} {how}{lines}"


class ProgramProcess:
    """A started program; `wait` for its exit code, `kill_tree` to stop it and everything it started.
    ``data_limit``: the program's ``RLIMIT_DATA`` in bytes (None: none); ``grace``: seconds its leftovers
    have between SIGTERM and SIGKILL once it has exited."""

    def __init__(
        self,
        argv: Sequence[str],
        cwd: str,
        env: Mapping[str, str],
        output: RankOutput,
        *,
        data_limit: int | None = None,
        grace: float = PROGRAM_STOP_GRACE,
    ) -> None:
        self._output = output
        pid_read, pid_write = os.pipe()
        try:
            self._launcher = subprocess.Popen(  # noqa: S603 - our launcher, then the job's own program, no shell
                [
                    sys.executable, "-I", str(Path(launcher.__file__).resolve()),
                    str(os.getpid()), str(grace), str(pid_write), str(data_limit or 0), *argv,
                ],
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(pid_write,),
            )
        finally:
            os.close(pid_write)
        with os.fdopen(pid_read, "rb") as pids:
            line = pids.readline().strip()
        self.pid: int | None = int(line) if line else None
        """The program's PID, also its process group and session id (None: it could not be started, and
        its stderr says why)."""
        self._readers = [
            threading.Thread(target=self._read, args=(stream, is_err), name=f"program-{name}", daemon=True)
            for stream, is_err, name in (
                (self._launcher.stdout, False, "stdout"), (self._launcher.stderr, True, "stderr")
            )
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[bytes] | None, stderr: bool) -> None:
        if stream is None:
            return
        with stream:
            for raw in stream:
                # A progress bar redraws its line after each carriage return: keep what a terminal shows.
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
                self._output.line(text, stderr=stderr)

    def wait(self) -> int:
        """The program's exit code (negative: killed by a signal) once it and every process it started
        have ended and its output is read."""
        code = self._launcher.wait()
        for reader in self._readers:
            reader.join(timeout=5.0)
        return code

    def kill_tree(self, grace: float) -> None:
        """SIGTERM the program and every process it started, SIGKILL after ``grace`` seconds whatever is
        left; returns once they are gone."""
        if self._launcher.poll() is not None:
            return
        self._launcher.send_signal(signal.SIGTERM)
        try:
            self._launcher.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            self._launcher.send_signal(signal.SIGUSR1)  # SIGKILL the tree now
        try:
            self._launcher.wait(timeout=LAUNCHER_KILL_SECONDS)
        except subprocess.TimeoutExpired:  # never seen: the program still dies with it (PR_SET_PDEATHSIG)
            self._launcher.kill()
            self._launcher.wait()
