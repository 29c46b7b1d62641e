"""The server side of bench_watch_fanout.py: the TrainingService's gRPC server (`build_grpc_server`,
the same server and call chain `trainctl serve` runs) over a SQLite JobStore holding one RUNNING job, and a writer thread that
appends that job's events at a steady rate, as the scheduler does while a job trains.

Prints `serving on PORT job JOB_ID` when ready. On stdin: `go RATE COUNT` appends COUNT log events at
RATE per second, then ends the job (SUCCEEDED) and writes the job's event sequences to `--sequences`;
EOF stops the server. Runs against whichever `trainctl` is on PYTHONPATH, so the benchmark can run the
same script over an older commit's tree (where `streams_per_tenant` did not exist, the per-tenant cap
was `workers // 4`, so `workers` is raised to allow the streams).

    .venv/bin/python bench/api/watch_fanout_server.py --data-dir DIR --streams 1000 --sequences FILE
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
import time
from pathlib import Path

from trainctl.planning.pool import GpuPool
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.auth import Authenticator
from trainctl.service.server import build_grpc_server
from trainctl.service.store import JobStore
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState
from trainctl.workers.topology import simulated_topology

JOB = {"metadata": {"name": "followed"}, "spec": {"training": {"steps": 100000}, "resources": {"gpus": 1, "device": "cpu"}}}
SPARE_THREADS = 100
"""Handler threads beyond the streams, for unary calls and health checks."""


def append_events(store: JobStore, job_id: str, rate: float, count: int, sequences: Path) -> None:
    start = time.monotonic()
    for i in range(count):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        store.append_event(job_id, "log", {"message": f"step {i} of the followed job", "level": "INFO"})
    store.update_status(job_id, state=JobState.SUCCEEDED, reason="done")
    cursor, out = 0, []
    while events := store.events(job_id, cursor):
        out += [e.sequence for e in events]
        cursor = events[-1].sequence
    sequences.write_text(json.dumps(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--sequences", type=Path, required=True)
    args = parser.parse_args()
    store = JobStore(args.data_dir)
    record, _ = store.create_job(TrainingJob.model_validate(JOB))
    store.update_status(record.id, state=JobState.RUNNING, reason="ranks up")
    pool = GpuPool(simulated_topology(1, 4), "simulated")
    scheduler = Scheduler(store, pool, None, args.data_dir / "runs")  # its loop never runs: no runtime needed
    authenticator = Authenticator(None)
    servicer = TrainingServicer(store, scheduler, pool, authenticator)
    workers = args.streams + SPARE_THREADS
    parameters = inspect.signature(build_grpc_server).parameters
    if parameters["workers"].default is not inspect.Parameter.empty:  # the asyncio server: a stream holds no thread
        server, _health = build_grpc_server(servicer, authenticator, None, streams_per_tenant=args.streams)
    elif "streams_per_tenant" in parameters:  # thread per call: each open stream holds a handler thread
        server, _health = build_grpc_server(servicer, authenticator, None, workers=workers, streams_per_tenant=args.streams)
    else:  # before the setting: one tenant could hold a quarter of the threads
        server, _health = build_grpc_server(servicer, authenticator, None, workers=4 * args.streams + SPARE_THREADS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"serving on {port} job {record.id}", flush=True)
    writer = None
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "go":
            writer = threading.Thread(
                target=append_events, args=(store, record.id, float(words[1]), int(words[2]), args.sequences)
            )
            writer.start()
    if writer is not None:
        writer.join()
    servicer.stopping.set()
    server.stop(2).wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
