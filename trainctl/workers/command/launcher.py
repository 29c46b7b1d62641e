"""The launcher between a rank worker and its program: a child subreaper that stops every process the
program started, including those that left its process group or session, when the program ends, when
it is stopped, or when the rank worker dies.

Run as a script, standard library only (``python -I launcher.py WORKER_PID GRACE PID_FD DATA_LIMIT
PROGRAM [ARGS...]``; `trainctl.workers.command.program` starts it). It marks itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so a process of the program's tree whose parent exits (a double-forked
``setsid`` daemon) is re-parented to it rather than to init: the program's whole tree stays below it,
and it finds that tree in /proc by parent PID. It starts the program in a session of its own with
``RLIMIT_DATA`` at DATA_LIMIT bytes (0: none; the rank's host-memory limit, `trainctl.workers.host_memory`)
and ``PR_SET_PDEATHSIG`` (SIGKILL when the launcher dies), writes the program's PID to PID_FD, then:

- the program exits: whatever it left running gets SIGTERM, and SIGKILL after GRACE seconds;
- SIGTERM (the worker stops the program): every process of the tree gets SIGTERM; once GRACE seconds
  pass or SIGUSR1 comes (the worker's own grace ran out), SIGKILL;
- the rank worker is gone (the launcher's ``PR_SET_PDEATHSIG`` is SIGTERM, and its parent PID changes):
  SIGKILL at once.

Signals go through pidfds, checked to belong to the tree after opening, so a PID reused meanwhile is
never signalled. The launcher exits the way the program did (its exit code, or killed by its signal),
once no process of the tree is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_SECONDS = 0.05
KILL_SECONDS = 10.0
"""How long SIGKILL rounds go on for processes that do not die at once (uninterruptible sleep)."""
NOT_FOUND, NOT_EXECUTABLE = 127, 126
"""Exit codes when the program cannot be started (the shell's)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def tree(root: int) -> dict[int, str]:
    """PID -> state letter of every process below ``root`` (its children, theirs, ...), from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        found = _stat(int(entry.name))
        if found is not None:
            children.setdefault(found[0], []).append((int(entry.name), found[1]))
    below: dict[int, str] = {}
    queue = [root]
    while queue:
        for pid, state in children.get(queue.pop(), []):
            if pid not in below:
                below[pid] = state
                queue.append(pid)
    return below


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent PID, state letter) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[1]), fields[0].decode()


def live(processes: dict[int, str]) -> list[int]:
    """The processes that are not zombies (a zombie has ended; only its parent's wait is missing)."""
    return [pid for pid, state in processes.items() if state not in ("Z", "X")]


def signal_tree(root: int, sig: int) -> int:
    """Send ``sig`` to every live process below ``root``; how many there were."""
    below = tree(root)
    targets = live(below)
    members = {root, *below}
    for pid in targets:
        _send(pid, sig, members)
    return len(targets)


def _send(pid: int, sig: int, members: set[int]) -> None:
    """Signal ``pid`` through a pidfd, once its parent is still one of ``members`` (the PID not reused). A
    process that is gone, or not this user's to signal (a setuid program), is left alone."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:  # a kernel before 5.3: plain kill
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        return
    try:
        found = _stat(pid)
        if found is not None and found[0] in members:
            signal.pidfd_send_signal(fd, sig)
    except OSError:  # gone meanwhile, or not ours to signal
        pass
    finally:
        os.close(fd)


def reap(program: int) -> int | None:
    """Collect every ended child of the launcher; the program's wait status if it was among them."""
    status = None
    while True:
        try:
            pid, found = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == program:
            status = found


def kill_everything(root: int, program: int) -> int | None:
    """SIGKILL the whole tree below ``root`` until none of it is left (or `KILL_SECONDS` pass), reaping
    the launcher's own children; the program's wait status if it was reaped meanwhile."""
    status = None
    deadline = time.monotonic() + KILL_SECONDS
    while True:
        left = signal_tree(root, signal.SIGKILL)
        status = _first(status, reap(program))
        if not left or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def _first(status: int | None, other: int | None) -> int | None:
    return status if status is not None else other


def exit_like(status: int | None) -> None:
    """End this process as the program ended: its exit code, or killed by its signal (no core file)."""
    if status is None:
        sys.exit(1)
    if os.WIFEXITED(status):
        sys.exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sig != signal.SIGKILL:  # the launcher handles the stop signals; SIGKILL has no handler to reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)


def program_setup(libc: ctypes.CDLL, data_limit: int) -> Callable[[], None]:
    """What the program's process does before exec: SIGKILL when the launcher dies, the data limit."""

    def setup() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if data_limit > 0:
            resource.setrlimit(resource.RLIMIT_DATA, (data_limit, data_limit))

    return setup


def supervise(worker: int, grace: float, program: int, requests: list[int]) -> int | None:
    """Wait for the program and stop its tree as the module says; the program's wait status."""
    me = os.getpid()
    status = None
    kill_at: float | None = None
    while True:
        status = _first(status, reap(program))
        if os.getppid() != worker or signal.SIGUSR1 in requests:
            return _first(status, kill_everything(me, program))
        if kill_at is None and (requests or status is not None):
            signal_tree(me, signal.SIGTERM)
            kill_at = time.monotonic() + grace
        if kill_at is not None and (not live(tree(me)) or time.monotonic() >= kill_at):
            return _first(status, kill_everything(me, program))
        time.sleep(POLL_SECONDS)


def main(argv: list[str]) -> None:
    worker, grace, pid_fd, data_limit = int(argv[1]), float(argv[2]), int(argv[3]), int(argv[4])
    command = argv[5:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    requests: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: requests.append(signum))
    try:
        program = subprocess.Popen(  # noqa: S603 - the job's own program, no shell
            command, start_new_session=True, preexec_fn=program_setup(libc, data_limit)  # noqa: PLW1509
        )
    except OSError as exc:
        os.close(pid_fd)
        print(f"trainctl: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        sys.exit(NOT_FOUND if isinstance(exc, FileNotFoundError) else NOT_EXECUTABLE)
    os.write(pid_fd, f"{program.pid}\n".encode())
    os.close(pid_fd)
    try:
        status = supervise(worker, grace, program.pid, requests)
    except BaseException:  # never leave the tree behind, whatever went wrong here
        kill_everything(os.getpid(), program.pid)
        raise
    exit_like(status)


if __name__ == "__main__":
    main(sys.argv)
