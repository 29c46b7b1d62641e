"""Load benchmark: N concurrent authenticated clients issuing a realistic RPC mix against one service.

The service (bench/load/serve.py) is `trainctl serve`'s own `Service` in a separate process on
127.0.0.1, with authentication (an access file with three user tenants and an admin), a data root,
the embedded single-node Ray and the Prometheus endpoint; its GPU pool is held, so jobs stay QUEUED.
The clients (bench/load/load_clients.py) are asyncio gRPC clients, each on its own channel and TCP
connection, spread over `--processes` processes, each issuing one call at a time: CreateJob (valid;
invalid ones must get INVALID_ARGUMENT naming the broken field), GetJob, ListJobs with state and label
filters walked page by page, WatchJob (reads from a cursor, a few one-second follows), CancelJob,
PlanJob (valid and invalid), GetCluster, reads / watches / cancels of other tenants' jobs (must get
NOT_FOUND) and calls with an unknown token (UNAUTHENTICATED). Every call whose status or answer is not
what its kind must get counts as unexpected.

Reported: calls, unexpected calls and p50 / p99 latency per kind and per method, throughput, the
server process's peak RSS (VmHWM) and CPU time, the clients' CPU time, how many calls were in flight,
the server's own per-method, per-code RPC counters (from its /metrics) next to the clients', the load
average, and whether every job whose CreateJob was acknowledged is in the store afterwards.

`--store sqlite,postgresql` runs the same mix once per store, one after the other: SQLite in the
service's data directory, then PostgreSQL started here the way the tests start it
(tests/postgres_server.py, fsync on like SQLite's synced commits, stopped by its PID), with the ratio
of the two. `--outage S` takes the PostgreSQL server away for S seconds during its run, `--outage-at`
seconds after the clients start: a fast shutdown (SIGINT to the postmaster), then a start on the same
data directory and port. Any call may then answer UNAVAILABLE, but only between the stop and
`RECOVERY_LIMIT` seconds after the database accepts connections again (anything else unexpected is
still unexpected); reported: answers by code during the outage, and per request kind and method the
time from the database accepting connections to the first OK answer, and to health SERVING.

`--baseline COMMIT` first runs the same mix on a server importing that commit's `trainctl` (extracted
with `git archive`), then on this checkout's, and reports this checkout's figures over the baseline's.

    .venv/bin/python bench/load/bench_load.py --clients 200 --seconds 60 --out bench/load/results-load.json
    .venv/bin/python bench/load/bench_load.py --baseline 2881b7d --out bench/load/results-load-baseline.json
    .venv/bin/python bench/load/bench_load.py --store sqlite,postgresql --out bench/load/results-load-stores.json
    .venv/bin/python bench/load/bench_load.py --store postgresql --outage 20 --out bench/load/results-load-outage.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.request
from collections import Counter
from io import BytesIO
from pathlib import Path
from typing import Any

import grpc
import psycopg
import yaml
from load_clients import run_clients
from outage import HealthWatch, outage_markdown, outage_summary, take_database_away

from trainctl.service.store.db import open_database
from trainctl.wire.tokens import generate_token, hash_token

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the PostgreSQL server the tests start, not a copy of it

from postgres_server import PostgresServer  # noqa: E402

STORES = ("sqlite", "postgresql")
TENANTS = ("vision", "nlp", "speech")
START_TIMEOUT = 300.0
"""Seconds the service may take to come up (it starts an embedded Ray), and the clients to connect."""
SETTLE_SECONDS = 2.0
"""Wait before reading the server's counters: a follow's handler notices its client's deadline within 0.5 s."""
METRIC_LINE = re.compile(r"^trainctl_grpc_requests_total\{(.*)\} (\S+)$")
SERVICE_LOG_LINE = re.compile(r"lease|scheduler|readiness")
"""The service's log lines kept with an outage's results: its leadership, scheduler and readiness."""
SERVICE_LOG_LINES = 60
RECOVERY_LIMIT = 5.0
"""Seconds after the database accepts connections again within which every kind of call must answer OK
again; an UNAVAILABLE answer later than that (or before the stop) is unexpected."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_access_file(path: Path) -> dict[str, str]:
    """One user token per tenant and an admin token ("ops"); returns tenant -> token."""
    tokens = {tenant: generate_token() for tenant in (*TENANTS, "ops")}
    entries = [
        {"name": f"{tenant}-user", "tenant": tenant, "role": "admin" if tenant == "ops" else "user", "sha256": hash_token(token)}
        for tenant, token in tokens.items()
    ]
    path.write_text(yaml.safe_dump({"tokens": entries}))
    return tokens


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """A process's user + system CPU seconds so far (with its reaped children's), from /proc."""
    ticks = [int(t) for t in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]
    return sum(ticks if reaped_children else ticks[:2]) / os.sysconf("SC_CLK_TCK")


def database_cpu_seconds(postmaster: int) -> float:
    """CPU seconds of a PostgreSQL server so far: the postmaster, its live and its reaped children."""
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    total = cpu_seconds(postmaster, reaped_children=True)
    for child in children:
        with contextlib.suppress(FileNotFoundError):  # it ended meanwhile: its time is in the reaped children's
            total += cpu_seconds(int(child))
    return total


def proc_status(pid: int) -> dict[str, float]:
    """The server process's memory (MiB) and CPU seconds so far, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {
        "vm_hwm_mib": int(fields["VmHWM"].split()[0]) / 1024,
        "vm_rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "cpu_seconds": cpu_seconds(pid),
    }


def server_rpc_counts(metrics_port: int) -> dict[str, dict[str, int]]:
    """trainctl_grpc_requests_total from the service's Prometheus endpoint: method -> code -> count."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    counts: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
            counts.setdefault(labels["method"], {})[labels["code"]] = int(float(match[2]))
    return counts


def compare_counts(clients: dict[str, dict[str, int]], server: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Whether the server counted the calls the clients saw, by method and code, allowing for four known
    differences: UNAUTHENTICATED calls are left out on both sides (servers before the asyncio one
    refused them before their metrics interceptor saw them); a following WatchJob that reaches its client's deadline (DEADLINE_EXCEEDED) ends OK or
    CANCELLED on the server, depending on where its handler notices, or UNAVAILABLE when the database
    went away before it noticed (`follows_ended_unavailable_by_server`); and one whose deadline passes
    while it waits for a handler thread is never counted (`follows_not_counted_by_server`)."""
    def normalised(counts: dict[str, dict[str, int]]) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for method, codes in counts.items():
            for code, n in codes.items():
                if code != "UNAUTHENTICATED":
                    ended = method == "WatchJob" and code in ("DEADLINE_EXCEEDED", "CANCELLED")
                    out.setdefault(method, Counter())["OK" if ended else code] += n
        return out

    ours, theirs = normalised(clients), normalised(server)
    watches, served = ours.setdefault("WatchJob", Counter()), theirs.setdefault("WatchJob", Counter())
    expired = clients.get("WatchJob", {}).get("DEADLINE_EXCEEDED", 0)
    unavailable = min(max(0, served["UNAVAILABLE"] - watches["UNAVAILABLE"]), expired)
    served["UNAVAILABLE"] -= unavailable
    served["OK"] += unavailable
    missing = watches["OK"] - served["OK"]
    served["OK"] += missing
    return {"agree": ours == theirs and missing >= 0 and missing + unavailable <= expired,
            "follows_not_counted_by_server": missing, "follows_ended_unavailable_by_server": unavailable}


def start_server(
    work: Path, tokens_file: Path, data_root: Path, metrics_port: int, store: str | None, tree: Path | None = None,
) -> tuple[subprocess.Popen, str]:
    """serve.py in its own session, logging to `work`/serve.log, importing trainctl from `tree` (None: this
    checkout); the process and its address once it serves."""
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "serve.py"), f"--data-dir={work / 'data'}", f"--tokens-file={tokens_file}",
         f"--data-root={data_root}", f"--metrics-port={metrics_port}", *([f"--store={store}"] if store else [])],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
             "PYTHONPATH": str(tree or REPO)},
    )
    deadline = time.monotonic() + START_TIMEOUT
    while (match := re.search(r"serving on (127\.0\.0\.1:\d+)", (work / "serve.log").read_text())) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the service did not start:\n{(work / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, match[1]


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (graceful stop, which also stops its embedded Ray); SIGKILL of its group after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def client_process(numbers: list[int], settings: dict[str, Any], barrier: Any, results: Any) -> None:
    """Entry point of one client process: run its clients, put the outcome (or the traceback) on `results`."""
    try:
        results.put(asyncio.run(run_clients(numbers, ready=lambda: barrier.wait(START_TIMEOUT), **settings)))
    except BaseException:  # noqa: BLE001 - reported by the driver
        barrier.abort()
        results.put({"error": traceback.format_exc()})


def start_clients(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[list[Any], Any]:
    """`args.processes` client processes running `args.clients` clients with `settings`, started and past
    the start barrier (every channel connected); the processes and the queue their results come on."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(args.processes + 1), ctx.Queue()
    workers = [
        ctx.Process(target=client_process, args=(list(range(i, args.clients, args.processes)), settings, barrier, results))
        for i in range(args.processes)
    ]
    for w in workers:
        w.start()
    barrier.wait(START_TIMEOUT)
    return workers, results


def client_results(clients: tuple[list[Any], Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each client process's outcome once it has run `args.seconds`, the processes joined; raises with the
    tracebacks if any failed."""
    workers, results = clients
    parts = [results.get(timeout=args.seconds + START_TIMEOUT) for _ in workers]
    for w in workers:
        w.join(30)
    failed = [p["error"] for p in parts if "error" in p]
    if failed:
        raise RuntimeError("a client process failed:\n" + "\n".join(failed))
    return parts


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """p50 and p99 of latencies in seconds, as milliseconds."""
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50_ms": round(1e3 * statistics.median(values), 2), "p99_ms": round(1e3 * q[98], 2)}


def summarise(parts: list[dict[str, Any]], server: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The client processes' outcomes merged: per kind and per method, totals, rate, concurrency."""
    latencies: dict[str, list[float]] = {}
    codes: dict[str, Counter[str]] = {}
    methods: dict[str, str] = {}
    unexpected: Counter[str] = Counter()
    samples: dict[str, list[str]] = {}
    for part in parts:
        methods.update(part["methods"])
        unexpected.update(part["unexpected"])
        for kind, values in part["latencies"].items():
            latencies.setdefault(kind, []).extend(values)
            codes.setdefault(kind, Counter()).update(part["codes"][kind])
        for kind, kept in part["samples"].items():
            samples.setdefault(kind, []).extend(kept)
    window = max(p["finished"] for p in parts) - min(p["started"] for p in parts)
    by_kind = {
        kind: {"method": methods[kind], "calls": len(values), "unexpected": unexpected[kind], "codes": dict(codes[kind]),
               **percentiles_ms(values)}
        for kind, values in sorted(latencies.items(), key=lambda kv: (methods[kv[0]], kv[0]))
    }
    by_method: dict[str, list[float]] = {}
    client_counts: dict[str, Counter[str]] = {}
    for kind, values in latencies.items():
        by_method.setdefault(methods[kind], []).extend(values)
        client_counts.setdefault(methods[kind], Counter()).update(codes[kind])
    total = sum(len(v) for v in latencies.values())
    in_flight = [sum(values) for values in zip(*(p["in_flight_samples"] for p in parts), strict=False)]
    return {
        "date": time.strftime("%Y-%m-%d"), "clients": args.clients, "processes": args.processes,
        "seconds": args.seconds, "max_requests_per_client": args.max_requests, "seed": args.seed,
        "window_seconds": round(window, 2), "calls": total, "unexpected": sum(unexpected.values()),
        "calls_per_second": round(total / window, 1),
        "in_flight": {"mean": round(statistics.mean(in_flight), 1), "min": min(in_flight), "max": max(in_flight)},
        "client_cpu_seconds": [round(p["cpu_seconds"], 1) for p in parts],
        "by_method": {
            m: {"calls": len(v), "unexpected": sum(unexpected[k] for k in methods if methods[k] == m), **percentiles_ms(v)}
            for m, v in sorted(by_method.items())
        },
        "by_kind": by_kind, "unexpected_samples": samples, "server": server,
        "rpc_counts": {"clients": {m: dict(c) for m, c in sorted(client_counts.items())}},
    }


def check_store(location: str, acknowledged: list[str]) -> dict[str, Any]:
    """Whether every acknowledged job is in the store at `location` (read directly, the service stopped)."""
    db = open_database(location)
    try:
        stored = {row["id"] for row in db.execute("SELECT id FROM jobs").fetchall()}
    finally:
        db.close()
    missing = sorted(set(acknowledged) - stored)
    return {
        "acknowledged": len(acknowledged), "acknowledged_twice": len(acknowledged) - len(set(acknowledged)),
        "jobs_in_store": len(stored), "missing": len(missing), "missing_samples": missing[:5],
        "in_store_not_acknowledged": len(stored - set(acknowledged)),
    }


def database_transactions(url: str) -> int:
    """Transactions the database has counted (committed and rolled back; each statement outside an
    explicit transaction is one). The server publishes a session's counts within a second or so."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(
    args: argparse.Namespace, work: Path, database: PostgresServer | None = None, tree: Path | None = None,
) -> dict[str, Any]:
    """Start the service (trainctl from `tree`, None: this checkout) in `work` on SQLite there or on a new
    database of `database`, run the client processes against it (taking `database` away for
    `args.outage` seconds if set), stop it; the summary."""
    data_root = work / "datasets"
    (data_root / "corpus").mkdir(parents=True)
    (data_root / "corpus" / "a.txt").write_text(__doc__ * 50)
    tokens = write_access_file(work / "access.yaml")
    metrics_port = free_port()
    store = database.create_database() if database is not None else None
    with_outage = database is not None and args.outage > 0
    load_before = load_average()
    proc, target = start_server(work, work / "access.yaml", data_root, metrics_port, store, tree)
    health: HealthWatch | None = None
    try:
        idle = proc_status(proc.pid)
        settings = {
            "tokens": {t: tokens[t] for t in TENANTS}, "target": target, "data_root": str(data_root),
            "seconds": args.seconds, "max_requests": args.max_requests, "seed": args.seed, "processes": args.processes,
            "unavailable_allowed": with_outage,
        }
        clients = start_clients(args, settings)
        load_started = time.time()
        before = proc_status(proc.pid)
        postmaster = database.process.pid if database is not None and database.process is not None else None
        database_before = database_cpu_seconds(postmaster) if postmaster else 0.0
        transactions_before = database_transactions(store) if store else 0
        times = None
        if with_outage:
            health = HealthWatch(target).start()
            times = take_database_away(database, load_started + args.outage_at, args.outage)
        parts = client_results(clients, args)
        after = proc_status(proc.pid)
        database_after = database_cpu_seconds(postmaster) if postmaster and not with_outage else None
        load_after = load_average()
        server = {
            "pid_rss_idle_mib": round(idle["vm_rss_mib"], 1), "peak_rss_mib": round(after["vm_hwm_mib"], 1),
            "rss_after_mib": round(after["vm_rss_mib"], 1), "threads_after": after["threads"],
            "cpu_seconds_under_load": round(after["cpu_seconds"] - before["cpu_seconds"], 1),
        }
        if database_after is not None:  # an outage replaces the postmaster: its CPU time is not comparable
            server["database_cpu_seconds_under_load"] = round(database_after - database_before, 1)
        summary = summarise(parts, server, args)
        summary["load_average"] = {"before": load_before, "after": load_after}
        if times is not None and health is not None:
            summary["outage"] = outage_summary(parts, times, health.stop(), RECOVERY_LIMIT)
            health = None
            summary["unexpected"] += summary["outage"]["unavailable_outside_window"]
        time.sleep(SETTLE_SECONDS)
        if store:
            summary["server"]["database_transactions"] = database_transactions(store) - transactions_before
        summary["rpc_counts"]["server"] = server_rpc_counts(metrics_port)
        summary["rpc_counts"].update(compare_counts(summary["rpc_counts"]["clients"], summary["rpc_counts"]["server"]))
    finally:
        if health is not None:
            health.stop()
        code = stop_server(proc)
    summary["server"]["exit_code"] = code
    if "outage" in summary:
        log = (work / "serve.log").read_text(errors="replace").splitlines()
        summary["outage"]["service_log"] = [line for line in log if SERVICE_LOG_LINE.search(line)][:SERVICE_LOG_LINES]
    summary["store"] = {"backend": "postgresql" if database is not None else "sqlite",
                        **check_store(store or str(work / "data"), [i for p in parts for i in p["acknowledged"]])}
    return summary


def run_on(backend: str, args: argparse.Namespace, work: Path, tree: Path | None = None) -> dict[str, Any]:
    """`run` on SQLite, or on a PostgreSQL server started for it (fsync on) and removed afterwards."""
    if backend == "sqlite":
        return run(args, work, tree=tree)
    database = PostgresServer(durable=True)
    try:
        database.start()
        summary = run(args, work, database, tree)
        with psycopg.connect(database.url()) as conn:
            summary["store"]["server_version"] = conn.info.server_version
        return summary
    finally:
        database.remove()


def markdown(summary: dict[str, Any]) -> str:
    """The per-method, per-kind table."""
    rows = ["| method | request kind | calls | unexpected | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    for method, m in summary["by_method"].items():
        rows.append(f"| **{method}** | all | {m['calls']} | {m['unexpected']} | {m['p50_ms']} | {m['p99_ms']} |")
        for kind, k in summary["by_kind"].items():
            if k["method"] == method:
                codes = ", ".join(f"{c} {n}" for c, n in sorted(k["codes"].items()))
                rows.append(f"| | {kind} ({codes}) | {k['calls']} | {k['unexpected']} | {k['p50_ms']} | {k['p99_ms']} |")
    return "\n".join(rows)


def comparison(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """`second`'s throughput and per-method p50 / p99 over `first`'s."""
    def ratio(a: float, b: float) -> float | None:
        return round(b / a, 2) if a else None

    return {
        "calls_per_second": ratio(first["calls_per_second"], second["calls_per_second"]),
        "by_method": {
            m: {"p50": ratio(a["p50_ms"], second["by_method"][m]["p50_ms"]), "p99": ratio(a["p99_ms"], second["by_method"][m]["p99_ms"])}
            for m, a in first["by_method"].items() if m in second["by_method"]
        },
    }


def comparison_markdown(names: list[str], backends: dict[str, dict[str, Any]], ratios: dict[str, Any]) -> str:
    """Per method, side by side: calls, unexpected, p50, p99 on each store, and the p50 / p99 ratios."""
    a, b = (backends[n] for n in names)
    cells = " | ".join(f"{n} calls | {n} unexpected | {n} p50 ms | {n} p99 ms" for n in names)
    rows = [f"| method | {cells} | p50 ratio | p99 ratio |", "|---" * (3 + 4 * len(names)) + "|"]
    for method, r in ratios["by_method"].items():
        stats = " | ".join(
            f"{s['by_method'][method]['calls']} | {s['by_method'][method]['unexpected']} | "
            f"{s['by_method'][method]['p50_ms']} | {s['by_method'][method]['p99_ms']}" for s in (a, b))
        rows.append(f"| {method} | {stats} | {r['p50']} | {r['p99']} |")
    totals = " | ".join(f"**{s['calls']}** ({s['calls_per_second']}/s) | **{s['unexpected']}** | | " for s in (a, b))
    rows.append(f"| **total** | {totals} | {ratios['calls_per_second']} (calls/s) | |")
    return "\n".join(rows)


def commit() -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes (other than results files)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", ".", ":!bench/load/results-*.json"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def extract_trainctl(commit: str, into: Path) -> None:
    """The `trainctl` package of `commit` under `into`, for a baseline server."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "trainctl"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The clients' options: how many, for how long, over how many processes, their cap and seed."""
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the clients issue requests")
    parser.add_argument("--processes", type=int, default=2, help="client processes the clients are spread over")
    parser.add_argument("--max-requests", type=int, default=100_000, help="cap on each client's requests")
    parser.add_argument("--seed", type=int, default=0)


def failed(summary: dict[str, Any]) -> bool:
    outage = summary.get("outage")
    return bool(summary["unexpected"] or summary["store"]["missing"] or (outage and not outage["recovered_within_limit"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_arguments(parser)
    parser.add_argument("--store", default="sqlite", help=f"the stores to run the mix on, one after the other: {', '.join(STORES)}")
    parser.add_argument("--outage", type=float, default=0.0, help="seconds the PostgreSQL server is stopped during its run")
    parser.add_argument("--outage-at", type=float, default=15.0, help="seconds after the clients start that the outage begins")
    parser.add_argument(
        "--baseline", metavar="COMMIT",
        help="first run the same mix on a server of this commit's trainctl (one store only), then on this checkout's; "
        "the ratio is this checkout's over the baseline's",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    names = args.store.split(",")
    if any(n not in STORES for n in names) or len(set(names)) != len(names):
        parser.error(f"--store: a comma-separated list of distinct stores from {', '.join(STORES)}, got {args.store!r}")
    if args.baseline and len(names) != 1:
        parser.error("--baseline compares two trees on one store: give one --store")
    if args.outage and "postgresql" not in names:
        parser.error("--outage takes the PostgreSQL server away: it needs --store postgresql")
    if args.outage and args.outage_at + args.outage + RECOVERY_LIMIT > args.seconds:
        parser.error(f"--outage-at + --outage + {RECOVERY_LIMIT:g} s of recovery must fit in --seconds {args.seconds:g}")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit(), "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
                    "psycopg": psycopg.__version__},
        "backends": {},
    }
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="trainctl-bench-load-") as work:
            extract_trainctl(args.baseline, Path(work) / "tree")
            baseline = run_on(names[0], args, Path(work), Path(work) / "tree")
        results["baseline"] = {"commit": args.baseline, "store": names[0], **baseline}
        print(f"## baseline {args.baseline} on {names[0]}\n\n{markdown(baseline)}\n")
    for name in names:
        with tempfile.TemporaryDirectory(prefix="trainctl-bench-load-") as work:
            summary = run_on(name, args, Path(work))
        results["backends"][name] = summary
        print(f"## {name}\n\n{markdown(summary)}\n")
        if "outage" in summary:
            print(outage_markdown(summary["outage"]) + "\n")
        print(json.dumps({k: v for k, v in summary.items() if k not in ("by_kind", "by_method", "rpc_counts", "outage")}, indent=1))
    if len(names) == 2:
        results["ratio"] = {"of": f"{names[1]} / {names[0]}", **comparison(*(results["backends"][n] for n in names))}
        print(comparison_markdown(names, results["backends"], results["ratio"]))
    if args.baseline:
        runs = {f"baseline {args.baseline}": results["baseline"], "this tree": results["backends"][names[0]]}
        results["ratio"] = {"of": f"this tree / baseline {args.baseline}", **comparison(*runs.values())}
        print(comparison_markdown(list(runs), runs, results["ratio"]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if any(failed(s) for s in [*results["backends"].values(), *([results["baseline"]] if args.baseline else [])]) else 0


if __name__ == "__main__":
    sys.exit(main())
