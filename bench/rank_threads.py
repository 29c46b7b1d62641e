"""Rank step time and CPU time with torch's default intra-op threads against one OpenMP thread a rank.

A RankWorker sets OMP_NUM_THREADS=1 before torch is imported when its environment sets none
(`trainctl.workers.resources.RANK_OPENMP_THREADS`, torchrun's default). This bench shows why: it starts
the ranks of a small job as separate processes on this machine, each with the environment a rank gets,
once without OMP_NUM_THREADS (torch's default: one intra-op thread per core in every rank) and once with
it set to 1, alternating, and trains the debug model under each layout with gloo. Per run: the slowest
rank's wall time over the measured steps and the CPU seconds all ranks spent in them (first step left out).

Usage: .venv/bin/python bench/rank_threads.py [--steps 20] [--repeats 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"fsdp-dp2": {"dp_shard": 2}, "tp2": {"tp": 2}}
"""Two-rank layouts: FSDP (collectives per layer, little compute between) and tensor parallel (more, smaller ops)."""
SETTINGS = {"torch default": None, "OMP_NUM_THREADS=1": "1"}
"""What each run's ranks find in their environment (None: OMP_NUM_THREADS unset)."""
WORDS = ["the", "a", "of", "model", "train", "data", "rank", "step", "loss", "grad", "node", "gpu", "layer", "token", "batch", "shard"]


def write_corpus(root: Path) -> str:
    rng = random.Random(1)
    for i in range(4):
        lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(150))
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    return str(root / "*.txt")


def job_json(corpus: str, parallelism: dict[str, int], steps: int) -> str:
    from trainctl.spec.job import JobSpecBody

    world = 1
    for degree in parallelism.values():
        world *= degree
    return JobSpecBody.model_validate({
        "model": {"preset": "debug"},
        "data": {"paths": [corpus], "seq_len": 32, "seed": 7},
        "parallelism": parallelism,
        "training": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "warmup_steps": 2, "lr": 3e-3, "seed": 11},
        "resources": {"gpus": world, "device": "cpu"},
    }).model_dump_json()


def rank_main(rank: int, world: int, port: int, body_json: str, steps: int) -> None:
    """One rank: gloo group, the engine's Trainer, `steps` steps; prints its wall and CPU seconds after the first."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainctl.parallelism.engine.trainer import Trainer
    from trainctl.spec.job import JobSpecBody

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    trainer = Trainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world, device="cpu")
    for step in range(steps):
        if step == 1:
            dist.barrier()
            usage, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        trainer.forward_backward(trainer.loader.next_batch())
        trainer.optimizer_step()
    dist.barrier()
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
    print(json.dumps({"wall": time.perf_counter() - started, "cpu": cpu}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(body_json: str, world: int, steps: int, threads: str | None) -> dict[str, float]:
    """Start `world` rank processes with or without OMP_NUM_THREADS; the slowest wall time and the CPU sum."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(rank), str(world), str(port), str(steps), body_json],
                         env=env, stdout=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return {"wall": max(o["wall"] for o in outs), "cpu": sum(o["cpu"] for o in outs)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank, world, port, steps = (int(a) for a in sys.argv[2:6])
        rank_main(rank, world, port, sys.argv[6], steps)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not measured)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp))
        for layout, parallelism in LAYOUTS.items():
            body = job_json(corpus, parallelism, args.steps)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
            for _ in range(args.repeats):
                for name, threads in SETTINGS.items():
                    runs[name].append(run_ranks(body, 2, args.steps, threads))
            medians = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")} for name, rs in runs.items()}
            default, one = medians["torch default"], medians["OMP_NUM_THREADS=1"]
            row = {"layout": layout, "runs": runs, "medians": medians,
                   "wall_ratio": default["wall"] / one["wall"], "cpu_ratio": default["cpu"] / one["cpu"]}
            rows.append(row)
            print(f"{layout}: {args.steps - 1} steps, torch default {default['wall']:.2f} s wall {default['cpu']:.2f} s CPU; "
                  f"one thread {one['wall']:.2f} s wall {one['cpu']:.2f} s CPU; "
                  f"default / one: wall {row['wall_ratio']:.2f}x, CPU {row['cpu_ratio']:.2f}x", flush=True)
    if args.out:
        meta = {"machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
