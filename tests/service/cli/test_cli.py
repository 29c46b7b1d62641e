"""The `trainctl` command: validate prints every offending field and exits non-zero; the client
commands against a loopback server (scripted runtime); progress rendering without a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from control_plane_fakes import ApiServer, ScriptedRuntime, bad_spec_catalogue
from small_jobs import small_job

from trainctl.cli.main import EXIT_INVALID, main
from trainctl.cli.progress import follow
from trainctl.spec.validate import load_job_file, semantic_violations
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.events import JobState

ROOT = Path(__file__).resolve().parents[3]
CASES = bad_spec_catalogue()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_validate_prints_each_violation_and_exits_non_zero(case, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(case.path), "--pool-gpus", "8"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"  {case.field}: " in err
    try:  # the same lines the library reports (and the API sends as BadRequest field violations)
        expected = semantic_violations(load_job_file(case.path), pool_gpus=8)
    except Exception as exc:  # noqa: BLE001 - schema errors: SpecError
        expected = exc.violations  # type: ignore[attr-defined]
    assert [line.strip() for line in err.splitlines()[1:]] == [str(v) for v in expected]


def test_validate_accepts_a_good_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(ROOT / "examples" / "demo.yaml")]) == 0
    assert "valid (8 ranks)" in capsys.readouterr().out


def test_submit_of_an_invalid_file_never_calls_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    bad = next(c for c in CASES if c.name == "malformed-yaml")
    assert main(["--server", "127.0.0.1:9", "submit", str(bad.path)]) == EXIT_INVALID
    assert "<document>: malformed YAML" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\xff\xfe\x00\x01 not text", "is not UTF-8 text"),
        (b"metadata: {name: x}\nspec: {training: {steps: 99999999999999999999999, seed: -99999999999999999999}}\n",
         "spec.training.steps: Input should be less than or equal to 1000000000"),
        (b"a: " + b"[" * 5000, "nested deeper than 32 levels"),
        (b"a: &a [1, 1]\nb: [*a, *a]\n", "aliases (*name) are not allowed"),
        (b"- just\n- a list\n", "expected a mapping"),
        (b"x: " + b"7" * 5000 + b"\n", "malformed YAML value"),
    ],
    ids=["binary", "huge-ints", "deep", "alias", "list", "long-int"],
)
def test_hostile_files_get_error_lines_not_tracebacks(tmp_path: Path, content: bytes, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    for command in (["validate", str(path)], ["--server", "127.0.0.1:9", "submit", str(path)], ["--server", "127.0.0.1:9", "plan", str(path)]):
        assert main(command) == EXIT_INVALID, command
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
        assert all(line.startswith(("error: ", "  ")) for line in err.splitlines()), err


def _spec(tmp_path: Path, name: str, gpus: int = 2, steps: int = 3, **labels: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    job = small_job(name, gpus=gpus, steps=steps, labels=labels)
    path.write_text(yaml.safe_dump(job.model_dump(mode="json", exclude_unset=True)))
    return path


def _submitted_id(out: str) -> str:
    return out.split()[1]


def test_client_commands(tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", str(_spec(tmp_path, "alpha", team="a"))]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    runtime.wait_started(job_id)
    runtime.run(job_id, [5.0, 4.0, 3.0])

    assert main(["logs", job_id, "-f"]) == 0
    out = capsys.readouterr().out
    assert "QUEUED -> SCHEDULED" in out and "RUNNING -> SUCCEEDED" in out and "step 3/3" in out
    assert f"job {job_id} SUCCEEDED" in out and "loss 5.0000 -> 3.0000 over 3 steps" in out

    assert main(["get", job_id, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["id"] == job_id and document["status"]["state"] == "SUCCEEDED"
    assert [(m["step"], m["loss"], m["tokens_per_second"]) for m in document["metrics"]] == [
        (1, 5.0, 1001.0), (2, 4.0, 1002.0), (3, 3.0, 1003.0),
    ]
    assert document["spec"]["parallelism"]["dp_shard"] == 2 and document["metadata"]["labels"] == {"team": "a"}

    assert main(["report", job_id, "--out", str(tmp_path / "alpha.png")]) == 0
    assert (tmp_path / "alpha.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "alpha.html").exists()
    capsys.readouterr()

    assert main(["get", job_id, "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["status"]["steps_done"] == 3

    assert main(["submit", str(_spec(tmp_path, "beta", gpus=8, team="b"))]) == 0
    beta = _submitted_id(capsys.readouterr().out)
    assert main(["list", "--label", "team=b"]) == 0
    listing = capsys.readouterr().out
    assert beta in listing and job_id not in listing
    assert main(["list", "--state", "succeeded"]) == 0
    assert job_id in capsys.readouterr().out
    assert main(["cancel", beta]) == 0
    assert beta in capsys.readouterr().out

    assert main(["plan", str(ROOT / "examples" / "demo.yaml")]) == 0
    plan = capsys.readouterr().out
    assert "valid: 8 ranks (pp2 x dp_shard2 x tp2)" in plan and "RANK" in plan and "node-1" in plan

    assert main(["get", "no-such-job"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_submit_watch_exit_status_follows_the_job(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    def fail_when_started() -> None:
        while not runtime.logs:
            threading.Event().wait(0.01)
        runtime.run(next(iter(runtime.logs)), [2.0], end=JobState.FAILED)

    threading.Thread(target=fail_when_started, daemon=True).start()
    assert main(["submit", str(_spec(tmp_path, "doomed")), "--watch"]) == 1
    assert "RUNNING -> FAILED: done" in capsys.readouterr().out


def test_plan_of_an_invalid_spec(api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    too_big = next(c for c in CASES if c.name == "too-many-gpus")
    assert main(["plan", str(too_big.path)]) == EXIT_INVALID
    assert "spec.resources.gpus: 16 GPUs requested but the pool can never hold more than 8" in capsys.readouterr().err


def _event(seq: int, **payload: object) -> pb.JobEvent:
    return pb.JobEvent(sequence=seq, job_id="j", **payload)


def test_progress_without_a_terminal_is_plain_lines() -> None:
    events = [
        _event(1, state_change=pb.StateChange(to_state=pb.QUEUED, reason="accepted")),
        _event(2, state_change=pb.StateChange(from_state=pb.QUEUED, to_state=pb.RUNNING, reason="up")),
        _event(3, step=pb.StepMetrics(step=1, loss=5.0, tokens_per_second=1000.0)),
        _event(4, step=pb.StepMetrics(step=2, loss=4.5, tokens_per_second=1200.0, mfu=0.25, mfu_full_attention=0.27)),
        _event(5, log=pb.LogLine(level="INFO", message="checkpoint saved", rank=0)),
        _event(6, state_change=pb.StateChange(from_state=pb.RUNNING, to_state=pb.SUCCEEDED)),
    ]
    out = io.StringIO()
    tracker = follow(events, 4, out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1] - -> QUEUED: accepted"
    assert lines[2].startswith("step 1/4  loss 5.0000  1,000 tok/s  MFU n/a  ETA -")
    assert lines[3].startswith("step 2/4  loss 4.5000  1,200 tok/s  MFU 25.0% (full-attn 27.0%)  ETA ")
    assert lines[4] == "[5] rank 0 INFO: checkpoint saved"
    assert lines[5] == "[6] RUNNING -> SUCCEEDED"
    assert "\x1b" not in out.getvalue()  # no terminal control codes
    assert tracker.state == pb.SUCCEEDED and tracker.first_loss == 5.0 and tracker.loss == 4.5


def test_logs_into_a_pipe_closed_early_ends_quietly(tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    """`trainctl logs JOB | head -1`: the reader leaves after one line; no BrokenPipeError traceback."""
    assert main(["submit", str(_spec(tmp_path, "chatty", steps=2000))]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    runtime.wait_started(job_id)
    runtime.run(job_id, [1.0] * 2000)
    reader = subprocess.Popen(
        [sys.executable, "-m", "trainctl.cli.main", "--server", api.target, "logs", job_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None and reader.stdout.readline()
    reader.stdout.close()
    _, err = reader.communicate(timeout=60)
    assert reader.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


CLIENT_IMPORTS = """
import sys
from trainctl.cli.main import main
job_id = sys.argv[2]  # argv: -c, the server, the job
codes = [main(["validate", "examples/demo.yaml"]), main(["list"]), main(["get", job_id]), main(["logs", job_id])]
try:
    main(["--help"])
except SystemExit:
    pass
print(codes, sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray"}))
"""


def test_client_commands_import_neither_torch_nor_ray(
    tmp_path: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--help`, validate, list, get and logs start without the engine or Ray (they load in seconds)."""
    assert main(["submit", str(_spec(tmp_path, "light", steps=2))]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    done = subprocess.run(
        [sys.executable, "-c", CLIENT_IMPORTS, api.target, job_id],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TRAINCTL_SERVER": api.target},
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[0, 0, 0, 0] []", done.stdout


def _run_to_its_end(
    tmp_path: Path, name: str, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str], losses: list[float]
) -> str:
    """Submit a job through the CLI and run it, one step per loss; its id once the service has it ended."""
    assert main(["submit", str(_spec(tmp_path, name))]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    runtime.wait_started(job_id)
    runtime.run(job_id, losses)
    main(["logs", job_id, "-f"])
    capsys.readouterr()
    return job_id


def _strict_json(text: str) -> object:
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_get_json_of_a_diverged_run_is_strict_json(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    """json.dumps wrote NaN and Infinity as bare tokens, which jq and strict parsers refuse."""
    job_id = _run_to_its_end(tmp_path, "diverged", runtime, capsys, [5.0, float("nan"), float("inf")])
    assert main(["get", job_id, "-o", "json"]) == 0
    document = _strict_json(capsys.readouterr().out)
    assert [m["loss"] for m in document["metrics"]] == [5.0, "NaN", "Infinity"]
    assert document["status"]["first_loss"] == 5.0 and document["status"]["last_loss"] == "Infinity"


def test_the_eta_of_replayed_steps_comes_from_when_they_ran(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps were timed by their arrival: a backlog replayed by `logs` arrives at once, which read as ETA 0s."""
    assert main(["submit", str(_spec(tmp_path, "slow", steps=10))]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    runtime.wait_started(job_id)
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    for step in range(1, 5):  # 0.5 s apart: 6 steps left, about 3 s
        runtime.step(job_id, step, 5.0 - step / 10)
        time.sleep(0.5)
    assert main(["logs", job_id]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 4/10")]
    eta = re.search(r"ETA (\d+)s$", line)
    assert eta is not None and int(eta[1]) >= 2, line  # at least 6 x 0.5 s: the steps' own spacing


def test_a_command_jobs_step_column_shows_no_total(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    document = yaml.safe_load((ROOT / "examples" / "command-job.yaml").read_text())
    document["spec"]["command"]["working_dir"] = str(tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document))
    assert main(["submit", str(tmp_path / "job.yaml")]) == 0
    job_id = _submitted_id(capsys.readouterr().out)
    runtime.wait_started(job_id)
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    runtime.step(job_id, 1, 2.0)
    api.scheduler.tick()
    assert main(["list"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(job_id)]
    assert row.split()[4] == "1", row  # not "1/0": the program decides how many steps


def test_a_report_to_a_path_that_cannot_be_written_is_one_error_line(
    tmp_path: Path, api: ApiServer, runtime: ScriptedRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = _run_to_its_end(tmp_path, "reported", runtime, capsys, [5.0, 4.0, 3.0])
    (tmp_path / "file").write_text("")
    assert main(["report", job_id, "--out", str(tmp_path / "file" / "report.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "Traceback" not in err, err


@pytest.mark.parametrize("command", [["plan", str(ROOT / "examples" / "demo.yaml"), "--topology"], ["topology", "validate"]])
def test_a_topology_map_that_is_not_utf8_is_one_error_line(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "map.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main([*command, str(binary)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "Traceback" not in err, err


def test_a_report_of_an_unknown_id_names_neither_job_nor_sweep_it_found(
    api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "nope"]) == 1
    assert capsys.readouterr().err == "error: no job or sweep 'nope'\n"  # was "sweep 'nope' not found"
