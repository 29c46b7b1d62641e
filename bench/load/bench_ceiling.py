"""The load mix's ceiling on this machine: bench_load.py's clients against a server that does no work.

The same client processes, mix, client count and duration as bench_load.py, against null_server.py
(gRPC on asyncio answering fixed bytes: no auth, store, validation or scheduler) instead of the service.
Its answers do not pass the mix's checks, so unexpected answers are counted but mean nothing here.
What it measures is how many calls per second this machine's CPUs allow the clients and a Python gRPC
server together, and the latency that concurrency gives at that rate: no server in Python can answer the
mix faster here. Reported: calls/s and p50 / p99 per method, the clients' and the server's CPU seconds
per call, the mean number of calls in flight over calls/s (Little's law: the mean latency any server
reaching that rate would give), and with `--baseline COMMIT` (that commit's service under the same
mix first, as bench_load.py runs it) the ceiling over the baseline's calls/s: the largest speed-up
over that commit this machine can show.

    .venv/bin/python bench/load/bench_ceiling.py --baseline b4d4df5 --out bench/load/results-ceiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from bench_load import (
    HERE,
    START_TIMEOUT,
    TENANTS,
    add_client_arguments,
    client_results,
    commit,
    extract_trainctl,
    load_average,
    markdown,
    proc_status,
    run_on,
    start_clients,
    stop_server,
    summarise,
)

from trainctl.wire.tokens import generate_token


def start_null_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    """null_server.py in its own session; the process and its address once it serves."""
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, str(HERE / "null_server.py")], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while (match := re.search(r"serving on (127\.0\.0\.1:\d+)", log_path.read_text())) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the null server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, match[1]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The client processes against a null server for `args.seconds`; the summary with CPU per call."""
    proc, target = start_null_server(work / "null_server.log")
    load_before = load_average()
    try:
        settings = {
            "tokens": {t: generate_token() for t in TENANTS}, "target": target, "data_root": str(work),
            "seconds": args.seconds, "max_requests": args.max_requests, "seed": args.seed, "processes": args.processes,
        }
        clients = start_clients(args, settings)
        before = proc_status(proc.pid)
        parts = client_results(clients, args)
        after = proc_status(proc.pid)
    finally:
        code = stop_server(proc)
    server = {"cpu_seconds_under_load": round(after["cpu_seconds"] - before["cpu_seconds"], 1),
              "peak_rss_mib": round(after["vm_hwm_mib"], 1), "exit_code": code}
    summary = summarise(parts, server, args)
    summary["load_average"] = {"before": load_before, "after": load_average()}
    calls = summary["calls"]
    summary["cpu_ms_per_call"] = {
        "clients": round(1e3 * sum(summary["client_cpu_seconds"]) / calls, 3),
        "server": round(1e3 * server["cpu_seconds_under_load"] / calls, 3),
    }
    summary["littles_law_mean_latency_ms"] = round(1e3 * summary["in_flight"]["mean"] / summary["calls_per_second"], 1)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_arguments(parser)
    parser.add_argument("--baseline", metavar="COMMIT",
                        help="first run the mix on this commit's service (SQLite), as bench_load.py --baseline does, "
                        "and report the ceiling over its calls/s")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    args.outage = 0.0
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit(), "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__},
    }
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="trainctl-bench-ceiling-") as work:
            extract_trainctl(args.baseline, Path(work) / "tree")
            results["baseline"] = {"commit": args.baseline, **run_on("sqlite", args, Path(work), Path(work) / "tree")}
        print(f"## baseline {args.baseline} on sqlite\n\n{markdown(results['baseline'])}\n")
    with tempfile.TemporaryDirectory(prefix="trainctl-bench-ceiling-") as work:
        results["ceiling"] = summary = run(args, Path(work))
    print(f"## null server\n\n{markdown(summary)}\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("by_kind", "by_method", "rpc_counts", "unexpected_samples")},
                     indent=1))
    if args.baseline:
        results["ceiling_over_baseline"] = round(summary["calls_per_second"] / results["baseline"]["calls_per_second"], 2)
        print(f"baseline {args.baseline}: {results['baseline']['calls_per_second']} calls/s, "
              f"{results['baseline']['unexpected']} unexpected; ceiling over baseline: {results['ceiling_over_baseline']}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
