"""The service under load: what `trainctl serve` runs, with every GPU of the pool held.

`Service(ServiceConfig(...)).start()` is exactly what `trainctl serve --gpus-per-node 4` starts: the
embedded single-node Ray (4 simulated GPUs, the pool docs/benchmarks.md measured on), the SQLite
store, the scheduler loop, the gRPC server with its interceptor chain (auth, undecodable requests,
errors and RPC metrics), the access file and the data-root policy, and the Prometheus endpoint. The
one difference: once it serves, every GPU of the pool is reserved for a placeholder, so admitted jobs
stay QUEUED and nothing trains (the scheduler still runs its admission pass on every tick and records
why each job waits). Prints `serving on HOST:PORT` when
ready; SIGTERM stops it gracefully.

    .venv/bin/python bench/load/serve.py --data-dir DIR --tokens-file FILE --data-root DIR --metrics-port N
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from trainctl.service.pool import PlannedPlacement
from trainctl.service.server import Service, ServiceConfig

HOLDER = "load-bench-holds-the-pool"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--tokens-file", type=Path, required=True)
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServiceConfig(
        address="127.0.0.1:0", data_dir=args.data_dir, metrics_port=args.metrics_port,
        tokens_file=args.tokens_file, data_roots=[args.data_root], embedded_gpus_per_node=4,
    )
    service = Service(config).start()
    slots = [{"rank": i, "node": n, "gpu": g} for i, (n, g) in enumerate(sorted(service.pool.free_slots()))]
    service.pool.reserve(HOLDER, PlannedPlacement.from_records(slots))
    print(f"serving on {service.target}", flush=True)
    stop = lambda *_: service.stop()  # noqa: E731 - a signal handler
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
