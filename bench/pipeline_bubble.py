"""Pipeline idle time against the theoretical bubble: GPipe, 1F1B, interleaved 1F1B, zero-bubble.

Runs the engine's real `PipelineRunner` (torch.distributed.pipelining schedules, gloo p2p) on `pp`
CPU processes. Each stage's work is *controlled*: every stage output passes through a function that
waits `F` ms in forward and `B` ms in its input-gradient backward, and a stage parameter passes
through one that waits `W` ms in its weight-gradient backward. The waits release the CPU, so the
timing reflects the schedule, not how many cores the machine has (this bench runs 4 ranks on 2
cores); the small debug model's own compute is extra and shows up as idle/overhead. Interleaved
chunks get F/v, B/v, W/v each so every schedule does the same work per rank.

Per rank and step: busy = the injected work (sum of the waits actually performed), idle = step wall
time - busy. Reported: idle / step time, mean over ranks, median over the measured steps, beside two
references:

- *schedule*: the idle fraction of the action order torch actually generated for this schedule
  (`schedule.pipeline_order`), replayed with the injected F / B / W times, free communication and no
  other work (each action starts when its rank is free and its inputs exist). This is what the
  schedule itself costs; measured - schedule is the runtime's overhead (p2p, Python, the model's own
  compute, 4 processes sharing the cores).
- *formula*: the textbook bubble fraction for m micro-batches and p stages, as `trainctl plan`
  models it (trainctl.parallelism.sizing.pipeline_bubble.bubble_fraction):

    GPipe, 1F1B          (p - 1) / (m + p - 1)
    interleaved (v)      (p - 1) / (v m + p - 1)
    zero-bubble (ZB-H1)  (p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W))

Usage: .venv/bin/python bench/pipeline_bubble.py [--pp 4] [--micro 8] [--f 20 --b 20 --w 20] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from trainctl.parallelism.layouts.pipeline import PipelineRunner, split_pipeline_stages
from trainctl.parallelism.model.transformer import build_model
from trainctl.parallelism.sizing.pipeline_bubble import bubble_fraction
from trainctl.spec.presets import PRESETS


@dataclass(frozen=True)
class Case:
    schedule: str
    virtual: int


CASES = (Case("gpipe", 1), Case("1f1b", 1), Case("interleaved_1f1b", 2), Case("zero_bubble", 1))


Action = tuple[int, str, int | None]
"""(stage index, computation type F / I / W / B / ..., micro-batch index) of one schedule action."""


def replay(order: dict[int, list[Action | None]], p: int, v: int, f: float, b: float, w: float) -> tuple[float, float]:
    """(step ms, mean idle fraction over ranks) of a schedule's per-rank action lists with forward
    `f`, input-gradient `b` and weight-gradient `w` ms per stage (`/ v` per chunk), free communication.

    F(s, m) needs F(s-1, m); I or B(s, m) needs F(s, m) and the input gradient of stage s+1 (its I or
    B); W(s, m) needs I(s, m). A full backward B costs b + w. Other actions (grad reductions, comms)
    take no time. Each rank runs its list in order, an action as soon as its rank and inputs allow.
    """
    cost = {"F": f / v, "I": b / v, "W": w / v, "B": (b + w) / v}
    stages = p * v
    queues = {r: [a for a in acts if a is not None and a[1] in cost] for r, acts in order.items()}
    done: dict[tuple[str, int, int | None], float] = {}
    pos = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)

    def needs(stage: int, kind: str, mb: int | None) -> list[tuple[str, int, int | None]]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind == "W":
            return [("G", stage, mb)]
        return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < stages - 1 else [])

    while any(pos[r] < len(q) for r, q in queues.items()):
        progressed = False
        for r, actions in queues.items():
            while pos[r] < len(actions):
                stage, kind, mb = actions[pos[r]]
                deps = needs(stage, kind, mb)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + cost[kind]
                busy[r] += cost[kind]
                done[("G" if kind in "IB" else kind, stage, mb)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: actions[pos[r]] for r, actions in queues.items() if pos[r] < len(actions)}
            raise RuntimeError(f"the schedule's action lists deadlock in replay; next actions per rank: {stuck}")
    makespan = max(free.values())
    if makespan == 0:  # no injected work (--f 0 --b 0 --w 0 measures the runtime's own step time)
        return 0.0, float("nan")
    return makespan, statistics.mean(1.0 - busy[r] / makespan for r in queues)


def single_stage_order(schedule: str, p: int, m: int) -> dict[int, list[Action | None]]:
    """The order ScheduleGPipe / Schedule1F1B execute (their own loops, not an action list): GPipe all
    forwards then all backwards; 1F1B `p - r` warm-up forwards on rank r, then one backward and one
    forward alternately, then the remaining backwards."""
    order: dict[int, list[Action | None]] = {}
    for r in range(p):
        warm = m if schedule == "gpipe" else min(p - r, m)
        acts: list[Action | None] = [(r, "F", i) for i in range(warm)]
        for i in range(m):
            acts.append((r, "B", i))
            if warm + i < m:
                acts.append((r, "F", warm + i))
        order[r] = acts
    return order


def action_lists(schedule: object, name: str, p: int, m: int) -> dict[int, list[Action | None]]:
    """Per-rank action order the schedule executes, as plain tuples. Multi-stage schedules run their
    `pipeline_order`; for the single-stage ones that IR is descriptive only (torch 2.13's Schedule1F1B
    names micro-batches 1..m on the last rank), so their canonical order is used."""
    if not isinstance(schedule, PipelineScheduleMulti):
        return single_stage_order(name, p, m)

    def flat(a: Any) -> list[Action]:
        if a.sub_actions:
            return [x for sub in a.sub_actions for x in flat(sub)]
        return [(a.stage_index, a.computation_type.value, a.microbatch_index)]

    return {rank: [x for a in acts if a is not None for x in flat(a)] for rank, acts in schedule.pipeline_order.items()}


class Ledger:
    """Milliseconds of injected work this rank has performed."""

    def __init__(self) -> None:
        self.busy = 0.0

    def wait(self, ms: float) -> None:
        start = time.perf_counter()
        time.sleep(ms / 1000.0)
        self.busy += time.perf_counter() - start


class ActivationWork(torch.autograd.Function):
    """Identity that waits F ms in forward and B ms in backward (the input-gradient path)."""

    @staticmethod
    def forward(ctx, x: Tensor, ledger: Ledger, f: float, b: float) -> Tensor:
        ledger.wait(f)
        ctx.ledger, ctx.b = ledger, b
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.ledger.wait(ctx.b)
        return grad, None, None, None


class WeightWork(torch.autograd.Function):
    """Identity on a parameter that waits W ms in backward (the weight-gradient path)."""

    @staticmethod
    def forward(ctx, p: Tensor, ledger: Ledger, w: float) -> Tensor:
        ctx.ledger, ctx.w = ledger, w
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.ledger.wait(ctx.w)
        return grad, None, None


def add_work(module: nn.Module, ledger: Ledger, f: float, b: float, w: float) -> None:
    """Make `module`'s forward cost F ms, its input backward B ms and its weight backward W ms."""
    module.register_parameter("bench_weight", nn.Parameter(torch.zeros(())))

    def after(mod: nn.Module, args: tuple, out: Tensor) -> Tensor:
        weight_term = WeightWork.apply(mod.bench_weight, ledger, w) * 0.0
        return ActivationWork.apply(out, ledger, f, b) + weight_term

    module.register_forward_hook(after)


def worker(rank: int, args: argparse.Namespace, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.pp)
    try:
        rows = []
        config = replace(PRESETS["debug"], n_layers=8)  # 8 layers: 2 virtual stages on each of 4 ranks
        for case in CASES:
            model = build_model(config, seed=0)
            chunks = split_pipeline_stages(model, pp_rank=rank, pp=args.pp, virtual_stages=case.virtual)
            ledger = Ledger()
            for chunk in chunks:
                add_work(chunk.module, ledger, args.f / case.virtual, args.b / case.virtual, args.w / case.virtual)
            runner = PipelineRunner(
                chunks, schedule=case.schedule, n_microbatches=args.micro, group=dist.group.WORLD,
                device=torch.device("cpu"),
            )
            generator = torch.Generator().manual_seed(0)
            data = torch.randint(0, config.vocab_size, (args.micro, 33), generator=generator)
            fractions, step_times = [], []
            for step in range(args.warmup + args.steps):
                for p in runner.parameters():
                    p.grad = None
                ledger.busy = 0.0
                dist.barrier()
                start = time.perf_counter()
                runner.step(data[:, :-1], data[:, 1:])
                elapsed = time.perf_counter() - start
                if step >= args.warmup:
                    fractions.append(1.0 - ledger.busy / elapsed)
                    step_times.append(elapsed)
            order = action_lists(runner.schedule, case.schedule, args.pp, args.micro) if rank == 0 else None
            rows.append((case, statistics.median(fractions), statistics.median(step_times), order))
        results.put((rank, rows))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (processes)")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--f", type=float, default=20.0, help="forward ms per stage per micro-batch")
    parser.add_argument("--b", type=float, default=20.0, help="input-gradient backward ms")
    parser.add_argument("--w", type=float, default=20.0, help="weight-gradient backward ms")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per schedule")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    per_rank: dict[int, list] = {}
    while len(per_rank) < len(procs):
        try:
            rank, rows = results.get(timeout=5)
            per_rank[rank] = rows
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"a pipeline rank failed (exit codes {failed}); see its traceback above") from None
    for proc in procs:
        proc.join()

    print(f"p={args.pp} stages, m={args.micro} micro-batches, F/B/W = {args.f}/{args.b}/{args.w} ms per stage")
    print(f"{'schedule':<22}{'measured idle':>14}{'schedule':>10}{'formula':>9}{'step (s)':>10}{'replayed (s)':>14}")
    rows = []
    for i, case in enumerate(CASES):
        measured = statistics.mean(per_rank[r][i][1] for r in range(args.pp))
        step = statistics.mean(per_rank[r][i][2] for r in range(args.pp))
        theory = bubble_fraction(case.schedule, args.pp, args.micro, case.virtual, args.f, args.b, args.w)
        replayed_ms, replayed_idle = replay(per_rank[0][i][3], args.pp, case.virtual, args.f, args.b, args.w)
        label = case.schedule + (f" (v={case.virtual})" if case.virtual > 1 else "")
        print(f"{label:<22}{measured:>14.1%}{replayed_idle:>10.1%}{theory:>9.1%}{step:>10.3f}{replayed_ms / 1000:>14.3f}")
        rows.append({
            "schedule": case.schedule, "virtual_stages": case.virtual, "measured_idle": measured,
            "schedule_idle": replayed_idle, "formula_idle": theory, "step_seconds": step,
            "replayed_step_seconds": replayed_ms / 1000,
        })
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
