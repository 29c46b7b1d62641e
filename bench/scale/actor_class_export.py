"""What creating a rank's actor costs its creator (issue 38): a RankWorker actor made from a remote class of its
own (``ray.remote(RankWorker)`` per actor, as `RankGroup`, the warm pool and the spares did) against one made
from a remote class shared by all (as they do now). Ray exports a remote class at its first actor, which
pickles it and disassembles its methods; the CPU figure is the creating thread's (`time.thread_time`).

The actors ask for a node label no node has, so they stay pending and no worker process starts: only the
creator's side is timed. The two ways alternate over ``--rounds`` rounds of ``--actors`` actors each.

    .venv/bin/python bench/scale/actor_class_export.py [--actors 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray: bind 127.0.0.1 only

import ray  # noqa: E402

from trainctl.workers.rank_worker import RankWorker  # noqa: E402
from trainctl.workers.resources import NODE_LABEL  # noqa: E402

OPTIONS = {"num_cpus": 0, "max_restarts": 0, "label_selector": {NODE_LABEL: "no-such-node"}}


def per_actor_class(count: int) -> list[Any]:
    return [ray.remote(RankWorker).options(**OPTIONS).remote("no-such-node", None, False) for _ in range(count)]


def one_class(count: int) -> list[Any]:
    worker_class = ray.remote(RankWorker)
    return [worker_class.options(**OPTIONS).remote("no-such-node", None, False) for _ in range(count)]


def cpu_per_actor(create: Callable[[int], list[Any]], count: int) -> float:
    started = time.thread_time()
    handles = create(count)
    spent = (time.thread_time() - started) / count
    for handle in handles:
        ray.kill(handle, no_restart=True)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        rows: dict[str, list[float]] = {"class per actor": [], "one class": []}
        for _ in range(args.rounds):
            rows["class per actor"].append(cpu_per_actor(per_actor_class, args.actors))
            rows["one class"].append(cpu_per_actor(one_class, args.actors))
    finally:
        ray.shutdown()
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, value in medians.items():
        print(f"{name}: {value * 1e3:.2f} ms of CPU per actor (rounds: {', '.join(f'{v * 1e3:.2f}' for v in rows[name])})")
    ratio = medians["class per actor"] / medians["one class"]
    print(f"ratio {ratio:.1f}x; a 4,096-rank group: {4096 * medians['class per actor']:.0f} s against "
          f"{4096 * medians['one class']:.1f} s of its supervisor's CPU")


if __name__ == "__main__":
    main()
