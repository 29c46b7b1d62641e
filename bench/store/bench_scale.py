"""Store scale: a service whose store holds 10,000 queued jobs and 1,000,000 events.

Preloads a store (schema from `JobStore`, rows written in bulk: every job QUEUED and asking for more
GPUs than the pool has, so the head of the queue blocks the rest, with labels and 100 events each):
SQLite in the service's data directory, or with `--store postgresql` a database on a PostgreSQL server
started here the way the tests start it (tests/postgres_server.py, fsync on, stopped by its PID), then
analyzed (`--no-analyze`: not), as autovacuum does within a minute of such a load; until then the
planner estimates one row per table and picks plans that read every matching job. Then, against the
real `trainctl serve` process on a Ray head this script starts:

- start: seconds from starting `trainctl serve` to its first OK GetJob, cold and after a SIGKILL;
- reads: 20 concurrent clients (asyncio gRPC, 2 processes) issuing GetJob of random jobs and ListJobs
  pages (no filter, the QUEUED state, a label, the page after a token) for `--warmup` seconds (not
  recorded: a service's first reads of a job convert it once; the steady state is the figure) and then
  `--seconds`; p50 / p99 per method at the client, and the service's resident memory after them;
- admission: with the service stopped, `Scheduler.tick()` on the same store and pool (in this
  process): the first pass, then the p50 / max of `--passes` more.

    .venv/bin/python bench/store/bench_scale.py --out bench/store/results-scale.json
    .venv/bin/python bench/store/bench_scale.py --store postgresql --out bench/store/results-scale-postgres.json
    .venv/bin/python bench/store/bench_scale.py --store postgresql --no-analyze --out bench/store/results-scale-postgres-unanalyzed.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psycopg

from trainctl.planning.pool import GpuPool
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.store import DB_NAME, EVENT_LOG, JobStore, total_steps
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.workers.embedded import topology_labels
from trainctl.workers.events import JobState
from trainctl.workers.resources import slot_resources
from trainctl.workers.topology import simulated_topology

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests"))  # the PostgreSQL server the tests start, not a copy of it

from postgres_server import PostgresServer  # noqa: E402

BIN = Path(sys.executable).parent
GPUS = 2
"""GPU slots of the one Ray node; every preloaded job asks for more, so none is admitted."""
LABELS = ("a", "b", "c")
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def preload(location: str, jobs: int, events: int, *, analyze: bool = True) -> list[str]:
    """A store at `location` (a data directory or a PostgreSQL URL) of `jobs` QUEUED jobs (priorities 0-4,
    label team=a|b|c) and `events` log events; the job ids. `analyze`: a PostgreSQL store's statistics
    are gathered after the load."""
    JobStore(location).close()  # the current schema
    job = TrainingJob.model_validate({
        "metadata": {"name": "scale"},
        "spec": {"model": {"preset": "debug"}, "parallelism": {"dp_shard": GPUS * 2},
                 "resources": {"gpus": GPUS * 2, "device": "cpu"}},
    })
    spec, steps, now = job.model_dump_json(), total_steps(job), time.time()
    ids = [f"scale-{i:06d}" for i in range(jobs)]
    payload = json.dumps({"message": "step 10: loss 2.3456 grad_norm 0.812 lr 0.0003 tokens/s 123456"})
    tables = {
        "jobs (id, seq, tenant, name, spec, priority, state, reason, create_time, update_time, total_steps)": (
            (job_id, i + 1, "default", "scale", spec, i % 5, JobState.QUEUED.value, "accepted", now + i * 1e-3, now, steps)
            for i, job_id in enumerate(ids)
        ),
        "job_labels (job_id, key, value)": ((job_id, "team", LABELS[i % 3]) for i, job_id in enumerate(ids)),
        "events (job_id, time, type, payload)": ((ids[k % jobs], now, EVENT_LOG, payload) for k in range(events)),
    }
    if location.startswith("postgresql://"):
        with psycopg.connect(location) as conn, conn.cursor() as cursor:
            for table, rows in tables.items():
                with cursor.copy(f"COPY {table} FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
        if analyze:
            with psycopg.connect(location, autocommit=True) as conn:
                conn.execute("ANALYZE")
        return ids
    db = sqlite3.connect(Path(location) / DB_NAME)
    with db:
        for table, rows in tables.items():
            marks = ", ".join("?" for _ in table[table.index("(") + 1:-1].split(", "))
            db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
    db.close()
    return ids


def store_mib(location: str) -> float:
    if location.startswith("postgresql://"):
        with psycopg.connect(location) as conn:
            return round(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0] / 2**20, 1)
    return round(sum(f.stat().st_size for f in Path(location).iterdir()) / 2**20, 1)


def start_ray_head(work: Path) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` on loopback, labelled as node-0 of the simulated map with GPUS slots."""
    topology = simulated_topology(1, GPUS)
    (work / "topology.yaml").write_text(topology.to_yaml())
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="tc-ray-"))  # Ray's socket paths must fit in 107 bytes
    labels = ",".join(f"{k}={v}" for k, v in topology_labels(topology, "node-0").items())
    ports = ("ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port")
    log = (work / "ray-head.log").open("w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", f"--temp-dir={temp}", f"--resources={json.dumps(slot_resources(GPUS))}",
         f"--labels={labels}", *(f"--{name}={free_port()}" for name in ports)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    deadline = time.monotonic() + START_TIMEOUT
    while "block forever" not in (work / "ray-head.log").read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start failed:\n{(work / 'ray-head.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return head, f"127.0.0.1:{port}"


def start_service(work: Path, store: str, ray_address: str, address: str, probe_id: str) -> tuple[subprocess.Popen, float]:
    """`trainctl serve` on the preloaded store; the process and the seconds until its first OK GetJob."""
    started = time.monotonic()
    on_postgres = [f"--store={store}"] if store.startswith("postgresql://") else []
    proc = subprocess.Popen(
        [str(BIN / "trainctl"), "serve", f"--address={address}", f"--data-dir={work / 'data'}", *on_postgres,
         f"--ray-address={ray_address}", f"--topology={work / 'topology.yaml'}", "--metrics-port=0"],
        stdout=(work / "serve.log").open("a"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TrainingServiceStub(channel)
        while True:
            if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT:
                raise RuntimeError(f"the service did not serve:\n{(work / 'serve.log').read_text()[-3000:]}")
            try:
                stub.GetJob(pb.GetJobRequest(id=probe_id), timeout=1.0)
                return proc, time.monotonic() - started
            except grpc.RpcError:
                time.sleep(0.05)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the process; SIGKILL its group if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def reader(stub: Any, ids: list[str], until: float, rng: random.Random, out: dict[str, list[float]]) -> None:
    """One client: GetJob and the four ListJobs kinds in turn until `until`; latencies by kind."""
    token = ""
    kinds = ("GetJob", "ListJobs", "ListJobs state", "ListJobs label", "ListJobs next page")
    while time.monotonic() < until:
        kind = kinds[rng.randrange(len(kinds))]
        request: Any
        if kind == "GetJob":
            call, request = stub.GetJob, pb.GetJobRequest(id=rng.choice(ids))
        else:
            request = pb.ListJobsRequest(page_size=50)
            if kind == "ListJobs state":
                request.states.append(pb.QUEUED)
            elif kind == "ListJobs label":
                request.labels["team"] = rng.choice(LABELS)
            elif kind == "ListJobs next page" and token:
                request.page_token = token
            call = stub.ListJobs
        t0 = time.perf_counter()
        answer = await call(request, timeout=30)
        out.setdefault(kind, []).append(time.perf_counter() - t0)
        if kind == "ListJobs":
            token = answer.next_page_token


def client_process(
    address: str, ids: list[str], clients: int, warmup: float, seconds: float, seed: int, results: Any
) -> None:
    """`clients` concurrent readers on one channel each, in this process: `warmup` seconds not recorded,
    then `seconds` recorded."""
    async def run() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        channels = [grpc.aio.insecure_channel(address) for _ in range(clients)]
        stubs = [pb_grpc.TrainingServiceStub(channel) for channel in channels]
        for span, into in ((warmup, {}), (seconds, out)):
            until = time.monotonic() + span
            await asyncio.gather(*(reader(stub, ids, until, random.Random(seed + i), into) for i, stub in enumerate(stubs)))
        for channel in channels:
            await channel.close()
        return out

    results.put(asyncio.run(run()))


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident set now and at its peak (VmRSS, VmHWM), MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: round(int(fields[key].split()[0]) / 1024, 1) for name, key in (("rss", "VmRSS"), ("peak", "VmHWM"))}


def percentiles_ms(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"calls": len(values), "p50_ms": round(1e3 * statistics.median(values), 2), "p99_ms": round(1e3 * q[98], 2)}


def read_load(address: str, ids: list[str], clients: int, processes: int, warmup: float, seconds: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=client_process,
                         args=(address, ids, clients // processes, warmup, seconds, 1000 * p, results))
             for p in range(processes)]
    for proc in procs:
        proc.start()
    merged: dict[str, list[float]] = {}
    for _ in procs:
        for kind, values in results.get(timeout=warmup + seconds + 120).items():
            merged.setdefault(kind, []).extend(values)
    for proc in procs:
        proc.join()
    by_method: dict[str, list[float]] = {}
    for kind, values in merged.items():
        by_method.setdefault(kind.split()[0], []).extend(values)
    return {"by_kind": {k: percentiles_ms(v) for k, v in sorted(merged.items())},
            "by_method": {m: percentiles_ms(v) for m, v in sorted(by_method.items())}}


def admission(store_location: str, data_dir: Path, topology_file: Path, passes: int) -> dict[str, Any]:
    """`Scheduler.tick()` over the preloaded queue, nothing admitted (every job needs more GPUs than there are)."""
    from trainctl.workers.topology import load_topology

    class NoRuntime:
        """Ray as the scheduler sees it when every node is alive and no job runs."""

        def live_nodes(self) -> set[str]:
            return {"node-0"}

        def running_jobs(self) -> list[str]:
            return []

        def start_job(self, job_id: str, *_: Any, **__: Any) -> None:
            raise AssertionError(f"{job_id} was admitted, but no preloaded job fits the pool")

    store = JobStore(store_location)
    try:
        scheduler = Scheduler(store, GpuPool(load_topology(topology_file), "bench"), NoRuntime(), data_dir / "runs")
        times = []
        for _ in range(passes + 1):
            t0 = time.perf_counter()
            scheduler.tick()
            times.append(time.perf_counter() - t0)
        queued = store.count_by_state().get(JobState.QUEUED, 0)
        reasons = {r.reason for r in store.list_jobs(states=[JobState.QUEUED], limit=1000)}
    finally:
        store.close()
    return {"queued": queued, "first_pass_ms": round(1e3 * times[0], 1),
            "pass_p50_ms": round(1e3 * statistics.median(times[1:]), 1), "pass_max_ms": round(1e3 * max(times[1:]), 1),
            "waiting_reasons": len(reasons)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of reads before the recorded ones")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--no-analyze", action="store_true", help="PostgreSQL: leave the loaded tables without statistics")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "store": args.store, "analyzed": args.store == "postgresql" and not args.no_analyze, "jobs": args.jobs, "events": args.events,
                              "clients": args.clients, "warmup": args.warmup, "seconds": args.seconds, "load_average": os.getloadavg()}
    postgres = PostgresServer(durable=True) if args.store == "postgresql" else None
    with tempfile.TemporaryDirectory(prefix="trainctl-scale-") as tmp, contextlib.ExitStack() as cleanup:
        work = Path(tmp)
        (work / "data").mkdir()
        location = str(work / "data")
        if postgres is not None:
            cleanup.callback(postgres.remove)
            postgres.start()
            cleanup.callback(postgres.stop)
            location = postgres.create_database()
        t0 = time.monotonic()
        ids = preload(location, args.jobs, args.events, analyze=not args.no_analyze)
        result["preload_seconds"] = round(time.monotonic() - t0, 1)
        result["store_mib"] = store_mib(location)
        head, ray_address = start_ray_head(work)
        try:
            address = f"127.0.0.1:{free_port()}"
            service, cold = start_service(work, location, ray_address, address, ids[0])
            try:
                result["reads"] = read_load(address, ids, args.clients, args.processes, args.warmup, args.seconds)
                result["service_memory_after_reads_mib"] = memory_mib(service.pid)
                stop(service, signal.SIGKILL)
                service, restart = start_service(work, location, ray_address, address, ids[-1])
                result["start_seconds"] = {"cold": round(cold, 2), "after_sigkill": round(restart, 2)}
            finally:
                stop(service)
        finally:
            stop(head)
        result["admission"] = admission(location, work / "data", work / "topology.yaml", args.passes)
        served = re.findall(r"error.*", (work / "serve.log").read_text())
        result["service_errors"] = served[:5]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
