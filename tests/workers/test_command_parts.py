"""The parts of a command job's rank without Ray (issue 15): the torchrun environment from a plan, the
report datagram -> StepReport, `trainctl.report` through a real socket, bounded and rate-limited output,
the process tree killed as a whole, and a reporting module that imports neither torch nor Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainctl
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.reporting import REPORT_SOCKET_ENV
from trainctl.workers.command import output as output_module
from trainctl.workers.command.environment import rank_environment
from trainctl.workers.command.output import RankOutput, rank_log_path
from trainctl.workers.command.program import ProgramExited, ProgramProcess
from trainctl.workers.command.report_channel import (
    ReportChannel,
    ReportError,
    seconds_per_step,
    sent_time,
    step_report_of,
)
from trainctl.workers.placement import RankAssignment


def test_cuda_ranks_see_their_nodes_planned_gpus_in_local_rank_order() -> None:
    slots = [RankAssignment(rank=0, node="b", gpu=5), RankAssignment(rank=1, node="a", gpu=2),
             RankAssignment(rank=2, node="b", gpu=1), RankAssignment(rank=3, node="a", gpu=7)]
    envs = [
        rank_environment(slots, r, grid=RankGrid(tp=2, dp_replicate=2), master_addr="10.0.0.1", master_port=29500,
                         restart_count=2, max_restarts=5, job_id="j", checkpoint_dir="/ck", use_gpu=True)
        for r in range(4)
    ]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["5,1", "2,7", "5,1", "2,7"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]  # cuda:LOCAL_RANK is the planned GPU
    assert [e["GROUP_RANK"] for e in envs] == ["0", "1", "0", "1"]  # node b holds rank 0
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"2"}
    assert envs[3]["TRAINCTL_RANK_COORDS"] == "pp=0,dp_replicate=1,dp_shard=0,cp=0,tp=1"


def test_report_datagrams_become_step_reports_or_name_the_bad_field() -> None:
    report = step_report_of({"step": 3, "loss": 2.5, "tokens": 100, "lr": 0.1}, step_time=0.5)
    assert (report.step, report.loss, report.tokens, report.lr, report.tokens_per_second) == (3, 2.5, 100, 0.1, 200.0)
    assert report.step_time_seconds == 0.5 and report.mfu is None
    for payload, field in (([1], "object"), ({"step": "3", "loss": 1.0}, "step"), ({"step": 1, "loss": float("nan")}, "loss"),
                           ({"step": 1, "loss": 1.0, "tokens": -1}, "tokens"), ({"step": 1, "loss": 1.0, "lr": "x"}, "lr"),
                           ({"step": 1, "loss": 1.0, "eval_loss": float("inf")}, "eval_loss"),
                           ({"step": 1, "loss": 1.0, "eval_loss": True}, "eval_loss")):
        with pytest.raises(ReportError, match=field):
            step_report_of(payload, 1.0)
    assert step_report_of({"step": 4, "loss": 2.5, "eval_loss": 3}, None).eval_loss == 3.0


def test_step_time_is_the_wall_time_between_reports_over_the_steps_between_them() -> None:
    """Issue 34, point 5: a program reporting every 5 steps, 2.5 s apart, steps in 0.5 s (not 2.5 s) at
    5 times the tokens/s; a run's first report, and one that does not advance the step (the program
    started over), has no rate rather than one that holds start-up or unknown steps."""
    assert seconds_per_step(None, 5, 100.0) is None  # the first report of a run (each generation is one)
    assert seconds_per_step((5, 100.0), 10, 102.5) == pytest.approx(0.5)
    assert seconds_per_step((10, 102.5), 11, 103.0) == pytest.approx(0.5)  # every step, as before
    assert seconds_per_step((10, 102.5), 10, 103.0) is None and seconds_per_step((10, 102.5), 4, 103.0) is None
    report = step_report_of({"step": 10, "loss": 1.5, "tokens": 100}, seconds_per_step((5, 100.0), 10, 102.5))
    assert (report.step_time_seconds, report.tokens_per_second) == (pytest.approx(0.5), pytest.approx(200.0))
    first = step_report_of({"step": 5, "loss": 1.5, "tokens": 100}, None)
    assert (first.tokens, first.step_time_seconds, first.tokens_per_second) == (100, None, None)


def test_metrics_a_report_leaves_out_are_absent_not_zero() -> None:
    report = step_report_of({"step": 1, "loss": 2.0}, 0.5)
    assert (report.grad_norm, report.lr, report.tokens, report.tokens_per_second, report.mfu, report.eval_loss) == (
        (None,) * 6)
    assert report.peak_memory_bytes is None and report.step_time_seconds == 0.5
    assert report.to_dict()["grad_norm"] is None  # the supervisor's event log and the store keep it absent


def test_a_channel_times_reports_every_n_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    reports: list = []
    problems: list[str] = []
    with ReportChannel(reports.append, problems.append) as channel:
        monkeypatch.setenv(REPORT_SOCKET_ENV, channel.path)
        started = time.monotonic()
        for step in (4, 8, 12):
            trainctl.report(step=step, loss=1.0, tokens=10)
            deadline = time.monotonic() + 5
            while len(reports) < step // 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    assert [r.step for r in reports] == [4, 8, 12] and problems == []
    assert reports[0].step_time_seconds is None and reports[0].tokens_per_second is None
    for r in reports[1:]:  # 4 steps in at least 0.2 s: at least 0.05 s a step, at most 10 / 0.05 tokens/s
        assert 0.05 <= r.step_time_seconds < elapsed / 4 and r.tokens_per_second == pytest.approx(10 / r.step_time_seconds)


def test_reports_are_timed_when_the_program_sent_them_not_when_the_worker_read_them() -> None:
    """A worker whose reading thread waited for a CPU still times the steps by when the program reported
    them: two datagrams sent 0.5 s apart, 5 steps apart, read together give 0.1 s a step. A `sent` the
    worker's clock contradicts (ahead of the receipt, before the previous report, not a number) is not
    trusted: the receipt times that report."""
    reports: list = []
    with ReportChannel(reports.append, lambda problem: None) as channel:
        sent = time.monotonic() - 1.0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            for step, at in ((5, sent), (10, sent + 0.5)):
                sock.sendto(json.dumps({"step": step, "loss": 1.0, "tokens": 10, "sent": at}).encode(), channel.path)
        deadline = time.monotonic() + 5
        while len(reports) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert reports[1].step_time_seconds == pytest.approx(0.1) and reports[1].tokens_per_second == pytest.approx(100.0)
    assert sent_time({"sent": 99.0}, 90.0, 100.0) == 99.0
    for payload in ({"sent": 101.0}, {"sent": 89.0}, {"sent": float("nan")}, {"sent": True}, {"sent": "99"}, {}, [1]):
        assert sent_time(payload, 90.0, 100.0) == 100.0, payload
    assert sent_time({"sent": 1.0}, None, 100.0) == 1.0


def test_trainctl_report_reaches_its_rank_workers_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    reports, problems = [], []
    trainctl.report(step=1, loss=1.0)  # outside a job: nothing happens
    with ReportChannel(reports.append, problems.append) as channel:
        monkeypatch.setenv(REPORT_SOCKET_ENV, channel.path)
        trainctl.report(step=1, loss=3.0, tokens=64, grad_norm=0.5)
        trainctl.report(step=2, loss=float("inf"))
        trainctl.report(step=3, loss=2.0, eval_loss=float("nan"))
        trainctl.report(step=4, loss=1.5, eval_loss=1.75)
        deadline = time.monotonic() + 5
        while len(reports) + len(problems) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [(r.step, r.loss, r.tokens, r.grad_norm, r.eval_loss) for r in reports] == [
        (1, 3.0, 64, 0.5, None), (4, 1.5, None, None, 1.75)]
    assert [p.split(": ", 1)[1].split(" must")[0] for p in problems] == ["loss", "eval_loss"], problems
    assert all("must be a finite number" in p for p in problems)
    assert not Path(channel.path).exists()


def test_output_is_rotated_and_forwarding_is_rate_limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_module, "LOG_FILE_BYTES", 4096)
    forwarded: list[str] = []
    now = [0.0]  # the burst takes no time, whatever the machine's load (a slow loop refilled the bucket once)
    out = RankOutput(tmp_path, 1, forwarded.append, clock=lambda: now[0])
    for i in range(2000):
        out.line(f"line {i:05d} " + "x" * 40, stderr=i % 2 == 1)
    out.close()
    files = sorted(tmp_path.glob("rank-1.log*"))
    assert len(files) == output_module.LOG_FILE_BACKUPS + 1 and all(f.stat().st_size <= 4096 for f in files)
    assert rank_log_path(tmp_path, 1).read_text().splitlines()[-1].startswith("stderr: line 01999")
    assert output_module.FORWARD_BURST <= len(forwarded) < 2000
    assert out.stderr_tail()[-1].startswith("line 01999") and len(out.stderr_tail()) == output_module.STDERR_TAIL_LINES
    now[0] += 0.1  # a few tokens come back
    out.line("after the burst", stderr=False)
    assert forwarded[-1].startswith("after the burst [") and "not forwarded" in forwarded[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_kill_tree_ends_the_program_and_what_it_started(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    lines: list[str] = []
    out = RankOutput(tmp_path, 0, lines.append)
    program = ProgramProcess([sys.executable, "-c", script], str(tmp_path), dict(os.environ), out)
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(lines[0])
    assert _alive(program.pid) and _alive(child) and os.getpgid(child) == program.pid
    program.kill_tree(grace=0.5)  # the child ignores SIGTERM: SIGKILL after the grace
    assert program.wait() < 0
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(program.pid) and not _alive(child)


def test_a_worker_killed_outright_takes_its_programs_whole_tree_with_it(tmp_path: Path) -> None:
    """SIGKILL of the rank worker (no kill_tree call): the program's launcher kills its tree, the child included."""
    worker = (
        "import os, sys, time\n"
        "from trainctl.workers.command.output import RankOutput\n"
        "from trainctl.workers.command.program import ProgramProcess\n"
        "tree = \"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(c.pid, flush=True); time.sleep(600)\"\n"
        "lines = []\n"
        "program = ProgramProcess([sys.executable, '-c', tree], '.', dict(os.environ), RankOutput(sys.argv[1], 0, lines.append))\n"
        "while not lines: time.sleep(0.05)\n"
        "print(program.pid, lines[0], flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(trainctl.__file__).resolve().parents[1])}
    fake = subprocess.Popen([sys.executable, "-c", worker, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in fake.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    fake.kill()
    fake.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []


def test_a_failed_programs_reason_names_rank_code_and_stderr() -> None:
    assert str(ProgramExited(2, 3, ["a", "b"], 0.0)) == "rank 2 exited with code 3; last stderr lines:\na\nb"
    assert str(ProgramExited(0, -9, [], 0.0)) == "rank 0 was killed by SIGKILL; it wrote nothing to stderr"


def test_the_reporting_call_imports_neither_torch_nor_ray() -> None:
    code = "import sys, trainctl; trainctl.report(step=1, loss=1.0); print(sorted({'torch', 'ray', 'grpc'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(Path(trainctl.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"
