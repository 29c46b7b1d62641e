"""Run the whole suite as one pytest process per test directory, then print the combined count.

`make test` uses it. Each directory (a layer of the code, plus reliability) gets a fresh process:
the Ray tests connect the test process to one embedded cluster after another, and Ray's in-process
GCS client has been seen to stop answering ("Deadline Exceeded", the node "timed out during startup")
after a dozen such clusters in one process. Every group runs even when an earlier one fails; the exit
status is non-zero when any group failed or collected no test (pytest's 5), so nothing is skipped
silently. The last line is the combined `N passed, N failed, N skipped` of every group.

Groups run one after another, except that the first stage runs at once the engine tests (`parallelism`,
which keep both CPUs busy), `deploy`, `spec`, the service tests that start no Ray cluster (`service-unit`)
and those that train jobs on an embedded cluster (`service-ray`): the others mostly wait (for a
Prometheus server, `ray start`, a job's ranks) and none of them is timing-sensitive. The Ray fault tests
in workers/ and reliability/, whose heartbeat and step timeouts a loaded machine could trip, and the
service tests timed by database leases (`service-lease`) run alone. A group run beside another writes to
a file, printed when it ends, so the outputs do not interleave. A directory split into groups by the
`slow` marker (tests/conftest.py) and by file has every test in exactly one of them.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LEASE_TESTS = ("service/test_leadership.py", "service/test_store_outage.py")
"""Service tests timed by database leases of a second or more: they run alone."""
STAGES = (
    (
        ("parallelism", ["parallelism"], ()),
        ("deploy", ["deploy"], ()),
        ("spec", ["spec", "test_layering.py"], ()),
        ("service-unit", ["service"], ("-m", "not slow")),
        ("service-ray", ["service"], ("-m", "slow", *(f"--ignore={TESTS / path}" for path in LEASE_TESTS))),
    ),
    (("workers", ["workers"], ()),),
    (("service-lease", list(LEASE_TESTS), ("-m", "slow")),),
    (("reliability", ["reliability"], ()),),
)
"""Groups (name, paths under tests/, pytest selection arguments) by stage; the groups of one stage run at once."""
GROUPS = tuple(group for stage in STAGES for group in stage)


def counts(junit: Path) -> dict[str, int]:
    """Passed, failed (failures and errors) and skipped tests of one pytest JUnit XML report."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


def main(extra: list[str]) -> int:
    covered = {entry for _, paths, _ in GROUPS for entry in paths}
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
        for stage in STAGES:
            running = []
            for index, (name, paths, selection) in enumerate(stage):
                junit = Path(tmp) / f"{name}.xml"
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
