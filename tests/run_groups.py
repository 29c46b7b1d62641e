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

Groups run one after another, except that `deploy`, `spec` and the service tests that start no Ray cluster
(`service-unit`, the service directory's fast tier) run beside `parallelism`: deploy's tests mostly wait (for a
Prometheus server, `ray start`, a service's first scrape) while the engine tests keep the CPUs busy, and none
of them is timing-sensitive (the Ray fault tests in workers/ and reliability/, whose heartbeat and step
timeouts a loaded machine could trip, run alone). A group run beside another writes to a file, printed
when it ends, so the outputs do not interleave. A directory split in two groups by the `slow` marker
(tests/conftest.py) has every test in exactly one of them.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STAGES = (
    (
        ("parallelism", ["parallelism"], None),
        ("deploy", ["deploy"], None),
        ("spec", ["spec", "planning", "test_layering.py"], None),
        ("service-unit", ["service"], "not slow"),
    ),
    (("workers", ["workers"], None),),
    (("service", ["service"], "slow"),),
    (("reliability", ["reliability"], None),),
)
"""Groups (name, paths under tests/, marker expression or None for all) by stage; the groups of one stage run at once."""
FAST_STAGES = (
    (
        ("parallelism-fast", ["parallelism"], "not slow"),
        ("service-fast", ["service"], "not slow"),
        ("others-fast", ["deploy", "spec", "planning", "test_layering.py", "workers", "reliability"], "not slow"),
    ),
)
"""`--fast`: the tests not marked slow, every directory in one of three groups run at once."""


def counts(junit: Path) -> dict[str, int]:
    """Passed, failed (failures and errors) and skipped tests of one pytest JUnit XML report."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


def main(extra: list[str]) -> int:
    fast = "--fast" in extra
    extra = [arg for arg in extra if arg != "--fast"]
    stages = FAST_STAGES if fast else STAGES
    covered = {entry for stage in stages for _, paths, _ in stage for entry in paths}
    collectable = {
        p.name for p in TESTS.iterdir()
        if (p.is_file() and p.name.startswith("test_") and p.suffix == ".py") or (p.is_dir() and any(p.rglob("test_*.py")))
    }
    if uncovered := sorted(collectable - covered):
        print(f"run_groups: {', '.join(uncovered)} under tests/ belong to no group", file=sys.stderr)
        return 2
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_groups = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            running = []
            for index, (name, paths, marks) in enumerate(stage):
                junit = Path(tmp) / f"{name}.xml"
                selection = [] if marks is None else ["-m", marks]
                command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra,
                           *selection, *(str(TESTS / p) for p in paths)]
                header = f"==== {name}: pytest {shlex.join([*selection, *('tests/' + p for p in paths)])}"
                if index == 0:
                    print(header, flush=True)
                    output = None
                else:
                    output = (Path(tmp) / f"{name}.out").open("w")
                    output.write(header + "\n")
                    output.flush()
                running.append((name, junit, output, subprocess.Popen(command, stdout=output, stderr=output)))
            for name, junit, output, proc in running:
                status = proc.wait()
                if output is not None:
                    output.close()
                    print(Path(output.name).read_text(), end="", flush=True)
                if status != 0:
                    failed_groups.append(f"{name} (exit {status})")
                if junit.exists():
                    for key, value in counts(junit).items():
                        total[key] += value
    if failed_groups:
        print(f"failed groups: {', '.join(failed_groups)}", flush=True)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", flush=True)
    return 1 if failed_groups else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
