"""The service under load: what `trainctl serve` runs, with every GPU of the pool held.

`Service(ServiceConfig(...)).start()` is exactly what `trainctl serve --gpus-per-node 4` starts: the
embedded single-node Ray (4 simulated GPUs, the pool docs/benchmarks.md measured on), the SQLite
store (or, with `--store postgresql://...`, PostgreSQL with the scheduler's leadership lease), the scheduler loop, the gRPC server with its call chain (RPC metrics, auth, undecodable requests,
errors), the access file and the data-root policy, and the Prometheus endpoint. The
one difference: once it serves, every GPU of the pool is reserved for a placeholder, so admitted jobs
stay QUEUED and nothing trains (the scheduler still runs its admission pass on every tick and records
why each job waits). The placeholder is pinned: the scheduler forgets reservations the store does
not know whenever it re-syncs (after a database outage, on taking the lease again), and releasing it
there would let queued jobs start. Once serving, it settles the heap as `trainctl serve` does (on trees
that have `settle_heap_for_serving`). Prints `serving on HOST:PORT` when ready; SIGTERM stops it gracefully.

    .venv/bin/python bench/load/serve.py --data-dir DIR --tokens-file FILE --data-root DIR --metrics-port N [--store URL]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.service.server import Service, ServiceConfig

try:
    from trainctl.service.server import settle_heap_for_serving
except ImportError:  # a baseline tree from before it (--baseline): its `trainctl serve` did not call it either
    settle_heap_for_serving = None

HOLDER = "load-bench-holds-the-pool"


def hold_the_pool(pool: GpuPool) -> None:
    """Reserve every GPU of `pool` for HOLDER, for good: `pool.release(HOLDER)` leaves it held."""
    slots = [{"rank": i, "node": n, "gpu": g} for i, (n, g) in enumerate(sorted(pool.free_slots()))]
    pool.reserve(HOLDER, PlannedPlacement.from_records(slots))
    release = pool.release
    pool.release = lambda job_id: None if job_id == HOLDER else release(job_id)  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--tokens-file", type=Path, required=True)
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--store", help="a postgresql:// URL for the job store (default: SQLite in --data-dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServiceConfig(
        address="127.0.0.1:0", data_dir=args.data_dir, metrics_port=args.metrics_port,
        tokens_file=args.tokens_file, data_roots=[args.data_root], embedded_gpus_per_node=4, store=args.store,
    )
    service = Service(config).start()
    hold_the_pool(service.pool)
    print(f"serving on {service.target}", flush=True)
    stop = lambda *_: service.stop()  # noqa: E731 - a signal handler
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if settle_heap_for_serving is not None:
        settle_heap_for_serving()
    service.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
