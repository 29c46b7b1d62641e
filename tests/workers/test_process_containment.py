"""Nothing a command job starts outlives it (trainctl.workers.command.launcher): a double-forked ``setsid``
daemon, which leaves the program's process group and session, is gone by PID once the program exits,
once it is stopped, and once its rank worker is killed outright; a program that ignores SIGTERM is
SIGKILLed after the grace; a program that cannot be started says why. On the embedded Ray: the daemon of
a job that SUCCEEDED is gone (after a cancel through the service: tests/service/e2e/test_command_jobs_e2e.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_trees import DAEMON, alive, daemon_of, gone
from test_command_jobs import command_job
from test_runtime import assert_nothing_left, finished, follow, plan

import trainctl
from trainctl.workers.command.output import RankOutput
from trainctl.workers.command.program import ProgramProcess
from trainctl.workers.events import JobState
from trainctl.workers.runtime import RayRuntime


def _program(tmp_path: Path, *args: str, grace: float = 0.5, data_limit: int | None = None) -> tuple[ProgramProcess, list[str]]:
    lines: list[str] = []
    program = ProgramProcess([sys.executable, "-c", *args], str(tmp_path), dict(os.environ),
                             RankOutput(tmp_path, 0, lines.append), grace=grace, data_limit=data_limit)
    return program, lines


def test_a_setsid_daemon_is_gone_once_the_program_exits(tmp_path: Path) -> None:
    program, lines = _program(tmp_path, DAEMON, str(tmp_path / "daemon"))
    assert program.wait() == 0  # returns once the daemon is stopped too (SIGTERM ignored: SIGKILL after the grace)
    daemon, session = daemon_of(tmp_path / "daemon")
    assert session not in (program.pid, os.getsid(0)), "the daemon had left the program's session"
    assert not alive(daemon)
    assert lines == ["daemon started"]


def test_a_stopped_program_takes_its_setsid_daemon_and_is_sigkilled_past_the_grace(tmp_path: Path) -> None:
    program, _ = _program(tmp_path, DAEMON, str(tmp_path / "daemon"), "stay")
    daemon, _ = daemon_of(tmp_path / "daemon")
    assert program.pid is not None and alive(program.pid) and alive(daemon)
    started = time.monotonic()
    program.kill_tree(grace=0.5)  # both ignore SIGTERM
    assert program.wait() == -signal.SIGKILL
    assert time.monotonic() - started < 5.0
    assert not alive(program.pid) and not alive(daemon)


def test_a_rank_worker_killed_outright_takes_the_setsid_daemon_with_it(tmp_path: Path) -> None:
    worker = (
        "import os, sys, time\n"
        "from trainctl.workers.command.output import RankOutput\n"
        "from trainctl.workers.command.program import ProgramProcess\n"
        "program = ProgramProcess([sys.executable, '-c', sys.argv[2], sys.argv[3], 'stay'], '.', dict(os.environ),\n"
        "                         RankOutput(sys.argv[1], 0, lambda line: None))\n"
        "print(program.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(trainctl.__file__).resolve().parents[1])}
    fake = subprocess.Popen([sys.executable, "-c", worker, str(tmp_path), DAEMON, str(tmp_path / "daemon")],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert fake.stdout is not None
    program = int(fake.stdout.readline())
    daemon, _ = daemon_of(tmp_path / "daemon")
    assert alive(program) and alive(daemon)
    fake.kill()
    fake.wait()
    assert gone([program, daemon])


def test_a_program_that_cannot_be_started_says_why_on_stderr(tmp_path: Path) -> None:
    lines: list[str] = []
    program = ProgramProcess([str(tmp_path / "missing")], str(tmp_path), dict(os.environ), RankOutput(tmp_path, 0, lines.append))
    assert program.pid is None
    assert program.wait() == 127
    assert lines == [f"stderr: trainctl: cannot start {str(tmp_path / 'missing')!r}: No such file or directory"]


# ---- on the embedded Ray ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


def test_a_command_job_leaves_no_daemon_behind_once_it_succeeded(runtime, tmp_path: Path) -> None:
    job = command_job("daemon-ok", sys.executable, "-c", DAEMON, str(tmp_path / "daemon"), gpus=1)
    runtime.start_job("cmd-daemon-ok", job, plan(("node-1", 2)), tmp_path / "run")
    _, status = follow(runtime, "cmd-daemon-ok", finished)
    assert status.state is JobState.SUCCEEDED, status.reason
    daemon, _ = daemon_of(tmp_path / "daemon")
    assert not alive(daemon)
    assert_nothing_left("cmd-daemon-ok")
