"""Command jobs on the embedded multi-node Ray (issue 15): the user's program on every rank with the
torchrun environment of the placement, its lines and `trainctl.report` calls in the event log, and the
faults: a SIGKILLed program restarts the group and resumes from its checkpoint, a program that always
fails FAILS the job naming the rank, exit code and stderr, cancel leaves no process of any tree, and a
silent program hits the no-progress timeout. The scenarios' jobs run side by side on GPU slots none of
them shares, each driven by a thread of its own (`runs`); each test checks one."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from test_runtime import Run, assert_nothing_left, finished, follow, plan, states_of, steps_of

from trainctl.spec.job import TrainingJob
from trainctl.workers.events import EventKind, JobState
from trainctl.workers.runtime import RayRuntime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "command"
ENV_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "CUDA_VISIBLE_DEVICES", "TRAINCTL_JOB_ID", "TRAINCTL_CHECKPOINT_DIR",
    "TRAINCTL_LAYOUT", "TRAINCTL_RANK_COORDS", "MY_SETTING", "NCCL_IB_HCA", "NCCL_CROSS_NIC", "OMP_NUM_THREADS",
)


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


def command_job(name: str, program: str, *args: str, gpus: int = 2, working_dir: Path | None = None,
                **sections: dict) -> TrainingJob:
    """A CPU command job of `gpus` ranks running `program args` (never restarted unless `scheduling` says so)."""
    command = {"program": program, "args": list(args), **sections.pop("command", {})}
    if working_dir is not None:
        command["working_dir"] = str(working_dir)
    spec = {"command": command, "resources": {"gpus": gpus, "device": "cpu"}, "scheduling": {"max_restarts": 0}}
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    return TrainingJob.model_validate({"metadata": {"name": name}, "spec": spec})


def rank_lines(events, rank: int, generation: int | None = None) -> list[str]:
    return [
        e.message for e in events
        if e.kind is EventKind.LOG and e.rank == rank and (generation is None or e.generation == generation)
    ]


def program_pid(events, rank: int, generation: int) -> int:
    [line] = [m for m in rank_lines(events, rank, generation) if m.startswith("program started")]
    return int(line.split("(pid ")[1].split(")")[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent's wait() is gone for every purpose but the PID table
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def dump_the_environment(runtime: RayRuntime, root: Path) -> Run:
    """4 ranks print their environment, rank order differing from node order and from bundle-friendly order."""
    dump = root / "dump_env.py"
    dump.write_text(
        "import json, os\n"
        f"print(json.dumps({{k: os.environ.get(k) for k in {ENV_NAMES!r}}}))\n"
        "print(os.getcwd())\n"
    )
    job = command_job("env", "python", str(dump), gpus=4, parallelism={"dp_replicate": 2, "tp": 2},
                      command={"env": {"MY_SETTING": "on", "NCCL_CROSS_NIC": "1"}})
    where = plan(("node-2", 3), ("node-2", 0), ("node-0", 1), ("node-2", 2))
    nccl = {"node-2": {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_CROSS_NIC": "0"}, "node-0": {"NCCL_CROSS_NIC": "0"}}
    runtime.start_job("cmd-env", job, where, root / "run", node_env=nccl)
    events, status = follow(runtime, "cmd-env", finished)
    return Run("cmd-env", root / "run", events, status)


def kill_the_program_at_step_3(runtime: RayRuntime, root: Path) -> Run:
    job = command_job("ddp", "python", str(EXAMPLES / "ddp_train.py"), "--steps", "12", "--step-seconds", "0.4",
                      scheduling={"max_restarts": 2})
    runtime.start_job("cmd-kill", job, plan(("node-0", 2), ("node-1", 0)), root)
    events, _ = follow(runtime, "cmd-kill", lambda events, status: max(steps_of(events, 0), default=0) >= 3)
    os.kill(program_pid(events, 1, 0), signal.SIGKILL)
    more, status = follow(runtime, "cmd-kill", finished, cursor=events[-1].seq)
    return Run("cmd-kill", root, events + more, status)


def run_a_program_that_exits_3(runtime: RayRuntime, root: Path) -> Run:
    failing = "import sys; print('about to fail', file=sys.stderr); print('bad config: lr', file=sys.stderr); sys.exit(3)"
    job = command_job("exit3", sys.executable, "-c", failing, scheduling={"max_restarts": 1})
    runtime.start_job("cmd-exit3", job, plan(("node-1", 1), ("node-2", 1)), root)
    events, status = follow(runtime, "cmd-exit3", finished)
    return Run("cmd-exit3", root, events, status)


def cancel_process_trees(runtime: RayRuntime, root: Path) -> Run:
    """Cancel once every rank's program and its child are up; asserts they were alive then and are gone
    once cancel answers. The run carries cancel's final status and no events."""
    tree = root / "tree.py"
    tree.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "pids = os.path.join(os.environ['TRAINCTL_CHECKPOINT_DIR'], f\"pids-{os.environ['RANK']}\")\n"
        "open(pids + '.tmp', 'w').write(f'{os.getpid()} {child.pid}')\n"
        "os.replace(pids + '.tmp', pids)\n"
        "print('tree up', flush=True)\n"
        "time.sleep(600)\n"
    )
    runtime.start_job("cmd-cancel", command_job("tree", "python", str(tree)), plan(("node-0", 3), ("node-1", 2)), root)
    checkpoints = root / "checkpoints"
    deadline = time.monotonic() + 120
    while not all((checkpoints / f"pids-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the programs did not start"
        time.sleep(0.2)
    pids = [int(p) for r in range(2) for p in (checkpoints / f"pids-{r}").read_text().split()]
    assert all(_alive(pid) for pid in pids)
    final = runtime.cancel("cmd-cancel")
    assert [pid for pid in pids if _alive(pid)] == []
    return Run("cmd-cancel", root, [], final)


def run_a_silent_program(runtime: RayRuntime, root: Path) -> Run:
    job = command_job("silent", sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(600)",
                      command={"no_progress_timeout_seconds": 3.0})
    runtime.start_job("cmd-silent", job, plan(("node-1", 3), ("node-0", 0)), root)
    events, status = follow(runtime, "cmd-silent", finished)
    return Run("cmd-silent", root, events, status)


@pytest.fixture(scope="module")
def runs(runtime: RayRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Every scenario's run, all started at once (the 12 GPU slots, each planned once), by job id."""
    scenarios = {
        "cmd-env": dump_the_environment,
        "cmd-kill": kill_the_program_at_step_3,
        "cmd-exit3": run_a_program_that_exits_3,
        "cmd-cancel": cancel_process_trees,
        "cmd-silent": run_a_silent_program,
    }
    with ThreadPoolExecutor(len(scenarios)) as threads:
        yield {
            job_id: threads.submit(drive, runtime, tmp_path_factory.mktemp(job_id))
            for job_id, drive in scenarios.items()
        }


def test_ranks_get_the_torchrun_environment_of_the_placement(runs):
    run = runs["cmd-env"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    envs = {}
    for rank in range(4):
        lines = rank_lines(events, rank)
        envs[rank] = json.loads(next(line for line in lines if line.startswith("{")))
        assert str(run.run_dir.resolve()) in lines, "runs in the job's run directory by default"
    assert [envs[r]["RANK"] for r in range(4)] == ["0", "1", "2", "3"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "2"]  # node-2 holds ranks 0, 1, 3
    assert [envs[r]["LOCAL_WORLD_SIZE"] for r in range(4)] == ["3", "3", "1", "3"]
    assert [envs[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "0"]
    assert {envs[r]["MASTER_PORT"] for r in range(4)} == {envs[0]["MASTER_PORT"]}
    for rank, env in envs.items():
        assert env["WORLD_SIZE"] == "4" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # simulated GPUs: CPU ranks
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")  # the node's, else torchrun's 1
        assert env["TRAINCTL_JOB_ID"] == "cmd-env" and env["MY_SETTING"] == "on"
        assert env["TRAINCTL_CHECKPOINT_DIR"] == str((run.run_dir / "checkpoints").resolve())
        assert env["TRAINCTL_LAYOUT"] == "pp=1,dp_replicate=2,dp_shard=1,cp=1,tp=2"
        assert env["TRAINCTL_RANK_COORDS"] == f"pp=0,dp_replicate={rank // 2},dp_shard=0,cp=0,tp={rank % 2}"
    # The node's NCCL settings (the map's); the spec's env overrides them.
    assert [envs[r]["NCCL_IB_HCA"] for r in range(4)] == ["=mlx5_0:1,mlx5_1:1"] * 2 + [None] + ["=mlx5_0:1,mlx5_1:1"]
    assert {envs[r]["NCCL_CROSS_NIC"] for r in range(4)} == {"1"}
    assert (run.run_dir / "logs" / "rank-3.log").read_text().startswith("{")
    assert_nothing_left(run.job_id)


def test_a_sigkilled_program_restarts_the_group_which_resumes_from_its_checkpoint(runs):
    run = runs["cmd-kill"].result()
    events, status = run.events, run.status
    assert status.state is JobState.SUCCEEDED, status.reason
    assert status.restarts == 1
    assert states_of(events)[-3:] == [JobState.RESTARTING, JobState.RUNNING, JobState.SUCCEEDED]
    restart = next(e for e in events if e.state is JobState.RESTARTING)
    assert restart.reason.startswith("rank 1 was killed by SIGKILL"), restart.reason
    second = steps_of(events, 1)
    assert min(second) > 3 and max(second) == 12, "generation 1 resumed from the program's own checkpoint"
    assert any("(restart 1) starts at step" in line for line in rank_lines(events, 0, 1))
    assert_nothing_left(run.job_id)


def test_a_program_that_always_exits_3_fails_with_its_rank_code_and_stderr(runs):
    run = runs["cmd-exit3"].result()
    status = run.status
    assert status.state is JobState.FAILED
    assert status.restarts == 1
    assert "exited with code 3" in status.reason and "bad config: lr" in status.reason, status.reason
    assert status.reason.startswith(("rank 0 exited with code 3", "rank 1 exited with code 3"))
    assert "giving up after 1 restart(s)" in status.reason
    assert_nothing_left(run.job_id)


def test_cancel_kills_every_process_tree_on_every_node(runs):
    run = runs["cmd-cancel"].result()
    assert run.status.state is JobState.CANCELLED
    assert_nothing_left(run.job_id)


def test_a_silent_program_hits_the_no_progress_timeout(runs):
    run = runs["cmd-silent"].result()
    events, status = run.events, run.status
    assert status.state is JobState.FAILED
    assert "no report and no output line" in status.reason and "no_progress_timeout_seconds=3" in status.reason
    assert "hello" in rank_lines(events, 0), "its output still shows"
    assert_nothing_left(run.job_id)
