"""CLI start-up: wall time of `trainctl --help`, `trainctl list` and `trainctl get JOB`, each a fresh process,
against a running service (issue 16: each ≤ 0.5 s on the 2-core machine; issue 34: ≤ 0.4 s median).

The service is `trainctl serve`'s `Service` in this process (embedded Ray, SQLite), holding one cancelled
job; nothing else runs while the commands are timed. Each command runs `--runs` times as
`python -m trainctl.cli.main ...`, as the `trainctl` script does; `python -c pass` is timed the same way,
the interpreter's own floor. `--baseline COMMIT` also times the same commands importing that commit's
`trainctl` (extracted with `git archive`, run from its directory), run for run in turn with this tree's,
for the ratio.

    .venv/bin/python bench/api/bench_cli_start.py --baseline 975a196 --out bench/api/results-cli-start.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from io import BytesIO  # noqa: E402
from pathlib import Path  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.validate import load_job_file  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def timed(argv: list[str], pythonpath: Path, server: str) -> float:
    """Seconds one run of `argv` takes; it must succeed. It runs in `pythonpath`: `python -m` puts the
    working directory first on sys.path, ahead of PYTHONPATH (run in the repository, a baseline tree
    would import the repository's trainctl, not its own)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "TRAINCTL_SERVER": server}
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=pythonpath, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds


def _summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "median_s": round(statistics.median(samples), 3),
        "p90_s": round(samples[min(len(samples) - 1, int(0.9 * len(samples)))], 3),
        "min_s": round(samples[0], 3),
    }


def measure(trees: dict[str, Path], server: str, job_id: str, runs: int) -> dict[str, dict[str, dict[str, float]]]:
    """Median, p90 and min seconds per command, per tree trainctl is imported from. The trees take turns
    run by run, so a load that comes and goes (other work on the machine) falls on each alike."""
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "trainctl --help": [sys.executable, "-m", "trainctl.cli.main", "--help"],
        "trainctl list": [sys.executable, "-m", "trainctl.cli.main", "list"],
        "trainctl get JOB": [sys.executable, "-m", "trainctl.cli.main", "get", job_id],
    }
    out: dict[str, dict[str, dict[str, float]]] = {label: {} for label in trees}
    for name, argv in commands.items():
        samples: dict[str, list[float]] = {label: [] for label in trees}
        for tree in trees.values():
            timed(argv, tree, server)  # warm the page cache and the .pyc files
        for _ in range(runs):
            for label, tree in trees.items():
                samples[label].append(timed(argv, tree, server))
        for label in trees:
            out[label][name] = _summary(samples[label])
            print(f"{label}: {name}: {out[label][name]}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--baseline", metavar="COMMIT", help="also time this commit's trainctl, in turn, for a ratio")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainctl-cli-start-") as tmp:
        work = Path(tmp)
        service = Service(ServiceConfig(address="127.0.0.1:0", data_dir=work / "data", metrics_port=0)).start()
        try:
            with TrainctlClient(service.target) as client:
                job = client.create_job(load_job_file(REPO / "examples" / "demo.yaml"))
                client.cancel_job(job.id)
            results: dict = {
                "date": time.strftime("%Y-%m-%d"), "runs": args.runs, "load_average_before": os.getloadavg(),
                "python": sys.version.split()[0],
            }
            trees = {"this tree": REPO}
            if args.baseline:
                archive = subprocess.run(
                    ["git", "-C", str(REPO), "archive", args.baseline, "trainctl"], check=True, capture_output=True
                ).stdout
                with tarfile.open(fileobj=BytesIO(archive)) as tar:
                    tar.extractall(work / "baseline", filter="data")
                trees = {"baseline": work / "baseline", **trees}
            measured = measure(trees, service.target, job.id, args.runs)
            if args.baseline:
                results["baseline"] = {"commit": args.baseline, **measured["baseline"]}
            results["this tree"] = measured["this tree"]
            if args.baseline:
                results["ratio_of_medians"] = {
                    name: round(results["this tree"][name]["median_s"] / results["baseline"][name]["median_s"], 2)
                    for name in results["this tree"]
                }
            results["load_average_after"] = os.getloadavg()
        finally:
            service.stop()
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
