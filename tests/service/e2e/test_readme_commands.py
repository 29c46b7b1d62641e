"""The README's "Using it" block, run in order as a new user would, against one `trainctl serve`.

The first `serve` line is the server (plus a free port, a data dir under tmp_path and no metrics
port); later `serve` lines are alternative ways to start it and are not run. Every other line runs as
a subprocess in a directory that links the repository's `.venv` and `examples`, so relative paths
resolve as from the repository root while `report` writes its files under tmp_path. JOB is the job the
first `submit` created, JOB2 the second's. Then every file in examples/ is planned on the same server as
shipped (its relative paths resolve against examples/, through the `examples` link), by the CLI in
this process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from reliability.serve_process import ServeProcess

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import main
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.job import ParallelismSpec
from trainctl.v1 import training_pb2 as pb

REPO = Path(__file__).resolve().parents[3]
COMMAND_TIMEOUT = 300.0
CANCEL_TIMEOUT = 120.0
DEFAULT_POOL_GPUS = 8
"""Simulated GPUs of `trainctl serve` with no --ray-address, --nodes or --gpus-per-node."""


def readme_commands() -> list[list[str]]:
    """The `.venv/bin/trainctl` lines of the README's "Using it" code block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    block = section.split("```", 2)[1]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_cancelled(target: str, job_id: str) -> None:
    deadline = time.monotonic() + CANCEL_TIMEOUT
    with TrainctlClient(target) as client:
        while (state := client.get_job(job_id).status.state) != pb.CANCELLED:
            assert time.monotonic() < deadline, f"{job_id} not CANCELLED after {CANCEL_TIMEOUT:g} s: {state}"
            time.sleep(0.5)


def plan_every_example(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`trainctl plan` of each example from the current directory: a plan where the default pool can
    hold it, else the clear refusal. The CLI runs in this process (the README's own lines ran as
    subprocesses): ten more processes importing the CLI would prove no more."""
    for spec in sorted((REPO / "examples").glob("*.yaml")):
        gpus = yaml.safe_load(spec.read_text())["spec"]["resources"]["gpus"]
        capsys.readouterr()
        code = main(["--server", target, "plan", f"examples/{spec.name}"])
        out, err = capsys.readouterr()
        if gpus <= DEFAULT_POOL_GPUS:
            assert code == 0 and "fits now" in out, (spec.name, out, err)
        else:
            refusal = f"{gpus} GPUs requested but the pool can never hold more than {DEFAULT_POOL_GPUS}"
            assert code == 2 and refusal in err, (spec.name, out, err)


def assert_the_demo_trained_as_placed(document: dict) -> None:
    """examples/demo.yaml (pp2 x dp_shard2 x tp2) as `get -o json` shows it: every step done, the loss
    fell, every rank placed, each tensor-parallel group inside one node."""
    status, spec = document["status"], document["spec"]
    assert status["steps_done"] == spec["training"]["steps"]
    assert status["last_loss"] < status["first_loss"], status
    where = {p["rank"]: p["node"] for p in status["placement"]}
    grid = RankGrid.from_spec(ParallelismSpec.model_validate(spec["parallelism"]))
    assert sorted(where) == list(range(grid.world_size))
    for group in grid.groups("tp"):
        assert len({where[r] for r in group}) == 1, f"TP group {group} straddles nodes: {where}"


def test_the_readme_commands_succeed_in_order_and_every_example_that_fits_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    commands = readme_commands()
    assert commands and all(c[0] == ".venv/bin/trainctl" for c in commands), commands
    serve_lines = [c for c in commands if c[1] == "serve"]
    assert commands[0][1] == "serve", "the block starts with the server"
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "examples"):
        (work / name).symlink_to(REPO / name)
    env = {**os.environ, "TRAINCTL_SERVER": ""}
    jobs: dict[str, str] = {}

    with ServeProcess(None, None, tmp_path / "data", *serve_lines[0][2:]) as serve:
        serve.start()
        env["TRAINCTL_SERVER"] = serve.target
        tree = descendants(serve.proc.pid)
        outputs: dict[str, str] = {}  # stdout by subcommand (the last submit's for submit)
        for command in commands:
            if command[1] == "serve":
                continue  # the server, started above; the other serve lines are alternatives to it
            argv = [str(work / command[0]), *(jobs.get(arg, arg) for arg in command[1:])]
            done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
            assert done.returncode == 0, (
                f"README command {shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}\nserver log:\n{serve.log_path.read_text()[-3000:]}"
            )
            outputs[command[1]] = done.stdout
            if command[1] == "submit":
                jobs["JOB" if not jobs else f"JOB{len(jobs) + 1}"] = re.match(r"job (\S+) ", done.stdout).group(1)
            tree |= descendants(serve.proc.pid)
        assert set(jobs) == {"JOB", "JOB2"}
        wait_cancelled(serve.target, jobs["JOB2"])

        assert "fits now" in outputs["plan"]
        assert jobs["JOB"] in outputs["list"]
        document = json.loads(outputs["get"])
        assert document["status"]["state"] == "SUCCEEDED"
        assert_the_demo_trained_as_placed(document)
        assert (work / f"{jobs['JOB']}-report.png").stat().st_size > 0
        assert not (REPO / f"{jobs['JOB']}-report.png").exists()
        monkeypatch.chdir(work)  # relative paths resolve as from the repository root
        plan_every_example(serve.target, capsys)
        tree |= descendants(serve.proc.pid)
        assert serve.stop() == 0
    left = sorted(pid for pid in tree if alive(pid))
    assert not left, f"processes of the service left after SIGTERM: {left}"
