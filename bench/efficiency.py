"""Every single-device efficiency technique measured against one baseline run (docs/efficiency.md).

Each row is the baseline job with one spec change, trained by the engine's own `Trainer` on this
machine's device (CUDA when available, else CPU):

- baseline: a Llama preset (`--preset`, default `tiny`: 8 layers, dim 128, GQA 8/4 heads), seq `--seq-len`, global batch 8 in one
  micro-batch, float32, no activation checkpointing, AdamW foreach, no prefetch, text data.
- per row, after one warm-up step: **model state** (the storages of parameters, gradients and
  optimizer state, counted exactly; local shards under ZeRO/FSDP), **peak memory** of one step
  (`torch.cuda.max_memory_allocated` on CUDA; on CPU a dispatch mode, `LiveBytes`, that follows
  every tensor storage an op creates until it is freed: what a caching-free allocator would peak at)
  and its part above the state held between steps (activations, gradients, temporaries), the
  estimator's prediction (`estimator.estimate_memory`, what
  `micro_batch_size: auto` plans with), and the median **step time** over `--steps` steps with its
  data-wait and optimizer parts.
- ZeRO-1/2/3 rows run 2 data-parallel ranks (gloo on CPU, nccl with 2+ GPUs) against DDP on the same
  2 ranks; they are skipped on a single GPU.
- data rows: start-up cost of tokenizing the corpus vs opening prepared token shards
  (`trainctl data prepare`), and the step's wait for data with and without the prefetch thread.

Rows a device cannot show (empty_cache_steps and the auto probe without CUDA; compile's memory on
CPU, whose generated kernels allocate outside the dispatcher; peaks of 2-rank rows on CPU, where
FSDP frees storages by resizing them) are printed as not measured (n/m), never estimated.

Usage: .venv/bin/python bench/efficiency.py [--preset small] [--seq-len 256] [--steps 3]
       [--json results.json] [--quick]   (about 4 minutes on a 2-core CPU; --quick: debug preset)
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import tempfile
import time
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.token_shards import prepare_shards
from trainctl.parallelism.engine import efficiency
from trainctl.parallelism.engine.distributed import init_distributed, teardown
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.estimator import estimate_memory
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model

MiB = 2**20


@dataclass(frozen=True)
class Row:
    """One technique: the spec fields it changes from the baseline."""

    name: str
    field: str
    changes: dict[str, Any]
    world: int = 1
    needs_cuda: bool = False


ROWS = [
    Row("baseline", "-", {}),
    Row("gradient accumulation 2 x 4", "training.micro_batch_size: 4", {"training.micro_batch_size": 4}),
    Row("gradient accumulation 8 x 1", "training.micro_batch_size: 1", {"training.micro_batch_size": 1}),
    Row("micro_batch_size auto", "training.micro_batch_size: auto", {"training.micro_batch_size": "auto"}),
    Row("activation checkpointing selective", "training.activation_checkpointing", {"training.activation_checkpointing": "selective"}),
    Row("activation checkpointing full", "training.activation_checkpointing", {"training.activation_checkpointing": "full"}),
    Row("bf16 autocast", "training.dtype: bfloat16", {"training.dtype": "bfloat16"}),
    Row("AdamW fused", "training.optimizer_impl: fused", {"training.optimizer_impl": "fused"}),
    Row("SGD momentum", "training.optimizer: sgd", {"training.optimizer": "sgd"}),
    Row("Adafactor", "training.optimizer: adafactor", {"training.optimizer": "adafactor"}),
    Row("LoRA r=8 on wq, wv", "lora", {"lora": {"rank": 8}}),
    Row("torch.compile", "training.compile", {"training.compile": True}),
    Row("prefetch 2 batches", "data.prefetch: 2", {"data.prefetch": 2}),
    Row("empty_cache_steps 1", "training.empty_cache_steps", {"training.empty_cache_steps": 1}, needs_cuda=True),
    Row("DDP (2 ranks, reference)", "parallelism.dp_replicate: 2", {"parallelism.dp_replicate": 2, "training.micro_batch_size": 4}, world=2),
    Row("ZeRO-1 (2 ranks)", "parallelism.zero_stage: 1", {"parallelism.dp_shard": 2, "parallelism.zero_stage": 1, "training.micro_batch_size": 4}, world=2),
    Row("ZeRO-2 (2 ranks)", "parallelism.zero_stage: 2", {"parallelism.dp_shard": 2, "parallelism.zero_stage": 2, "training.micro_batch_size": 4}, world=2),
    Row("ZeRO-3 / FSDP (2 ranks)", "parallelism.zero_stage: 3", {"parallelism.dp_shard": 2, "parallelism.zero_stage": 3, "training.micro_batch_size": 4}, world=2),
]


@dataclass
class Measured:
    """What one row's run measured (bytes, seconds); None where the device cannot measure it."""

    row: str
    device: str
    micro_batch_size: int
    trainable_params: int
    state_bytes: int
    peak_bytes: int | None
    activation_bytes: int | None
    estimate_bytes: int
    step_seconds: float
    data_seconds: float
    optimizer_seconds: float
    first_step_seconds: float
    extra: dict[str, float] = field(default_factory=dict)


def baseline_job(preset: str, seq_len: int, corpus: list[str], max_files: int) -> JobSpecBody:
    return JobSpecBody.model_validate({
        "model": {"preset": preset},
        "data": {"paths": corpus, "seq_len": seq_len, "max_files": max_files, "prefetch": 0},
        "training": {"steps": 1000, "global_batch_size": 8, "micro_batch_size": 8, "warmup_steps": 1, "lr": 1e-3,
                     "optimizer_impl": "foreach"},
        "checkpoint": {"resume": False},
    })


def with_changes(job: JobSpecBody, changes: dict[str, Any], world: int) -> JobSpecBody:
    data = job.model_dump()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    data["resources"]["gpus"] = world
    return JobSpecBody.model_validate(data)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(trainer: Trainer) -> list[torch.Tensor]:
    return [v for opt in trainer.optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def timed_step(trainer: Trainer) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    _, _, breakdown = trainer.train_step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return time.perf_counter() - t0, breakdown


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages: those of `existing` plus every storage an op creates while the
    mode is active (each counted until it is freed), and their peak."""

    def __init__(self, existing: Iterable[torch.Tensor]):
        super().__init__()
        self.live: set[tuple[str, int]] = set()
        self.current = self.peak = 0
        for t in existing:
            self._track(t)
        self.start = self.current

    def _track(self, t: torch.Tensor) -> None:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key in self.live or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self.live.add(key)
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: tuple[str, int], size: int) -> None:
        self.live.discard(key)
        self.current -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def peak_of_step(trainer: Trainer, tracked: bool) -> tuple[int | None, int | None]:
    """(peak bytes, peak bytes above the model state held at the start) of one training step."""
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        timed_step(trainer)
        peak = torch.cuda.max_memory_allocated(device)
        return peak, peak - before
    if not tracked:
        return None, None
    with LiveBytes([*trainer.model.parameters(), *optimizer_tensors(trainer)]) as live:
        timed_step(trainer)
    return live.peak, live.peak - live.start


def measure(row: Row, job: JobSpecBody, device: torch.device, steps: int, rank: int = 0) -> Measured:
    """Build the row's Trainer and measure state, peak and step time (collective for 2-rank rows)."""
    trainer = Trainer(job, rank=rank, world_size=row.world, device=device)
    config = resolve_model(job.model)
    t_first, _ = timed_step(trainer)  # warm-up: optimizer state exists, compile has run
    batch = trainer.loader.next_batch()
    trainer.forward_backward(batch)
    grads = storage_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None)
    trainer.optimizer_step()
    state = storage_bytes(trainer.model.parameters()) + grads + storage_bytes(optimizer_tensors(trainer))
    times = [timed_step(trainer) for _ in range(steps)]
    peak, act = peak_of_step(trainer, tracked=row.world == 1 and not job.training.compile)
    extra: dict[str, float] = {}
    if job.training.empty_cache_steps and device.type == "cuda":
        extra = efficiency.allocator_report(device).as_breakdown()
    return Measured(
        row=row.name,
        device=str(device),
        micro_batch_size=int(trainer.job.training.micro_batch_size),
        trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        state_bytes=state,
        peak_bytes=peak,
        activation_bytes=act,
        estimate_bytes=estimate_memory(ResolvedJob.resolve(trainer.job, model=config), rank).total_bytes,
        step_seconds=statistics.median(t for t, _ in times),
        data_seconds=statistics.median(b["data"] for _, b in times),
        optimizer_seconds=statistics.median(b["optimizer"] for _, b in times),
        first_step_seconds=t_first,
        extra=extra,
    )


def _rank_main(rank: int, row: Row, job: JobSpecBody, steps: int, port: int, use_cuda: bool, out: Any) -> None:
    torch.set_num_threads(1)
    device = init_distributed(rank, row.world, "127.0.0.1", port, device="cuda" if use_cuda else "cpu")
    try:
        result = measure(row, job, device, steps, rank)
        if rank == 0:
            out.put(asdict(result))
    finally:
        teardown()


def measure_distributed(row: Row, job: JobSpecBody, steps: int, use_cuda: bool) -> Measured:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(row, job, steps, port, use_cuda, out), nprocs=row.world, start_method="spawn")
    return Measured(**out.get())


def data_startup(job: JobSpecBody, workdir: Path) -> dict[str, float]:
    """Seconds to tokenize the corpus at start-up vs to prepare it once and open the shards."""
    t0 = time.perf_counter()
    text = build_dataset(job.data, 256)
    t1 = time.perf_counter()
    prepare_shards(job.data.paths, workdir, max_files=job.data.max_files, workers=2)
    t2 = time.perf_counter()
    spec = job.data.model_copy(update={"paths": [str(workdir)], "format": "tokens"})
    shards = build_dataset(spec, 256)
    t3 = time.perf_counter()
    assert torch.equal(text.samples(0, 4), shards.samples(0, 4))
    return {"tokenize_at_startup_s": t1 - t0, "prepare_once_s": t2 - t1, "open_shards_s": t3 - t2,
            "tokens": float(text.n_samples * (job.data.seq_len + 1))}


def cell(value: float | None, ref: float | None, scale: float, fmt: str) -> str:
    """`value / scale` with its ratio to `ref`; n/m when not measured."""
    if value is None:
        return "n/m"
    return f"{value / scale:{fmt}} ({value / ref:.2f}x)" if ref else f"{value / scale:{fmt}}"


def table(results: list[Measured], base: Measured, ddp: Measured | None) -> str:
    """Markdown rows: absolute values with the ratio to the reference (baseline; DDP for ZeRO rows)."""
    lines = [
        "| technique | micro | trainable params | model state MiB | step peak MiB | above state MiB | estimate MiB "
        "| step s | data wait ms | optimizer ms |",
        "|" + "---|" * 10,
    ]
    for m in results:
        ref = ddp if "ZeRO" in m.row and ddp is not None else base
        lines.append(
            f"| {m.row} | {m.micro_batch_size} | {m.trainable_params:,} | {cell(m.state_bytes, ref.state_bytes, MiB, '.2f')} "
            f"| {cell(m.peak_bytes, ref.peak_bytes, MiB, '.1f')} | {cell(m.activation_bytes, ref.activation_bytes, MiB, '.1f')} "
            f"| {m.estimate_bytes / MiB:.1f} | {cell(m.step_seconds, ref.step_seconds, 1, '.3f')} "
            f"| {m.data_seconds * 1e3:.2f} | {m.optimizer_seconds * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--corpus", default="@stdlib")
    parser.add_argument("--max-files", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of single-process rows")
    parser.add_argument("--only", nargs="*", help="row names to run (default: all)")
    parser.add_argument("--json", type=Path, help="write the raw measurements here")
    parser.add_argument("--quick", action="store_true", help="debug preset, seq 64, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.seq_len, args.steps = "debug", 64, 2
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    base_job = baseline_job(args.preset, args.seq_len, [args.corpus], args.max_files)
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, " + (
        torch.cuda.get_device_name(device) if use_cuda else "no GPU")
    print(f"preset {args.preset}, seq {args.seq_len}, global batch 8, device {device} ({machine})", flush=True)

    results: list[Measured] = []
    not_measured: list[str] = []
    for row in ROWS:
        if args.only and row.name not in args.only and row.name != "baseline":
            continue
        if (row.needs_cuda and not use_cuda) or (row.world > 1 and use_cuda and torch.cuda.device_count() < row.world):
            not_measured.append(f"{row.name} ({row.field}): needs {'CUDA' if row.needs_cuda else f'{row.world} GPUs'}")
            continue
        job = with_changes(base_job, row.changes, row.world)
        t0 = time.perf_counter()
        try:
            m = measure_distributed(row, job, args.steps, use_cuda) if row.world > 1 else measure(row, job, device, args.steps)
        except Exception as exc:  # noqa: BLE001 - a technique this machine cannot run is reported, not fatal
            not_measured.append(f"{row.name} ({row.field}): failed here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            print(f"  {not_measured[-1]}", flush=True)
            continue
        results.append(m)
        print(f"  {row.name}: {time.perf_counter() - t0:.1f} s", flush=True)

    base = next(m for m in results if m.row == "baseline")
    ddp = next((m for m in results if m.row.startswith("DDP")), None)
    print(table(results, base, ddp))
    with tempfile.TemporaryDirectory() as tmp:
        startup = data_startup(base_job, Path(tmp))
    print("\ndata start-up: " + ", ".join(f"{k} {v:.3f}" if k.endswith("_s") else f"{k} {v:.0f}" for k, v in startup.items()))
    compiled = next((m for m in results if m.row == "torch.compile"), None)
    if compiled is not None:
        print(f"torch.compile first step (compilation) {compiled.first_step_seconds:.1f} s vs baseline first step {base.first_step_seconds:.2f} s")
    for m in results:
        if m.extra:
            print(f"{m.row} allocator: {m.extra}")
    for line in not_measured:
        print(f"not measured: {line}")
    if args.json:
        payload = {"config": vars(args) | {"json": str(args.json)}, "machine": machine, "rows": [asdict(m) for m in results],
                   "data_startup": startup, "not_measured": not_measured}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
