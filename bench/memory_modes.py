"""Peak memory of a training step under each data-parallel mode, tensor and pipeline parallel, on CPU
under gloo, against the estimator (`estimator.estimate_memory`, docs/engine.md "Memory estimator").

Every case trains the `small` preset (8 blocks of dim 256, 6 M parameters, float32 state 96 MiB on one
process) on 128 tokens per rank, so parameters, gradients, optimizer state and the data-parallel
working copies dominate the step, for two warm-up steps (optimizer state created, DDP's buckets
rebuilt), then measures the third, on every rank:

- held at the start: the storages of parameters, optimizer state and DDP's gradient buckets,
  counted exactly;
- the step's rise: the process's heap in use (glibc `mallinfo2`: every thread's arenas and mmapped
  blocks, so storages FSDP frees by resizing them and the buffers gloo allocates count) sampled
  before and after every dispatched op (a TorchDispatchMode) during forward, backward, the loss's
  all-reduce and the optimizer step, less its value at the start;
- measured peak = held + rise. "outside collectives" leaves out the samples taken as a collective
  returns, when gloo still holds the flat copy it makes of each all-gather's output and each
  reduce-scatter's input (NCCL's buffers are outside the CUDA allocator's statistics, and the
  estimator does not model them).

The error is estimate / measured - 1 for the rank with the largest |error|; the test
`test_estimated_peaks_match_the_peaks_measured_under_gloo` (tests/parallelism/test_estimator.py)
holds the estimator within 10 % of the measured peak on every rank for `TESTED`: DDP, ZeRO-1, ZeRO-2,
ZeRO-3, HSDP, TP, PP and PP over ZeRO-3. Results: bench/results-memory-modes.json, docs/engine.md
("Memory estimator").

Usage: .venv/bin/python bench/memory_modes.py [--only fsdp zero2] [--json bench/results-memory-modes.json]
       (about 10 minutes on a 2-core CPU; glibc only)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import platform
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from trainctl.parallelism.engine.distributed import init_distributed, teardown
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.estimator import estimate_memory
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model

MiB = 2**20
WARMUP_STEPS = 2
SEQUENCES_PER_MICRO_BATCH = 4
"""Sequences of `SEQ_LEN` tokens per micro-batch (one micro-batch per rank and step, two under PP)."""
SEQ_LEN = 32


@dataclass(frozen=True)
class Case:
    """One layout: its spec.parallelism fields and spec.training changes."""

    name: str
    parallelism: dict[str, Any]
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        world = 1
        for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
            world *= self.parallelism.get(dim, 1)
        return world


CASES = (
    Case("single", {}),
    Case("ddp", {"dp_replicate": 2}),
    Case("zero1", {"dp_shard": 2, "zero_stage": 1}),
    Case("zero2", {"dp_shard": 2, "zero_stage": 2}),
    Case("fsdp", {"dp_shard": 2, "zero_stage": 3}),
    Case("hsdp", {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}),
    Case("tp", {"tp": 2, "sequence_parallel": True}),
    Case("pp", {"pp": 2}),
    Case("zero2-bf16", {"dp_shard": 2, "zero_stage": 2}, {"dtype": "bfloat16"}),
    Case("fsdp-bf16", {"dp_shard": 2, "zero_stage": 3}, {"dtype": "bfloat16"}),
    Case("ddp-over-tp", {"dp_replicate": 2, "tp": 2, "sequence_parallel": True}),
    Case("pp-fsdp", {"pp": 2, "dp_shard": 2, "zero_stage": 3}),
)
TESTED = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "pp", "pp-fsdp")
"""The cases the test holds within 10 % (one per mode, and PP over ZeRO-3; the others are measured here only)."""


def case_job(case: Case, paths: list[str]) -> JobSpecBody:
    """The job of `case` on the text files `paths` (globs, or `@stdlib`)."""
    par = case.parallelism
    dp = par.get("dp_replicate", 1) * par.get("dp_shard", 1)
    micro_batches = 2 if par.get("pp", 1) > 1 else 1
    return JobSpecBody.model_validate({
        "model": {"preset": "small"},
        "data": {"paths": paths, "seq_len": SEQ_LEN, "max_files": 20, "seed": 7},
        "parallelism": par,
        "training": {"steps": 100, "global_batch_size": SEQUENCES_PER_MICRO_BATCH * micro_batches * dp,
                     "micro_batch_size": SEQUENCES_PER_MICRO_BATCH, "warmup_steps": 1, "lr": 1e-3, "seed": 3,
                     "optimizer_impl": "fused", **case.training},
        "resources": {"gpus": case.world, "device": "cpu"},
        "checkpoint": {"resume": False},
    })


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_reader() -> Any:
    """A function returning the bytes glibc's malloc has handed out and not yet taken back (arenas of
    every thread + mmapped blocks); None where the C library has no `mallinfo2` (not glibc >= 2.33)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class HeapPeak(TorchDispatchMode):
    """The largest heap in use sampled before and after every dispatched op, in all and outside
    collectives (not right after a c10d op returns)."""

    def __init__(self, in_use: Any):
        super().__init__()
        self.in_use = in_use
        self.start = self.peak = self.peak_outside = in_use()

    def _sample(self, collective: bool) -> None:
        value = self.in_use()
        self.peak = max(self.peak, value)
        if not collective:
            self.peak_outside = max(self.peak_outside, value)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._sample(False)
        out = func(*args, **(kwargs or {}))
        self._sample("c10d" in func.namespace)
        return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_rank(rank: int, world: int, body_json: str) -> dict[str, int]:
    """On one rank (process group initialised when world > 1): the measured peak of a step after the
    warm-up, and its parts (module docstring)."""
    in_use = heap_reader()
    if in_use is None:
        raise RuntimeError("the heap is measured with glibc's mallinfo2, which this C library lacks")
    trainer = Trainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world, device="cpu")
    for _ in range(WARMUP_STEPS):
        trainer.train_step()
    batch = trainer.loader.next_batch()
    gc.collect()
    optimizer_state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = storage_bytes([*trainer.model.parameters(), *optimizer_state])
    heap = HeapPeak(in_use)
    with heap:
        trainer.global_loss(trainer.forward_backward(batch))
        buckets = storage_bytes(p.grad for part in trainer.model.parts if isinstance(part, DistributedDataParallel)
                                for p in part.parameters() if p.grad is not None)  # allocated with the model
        trainer.optimizer_step()
    held += buckets
    return {"held": held, "peak": held + heap.peak - heap.start, "peak_outside_collectives": held + heap.peak_outside - heap.start}


def _rank_main(rank: int, world: int, body_json: str, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    if world > 1:
        init_distributed(rank, world, "127.0.0.1", port, device="cpu")
    try:
        out.put((rank, measure_rank(rank, world, body_json)))
    finally:
        if world > 1:
            teardown()


def measure_case(body: JobSpecBody) -> list[dict[str, int]]:
    """`measure_rank` on every rank of `body`, in spawned processes."""
    world = body.parallelism.world_size
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, body.model_dump_json(), port, out), nprocs=world, start_method="spawn")
    return [m for _, m in sorted(out.get() for _ in range(world))]


def compare(body: JobSpecBody, measured: list[dict[str, int]]) -> dict[str, Any]:
    """The rank whose estimate is furthest from its measured peak: both, the estimate's parts, the error."""
    config = resolve_model(body.model)
    rows = []
    for rank, m in enumerate(measured):
        e = estimate_memory(ResolvedJob.resolve(body, model=config), rank)
        rows.append({
            "rank": rank, "measured": m["peak"], "measured_outside_collectives": m["peak_outside_collectives"],
            "held_at_start": m["held"], "estimate": e.total_bytes,
            "estimate_parts": {"params": e.params_bytes, "grads": e.grads_bytes, "optimizer": e.optimizer_bytes,
                               "activations": e.activations_bytes, "working": e.working_bytes},
            "error": e.total_bytes / m["peak"] - 1,
            "error_outside_collectives": e.total_bytes / m["peak_outside_collectives"] - 1,
        })
    return max(rows, key=lambda r: abs(r["error"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names (default: all): " + ", ".join(c.name for c in CASES))
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'case':12s} {'ranks':>5s} {'measured':>9s} {'outside':>8s} {'estimate':>9s} {'error':>7s} {'(outside)':>9s}  "
          "estimate parts MiB (params, grads, optimizer, activations, working)")
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        body = case_job(case, ["@stdlib"])
        started = time.perf_counter()
        row = {"case": case.name, "parallelism": case.parallelism, "training": case.training, "ranks": case.world,
               **compare(body, measure_case(body)), "seconds": time.perf_counter() - started}
        rows.append(row)
        parts = ", ".join(f"{v / MiB:.1f}" for v in row["estimate_parts"].values())
        print(f"{case.name:12s} {case.world:5d} {row['measured'] / MiB:9.1f} {row['measured_outside_collectives'] / MiB:8.1f} "
              f"{row['estimate'] / MiB:9.1f} {row['error']:+7.1%} {row['error_outside_collectives']:+9.1%}  {parts}", flush=True)
    if args.json:
        payload = {"machine": f"{platform.machine()}, {platform.system()}, torch {torch.__version__}, gloo",
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": "small", "seq_len": SEQ_LEN,
                   "micro_batch_size": SEQUENCES_PER_MICRO_BATCH, "warmup_steps": WARMUP_STEPS, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
