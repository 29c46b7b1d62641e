"""What a new user meets at the `trainctl` command: with no server a client command ends at once with one
line naming the addresses tried and how to start or name a server; every command and subcommand has a
working --help; --version; --help loads no more than argparse; cancelling an ended job is one
FAILED_PRECONDITION line; a sweep watched into a pipe prints its changes, not its table at every
refresh; a finished job's reason holds no raw floats."""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import grpc
import pytest
import yaml
from control_plane_fakes import ApiServer, ScriptedRuntime, free_port
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.cli.commands import HANDLERS, command_parser
from trainctl.cli.main import EXIT_ERROR, EXIT_OK, main
from trainctl.cli.parsing import COMMANDS
from trainctl.cli.sweep_cmd import show_changes
from trainctl.v1 import training_pb2 as pb

REPO = Path(__file__).resolve().parents[3]
HINT = "start one with `trainctl serve`, or give its address with --server HOST:PORT or $TRAINCTL_SERVER"


def _trainctl(*argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """`python -m trainctl.cli.main ARGV` as the `trainctl` script runs it, and its wall seconds."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainctl.cli.main", *argv], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, **(env or {})})
    return done, time.monotonic() - started


def test_a_client_command_without_a_server_ends_at_once_with_a_hint() -> None:
    """It waited 12.8 s (five rounds of retries), then printed gRPC's UNAVAILABLE. "At once" is judged
    against a CLI start measured beside it (`--version`), so a loaded machine's slower start is not taken
    for retries: twice that start plus 2 s, well under the retries' 10 s."""
    _, start = _trainctl("--version")
    nobody = f"127.0.0.1:{free_port()}"
    done, seconds = _trainctl("list", env={"TRAINCTL_SERVER": nobody})
    assert done.returncode == EXIT_ERROR and done.stdout == ""
    assert done.stderr == f"error: no trainctl server at {nobody} (connection failed); {HINT}\n"
    assert seconds < 2 * start + 2.0, f"took {seconds:.1f} s, a CLI start {start:.1f} s"


def test_every_address_is_named_and_a_silent_one_is_given_up_after_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    refusing = f"127.0.0.1:{free_port()}"
    with socket.socket() as silent:  # accepts TCP connections (the kernel's backlog) and never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        quiet = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        assert main(["--server", f"{refusing},{quiet}", "get", "some-job"]) == EXIT_ERROR
        seconds = time.monotonic() - started
    assert capsys.readouterr().err == (
        f"error: no trainctl server at {refusing} (connection failed), {quiet} (no answer in 1.5 s); {HINT}\n")
    assert seconds < 2.0, f"took {seconds:.1f} s"


def _command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """`path` and the path of every subcommand below it."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_paths(sub, (*path, name))


def test_every_command_and_subcommand_has_a_working_help(capsys: pytest.CaptureFixture[str]) -> None:
    """`trainctl token --help` was a usage error (its arguments were one REMAINDER)."""
    assert HANDLERS.keys() == COMMANDS.keys(), "every command listed is declared and run"
    paths = sorted({p for name in COMMANDS for p in _command_paths(command_parser(name)) if p and p[0] == name})
    assert {"token", "new"} <= {w for p in paths for w in p} and ("sweep", "create") in paths and ("topology", "inspect") in paths
    for path in [(), *paths]:
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0, path
        assert out.startswith(" ".join(("usage: trainctl", *path))), (path, out[:200])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"trainctl {metadata.version('trainctl')}\n"


LOADED = """
import sys
from trainctl.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("grpc", "google", "rich", "pydantic", "yaml", "torch", "ray", "trainctl.v1", "trainctl.spec.job",
         "trainctl.workers", "trainctl.service.server", "trainctl.cli.client")
light = {"trainctl.workers", "trainctl.workers.ray_environment"}  # the Ray environment guard: the standard library only
print(sorted({m for m in sys.modules if m.startswith(heavy) and (m in heavy or m.startswith(tuple(h + "." for h in heavy)))} - light))
"""


def test_help_and_a_mistyped_command_load_nothing_but_the_parser() -> None:
    """`trainctl --help` took 0.5 s, 170 ms of it importing the topology model for the subcommands' help."""
    for argv in (["--help"], ["lsit"], ["--version"]):
        done = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert done.stdout.splitlines()[-1] == "[]", (argv, done.stdout[-500:], done.stderr[-500:])


def test_a_client_command_loads_no_spec_models_and_no_topology(tmp_path: Path) -> None:
    code = ("import sys\nfrom trainctl.cli.main import main\nmain(sys.argv[1:])\n"
            "print(sorted(m for m in ('pydantic', 'rich', 'trainctl.workers.topology.model', 'trainctl.spec.job') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, "--server", f"127.0.0.1:{free_port()}", "list"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr


def _submit(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str], gpus: int = 2) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(name, gpus=gpus, steps=2).model_dump(mode="json", exclude_unset=True)))
    assert main(["submit", str(path)]) == EXIT_OK
    return capsys.readouterr().out.split()[1]


def test_cancelling_an_ended_job_is_one_failed_precondition_line(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second cancel answered OK, while the README says an ended job answers FAILED_PRECONDITION."""
    _submit(tmp_path, "holder", capsys, gpus=8)
    queued = _submit(tmp_path, "queued", capsys, gpus=8)  # waits behind the holder
    assert main(["cancel", queued]) == EXIT_OK
    assert capsys.readouterr().out.startswith(f"job {queued} CANCELLED: cancelled by")
    assert main(["cancel", queued]) == EXIT_ERROR
    assert capsys.readouterr().err == (
        f"error: FAILED_PRECONDITION: job {queued} has already ended (CANCELLED); nothing to cancel\n")
    with TrainctlClient(api.target) as client, pytest.raises(grpc.RpcError) as refused:
        client.cancel_job(queued)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


class _LostAnswer(grpc.RpcError):
    """UNAVAILABLE after the server did the work: the answer was lost on the way back."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"


def test_a_cancel_repeated_after_a_lost_answer_answers_the_cancelled_job(
    tmp_path: Path, api: ApiServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client repeats a call answered UNAVAILABLE; the repeat of a cancel that went through finds the
    job CANCELLED, which is what the caller asked for, not a failure."""
    _submit(tmp_path, "holder", capsys, gpus=8)
    queued = _submit(tmp_path, "queued", capsys, gpus=8)
    real = TrainctlClient._stub.fget
    lost = []

    def first_answer_lost(client: TrainctlClient) -> object:
        stub = real(client)
        if not lost:
            done = stub.CancelJob

            def cancel(request: pb.CancelJobRequest, **kwargs: object) -> pb.Job:
                lost.append(done(request, **kwargs))
                raise _LostAnswer()

            stub.CancelJob = cancel
        return stub

    monkeypatch.setattr(TrainctlClient, "_stub", property(first_answer_lost))
    with TrainctlClient(api.target) as client:
        answer = client.cancel_job(queued)
    assert [j.status.state for j in lost] == [pb.CANCELLED] and answer.status.state == pb.CANCELLED


def _sweep(state: int, trials: list[tuple[int, int, int, float | None]], best: int | None = None) -> pb.Sweep:
    """A sweep with trials (state, job state, steps done, objective)."""
    sweep = pb.Sweep(id="sweep-1")
    sweep.spec.objective.metric = "loss"
    sweep.status.state = state
    sweep.status.reason = "running" if state == pb.SWEEP_STATE_RUNNING else "done"
    for number, (trial_state, job_state, steps, objective) in enumerate(trials):
        trial = sweep.status.trials.add(number=number, job_id=f"job-{number}", state=trial_state, job_state=job_state, steps_done=steps)
        trial.params["spec.training.lr"].float_value = 0.001 * (number + 1)
        if objective is not None:
            trial.objective = objective
    if best is not None:
        sweep.status.best_trial, sweep.status.best_objective = best, trials[best][3]
    return sweep


def _watched() -> list[pb.Sweep]:
    """A sweep of two trials seen 42 times: mostly step counts moving, five changes a person wants to see."""
    running, complete = pb.TRIAL_STATE_RUNNING, pb.TRIAL_STATE_COMPLETE
    seen = [_sweep(pb.SWEEP_STATE_RUNNING, [(running, pb.RUNNING, step, None)]) for step in range(20)]
    seen.append(_sweep(pb.SWEEP_STATE_RUNNING, [(complete, pb.SUCCEEDED, 20, 1.5)], best=0))
    seen += [_sweep(pb.SWEEP_STATE_RUNNING, [(complete, pb.SUCCEEDED, 20, 1.5), (running, pb.RUNNING, step, None)], best=0)
             for step in range(20)]
    seen.append(_sweep(pb.SWEEP_STATE_SUCCEEDED, [(complete, pb.SUCCEEDED, 20, 1.5), (complete, pb.SUCCEEDED, 20, 1.25)], best=1))
    return seen


def test_a_sweep_watched_into_a_pipe_prints_its_changes_not_its_table_each_time() -> None:
    """`sweep create --watch > file` printed the whole table 320 times in 104 s."""
    out = io.StringIO()
    assert show_changes(_watched(), out).status.state == pb.SWEEP_STATE_SUCCEEDED
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("TRIAL ") for line in lines) == 2, "the table first and last, not at each refresh"
    changes = lines[lines.index("sweep sweep-1 RUNNING: running") + 4:]  # after the first table (header, objective, columns, a row)
    changes = changes[:next(i for i, line in enumerate(changes) if line.startswith("sweep sweep-1 SUCCEEDED"))]
    assert changes == [
        "trial 0 COMPLETE (training.lr=0.001, job job-0 SUCCEEDED, step 20, objective 1.5)",
        "best: trial 0 (job-0) objective 1.5 with spec.training.lr=0.001",
        "trial 1 RUNNING (training.lr=0.002, job job-1 RUNNING, step 0)",
    ], lines
    assert "trial 1 COMPLETE (training.lr=0.002, job job-1 SUCCEEDED, step 20, objective 1.25)" in lines
    assert "best: trial 1 (job-1) objective 1.25 with spec.training.lr=0.002" in lines


def test_a_sweep_watched_on_a_terminal_is_redrawn_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat the output as a terminal
    out = io.StringIO()
    show_changes(_watched(), out)
    text = out.getvalue()
    assert "\x1b[" in text and "sweep sweep-1 SUCCEEDED: done" in text  # cursor moves, and the end shown


def test_a_finished_jobs_reason_rounds_its_numbers() -> None:
    """`wall_seconds=18.237455856999986` in the reason `get` and `list` show."""
    from trainctl.workers.outcomes import finished_summary

    result = {"steps_completed": 40, "final_loss": 2.345678901, "losses": [3.0, 2.3], "wall_seconds": 18.237455856999986,
              "last_checkpoint": "/runs/job-1/checkpoints/step_40"}
    assert finished_summary(result, 8) == ("all 8 ranks finished (steps_completed=40, final_loss=2.346, wall_seconds=18.24, "
                                   "last_checkpoint=/runs/job-1/checkpoints/step_40)")
