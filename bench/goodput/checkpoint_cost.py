"""What a checkpoint step costs against an ordinary step, with synchronous and with asynchronous saves
(`checkpoint.async_save`), and what an in-memory snapshot step costs (`checkpoint.memory_interval_steps`),
on CPU under gloo (issue 35: "a checkpoint step with asynchronous saving costs at most 10 % more than an
ordinary step").

One job (the `small` preset by default: 6 M parameters, a 72 MB checkpoint, so a synchronous save
takes clearly longer than a step) runs `--repeats` times in each of the `--modes`, interleaved so that
load on the machine falls on every mode alike: `none` (no checkpoint before the final step), `sync`
and `async` (a checkpoint every `--interval` steps), and `snapshot` (no checkpoint before the final step,
an in-memory snapshot every `--interval` steps). A snapshot here costs what it costs a rank: its shard
turned into bytes and one copy of them (`HostMemorySnapshots`, standing for the object-store copy
`ray.put` makes on a RankWorker); the keepers' copies are made in their own processes. A step's time is its whole loop iteration on rank
0: from the start of its `train_step` to the start of the next one, so it includes everything the loop
does for the step (the copy, the commit, starting the next save, a wait for the one in flight). The
last step (its checkpoint is always synchronous) and the first `WARMUP_STEPS` are left out.

Reported per mode: the median ordinary step and the median checkpoint step, their ratio (checkpoint
step / ordinary step of the same runs), the checkpoint step over the `none` runs' ordinary step (the
background write slows the steps it overlaps, which the first ratio hides), and the mean step over the
`none` runs' mean step (the whole cost spread over the run).

Usage: nice -n 19 .venv/bin/python bench/goodput/checkpoint_cost.py [--ranks 2] [--json PATH]
       nice -n 19 .venv/bin/python bench/goodput/checkpoint_cost.py --smoke      (seconds: debug model)
Results: bench/goodput/results-checkpoint-cost.json, docs/benchmarks.md ("Checkpoint step cost").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from trainctl.parallelism.engine.distributed import init_distributed, teardown
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import JobSpecBody

MODES = ("none", "sync", "async", "snapshot")
WARMUP_STEPS = 2
RESULTS = Path(__file__).with_name("results-checkpoint-cost.json")


def job(model: str, steps: int, interval: int, mode: str, ranks: int) -> JobSpecBody:
    """The benchmark's job: `ranks` FSDP ranks of `model` on the standard library's sources."""
    return JobSpecBody.model_validate({
        "model": {"preset": model},
        "data": {"max_files": 40, "seq_len": 128, "seed": 3},
        "parallelism": {"dp_shard": ranks, "zero_stage": 3} if ranks > 1 else {},
        "training": {"steps": steps, "global_batch_size": 4 * ranks, "micro_batch_size": 4, "warmup_steps": 2,
                     "lr": 1e-3, "seed": 5},
        "checkpoint": {"interval_steps": interval if mode in ("sync", "async") else 0, "keep_last": 2,
                       "async_save": mode == "async", "memory_interval_steps": interval if mode == "snapshot" else 0},
        "resources": {"gpus": ranks, "device": "cpu"},
    })


class HostMemorySnapshots:
    """A `SnapshotStore` that keeps the newest snapshot as one copy in this process's memory."""

    def __init__(self) -> None:
        self.newest: tuple[int, bytearray] | None = None

    def put(self, step: int, payload: bytearray) -> None:
        kept = self.newest[1] if self.newest is not None and len(self.newest[1]) == len(payload) else bytearray(len(payload))
        kept[:] = payload  # into the previous copy's memory, as `ray.put` copies into the object store's
        self.newest = (step, kept)

    def steps(self) -> set[int]:
        return {self.newest[0]} if self.newest else set()

    def fetch(self, step: int) -> tuple[bytes, str] | None:
        return (bytes(self.newest[1]), "this process") if self.newest and self.newest[0] == step else None

    def discard_after(self, step: int) -> None:
        if self.newest and self.newest[0] > step:
            self.newest = None


class TimedTrainer(Trainer):
    """A Trainer that notes when each step's loop iteration starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_starts: list[float] = []

    def train_step(self) -> tuple[float, float, dict[str, float]]:
        self.step_starts.append(time.perf_counter())
        return super().train_step()


def train_timed(rank: int, world: int, body_json: str, checkpoint_dir: str) -> dict[str, Any]:
    """Run the job on this rank (one torch thread); its step start times and losses."""
    torch.set_num_threads(1)
    trainer = TimedTrainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world,
                           device="cpu", checkpoint_dir=checkpoint_dir, snapshots=HostMemorySnapshots())
    result = trainer.run()
    return {"step_starts": trainer.step_starts, "losses": result.losses}


def _rank_main(rank: int, world: int, body_json: str, port: int, checkpoint_dir: str, out: Any) -> None:
    init_distributed(rank, world, "127.0.0.1", port, device="cpu")
    try:
        timed = train_timed(rank, world, body_json, checkpoint_dir)
        if rank == 0:
            out.put(timed)
    finally:
        teardown()


def run_once(body: JobSpecBody) -> dict[str, Any]:
    """One run of `body` in a fresh checkpoint directory (one rank: in this process; more: spawned
    processes): rank 0's step start times and losses."""
    world = body.parallelism.world_size
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as directory:
        if world == 1:
            return train_timed(0, 1, body.model_dump_json(), directory)
        out = mp.get_context("spawn").SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank_main, args=(world, body.model_dump_json(), port, directory, out), nprocs=world,
                           start_method="spawn")
        return out.get()


def step_times(starts: list[float], interval: int, mode: str) -> tuple[list[float], list[float]]:
    """(ordinary steps, checkpoint steps) seconds of one run; step n (1-based) lasts from its start to
    step n+1's; the warm-up steps and the last step are left out."""
    ordinary, checkpoint = [], []
    for n in range(WARMUP_STEPS + 1, len(starts)):
        seconds = starts[n] - starts[n - 1]
        (checkpoint if mode != "none" and n % interval == 0 else ordinary).append(seconds)  # a snapshot's too
    return ordinary, checkpoint


def summarise(times: dict[str, tuple[list[float], list[float]]]) -> dict[str, Any]:
    """Per mode: medians, the ratios described in the module docstring."""
    baseline = statistics.median(times["none"][0])
    baseline_mean = statistics.mean(times["none"][0])
    rows: dict[str, Any] = {}
    for mode, (ordinary, checkpoint) in times.items():
        row: dict[str, Any] = {"ordinary_step_median_s": statistics.median(ordinary), "ordinary_steps": len(ordinary)}
        if checkpoint:
            row |= {
                "checkpoint_step_median_s": statistics.median(checkpoint),
                "checkpoint_steps": len(checkpoint),
                "checkpoint_step_max_s": max(checkpoint),
                "ratio_checkpoint_to_ordinary": statistics.median(checkpoint) / row["ordinary_step_median_s"],
                "ratio_checkpoint_to_no_checkpoint_run": statistics.median(checkpoint) / baseline,
                "mean_step_over_no_checkpoint_run": statistics.mean(ordinary + checkpoint) / baseline_mean,
            }
        rows[mode] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="debug model, few steps, one repeat (seconds)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--json", type=Path, help=f"write the results here (full mode default: {RESULTS.name})")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.steps, args.interval, args.repeats = "debug", 8, 2, 1
    modes = [mode for mode in args.modes.split(",") if mode]
    if "none" not in modes or set(modes) - set(MODES):
        parser.error(f"--modes: none and any of {', '.join(MODES[1:])}, got {args.modes!r}")
    times: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in modes}
    losses: dict[str, list[float]] = {}
    per_repeat: list[dict[str, Any]] = []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for mode in modes:
            run = run_once(job(args.model, args.steps, args.interval, mode, args.ranks))
            ordinary, checkpoint = step_times(run["step_starts"], args.interval, mode)
            times[mode][0].extend(ordinary)
            times[mode][1].extend(checkpoint)
            losses.setdefault(mode, run["losses"])
            per_repeat.append({"repeat": repeat + 1, "mode": mode, "ordinary_step_median_s": statistics.median(ordinary),
                               "checkpoint_step_median_s": statistics.median(checkpoint) if checkpoint else None})
            print(f"repeat {repeat + 1} {mode:8s}: ordinary {statistics.median(ordinary):.3f} s"
                  + (f", checkpoint {statistics.median(checkpoint):.3f} s" if checkpoint else ""), flush=True)
    if any(run_losses != losses["none"] for run_losses in losses.values()):
        raise SystemExit("the modes trained different losses: saving or snapshotting changed the run")
    rows = summarise(times)
    for mode, row in rows.items():
        line = f"{mode:8s} ordinary {row['ordinary_step_median_s']:.3f} s"
        if "checkpoint_step_median_s" in row:
            line += (f"  checkpoint {row['checkpoint_step_median_s']:.3f} s  ratio {row['ratio_checkpoint_to_ordinary']:.2f}"
                     f"  vs no-checkpoint run {row['ratio_checkpoint_to_no_checkpoint_run']:.2f}"
                     f"  mean step vs no-checkpoint run {row['mean_step_over_no_checkpoint_run']:.3f}")
        print(line)
    target = args.json or (None if args.smoke else RESULTS)
    if target is not None:
        payload = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, torch {torch.__version__}, gloo",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": args.model, "ranks": args.ranks, "steps": args.steps, "interval": args.interval,
            "repeats": args.repeats, "warmup_steps": WARMUP_STEPS, "seconds": time.perf_counter() - started,
            "losses_identical": True, "modes": rows, "per_repeat": per_repeat,
        }
        target.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
