"""Shared harness for the engine's multi-process tests (gloo, CPU, fp32).

API (the `pool` fixture in conftest.py is a session-wide `WorkerPool`):

    pool.run(fn, world_size, *args, timeout=...) -> list[result per rank]
        Run `fn(rank, world_size, *args)` on `world_size` long-lived worker processes, each inside a
        fresh gloo default process group (new TCPStore port per call), then destroy the group.
        `fn` must be a module-level function importable by module name in the workers (this module,
        or a test module in tests/parallelism); arguments and results must pickle. An exception on
        any rank fails the call with that rank's traceback. world_size 1 runs without a process group.

    run_layout(pool, body, steps=5, grad_step=1) -> LayoutRun
        Train `body` (a JobSpecBody; its parallelism block picks the layout, world size = its
        product) for `steps` optimizer steps; `LayoutRun.losses` are the global losses per step and
        `LayoutRun.grads` the gradients of optimizer step `grad_step` (0-based), after reduction and
        before clipping, gathered to full tensors and keyed by canonical parameter name
        (`layers.0.attention.wq.weight`). Set `grads_fn="module:function"` to gather differently:
        the function takes the Trainer and returns {name: full tensor} on every rank (collective).

    run_reference(pool, body, steps=5, grad_step=1) -> LayoutRun
        The same job with every parallel degree set to 1, in one process: the single-process result
        every layout must reproduce. Cached per job, so a matrix of layouts pays for it once.

    assert_equivalent(run, reference, loss_rtol=1e-5, grad_atol=1e-4)
        Losses equal within `loss_rtol` (relative), and every gradient within `grad_atol` (absolute,
        plus the same relative), same parameter names on both sides.

    run_training(pool, body, checkpoint_dir=None) -> TrainResult
        `Trainer.run()` as the service runs it (checkpoints on schedule, resumes from the newest
        complete checkpoint in `checkpoint_dir`); rank 0's result.

    tiny_job(tmp_corpus, **parallelism) -> JobSpecBody
        A small model (the debug preset), seq_len 32, global batch 8, micro-batch 1, on `tmp_corpus`
        (the `corpus` fixture: a few KB of deterministic text files).

Workers set torch to 1 thread and float32, so results are deterministic and cheap on 2 cores.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from trainctl.parallelism.distributed import teardown
from trainctl.spec.job import JobSpecBody

DEFAULT_TIMEOUT = 240.0
MAX_WORKER_THREADS = 96
"""A worker with more native threads than this after a call is replaced by a fresh process. Gloo process groups
leave their event-loop threads behind when torch destroys them, and hundreds of idle-polling threads
per worker slow every later case (a 2x longer suite was measured)."""


RECYCLE = "recycle"
"""Task that makes a worker exit at once, sent by the pool after a call whose result said so."""


def native_threads() -> int:
    """Native threads of this process (Linux /proc; 0 where unknown, so nothing is recycled)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_loop(index: int, tasks: mp.Queue, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while True:
        task = tasks.get()
        if task is None:
            return
        if task == RECYCLE:  # the parent has every result (tensors travel by fd from this process)
            os._exit(0)  # without torch's and gloo's destructors, which can wait on leaked threads
        call_id, fn, rank, world_size, port, args = task
        try:
            if world_size > 1:
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=DEFAULT_TIMEOUT),
                )
            try:
                out = (True, fn(rank, world_size, *args))
            finally:
                teardown()
        except BaseException:  # noqa: BLE001 - reported to the test process
            out = (False, f"rank {rank}:\n{traceback.format_exc()}")
        results.put((call_id, rank, out, native_threads() > MAX_WORKER_THREADS))


class WorkerPool:
    """Long-lived worker processes reused across test cases (grown on demand)."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._results = self._ctx.Queue()
        self._workers: list[tuple[Any, Any]] = []
        self._calls = 0

    def _replace(self, index: int) -> None:
        """Stop worker `index` (its last result said it holds too many threads) and start a fresh one."""
        proc, tasks = self._workers[index]
        tasks.put(RECYCLE)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        replacement = self._ctx.Process(target=_worker_loop, args=(index, tasks, self._results), daemon=True)
        replacement.start()
        self._workers[index] = (replacement, tasks)

    def _ensure(self, n: int) -> None:
        while len(self._workers) < n:
            tasks = self._ctx.Queue()
            proc = self._ctx.Process(target=_worker_loop, args=(len(self._workers), tasks, self._results), daemon=True)
            proc.start()
            self._workers.append((proc, tasks))

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        """`fn(rank, world_size, *args)` on `world_size` workers; results ordered by rank."""
        self._ensure(world_size)
        self._calls += 1
        call_id = self._calls
        port = free_port()
        for rank in range(world_size):
            self._workers[rank][1].put((call_id, fn, rank, world_size, port, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        exiting: list[int] = []
        while len(results) + len(errors) < world_size:
            try:
                got_id, rank, (ok, payload), recycle = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in {timeout}s") from None
            if got_id != call_id:
                continue
            if recycle:
                exiting.append(rank)
            if ok:
                results[rank] = payload
            else:
                errors.append(payload)
        for rank in exiting:
            self._replace(rank)
        if errors:
            raise AssertionError("worker failure:\n" + "\n".join(sorted(errors)))
        return [results[r] for r in range(world_size)]

    def close(self) -> None:
        """Stop every worker (by its own handle) and forget them."""
        for proc, tasks in self._workers:
            if proc.is_alive():
                tasks.put(None)
        for proc, _ in self._workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._workers.clear()


# ---- jobs ------------------------------------------------------------------------------------------
def tiny_job(corpus: str, *, steps: int = 5, model: dict | None = None, training: dict | None = None,
             data: dict | None = None, **parallelism: Any) -> JobSpecBody:
    """A debug-sized job on `corpus` (a glob); keyword arguments set spec.parallelism fields."""
    world = 1
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        world *= parallelism.get(dim, 1)
    return JobSpecBody.model_validate(
        {
            "model": {"preset": "debug", **(model or {})},
            "data": {"paths": [corpus], "seq_len": 32, "seed": 7, **(data or {})},
            "parallelism": parallelism,
            "training": {
                "steps": steps, "global_batch_size": 8, "micro_batch_size": 1, "warmup_steps": 2,
                "lr": 3e-3, "seed": 11, **(training or {}),
            },
            "resources": {"gpus": world, "device": "cpu"},
        }
    )


def single_process(body: JobSpecBody) -> JobSpecBody:
    """`body` with every parallel degree 1 (the reference layout)."""
    data = body.model_dump()
    data["parallelism"] = {}
    data["resources"]["gpus"] = 1
    return JobSpecBody.model_validate(data)


@dataclass
class LayoutRun:
    """Global loss per step, and one step's full gradients by canonical parameter name."""

    losses: list[float]
    grads: dict[str, torch.Tensor]


def full_named_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by canonical name, on every rank (collective).

    DTensor gradients are gathered with full_tensor(); plain ones are complete already. Pipeline
    stages contribute their own parameters (all-gathered across ranks).
    """
    mine: dict[str, torch.Tensor] = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        mine[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    if not dist.is_initialized():
        return mine
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, grad in part.items():
            merged.setdefault(name, grad)
    return merged


def _resolve(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def train_case(rank: int, world_size: int, body_json: str, steps: int, grad_step: int, grads_fn: str) -> LayoutRun | None:
    """Worker body of run_layout: step the Trainer by hand so one step's gradients can be read."""
    from trainctl.parallelism.trainer import Trainer

    body = JobSpecBody.model_validate_json(body_json)
    trainer = Trainer(body, rank=rank, world_size=world_size, device="cpu")
    gather = _resolve(grads_fn)
    losses, grads = [], {}
    for step in range(steps):
        local = trainer.forward_backward(trainer.loader.next_batch())
        losses.append(trainer.global_loss(local))
        if step == grad_step:
            grads = gather(trainer)
        trainer.optimizer_step()
    return LayoutRun(losses=losses, grads=grads) if rank == 0 else None


def run_layout(pool: WorkerPool, body: JobSpecBody, *, steps: int = 5, grad_step: int = 1,
               grads_fn: str = "harness:full_named_grads") -> LayoutRun:
    """Train `body` under its layout; rank 0's losses and gathered gradients."""
    world = body.parallelism.world_size
    return pool.run(train_case, world, body.model_dump_json(), steps, grad_step, grads_fn)[0]


def run_reference(pool: WorkerPool, body: JobSpecBody, *, steps: int = 5, grad_step: int = 1) -> LayoutRun:
    """The single-process run of `body` (cached on the pool per job)."""
    ref = single_process(body)
    key = (ref.model_dump_json(), steps, grad_step)
    cache = pool.__dict__.setdefault("reference_cache", {})
    if key not in cache:
        cache[key] = run_layout(pool, ref, steps=steps, grad_step=grad_step)
    return cache[key]


def assert_equivalent(run: LayoutRun, reference: LayoutRun, *, loss_rtol: float = 1e-5, grad_atol: float = 1e-4) -> None:
    """Losses within loss_rtol (relative), gradients within grad_atol; names must match."""
    assert len(run.losses) == len(reference.losses)
    for step, (got, want) in enumerate(zip(run.losses, reference.losses, strict=True)):
        assert abs(got - want) <= loss_rtol * abs(want), f"step {step}: loss {got!r} != reference {want!r}"
    assert sorted(run.grads) == sorted(reference.grads), "gradient names differ from the reference"
    for name, want in reference.grads.items():
        got = run.grads[name]
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        torch.testing.assert_close(got, want, atol=grad_atol, rtol=grad_atol, msg=lambda m, n=name: f"{n}: {m}")


def train_run(rank: int, world_size: int, body_json: str, checkpoint_dir: str | None) -> Any:
    """Worker body of run_training: `Trainer.run()` as the service runs it."""
    from trainctl.parallelism.trainer import Trainer

    body = JobSpecBody.model_validate_json(body_json)
    result = Trainer(body, rank=rank, world_size=world_size, device="cpu", checkpoint_dir=checkpoint_dir).run()
    return result if rank == 0 else None


def run_training(pool: WorkerPool, body: JobSpecBody, checkpoint_dir: str | None = None) -> Any:
    """`Trainer.run()` of `body` under its layout (resuming from `checkpoint_dir` if it holds a
    complete checkpoint); rank 0's TrainResult."""
    return pool.run(train_run, body.parallelism.world_size, body.model_dump_json(), checkpoint_dir)[0]
