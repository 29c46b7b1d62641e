"""Run the whole suite as one pytest process per test directory, then print the combined count.

`make test` uses it. Each directory (a layer of the code, plus reliability) gets a fresh process:
the Ray tests connect the test process to one embedded cluster after another, and Ray's in-process
GCS client has been seen to stop answering ("Deadline Exceeded", the node "timed out during startup")
after a dozen such clusters in one process. Every group runs even when an earlier one fails; the exit
status is non-zero when any group failed or collected no test (pytest's 5), so nothing is skipped
silently. The last line is the combined `N passed, N failed, N skipped` of every group.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent
GROUPS = (
    ("spec", ["spec", "test_layering.py"]),
    ("parallelism", ["parallelism"]),
    ("workers", ["workers"]),
    ("service", ["service"]),
    ("deploy", ["deploy"]),
    ("reliability", ["reliability"]),
)


def counts(junit: Path) -> dict[str, int]:
    """Passed, failed (failures and errors) and skipped tests of one pytest JUnit XML report."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


def main(extra: list[str]) -> int:
    covered = {entry for _, paths in GROUPS for entry in paths}
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
        for name, paths in GROUPS:
            junit = Path(tmp) / f"{name}.xml"
            print(f"==== {name}: pytest {' '.join('tests/' + p for p in paths)}", flush=True)
            command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra,
                       *(str(TESTS / p) for p in paths)]
            status = subprocess.call(command)
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
