"""Shared harness for the engine's multi-process tests (gloo, CPU, fp32).

API (the `pool` fixture in conftest.py is a session-wide `WorkerPool`):

    pool.run(fn, world_size, *args, timeout=...) -> list[result per rank]
        Run `fn(rank, world_size, *args)` on `world_size` long-lived worker processes, each inside a
        fresh gloo default process group (new TCPStore port per call), then destroy the group.
        `fn` must be a module-level function importable by module name in the workers (this module,
        or a test module in tests/parallelism); arguments and results must pickle. An exception on
        any rank fails the call with that rank's traceback. world_size 1 runs without a process group.

    run_layout(pool, body, steps=3, eval_after=()) -> LayoutRun
        Train `body` (a JobSpecBody; its parallelism block picks the layout, world size = its
        product) for `steps` optimizer steps; `LayoutRun.losses` are the global losses per step and
        `LayoutRun.grads[step]` that step's gradients, after reduction and before clipping, gathered
        to full tensors and keyed by canonical parameter name (`layers.0.attention.wq.weight`).
        With `eval_after` (optimizer steps, e.g. EVAL_AFTER), the Trainer's evaluation runs after each
        of those steps and `LayoutRun.eval_losses[step]` is its global eval loss; a body without
        `spec.evaluation` evaluates one batch of its own training data (`with_evaluation`).
        `context=` ("module:function") wraps each rank's run in a context manager; `edit_batch=` /
        `edit_grads=` inject an error, to test the harness itself.

    run_reference(pool, body, steps=3, eval_after=()) -> LayoutRun
        The same job with every parallel degree set to 1, in one process: the single-process result
        every layout must reproduce. Cached per job, so a matrix of layouts pays for it once.

    assert_equivalent(run, reference, loss_rtol=1e-5, grad_rtol=5e-5)
        At every step: the loss within `loss_rtol` (relative) and every parameter's gradient within
        `grad_rtol` relative error per tensor (||g - g_ref|| / ||g_ref||), same parameter names on both
        sides; the eval losses after the same steps, each within `loss_rtol`. A failure lists the
        mismatches in step order, naming step and parameter.

    run_training(pool, body, checkpoint_dir=None) -> TrainResult
        `Trainer.run()` as the service runs it (checkpoints on schedule, resumes from the newest
        complete checkpoint in `checkpoint_dir`); rank 0's result.

    tiny_job(tmp_corpus, **parallelism) -> JobSpecBody
        A small model (the debug preset), seq_len 32, global batch 8, micro-batch 2, on `tmp_corpus`
        (the `corpus` fixture: a few KB of deterministic text files). Micro-batch 2 leaves 4 micro-batches
        to accumulate over 1 or 2 data-parallel ranks (2 a rank at dp2, enough to fill a 2-stage pipeline)
        at half the forward and backward calls of micro-batch 1, whose Python dispatch is what a gloo
        layout of this model spends most of its time on.

Workers set torch to 1 thread and float32, so results are deterministic and cheap on 2 cores.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from trainctl.parallelism.engine.distributed import teardown
from trainctl.parallelism.layouts.parallelize import canonical_name
from trainctl.spec.job import JobSpecBody

DEFAULT_TIMEOUT = 240.0
DEFAULT_STEPS = 3
"""Optimizer steps an equivalence run trains (each step's gradients are gathered and compared): the
first step's gradients check the layout's forward and backward, the later two that its optimizer
updates (Adam's moments over two updates, the warm-up schedule) keep the parameters equal."""
FP32_LOSS_RTOL = 1e-5
FP32_GRAD_RTOL = 5e-5
"""fp32 tolerances: relative loss error, and per-tensor relative gradient error ||g - g_ref|| / ||g_ref||.
Reduction order is the only difference between layouts: measured up to 1.3e-5 (MoE experts' w1 / w3
under tp2 + SP, step 1), under 7e-6 for every other layout over 4 steps. 5e-5 leaves room for other
CPUs' kernels and is 200x below a 1 % error in one tensor's gradient."""
BF16_TP_GRAD_RTOL = 8e-3
"""bf16 under TP against the bf16 single-process run: the row-parallel projections (wo, w2) round each
rank's partial sum to bf16 before the all-reduce, which moves the attention projections' gradients by
up to 0.6 % per step (measured: 5.6e-3 for layers.2.attention.wq.weight). A 1 % error in one tensor
still exceeds 8e-3 (test_harness.py shows it for that noisiest tensor)."""
BF16_TP_LOSS_RTOL = 5e-5
"""Measured up to 1.1e-5 for the same reason."""
BF16_TP_TRAINING = {"dtype": "bfloat16", "lr": 1e-4, "micro_batch_size": 4}
"""lr 1e-4 so the per-step bf16 differences do not compound through the weights over the steps (at
lr 3e-3 the worst gradient difference grows to 6 % by step 4, which would hide a 1 % error)."""
EVAL_AFTER = (1, DEFAULT_STEPS)
"""Steps an equivalence matrix evaluates after: the first and the last (the same batches both times)."""
MAX_REPORTED = 20
"""Mismatches listed in an assert_equivalent failure (the rest are counted)."""
MAX_WORKER_THREADS = 96
"""A worker with more native threads than this after a call is replaced by a fresh process. A process group that
something still holds after `teardown` keeps its gloo threads, and hundreds of them per worker slow every later
case (a 2x longer suite was measured). `teardown` releases every group the engine makes
(test_distributed_teardown.py), so this is a safety net for a call that leaks one."""


DEATH_CHECK_SECONDS = 2.0
"""How often `WorkerPool.run` checks, while it waits, that the workers of the call are still alive."""
EXIT = "exit"
"""Task that makes a worker exit at once, without torch's and gloo's destructors (which can wait on
leaked threads: with a plain return, closing 4 workers waited out the 5 s join timeout; 0.2 s with this).
The pool sends it to replace a worker whose last result said so, and to every worker when it closes."""


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
    # A worker lives through every layout of the session: it loads the pipeline schedules (and torch._dynamo
    # with them) once, before its first process group, as the engine's import did before d0f2029, rather
    # than midway through its life, after the gloo groups of earlier calls (one unexplained native abort,
    # "free(): invalid pointer", was seen in such a worker after that change; docs/engine.md says more).
    import torch.distributed.pipelining  # noqa: F401

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while True:
        task = tasks.get()
        if task == EXIT:  # the parent has every result it waits for (tensors travel by fd from this process)
            os._exit(0)
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
                gc.collect()  # the call's model, meshes and process groups (and their gloo threads) go now
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
        tasks.put(EXIT)
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
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            try:
                got_id, rank, (ok, payload), recycle = self._results.get(timeout=DEATH_CHECK_SECONDS)
            except queue.Empty:
                dead = {r: proc.exitcode for r, (proc, _) in enumerate(self._workers[:world_size]) if not proc.is_alive()}
                if dead or time.monotonic() > deadline:
                    self.close()
                    name = getattr(fn, "__name__", fn)
                    if dead:  # a native crash (abort, segfault): say so now, not after the timeout
                        raise AssertionError(f"{name}: worker(s) of rank {sorted(dead)} died, exit codes {dead}") from None
                    raise TimeoutError(f"{name} on {world_size} ranks did not finish in {timeout}s") from None
                continue
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
                tasks.put(EXIT)
        for proc, _ in self._workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._workers.clear()


# ---- jobs ------------------------------------------------------------------------------------------
FP8_SHAPE = {"ffn_dim": 1040}
"""The debug preset (dim 64) with a feed-forward wide enough for `training.fp8` tensorwise to convert w1
and w3 (64 -> 1040: out_features over 1024); w2 (1040 -> 64) and attention (64 -> 64) stay in bf16."""


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
                "steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "warmup_steps": 2,
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


def with_evaluation(body: JobSpecBody) -> JobSpecBody:
    """`body` itself when it has `spec.evaluation`, else `body` evaluating one batch of its training data."""
    if body.evaluation is not None:
        return body
    data = body.model_dump()
    data["evaluation"] = {"data": data["data"], "batches": 1}
    return JobSpecBody.model_validate(data)


@dataclass
class LayoutRun:
    """Global loss and full gradients (by canonical parameter name) of every optimizer step, and the
    global eval loss after each step that evaluated."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    eval_losses: dict[int, float] = field(default_factory=dict)


def full_named_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by canonical name, on every rank (collective).

    DTensor gradients are gathered with full_tensor(); plain ones are complete already. Pipeline
    stages contribute their own parameters (all-gathered across ranks).
    """
    mine: dict[str, torch.Tensor] = {}
    named = [(canonical_name(n), p) for part in trainer.model.parts for n, p in part.named_parameters(remove_duplicate=False)]
    for name, param in named:  # a tied embedding under both its names, as each pipeline stage holds it
        grad = param.grad
        if grad is None:
            continue
        mine[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().float().clone()
    if not dist.is_initialized():
        return mine
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, grad in part.items():
            merged.setdefault(name, grad)
    return merged


def _resolve(path: str | None) -> Callable[..., Any] | None:
    if path is None:
        return None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def train_case(rank: int, world_size: int, body_json: str, steps: int, hooks: dict[str, str],
               eval_after: tuple[int, ...] = ()) -> LayoutRun | None:
    """Worker body of run_layout: step the Trainer by hand so every step's gradients can be read."""
    from trainctl.parallelism.engine.trainer import Trainer

    body = JobSpecBody.model_validate_json(body_json)
    context = _resolve(hooks.get("context"))
    batch_editor, grads_editor = _resolve(hooks.get("edit_batch")), _resolve(hooks.get("edit_grads"))
    losses, grads, eval_losses = [], [], {}
    with context() if context is not None else contextlib.nullcontext():
        trainer = Trainer(body, rank=rank, world_size=world_size, device="cpu")
        for step in range(steps):
            batch = trainer.loader.next_batch()
            if batch_editor is not None:
                batch = batch_editor(trainer, step, batch)
            local = trainer.forward_backward(batch)
            losses.append(trainer.global_loss(local))
            if grads_editor is not None:
                grads_editor(trainer, step)
            grads.append(full_named_grads(trainer))
            trainer.optimizer_step()
            if trainer.step in eval_after:
                eval_losses[trainer.step] = trainer.evaluator.evaluate()
    return LayoutRun(losses=losses, grads=grads, eval_losses=eval_losses) if rank == 0 else None


def run_layout(pool: WorkerPool, body: JobSpecBody, *, steps: int = DEFAULT_STEPS, eval_after: tuple[int, ...] = (),
               context: str | None = None, edit_batch: str | None = None, edit_grads: str | None = None) -> LayoutRun:
    """Train `body` under its layout; rank 0's losses and gathered gradients of every step.

    Hooks ("module:function", run on every rank): `context()` returns a context manager entered
    around building and training the Trainer; `edit_batch(trainer, step, micro_batches)` returns the
    micro-batches to train on and `edit_grads(trainer, step)` may change gradients after backward
    (both inject errors, to test the harness itself).
    """
    hooks = {k: v for k, v in {"context": context, "edit_batch": edit_batch, "edit_grads": edit_grads}.items() if v}
    if eval_after:
        body = with_evaluation(body)
    return pool.run(train_case, body.parallelism.world_size, body.model_dump_json(), steps, hooks, tuple(eval_after))[0]


def run_reference(pool: WorkerPool, body: JobSpecBody, *, steps: int = DEFAULT_STEPS,
                  eval_after: tuple[int, ...] = ()) -> LayoutRun:
    """The single-process run of `body` (cached on the pool per job and evaluation steps)."""
    ref = single_process(with_evaluation(body) if eval_after else body)
    key = (ref.model_dump_json(), steps, tuple(eval_after))
    cache = pool.__dict__.setdefault("reference_cache", {})
    if key not in cache:
        cache[key] = run_layout(pool, ref, steps=steps, eval_after=eval_after)
    return cache[key]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (the absolute norm of the difference where `want` is all zero)."""
    diff = float(torch.linalg.vector_norm(got.double() - want.double()))
    scale = float(torch.linalg.vector_norm(want.double()))
    return diff / scale if scale > 0 else diff


def mismatches(run: LayoutRun, reference: LayoutRun, *, loss_rtol: float = FP32_LOSS_RTOL,
               grad_rtol: float = FP32_GRAD_RTOL) -> list[str]:
    """Every disagreement of `run` with `reference`, in step order: the step's loss, then each
    parameter whose gradient's relative error exceeds `grad_rtol` (or that is missing / misshapen);
    then the eval losses (the same steps evaluated, each loss within `loss_rtol`)."""
    found: list[str] = []
    if len(run.losses) != len(reference.losses):
        return [f"{len(run.losses)} steps != reference {len(reference.losses)}"]
    for step, (got, want) in enumerate(zip(run.losses, reference.losses, strict=True)):
        if not abs(got - want) <= loss_rtol * abs(want):
            found.append(f"step {step}: loss {got!r} != reference {want!r} (rel {abs(got - want) / abs(want):.2e})")
        grads, wanted = run.grads[step], reference.grads[step]
        for name in sorted(set(grads) ^ set(wanted)):
            found.append(f"step {step}: {name}: gradient {'missing' if name in wanted else 'not in the reference'}")
        for name in sorted(set(grads) & set(wanted)):
            g, w = grads[name], wanted[name]
            if g.shape != w.shape:
                found.append(f"step {step}: {name}: gradient shape {tuple(g.shape)} != {tuple(w.shape)}")
                continue
            err = relative_error(g, w)
            if not err <= grad_rtol:
                found.append(f"step {step}: {name}: gradient relative error {err:.2e} > {grad_rtol:.0e}")
    return found + _eval_mismatches(run.eval_losses, reference.eval_losses, loss_rtol)


def _eval_mismatches(got: dict[int, float], want: dict[int, float], loss_rtol: float) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"evaluated after steps {sorted(got)} != reference {sorted(want)}"]
    return [
        f"after step {step}: eval loss {got[step]!r} != reference {want[step]!r} (rel {abs(got[step] - want[step]) / abs(want[step]):.2e})"
        for step in sorted(got)
        if not abs(got[step] - want[step]) <= loss_rtol * abs(want[step])
    ]


def assert_equivalent(run: LayoutRun, reference: LayoutRun, *, loss_rtol: float = FP32_LOSS_RTOL,
                      grad_rtol: float = FP32_GRAD_RTOL) -> None:
    """Every step's loss within loss_rtol and every parameter's gradient within grad_rtol (relative,
    per tensor) of the reference; the error names the first mismatching step and parameters."""
    found = mismatches(run, reference, loss_rtol=loss_rtol, grad_rtol=grad_rtol)
    if found:
        shown = "\n  ".join(found[:MAX_REPORTED])
        more = f"\n  ... and {len(found) - MAX_REPORTED} more" if len(found) > MAX_REPORTED else ""
        raise AssertionError(f"layout differs from the reference ({len(found)} mismatches):\n  {shown}{more}")


def train_run(rank: int, world_size: int, body_json: str, checkpoint_dir: str | None) -> Any:
    """Worker body of run_training: `Trainer.run()` as the service runs it."""
    from trainctl.parallelism.engine.trainer import Trainer

    body = JobSpecBody.model_validate_json(body_json)
    result = Trainer(body, rank=rank, world_size=world_size, device="cpu", checkpoint_dir=checkpoint_dir).run()
    return result if rank == 0 else None


def run_training(pool: WorkerPool, body: JobSpecBody, checkpoint_dir: str | None = None) -> Any:
    """`Trainer.run()` of `body` under its layout (resuming from `checkpoint_dir` if it holds a
    complete checkpoint); rank 0's TrainResult."""
    return pool.run(train_run, body.parallelism.world_size, body.model_dump_json(), checkpoint_dir)[0]
