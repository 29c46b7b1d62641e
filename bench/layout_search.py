"""How long the layout search (`trainctl plan FILE --cluster hgx-h100:N --suggest`) takes, and what it picks.

For Llama 3 8B and 70B at seq_len 8192 (global batch 2M tokens unless --sequences) on 1 to 128 HGX H100
nodes (8 to 1,024 GPUs), runs `suggest_layouts` once per size after a warm-up search (imports and
first-call costs are not counted; `trainctl` itself also pays the torch import, about 3 s on this
machine), and prints per size: search wall time (median of --repeat runs), layouts enumerated, those
checked against the rules and memory, those placed by the solver, and the best layout with its
modelled step time. Timings are measured here, never asserted in a test.

Usage: .venv/bin/python bench/layout_search.py [--nodes 1 2 4 8 16 32 64 128] [--repeat 3] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from trainctl.planning.layout_search import LayoutSearchError, describe, suggest_layouts
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import parse_object
from trainctl.workers.topology.presets import cluster_topology

MODELS = ("llama3-8b", "llama3-70b")


def job_of(model: str, sequences: int) -> TrainingJob:
    return parse_object({
        "metadata": {"name": "bench"},
        "spec": {"model": {"preset": model}, "data": {"seq_len": 8192},
                 "training": {"global_batch_size": sequences, "dtype": "bfloat16"}, "resources": {"device": "cuda"}},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--sequences", type=int, default=256, help="global batch in sequences of 8,192 tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    suggest_layouts(job_of(MODELS[0], args.sequences), cluster_topology("hgx-h100:1"), "warm-up", top=1)
    for model in MODELS:
        job = job_of(model, args.sequences)
        for nodes in args.nodes:
            topology = cluster_topology(f"hgx-h100:{nodes}")
            seconds, result, error = [], None, None
            for _ in range(args.repeat):
                started = time.perf_counter()
                try:
                    result = suggest_layouts(job, topology, f"hgx-h100:{nodes}", top=3)
                except LayoutSearchError as exc:
                    error = str(exc)
                seconds.append(time.perf_counter() - started)
            row = {"model": model, "gpus": nodes * 8, "seconds": statistics.median(seconds)}
            if result is not None:
                best = result.layouts[0]
                row.update(enumerated=result.enumerated, checked=result.evaluated, placed=result.solved,
                           best=describe(best.body), step_ms=round(best.step.total * 1e3, 2), mfu=round(best.step.mfu, 3))
            else:
                row["error"] = error
            rows.append(row)
            print(f"{model:<11} {nodes * 8:>5} GPUs  {row['seconds']:.2f} s  "
                  + (f"{row['enumerated']:>5} enumerated {row['checked']:>4} checked {row['placed']} placed  "
                     f"{row['best']}  {row['step_ms']:,.2f} ms" if result else f"refused: {error[:80]}"), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
