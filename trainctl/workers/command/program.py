"""The user's program as a child process of its rank worker, in a session of its own so the whole tree
(the program and whatever it starts) can be killed through its process group.

A rank worker killed outright (``ray.kill``, a crash, its node's OOM killer) cannot call
`ProgramProcess.kill_tree`, so two guards outlive it: the program asks the kernel to SIGKILL it when
the thread that started it dies (``PR_SET_PDEATHSIG``), and a small reaper process (`REAPER`, in a
session of its own, the standard library only) SIGKILLs the program's whole process group once its
parent worker is gone; it exits by itself when the group is gone. stdout and stderr are read line by
line into a `RankOutput`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from trainctl.workers.command.output import RankOutput

PR_SET_PDEATHSIG = 1
STDERR_TAIL_IN_REASON = 10
"""Last stderr lines quoted in the reason of a program that failed."""


REAPER = """
import os, signal, sys, time
worker, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == worker:
    time.sleep(0.5)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""
"""The reaper's program: ``python -c REAPER <worker pid> <program's process group>``."""


class ProgramExited(RuntimeError):
    """A rank's program ended with a non-zero exit code (negative: killed by that signal)."""

    def __init__(self, rank: int, code: int, stderr_tail: list[str], ended_at: float) -> None:
        super().__init__(rank, code, stderr_tail, ended_at)
        self.rank, self.code, self.stderr_tail, self.ended_at = rank, code, stderr_tail, ended_at

    def __str__(self) -> str:
        how = f"was killed by {signal.Signals(-self.code).name}" if self.code < 0 else f"exited with code {self.code}"
        tail = self.stderr_tail[-STDERR_TAIL_IN_REASON:]
        lines = "; last stderr lines:\n" + "\n".join(tail) if tail else "; it wrote nothing to stderr"
        return f"rank {self.rank} {how}{lines}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent thread dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ProgramProcess:
    """A started program; `wait` for its exit code, `kill_tree` to stop it and everything it started."""

    def __init__(self, argv: Sequence[str], cwd: str, env: Mapping[str, str], output: RankOutput) -> None:
        self._output = output
        self._popen = subprocess.Popen(  # noqa: S603 - the job's own program, no shell
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call, no locks
        )
        self.pid = self._popen.pid
        """The program's PID, also its process group and session id."""
        self._reaper = subprocess.Popen(  # noqa: S603 - our own guard, no shell
            [sys.executable, "-c", REAPER, str(os.getpid()), str(self.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._readers = [
            threading.Thread(target=self._read, args=(stream, is_err), name=f"program-{name}", daemon=True)
            for stream, is_err, name in ((self._popen.stdout, False, "stdout"), (self._popen.stderr, True, "stderr"))
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
        """The program's exit code once it has ended and its output is read (negative: killed by a signal)."""
        code = self._popen.wait()
        for reader in self._readers:
            reader.join(timeout=5.0)  # a grandchild holding the pipes open must not block the verdict
        return code

    def kill_tree(self, grace: float) -> None:
        """SIGTERM the program's process group, SIGKILL it after ``grace`` seconds if anything is left."""
        if not _signal_group(self.pid, signal.SIGTERM):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._popen.poll() is not None and not _group_alive(self.pid):
                return
            time.sleep(0.05)
        _signal_group(self.pid, signal.SIGKILL)
        self._popen.wait()


    def release(self) -> None:
        """Stop the reaper (call once the program's group is gone, after `wait` and `kill_tree`)."""
        self._reaper.kill()
        self._reaper.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
