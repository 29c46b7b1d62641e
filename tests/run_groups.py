"""Run the whole suite as one pytest process per test directory, then print the combined count.

`make test` uses it (`make test-fast` too, with `--fast`). Each directory (a layer of the code, plus reliability) gets a fresh process:
the Ray tests connect the test process to one embedded cluster after another, and Ray's in-process
GCS client has been seen to stop answering ("Deadline Exceeded", the node "timed out during startup")
after a dozen such clusters in one process. Every group runs even when an earlier one fails; the exit
status is non-zero when any group failed or collected no test (pytest's 5), so nothing is skipped
silently. The last line is the combined `N passed, N failed, N skipped` of every group.

`--fast` (`make test-fast`) runs only the tests not marked slow, as three groups at once: the engine's quick
gloo layouts, whose worker processes keep one core or two busy, beside the control plane's and the rest's,
each a pytest process on one core (in one process the whole tier left a core idle most of the time).

The suite is CPU-bound, and the Ray groups leave a fifth to a quarter of the machine idle while they wait
(for a heartbeat to lapse, a node to be declared dead, a job to be preempted). So the engine's tests, pure
computation with nothing timed against the wall clock but generous timeouts, run in the `BACKGROUND` from
start to end at the lowest CPU priority (nice 19): they take what the other groups leave, and a group
beside them keeps the CPUs as if alone. The other groups run in stages, one stage after another: first
`deploy`, `spec` and the service tests that start no Ray cluster (`service-unit`, the service directory's
fast tier) at once (deploy's tests mostly wait: for a Prometheus server, `ray start`, a service's first
scrape), then `workers` and `service` alone (Ray fault tests whose heartbeat and step timeouts a loaded
machine could trip). Those two keep a core busy on average and wait the rest of the time (a heartbeat to
lapse, a node declared dead, a job preempted): the background fills that time, and once it has ended the
`FILLER` group (`reliability`, Ray fault tests as well) starts beside `service` in its place; it runs
after `service` only when the background outlasts it. The engine's tests that do assert wall-clock bounds (a chat
template stopped within seconds) run in `spec` instead. A group run beside another writes to a file,
printed when it ends, so the outputs do not interleave. A directory split in two groups (by the `slow`
marker, tests/conftest.py, or by files left to another group) has every test in exactly one of them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, NamedTuple

TESTS = Path(__file__).resolve().parent


class Group(NamedTuple):
    """One pytest process: its name, its paths under tests/, a marker expression (None: every test) and
    the files under tests/ it leaves to another group."""

    name: str
    paths: tuple[str, ...]
    marks: str | None = None
    ignore: tuple[str, ...] = ()


WALL_CLOCK_ENGINE_TESTS = ("parallelism/test_chat_template_bounds.py",)
"""Engine test files that assert wall-clock bounds: run in a stage, not in the background."""
BACKGROUND = Group("parallelism", ("parallelism",), ignore=WALL_CLOCK_ENGINE_TESTS)
"""`make test`'s group that runs at the lowest CPU priority beside every stage (see the module docstring)."""
BACKGROUND_NICENESS = 19
STAGES = (
    (
        Group("deploy", ("deploy",)),
        Group("spec", ("spec", "planning", "test_layering.py", *WALL_CLOCK_ENGINE_TESTS)),
        Group("service-unit", ("service",), "not slow"),
    ),
    (Group("workers", ("workers",)),),
    (Group("service", ("service",), "slow"),),
)
"""`make test`'s other groups by stage; the groups of one stage run at once."""
FILLER = Group("reliability", ("reliability",))
"""`make test`'s group that starts beside the last stage as soon as the background group has ended (the CPU it
took is free then), or after the last stage when that ends first."""
FAST_STAGES = (
    (
        Group("parallelism-fast", ("parallelism",), "not slow"),
        Group("service-fast", ("service",), "not slow"),
        Group("others-fast", ("deploy", "spec", "planning", "test_layering.py", "workers", "reliability"), "not slow"),
    ),
)
"""`--fast`: the tests not marked slow, every directory in one of three groups run at once (no background)."""


def counts(junit: Path) -> dict[str, int]:
    """Passed, failed (failures and errors) and skipped tests of one pytest JUnit XML report."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


class Running(NamedTuple):
    name: str
    junit: Path
    output: IO[str] | None
    """The file its output goes to (None: this process's output)."""
    proc: subprocess.Popen


def start(group: Group, tmp: Path, extra: list[str], *, to_file: bool, niceness: int = 0) -> Running:
    """Start `group`'s pytest process (its output to a file under `tmp` when `to_file`)."""
    junit = tmp / f"{group.name}.xml"
    selection = [] if group.marks is None else ["-m", group.marks]
    ignored = [f"--ignore={TESTS / path}" for path in group.ignore]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra,
               *selection, *ignored, *(str(TESTS / p) for p in group.paths)]
    header = " ".join([f"==== {group.name}: pytest", shlex.join([*selection, *("tests/" + p for p in group.paths)]),
                       *(f"(not tests/{path})" for path in group.ignore), *([f"(nice {niceness})"] if niceness else [])])
    output = None
    if to_file:
        output = (tmp / f"{group.name}.out").open("w")
        output.write(header + "\n")
        output.flush()
    else:
        print(header, flush=True)
    niced = (lambda: os.nice(niceness)) if niceness else None
    return Running(group.name, junit, output, subprocess.Popen(command, stdout=output, stderr=output, preexec_fn=niced))


def finish(running: Running, total: dict[str, int], failed_groups: list[str]) -> None:
    """Wait for a started group, print its output if it went to a file, and add its counts."""
    status = running.proc.wait()
    if running.output is not None:
        running.output.close()
        print(Path(running.output.name).read_text(), end="", flush=True)
    if status != 0:
        failed_groups.append(f"{running.name} (exit {status})")
    if running.junit.exists():
        for key, value in counts(running.junit).items():
            total[key] += value


def main(extra: list[str]) -> int:
    fast = "--fast" in extra
    extra = [arg for arg in extra if arg != "--fast"]
    stages, background = (FAST_STAGES, None) if fast else (STAGES, BACKGROUND)
    groups = [group for stage in stages for group in stage] + ([background, FILLER] if background else [])
    covered = {path.split("/", 1)[0] for group in groups for path in group.paths}
    collectable = {
        p.name for p in TESTS.iterdir()
        if (p.is_file() and p.name.startswith("test_") and p.suffix == ".py") or (p.is_dir() and any(p.rglob("test_*.py")))
    }
    if uncovered := sorted(collectable - covered):
        print(f"run_groups: {', '.join(uncovered)} under tests/ belong to no group", file=sys.stderr)
        return 2
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_groups: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        behind = start(background, Path(tmp), extra, to_file=True, niceness=BACKGROUND_NICENESS) if background else None
        filler: Running | None = None
        for number, stage in enumerate(stages, start=1):
            running = [start(group, Path(tmp), extra, to_file=index > 0) for index, group in enumerate(stage)]
            while number == len(stages) and behind is not None and filler is None and running[0].proc.poll() is None:
                if behind.proc.poll() is not None:
                    filler = start(FILLER, Path(tmp), extra, to_file=True)
                    break
                time.sleep(1.0)
            for group in running:
                finish(group, total, failed_groups)
        if behind is not None:
            if filler is None:
                filler = start(FILLER, Path(tmp), extra, to_file=False)
            finish(filler, total, failed_groups)
            finish(behind, total, failed_groups)
    if failed_groups:
        print(f"failed groups: {', '.join(failed_groups)}", flush=True)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", flush=True)
    return 1 if failed_groups else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
