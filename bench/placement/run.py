"""Placement benchmark: four strategies on fragmented simulated fleets, scored by the cost model.

Fleets: 1,024 HGX H100 nodes x 8 (32-node scalable units, 8 rails, leaf/spine uplinks 1:1 and 2:1),
128 GB200 NVL72 racks, 1,024 PCIe H100 NVL nodes x 8 NVLink-bridged in pairs, and 1,024 mixed PCIe
nodes (bridged pairs, no NVLink with every NIC on socket 0, NVLink on half the GPUs; one kind per
scalable unit). Each fleet is fragmented by random background jobs to 50 / 70 / 85 %
occupancy per seed; every job of the mix is then placed on that state by each strategy and compared
with our solver on the empty fleet and with the cost model's lower bound.

    .venv/bin/python bench/placement/run.py            # full: 20 seeds
    .venv/bin/python bench/placement/run.py --quick    # 2 seeds, for a smoke run
    .venv/bin/python bench/placement/run.py --fleet PCIe   # only the fleets whose name contains PCIe
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategies import STRATEGIES  # noqa: E402

from trainctl.parallelism.layouts.grid import RankGrid  # noqa: E402
from trainctl.spec.presets import PRESETS  # noqa: E402
from trainctl.workers.placement.cost import Workload, build_traffic, evaluate, lower_bound  # noqa: E402
from trainctl.workers.placement.fabric import FabricIndex  # noqa: E402
from trainctl.workers.placement.solver import _Solver  # noqa: E402
from trainctl.workers.topology.builders import (  # noqa: E402
    bridged_pcie_fleet,
    mixed_pcie_fleet,
    nvl72_fleet,
    rail_optimized_fleet,
)


@dataclass(frozen=True)
class Job:
    name: str
    model: str
    grid: RankGrid
    work: Workload


JOBS = [
    Job("8B tp8.pp4.dp32", "llama3-8b", RankGrid(tp=8, pp=4, dp_shard=32), Workload(seq_len=8192, micro_batches=16)),
    Job("70B tp8.pp8.dp16", "llama3-70b", RankGrid(tp=8, pp=8, dp_shard=16), Workload(seq_len=8192, micro_batches=32)),
    Job("MoE ep8.dp64", "moe-8x1b", RankGrid(ep=8, dp_shard=64), Workload(seq_len=4096, micro_batches=4)),
    Job("8B long-ctx tp2.cp4.dp8", "llama3-8b", RankGrid(tp=2, cp=4, dp_shard=8), Workload(seq_len=65536, micro_batches=4)),
    Job("1B FSDP dp8", "llama-1b", RankGrid(dp_shard=8), Workload(seq_len=4096, micro_batches=4)),
    Job("1B FSDP dp32", "llama-1b", RankGrid(dp_shard=32), Workload(seq_len=4096, micro_batches=4)),
]


def fleets() -> dict[str, object]:
    return {
        "H100 1024x8, 1:1": lambda: rail_optimized_fleet(1024, oversubscription=1.0),
        "H100 1024x8, 2:1": lambda: rail_optimized_fleet(1024, oversubscription=2.0),
        "GB200 NVL72 x128": lambda: nvl72_fleet(128),
        "PCIe H100 NVL bridged 1024x8": lambda: bridged_pcie_fleet(1024),
        "PCIe mixed 1024x8": lambda: mixed_pcie_fleet(1024),
    }


def fragment(index: FabricIndex, occupancy: float, rng: random.Random) -> dict[int, list[int]]:
    """Free GPUs after random background jobs fill `occupancy` of the fleet.

    A third of the jobs take 1-4 GPUs of one node, a quarter take one whole node, the rest take 2-32
    whole nodes starting at a random node (the next fully free ones in id order): a mix of partial
    nodes and scattered runs of busy nodes, as a busy shared cluster has.
    """
    free = {n: list(g) for n, g in enumerate(index.node_gpus)}
    n_nodes = len(free)
    per_node = max(len(g) for g in index.node_gpus)
    total = sum(len(g) for g in free.values())
    used = 0
    while used < occupancy * total:
        kind = rng.random()
        if kind < 0.33:
            size = rng.choice([s for s in (1, 2, 4) if s < per_node] or [1])
            for _ in range(50):
                n = rng.randrange(n_nodes)
                if len(free[n]) >= size:
                    free[n] = free[n][size:]
                    used += size
                    break
            continue
        count = 1 if kind < 0.58 else rng.choice([2, 4, 8, 16, 32])
        start = rng.randrange(n_nodes)
        taken = 0
        for step in range(n_nodes):
            n = (start + step) % n_nodes
            if len(free[n]) == len(index.node_gpus[n]) and free[n]:
                used += len(free[n])
                free[n] = []
                taken += 1
                if taken == count or used >= occupancy * total:
                    break
    return {n: g for n, g in free.items() if g}


def ours(job: Job, index: FabricIndex, free: dict[int, list[int]], traffic, budget: float):
    solver = _Solver(job.grid, index, free, traffic, time.perf_counter() + budget)
    if sum(len(g) for g in free.values()) < job.grid.world_size:
        return None
    return solver.solve()


def run(seeds: int, occupancies: list[float], budget: float, out: Path | None, only: str = "") -> list[dict]:
    rows: list[dict] = []
    for fleet_name, make in fleets().items():
        if only not in fleet_name:
            continue
        topo = make()
        t0 = time.perf_counter()
        index = FabricIndex.build(topo)
        print(f"{fleet_name}: map compiled in {time.perf_counter() - t0:.2f} s (once per map)", file=sys.stderr)
        everything = {n: list(g) for n, g in enumerate(index.node_gpus)}
        traffic = {j.name: build_traffic(j.grid, PRESETS[j.model], j.work) for j in JOBS}
        empty = {}
        for job in JOBS:
            slots = ours(job, index, everything, traffic[job.name], budget)
            empty[job.name] = evaluate(traffic[job.name], slots, index).total_seconds
        bound = {j.name: sum(lower_bound(traffic[j.name], index).values()) for j in JOBS}
        for occ in occupancies:
            for seed in range(seeds):
                free = fragment(index, occ, random.Random(seed * 1000 + int(occ * 100)))
                unit_free: dict[int, int] = {}
                for n, gpus in free.items():
                    unit_free[index.node_unit[n]] = unit_free.get(index.node_unit[n], 0) + len(gpus)
                for job in JOBS:
                    tr = traffic[job.name]
                    tp = job.grid.tp
                    unsplit_possible = sum(f // tp for f in unit_free.values()) * tp >= job.grid.world_size
                    for strategy in [*STRATEGIES, "ours"]:
                        t0 = time.perf_counter()
                        if strategy == "ours":
                            slots = ours(job, index, free, tr, budget)
                        else:
                            slots = STRATEGIES[strategy](job.grid.world_size, index, free)
                        elapsed = time.perf_counter() - t0
                        row = {
                            "fleet": fleet_name, "occupancy": occ, "seed": seed, "job": job.name,
                            "gpus": job.grid.world_size, "strategy": strategy, "solve_s": elapsed,
                            "empty_s": empty[job.name], "bound_s": bound[job.name], "placed": slots is not None,
                            "unsplit_possible": unsplit_possible,
                        }
                        if slots is not None:
                            cost = evaluate(tr, slots, index)
                            row["comm_s"] = cost.total_seconds
                            row["split_tp"] = len(cost.split_groups.get("tp", []))
                        rows.append(row)
            print(f"{fleet_name} occupancy {occ:.0%}: done", file=sys.stderr, flush=True)
    if out:
        out.write_text(json.dumps(rows))
    return rows


def summarise(rows: list[dict]) -> str:
    lines = [
        "| fleet | occ. | strategy | placed | within 5% of empty | median / empty | p95 / empty | median / bound | jobs with a split TP group |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["fleet"], r["occupancy"]) for r in rows})
    for fleet, occ in keys:
        for strategy in [*STRATEGIES, "ours"]:
            sel = [r for r in rows if r["fleet"] == fleet and r["occupancy"] == occ and r["strategy"] == strategy]
            placed = [r for r in sel if r["placed"]]
            if not placed:
                lines.append(f"| {fleet} | {occ:.0%} | {strategy} | 0/{len(sel)} | - | - | - | - | - |")
                continue
            ratios = sorted(r["comm_s"] / r["empty_s"] for r in placed)
            within = sum(x <= 1.05 for x in ratios)
            p95 = ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))]
            to_bound = statistics.median(r["comm_s"] / r["bound_s"] for r in placed)
            split = sum(r["split_tp"] > 0 for r in placed)
            lines.append(
                f"| {fleet} | {occ:.0%} | {strategy} | {len(placed)}/{len(sel)} | {within / len(placed):.0%} | "
                f"{statistics.median(ratios):.3f} | {p95:.3f} | {to_bound:.3f} | {split} |"
            )
    lines += ["", per_job(rows, 0.7)]
    big = [r for r in rows if r["strategy"] == "ours" and r["gpus"] >= 1024]
    if big:
        times = sorted(r["solve_s"] for r in big)
        lines.append("")
        lines.append(
            f"Our solver on 1,024-GPU jobs: median {statistics.median(times) * 1e3:.0f} ms, "
            f"p95 {times[int(0.95 * len(times))] * 1e3:.0f} ms, max {times[-1] * 1e3:.0f} ms, "
            f"{sum(t >= 1.0 for t in times)} of {len(times)} solves at 1 s or more."
        )
    needless = [r for r in rows if r["strategy"] == "ours" and r["placed"] and r["split_tp"] and r["unsplit_possible"]]
    unavoidable = [r for r in rows if r["strategy"] == "ours" and r["placed"] and not r["unsplit_possible"]]
    lines.append(
        f"Our placements that split a TP group although the free GPUs allowed none to be split: {len(needless)} "
        f"(jobs where splitting was unavoidable: {len(unavoidable)})."
    )
    ours_at = {(r["fleet"], r["occupancy"], r["seed"], r["job"]): r for r in rows if r["strategy"] == "ours"}
    beaten = [
        r for r in rows
        if r["strategy"] != "ours" and r["placed"] and r["occupancy"] <= 0.7
        and r["comm_s"] < ours_at[(r["fleet"], r["occupancy"], r["seed"], r["job"])].get("comm_s", float("inf")) * (1 - 1e-9)
    ]
    compared = sum(1 for r in rows if r["strategy"] != "ours" and r["placed"] and r["occupancy"] <= 0.7)
    by_fleet = ", ".join(f"{f}: {sum(r['fleet'] == f for r in beaten)}" for f in sorted({r["fleet"] for r in rows}))
    lines.append(
        f"Baseline placements faster than ours on the same state, at <= 70 % occupancy: {len(beaten)} of {compared} ({by_fleet})."
    )
    below = [r for r in rows if r["placed"] and r["comm_s"] < r["bound_s"] * (1 - 1e-9)]
    lines.append(f"Placements below the lower bound: {len(below)} (must be 0).")
    return "\n".join(lines)


def per_job(rows: list[dict], occupancy: float) -> str:
    """Median modelled time / empty-cluster time per job and strategy at one occupancy."""
    strategies = [*STRATEGIES, "ours"]
    lines = [
        f"Per job at {occupancy:.0%} occupancy: median of modelled comm time / same job on the empty fleet "
        "(placed jobs only; empty / lower bound in the last column).",
        "",
        f"| fleet | job | {' | '.join(strategies)} | empty / bound |",
        "|---|---|" + "---|" * (len(strategies) + 1),
    ]
    for fleet in sorted({r["fleet"] for r in rows}):
        for job in dict.fromkeys(r["job"] for r in rows):
            sel = [r for r in rows if r["fleet"] == fleet and r["job"] == job and r["occupancy"] == occupancy]
            if not sel:
                continue
            cells = []
            for strategy in strategies:
                ratios = [r["comm_s"] / r["empty_s"] for r in sel if r["strategy"] == strategy and r["placed"]]
                cells.append(f"{statistics.median(ratios):.3f}" if ratios else "-")
            lines.append(f"| {fleet} | {job} | {' | '.join(cells)} | {sel[0]['empty_s'] / sel[0]['bound_s']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds instead of 20")
    parser.add_argument("--seeds", type=int, default=None, help="override the seed count")
    parser.add_argument("--budget", type=float, default=0.5, help="our solver's time budget per job, seconds")
    parser.add_argument("--json", type=Path, default=None, help="write raw rows here")
    parser.add_argument("--fleet", default="", help="run only the fleets whose name contains this text")
    parser.add_argument("--summarise", type=Path, default=None, help="only print the tables of a saved --json file")
    args = parser.parse_args()
    if args.summarise:
        print(summarise(json.loads(args.summarise.read_text())))
        return 0
    seeds = args.seeds or (2 if args.quick else 20)
    t0 = time.perf_counter()
    rows = run(seeds, [0.5, 0.7, 0.85], args.budget, args.json, args.fleet)
    print(summarise(rows))
    print(f"\n{seeds} seeds, {len(rows)} placements, {time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
