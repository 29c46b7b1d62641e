"""A command job's program on one rank: started with its report channel and output, waited for, its
leftovers killed; and the slot through which `RankWorker.stop_program` reaches it from another thread."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl import reporting
from trainctl.reporting import REPORT_SOCKET_ENV
from trainctl.workers.command.output import RankOutput
from trainctl.workers.command.program import ProgramExited, ProgramProcess
from trainctl.workers.command.report_channel import ReportChannel

PROGRAM_STOP_GRACE = 5.0
"""Seconds a stopped program's process group has between SIGTERM and SIGKILL."""
OWN_INTERPRETER = ("python", "python3")
"""Program names that mean the rank worker's own Python interpreter."""

@dataclass(frozen=True)
class ProgramLaunch:
    """What a rank of a command job runs: the command line, its directory, the variables the job sets
    (`program_environment` adds them to the worker's), and where its output is kept."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    log_dir: str


class ProgramSlot:
    """The program a worker runs, shared between `run_program` and `stop_program` (two threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: ProgramProcess | None = None
        self.stopped = False


def program_environment(base: Mapping[str, str], launch_env: Mapping[str, str], report_socket: str) -> dict[str, str]:
    """The program's environment: the worker's (``base``, as torchrun passes its own), one OpenMP thread
    unless the job sets another number (torchrun's default with several ranks per node), the launch's
    variables, the report socket, and the directory of the `trainctl` package first on PYTHONPATH so
    ``import trainctl`` finds `trainctl.report`."""
    package_root = str(Path(reporting.__file__).resolve().parents[1])
    env = {**base, "OMP_NUM_THREADS": "1", **launch_env, REPORT_SOCKET_ENV: report_socket}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def resolve_argv(argv: list[str]) -> list[str]:
    """``argv`` with `OWN_INTERPRETER` names replaced by this interpreter's path."""
    return [sys.executable, *argv[1:]] if argv and argv[0] in OWN_INTERPRETER else list(argv)


def run_program(
    slot: ProgramSlot, rank: int, launch: ProgramLaunch, reporter: Any, generation: int
) -> dict[str, Any]:
    """Run ``launch`` as ``rank``'s program until it exits; raise ProgramExited when it fails."""
    output = RankOutput(launch.log_dir, rank, lambda line: reporter.record_log.remote(generation, rank, line))

    def log_line(message: str) -> None:
        reporter.record_log.remote(generation, rank, message)

    try:
        on_report = lambda report: reporter.record_step.remote(generation, rank, report.to_dict())  # noqa: E731
        with ReportChannel(on_report, log_line) as channel:
            with slot.lock:
                if slot.stopped:
                    raise ProgramExited(rank, -int(signal.SIGTERM), ["stopped before it started"], time.time())
                env = program_environment(os.environ, launch.env, channel.path)
                slot.process = ProgramProcess(resolve_argv(launch.argv), launch.cwd, env, output)
            log_line(f"program started: {' '.join(launch.argv)[:200]} (pid {slot.process.pid}) in {launch.cwd}")
            code = slot.process.wait()
            ended = time.time()
            slot.process.kill_tree(PROGRAM_STOP_GRACE)  # whatever it left running in its group
            slot.process.release()
        if code != 0:
            raise ProgramExited(rank, code, output.stderr_tail(), ended)
        return {"exit_code": code}
    finally:
        output.close()
