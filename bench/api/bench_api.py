"""CreateJob / GetJob latency and throughput: trainctl's gRPC API vs Ray's Jobs API, same embedded Ray.

Both sides run against one embedded 2-node Ray on loopback (with the dashboard, which serves Ray's
Jobs API). For each concurrency level (1, 16, 128 client threads) every client creates
`--per-client` jobs and then reads each back:

- trainctl: `TrainctlClient.create_job` (validation, a committed SQLite WAL transaction, the answer)
  and `get_job`. The pool is held for the whole run, so created jobs stay QUEUED: this measures the
  API, not training.
- Ray: `JobSubmissionClient.submit_job(entrypoint="true", entrypoint_resources={never: 1})` (the job
  stays PENDING the same way: accepted, recorded in the GCS, its supervisor actor waiting for a
  resource no node has) and `get_job_info`.

Latency is per call (p50 / p99 over every call at that level); throughput is calls per second of
wall time for the whole level (at least 128 creates per level, as many gets). Results are printed and written as JSON (`--out`).

    .venv/bin/python bench/api/bench_api.py --out bench/api/results-api.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.planning.pool import PlannedPlacement  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.workers.embedded import EmbeddedRay, start_embedded  # noqa: E402

LEVELS = (1, 16, 128)
MIN_CREATES = 128
"""Each level creates at least this many jobs (so p99 at 1 client rests on 128 samples)."""
NEVER = "trainctl_bench_never"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def per_client_at(level: int, per_client: int) -> int:
    return max(per_client, -(-MIN_CREATES // level))


def run_level(clients: int, per_client: int, create: Callable[[int, int], str], get: Callable[[str], None]) -> dict:
    """`clients` threads each create `per_client` jobs, then get each; per-call latencies and rates."""
    create_lat: list[float] = []
    get_lat: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        mine_c, mine_g, ids = [], [], []
        barrier.wait()
        try:
            for i in range(per_client):
                t = time.perf_counter()
                ids.append(create(index, i))
                mine_c.append(time.perf_counter() - t)
            for job_id in ids:
                t = time.perf_counter()
                get(job_id)
                mine_g.append(time.perf_counter() - t)
        except BaseException as exc:  # noqa: BLE001 - reported after the level
            errors.append(exc)
        with lock:
            create_lat.extend(mine_c)
            get_lat.extend(mine_g)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed, first: {errors[0]!r}")
    total = len(create_lat) + len(get_lat)
    return {
        "clients": clients,
        "calls": total,
        "create_p50_ms": 1e3 * statistics.median(create_lat),
        "create_p99_ms": 1e3 * percentile(create_lat, 0.99),
        "get_p50_ms": 1e3 * statistics.median(get_lat),
        "get_p99_ms": 1e3 * percentile(get_lat, 0.99),
        "calls_per_second": total / wall,
    }


def dashboard_url(cluster: EmbeddedRay) -> str:
    """Where the embedded head's dashboard (Ray's Jobs API) listens."""
    return "http://" + cluster._cluster.head_node.webui_url  # no public accessor on ray.cluster_utils.Cluster


def bench_trainctl(cluster: EmbeddedRay, per_client: int) -> list[dict]:
    data_dir = Path(tempfile.mkdtemp(prefix="trainctl-bench-api-"))
    config = ServiceConfig(address="127.0.0.1:0", data_dir=data_dir, metrics_port=0, ray_address=cluster.address)
    job = TrainingJob.model_validate({
        "metadata": {"name": "bench", "labels": {"bench": "api"}},
        "spec": {"resources": {"gpus": 1, "device": "cpu"}, "training": {"steps": 10}},
    })
    results = []
    with Service(config, topology=cluster.topology) as service:
        slots = [{"rank": i, "node": n, "gpu": g} for i, (n, g) in enumerate(sorted(service.pool.free_slots()))]
        service.pool.reserve("bench-holds-the-pool", PlannedPlacement.from_records(slots))
        clients = [TrainctlClient(service.target) for _ in range(max(LEVELS))]
        for level in LEVELS:
            results.append(run_level(
                level, per_client_at(level, per_client),
                lambda index, _i: clients[index].create_job(job).id,
                lambda job_id: clients[0].get_job(job_id) and None,
            ))
            print("trainctl", results[-1], flush=True)
        for c in clients:
            c.close()
    return results


def bench_ray(cluster: EmbeddedRay, per_client: int) -> list[dict]:
    from ray.job_submission import JobSubmissionClient

    clients = [JobSubmissionClient(dashboard_url(cluster)) for _ in range(max(LEVELS))]
    results = []
    for level in LEVELS:
        results.append(run_level(
            level, per_client_at(level, per_client),
            lambda index, _i: clients[index].submit_job(entrypoint="true", entrypoint_resources={NEVER: 1}),
            lambda job_id: clients[0].get_job_info(job_id) and None,
        ))
        print("ray", results[-1], flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-client", type=int, default=4, help="jobs each client creates per level")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    cluster = start_embedded(2, 2, head_cpus=2, dashboard=True)
    try:
        ours = bench_trainctl(cluster, args.per_client)
        import ray

        ray.init(address=cluster.address, log_to_driver=False)
        theirs = bench_ray(cluster, args.per_client)
    finally:
        cluster.shutdown()
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        rows.append({
            "clients": a["clients"], "trainctl": a, "ray_jobs": b,
            "create_p50_ratio": b["create_p50_ms"] / a["create_p50_ms"],
            "get_p50_ratio": b["get_p50_ms"] / a["get_p50_ms"],
            "throughput_ratio": a["calls_per_second"] / b["calls_per_second"],
        })
    print(json.dumps(rows, indent=1))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
