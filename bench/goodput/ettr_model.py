"""ETTR (effective training time ratio) of a job of 1,024 to 16,384 GPUs, from a per-failure cost and a
checkpoint cost measured here and the failure rate Meta published for Llama 3 (419 unexpected
interruptions in 54 days on 16,384 H100s: 1.97e-5 per GPU-hour).

With failures arriving at rate `G * RATE` per hour for a job of G GPUs, each costing `recovery` seconds
(kill to the next completed step) plus the steps trained again (on average half a checkpoint interval),
and every `interval`-th step costing `checkpoint_ratio` ordinary steps:

    ETTR = (1 - (checkpoint_ratio - 1) / interval) / (1 + G * RATE * (recovery + interval * step / 2) / 3600)

With in-memory snapshots every `K` steps (`checkpoint.memory_interval_steps`) a failure recomputes half a
snapshot interval instead, and every `K`-th step costs `snapshot_ratio` ordinary ones more:

    ETTR = (1 - (checkpoint_ratio - 1) / interval - (snapshot_ratio - 1) / K) / (1 + G * RATE * (recovery + K * step / 2) / 3600)

(the first-order model of Young and Daly: failures rare against the time between them). The rows take the
median recovery of each restart path that bench/goodput/fault_schedule.py measured in one run
(`--results`, by default results-fault-schedule-async5-spares.json: `cold`, fresh rank processes; `warm`, the
survivors' processes and a spare) with the checkpoint step's measured ratio (results-checkpoint-cost.json: synchronous saves, and for
`warm, async saves` asynchronous ones, at least 1); `warm, async saves, snapshots` adds a snapshot every
`--memory-interval` steps at the snapshot step's measured ratio (results-snapshot-cost.json: what a snapshot
costs the rank, its shard turned into bytes and copied once; the copies to the keepers are made by other
processes, off the step on a GPU host); `goal` takes issue 35's targets (recovery within twice a
warm first step, at most 5 steps recomputed, a checkpoint step at most 1.1 ordinary ones). The step time and
interval of a large job are assumptions, printed with the table.

    .venv/bin/python bench/goodput/ettr_model.py [--step 2.0 --interval 100 --memory-interval 20] [--results FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RATE = 419 / (54 * 24 * 16384)
"""Unexpected interruptions per GPU-hour in Llama 3's 54-day pre-training run on 16,384 H100s."""
GPUS = (1024, 2048, 4096, 8192, 16384)
HERE = Path(__file__).resolve().parent


def ettr(gpus: int, recovery: float, recomputed_s: float, checkpoint_ratio: float, interval: int,
         snapshot_cost: float = 0.0) -> float:
    """The model in the module docstring (``snapshot_cost``: the snapshots' share of a step, (ratio - 1) / K)."""
    per_failure = recovery + recomputed_s
    return (1 - (checkpoint_ratio - 1) / interval - snapshot_cost) / (1 + gpus * RATE * per_failure / 3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=float, default=2.0, help="seconds per step of the large job (assumed)")
    parser.add_argument("--interval", type=int, default=100, help="steps between checkpoints (assumed)")
    parser.add_argument("--memory-interval", type=int, default=20, help="steps between in-memory snapshots (assumed)")
    parser.add_argument("--results", type=Path, default=HERE / "results-fault-schedule-async5-spares.json",
                        help="a fault_schedule.py results file with a cold and a warm run")
    args = parser.parse_args()
    paths = json.loads(args.results.read_text())["faulted"]
    checkpoint = json.loads((HERE / "results-checkpoint-cost.json").read_text())["modes"]
    sync, asynchronous = (max(1.0, checkpoint[mode]["ratio_checkpoint_to_ordinary"]) for mode in ("sync", "async"))
    snapshot = json.loads((HERE / "results-snapshot-cost.json").read_text())["modes"]["snapshot"]
    snapshot_cost = (max(1.0, snapshot["ratio_checkpoint_to_ordinary"]) - 1) / args.memory_interval
    recomputed = args.interval * args.step / 2
    warm_first_step = 3.9  # docs/benchmarks.md, CreateJob to the first step with the warm pool
    rows = {
        "cold": (paths["cold"]["median"]["recovery_s"], recomputed, sync),
        "warm": (paths["warm"]["median"]["recovery_s"], recomputed, sync),
        "warm, async saves": (paths["warm"]["median"]["recovery_s"], recomputed, asynchronous),
        "warm, async saves, snapshots": (paths["warm"]["median"]["recovery_s"], args.memory_interval * args.step / 2,
                                         asynchronous, snapshot_cost),
        "goal": (2 * warm_first_step, min(5, args.interval / 2) * args.step, 1.1),
    }
    print(f"step {args.step:g} s, a checkpoint every {args.interval} steps, a snapshot every {args.memory_interval}, "
          f"{RATE:.3g} failures per GPU-hour")
    print("| GPUs | mean time between failures | " + " | ".join(f"ETTR {name}" for name in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for gpus in GPUS:
        hours = 1 / (gpus * RATE)
        cells = [f"{ettr(gpus, *row[:3], args.interval, *row[3:]):.4f}" for row in rows.values()]
        print(f"| {gpus:,} | {hours:.1f} h | " + " | ".join(cells) + " |")
    for name, (r, k, c, *snap) in rows.items():
        print(f"{name}: recovery {r:.1f} s, recomputed {k:.0f} s per failure, checkpoint step {c:.2f}x"
              + (f", snapshots {snap[0]:.2%} of every step" if snap else ""))


if __name__ == "__main__":
    main()
