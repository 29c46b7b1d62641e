"""Process trees the containment tests start: a program that double-forks a ``setsid`` daemon (which
leaves the program's process group and session), and how a test tells a process is gone by PID."""

from __future__ import annotations

import os
import time
from pathlib import Path

DAEMON = """
import os, signal, sys, time
pid_file = sys.argv[1]
stay = len(sys.argv) > 2
if stay:  # before the daemon exists: a test that waits for its PID file may stop the program at once
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:  # the classic daemon: fork, setsid, fork again, the middle process exits
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pid_file + ".tmp", "w") as out:
            out.write(f"{os.getpid()} {os.getsid(0)}")
        os.replace(pid_file + ".tmp", pid_file)
        time.sleep(600)
    os._exit(0)
while not os.path.exists(pid_file):
    time.sleep(0.05)
print("daemon started", flush=True)
if stay:  # and ignore the SIGTERM a stop sends
    time.sleep(600)
"""
"""``python -c DAEMON PID_FILE [stay]``: start a daemon that ignores SIGTERM (its PID and session id to
PID_FILE), print ``daemon started`` and exit; with ``stay``, ignore SIGTERM and sleep instead of exiting."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended; only its parent's wait is missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gone(pids: list[int], within: float = 10.0) -> bool:
    """Whether every one of ``pids`` has ended within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def daemon_of(pid_file: Path, within: float = 60.0) -> tuple[int, int]:
    """(PID, session id) the DAEMON program's daemon wrote to ``pid_file``, once it has."""
    deadline = time.monotonic() + within
    while not pid_file.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"no daemon wrote {pid_file} within {within:g} s")
        time.sleep(0.05)
    pid, session = (int(x) for x in pid_file.read_text().split())
    return pid, session


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
