"""A command job's program on one rank: started with its report channel, its output and its host-memory
limit, waited for (its launcher stops whatever it left running); and the slot through which
`RankWorker.stop_program` reaches it from another thread. A program stopped that way (its group is being
torn down: cancel, or another rank's failure) returns ``{"stopped": True}`` rather than failing: the
supervisor has already decided the generation's outcome."""

from __future__ import annotations

import os
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
from trainctl.workers.command.program import STDERR_TAIL_IN_REASON, ProgramExited, ProgramProcess
from trainctl.workers.command.report_channel import ReportChannel
from trainctl.workers.host_memory import HostMemoryLimit, says_out_of_memory
from trainctl.workers.resources import RANK_OPENMP_THREADS

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
    host_memory_gib: float | None = None
    """``spec.resources.host_memory_gib`` (None: the node's default, `trainctl.workers.host_memory`)."""


class ProgramSlot:
    """The program a worker runs, shared between `run_program` and `stop_program` (two threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: ProgramProcess | None = None
        self.stopped = False


def program_environment(base: Mapping[str, str], launch_env: Mapping[str, str], report_socket: str) -> dict[str, str]:
    """The program's environment: the worker's (``base``, as torchrun passes its own), one OpenMP thread
    unless the worker's environment or the job sets another number (torchrun's default with several ranks
    per node), the launch's variables, the report socket, and the directory of the `trainctl` package first
    on PYTHONPATH so ``import trainctl`` finds `trainctl.report`."""
    package_root = str(Path(reporting.__file__).resolve().parents[1])
    env = {"OMP_NUM_THREADS": RANK_OPENMP_THREADS, **base, **launch_env, REPORT_SOCKET_ENV: report_socket}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def resolve_argv(argv: list[str]) -> list[str]:
    """``argv`` with `OWN_INTERPRETER` names replaced by this interpreter's path."""
    return [sys.executable, *argv[1:]] if argv and argv[0] in OWN_INTERPRETER else list(argv)


def run_program(
    slot: ProgramSlot, rank: int, launch: ProgramLaunch, reporter: Any, generation: int, memory: HostMemoryLimit
) -> dict[str, Any]:
    """Run ``launch`` as ``rank``'s program, its data limited to ``memory``, until it and whatever it
    started have ended; raise ProgramExited when it failed (not when `ProgramSlot.stopped` stopped it)."""
    output = RankOutput(launch.log_dir, rank, lambda line: reporter.record_log.remote(generation, rank, line))

    def log_line(message: str) -> None:
        reporter.record_log.remote(generation, rank, message)

    try:
        on_report = lambda report: reporter.record_step.remote(generation, rank, report.to_dict())  # noqa: E731
        with ReportChannel(on_report, log_line) as channel:
            with slot.lock:
                if slot.stopped:
                    return {"stopped": True}
                env = program_environment(os.environ, launch.env, channel.path)
                slot.process = ProgramProcess(resolve_argv(launch.argv), launch.cwd, env, output, data_limit=memory.bytes)
            if slot.process.pid is not None:
                log_line(
                    f"program started: {' '.join(launch.argv)[:200]} (pid {slot.process.pid}) in {launch.cwd}, "
                    f"host-memory limit {memory}"
                )
            code = slot.process.wait()
            ended = time.time()
        with slot.lock:
            if slot.stopped:
                return {"exit_code": code, "stopped": True}
        if code != 0:
            tail = output.stderr_tail()
            memory_limit = str(memory) if says_out_of_memory(tail[-STDERR_TAIL_IN_REASON:]) else None
            raise ProgramExited(rank, code, tail, ended, memory_limit)
        return {"exit_code": code}
    finally:
        output.close()
