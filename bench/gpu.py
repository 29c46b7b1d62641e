"""GPU benchmarks in one call: MFU of Llama shapes against torchtitan in bf16 and float8, the NCCL
path, the memory estimator's and the step-time model's error (docs/benchmarks.md, "GPU" and "GPU:
float8").

    python3 bench/gpu.py --converge-steps 200 --out results.json       # every case, every row
    python3 bench/gpu.py --cases llama-3b:2048 --only compile fp8       # a subset
    .venv/bin/python bench/gpu.py --merge a.json b.json --out bench/results-gpu-fp8.json
    .venv/bin/python bench/gpu.py --smoke        # the same code paths on CPU, tiny models

Each case (`--cases PRESET:SEQ_LEN`, default llama-1b:2048, llama-3b:2048, llama-1b:8192) runs its
rows in `ORDER`, each in a fresh process (its own CUDA context and peak counters), on the same job:
bfloat16 autocast over fp32 master weights, gradients and AdamW state (fused), one micro-batch of 4
sequences, byte-level data from the standard library:

1. ``compile``: one GPU, one process, ``training.compile`` (each decoder block and the loss).
2. ``fp8`` / ``fp8-rowwise``: the same with ``training.fp8: tensorwise`` / ``rowwise``.
3. ``torchtitan`` / ``torchtitan-fp8``: bench/torchtitan_peer.py, torchtitan's own Trainer on the
   same shape, batch and sequence length (its wheels on the path), without and with its Float8
   linears; ours over theirs per precision is the ratio reported.
4. ``eager``: no compile.
5. ``nccl``: the compiled job under ``torchrun`` with an NCCL process group (an all-reduce checked at
   start): 2 ranks with FSDP (``dp_shard: 2``) when the machine has 2 GPUs, else 1 rank (NCCL refuses
   two ranks on one GPU).
6. ``checkpointed``: eager with ``activation_checkpointing: full``.
7. ``lora``: eager with LoRA rank 16 on every projection.

``--converge-steps N`` runs the first case's `CONVERGED` rows (compile, fp8, fp8-rowwise, eager) for N
steps: each one's losses against compile's (`convergence`), eager's gap the control; they are timed
over the same steps as every other row.
``--merge`` joins the files of several calls into one.

Per run, ``--warmup`` steps are left out (compilation, allocator growth); over the ``--steps`` that
follow: the median step time and tokens/s, MFU as the Trainer reports it (`flops.mfu`), the step time
`trainctl plan` models for the job on this GPU (`step_time.modelled_step_time` at `flops.peak_flops`
and the GPU's memory bandwidth, no communication on one GPU) and measured / modelled, and peak memory against
`estimator.estimate_memory(...).total_bytes` (error = estimate / measured - 1; target within 10 %).
Memory phases: the allocated bytes at a step's start, at the end of forward, at the peaks of forward,
backward and the optimizer step, and after each (`PHASES`; the largest over the measured steps), so a
wrong estimate shows where it goes wrong. Dynamo's graph-break count is recorded for the compiled runs.

``--efficiency-json F`` then runs bench/efficiency.py on the GPU (docs/efficiency.md's GPU column).
``--budget S`` starts no run after S seconds, so a leased machine's time is never overrun; each row is
written to ``--out`` as soon as it is measured.

``--smoke`` runs the same steps on CPU with the ``debug`` preset, seq 64, gloo with 2 torchrun ranks
instead of NCCL and torchtitan's tiny smoke model (its row says "not run" where torchtitan is not
installed, as in the project's virtualenv; the ``fp8`` row shows the spec's refusal on CPU): it checks
the script, not the hardware. It reports no
MFU (CPU peaks are unknown), and its memory is the process's RSS, which is not comparable with the
estimate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

MiB = 2**20
HERE = Path(__file__).resolve()
PEER = HERE.parent / "torchtitan_peer.py"
EFFICIENCY_ARGS = ("--steps", "3")
"""bench/efficiency.py on a GPU: its default job (the CPU column's), 3 timed steps per row."""


@dataclass(frozen=True)
class Run:
    """One measured run of the engine: how it differs from the eager single-GPU job."""

    name: str
    compile: bool = False
    torchrun: bool = False
    activation_checkpointing: str = "none"
    lora: bool = False
    fp8: str = "none"


RUNS = (
    Run("eager"),
    Run("compile", compile=True),
    Run("fp8", compile=True, fp8="tensorwise"),
    Run("fp8-rowwise", compile=True, fp8="rowwise"),
    Run("nccl", compile=True, torchrun=True),
    Run("checkpointed", activation_checkpointing="full"),
    Run("lora", lora=True),
)
PEERS = {"torchtitan": "none", "torchtitan-fp8": "tensorwise"}
"""torchtitan's rows: bench/torchtitan_peer.py with its Float8 linears off or tensorwise."""
ORDER = ("compile", "fp8", "torchtitan", "torchtitan-fp8", "eager", "fp8-rowwise", "nccl", "checkpointed", "lora")
"""Rows of each case, in the order they run (the ones the issue asks for first)."""
CONVERGED = ("compile", "fp8", "fp8-rowwise", "eager")
"""Rows that run `--converge-steps` steps in the first case, each one's losses against `compile`'s:
float8 (both recipes) against bf16, and eager bf16 as the control. Eager and compiled bf16 differ only
in rounding (fused kernels), so their gap sizes how far such differences alone carry the losses apart
over the run: float8 tracks bf16 when its gap is of that size."""


@dataclass(frozen=True)
class Case:
    """A model shape and sequence length every row of a case trains."""

    preset: str
    seq_len: int

    @classmethod
    def parse(cls, text: str) -> Case:
        preset, _, seq = text.partition(":")
        return cls(preset, int(seq or 2048))

    @property
    def label(self) -> str:
        return f"{self.preset} s{self.seq_len}"
LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}
"""The LoRA run's adapters: rank 16 on every projection of every block."""


def job_spec(run_: Run, smoke: bool, ranks: int, steps: int, micro: int, seq_len: int, preset: str = "llama-1b") -> dict[str, Any]:
    """The benchmark job (JobSpecBody fields) for one run."""
    job: dict[str, Any] = {
        "model": {"preset": "debug" if smoke else preset},
        "data": {"seq_len": seq_len, "max_files": 50 if smoke else 200, "prefetch": 2},
        "parallelism": {"dp_shard": ranks},
        "training": {
            "steps": steps,
            "global_batch_size": micro * ranks,
            "micro_batch_size": micro,
            "warmup_steps": 2,
            "dtype": "bfloat16",
            "compile": run_.compile,
            "activation_checkpointing": run_.activation_checkpointing,
            "optimizer_impl": "auto",  # fused on CUDA, foreach on CPU
            "fp8": run_.fp8,
        },
        "checkpoint": {"interval_steps": 0, "resume": False},
        "resources": {"gpus": ranks, "device": "cpu" if smoke else "cuda"},
    }
    if run_.lora:
        job["lora"] = LORA
    return job


# ---- one run (a worker process) ----------------------------------------------------------------------
PHASES = ("step_start", "forward_end", "forward_peak", "backward_peak", "after_backward", "optimizer_peak", "step_end")
"""Allocated CUDA bytes through one step (module docstring, "memory phases")."""


@dataclass(frozen=True)
class MemoryCounters:
    """Where a run reads its memory: CUDA's allocator counters, or on CPU (--smoke) the process's RSS."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]

    @classmethod
    def of(cls, device: Any) -> MemoryCounters:
        import torch

        if device.type == "cuda":
            return cls(partial(torch.cuda.memory_allocated, device), partial(torch.cuda.max_memory_allocated, device),
                       partial(torch.cuda.reset_peak_memory_stats, device))
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            return int(Path("/proc/self/statm").read_text().split()[1]) * page

        return cls(rss, lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, lambda: None)


def record_phases(trainer: Any, counters: MemoryCounters, steps: list[dict[str, int]]) -> None:
    """Append the allocated bytes at each of `PHASES` of every step of `trainer` to `steps`.

    Wraps the trainer's forward_backward and optimizer_step and hooks its model's forward; the peak
    counter is reset at the start of each phase, so a step's peak is the largest of its three peaks."""
    forward_backward, optimizer_step = trainer.forward_backward, trainer.optimizer_step
    current: dict[str, int] = {}

    def on_forward(module: Any, args: Any, output: Any) -> None:
        current["forward_end"], current["forward_peak"] = counters.allocated(), counters.peak()
        counters.reset_peak()

    def measured_forward_backward(batch: Any) -> Any:
        current.clear()
        current["step_start"] = counters.allocated()
        counters.reset_peak()
        out = forward_backward(batch)
        current["backward_peak"], current["after_backward"] = counters.peak(), counters.allocated()
        return out

    def measured_optimizer_step() -> Any:
        counters.reset_peak()
        out = optimizer_step()
        current["optimizer_peak"], current["step_end"] = counters.peak(), counters.allocated()
        steps.append(dict(current))
        return out

    trainer.model.parts[0].register_forward_hook(on_forward)
    trainer.forward_backward, trainer.optimizer_step = measured_forward_backward, measured_optimizer_step


def worker(job_json: str, warmup: int, result_path: Path) -> None:
    """Train the job on this process's rank and write rank 0's measurements to `result_path`.

    Under torchrun (WORLD_SIZE set) it joins a process group first, NCCL on CUDA and gloo on CPU, and
    checks an all-reduce across it; without torchrun it runs alone.
    """
    import torch
    import torch.distributed as dist

    from trainctl.parallelism.engine.distributed import init_distributed, teardown
    from trainctl.parallelism.engine.step_report import StepReport
    from trainctl.parallelism.engine.trainer import Trainer
    from trainctl.parallelism.resolved_job import ResolvedJob
    from trainctl.parallelism.sizing.device_memory import gpu_memory_bandwidth
    from trainctl.parallelism.sizing.estimator import estimate_memory
    from trainctl.parallelism.sizing.flops import peak_flops
    from trainctl.parallelism.sizing.step_time import modelled_step_time
    from trainctl.spec.job import JobSpecBody
    from trainctl.spec.presets import resolve_model

    body = JobSpecBody.model_validate_json(job_json)
    torchrun = "WORLD_SIZE" in os.environ
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device_kind = body.resources.device
    group: dict[str, Any] = {}
    if torchrun:
        device = init_distributed(
            rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            device=device_kind if device_kind != "cuda" else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))),
        )
        check = torch.ones(1, device=device)
        dist.all_reduce(check)
        group = {"backend": dist.get_backend(), "all_reduce_ok": float(check.item()) == world}
    else:
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    reports: list[StepReport] = []
    phases: list[dict[str, int]] = []
    try:
        started = time.perf_counter()
        trainer = Trainer(body, rank=rank, world_size=world, device=device, on_step=reports.append)
        built = time.perf_counter() - started
        record_phases(trainer, MemoryCounters.of(device), phases)
        result = trainer.run()
        wall = time.perf_counter() - started
    finally:
        teardown()
    if rank != 0:
        return
    steady = [r for r in reports if r.step > warmup]
    steady_phases = phases[warmup:]
    mfus = [r.mfu for r in steady if r.mfu is not None]
    config = resolve_model(body.model)
    measured_peak = max(max(p["forward_peak"], p["backward_peak"], p["optimizer_peak"]) for p in steady_phases)
    phase_bytes = {name: max(p[name] for p in steady_phases) for name in PHASES}
    estimate = estimate_memory(ResolvedJob.resolve(trainer.job, model=config), rank)
    step_seconds = statistics.median(r.step_time_seconds for r in steady)
    peak = peak_flops(torch.cuda.get_device_name(device) if cuda else None, body.training.dtype)
    bandwidth = gpu_memory_bandwidth(torch.cuda.get_device_name(device)) if cuda else None
    modelled = modelled_step_time(config, trainer.job, peak, {}, memory_bandwidth=bandwidth) if peak else None
    from torch._dynamo.utils import counters

    out = {
        "preset": body.model.preset,
        "seq_len": body.data.seq_len,
        "fp8": body.training.fp8,
        "float8_linears": len(trainer.model.float8),
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()})",
        "ranks": world,
        "process_group": group or None,
        "compile": body.training.compile,
        "activation_checkpointing": body.training.activation_checkpointing,
        "lora": body.lora is not None,
        "dtype": body.training.dtype,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "steps_measured": len(steady),
        "step_seconds": step_seconds,
        "step_seconds_all": [r.step_time_seconds for r in reports],
        "breakdown": {k: statistics.median(r.breakdown.get(k, 0.0) for r in steady) for k in steady[-1].breakdown},
        "tokens_per_second": statistics.median(r.tokens_per_second for r in steady),
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_bytes": measured_peak,
        "peak_kind": "torch.cuda.max_memory_allocated" if cuda else "peak RSS (not comparable)",
        "memory_phases": phase_bytes,
        "reserved_peak_bytes": torch.cuda.memory_stats(device).get("reserved_bytes.all.peak") if cuda else None,
        "estimate_bytes": estimate.total_bytes,
        "estimate_parts": {
            "params": estimate.params_bytes, "grads": estimate.grads_bytes,
            "optimizer": estimate.optimizer_bytes, "activations": estimate.activations_bytes,
        },
        "estimate_error": estimate.total_bytes / measured_peak - 1 if measured_peak else None,
        "modelled_step_seconds": modelled.total if modelled else None,
        "modelled_terms": modelled.terms() if modelled else None,
        "measured_over_modelled": step_seconds / modelled.total if modelled else None,
        "graph_breaks": sum(counters["graph_break"].values()),
        "final_loss": result.final_loss,
        "losses": result.losses,
        "build_seconds": built,
        "wall_seconds": wall,
    }
    result_path.write_text(json.dumps(out, indent=1))


# ---- the driver --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(name: str, job: dict[str, Any], warmup: int, ranks: int, torchrun: bool, workdir: Path, timeout: float) -> dict[str, Any]:
    """One run in a fresh process (under torchrun when asked); its measurements, or its error."""
    result = workdir / f"{name}-{job['model']['preset']}-{job['data']['seq_len']}.json"
    tail = [str(HERE), "--worker", json.dumps(job), "--warmup", str(warmup), "--result", str(result)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), *tail]
    else:
        cmd = [sys.executable, *tail]
    return _finish(name, cmd, result, timeout)


def peer_run(name: str, case: Case, warmup: int, steps: int, micro: int, smoke: bool, workdir: Path, timeout: float) -> dict[str, Any]:
    """torchtitan training the same model shape, batch and sequence length (bench/torchtitan_peer.py),
    its Float8 linears as `PEERS[name]` says; its row in this script's terms."""
    result = workdir / f"{name}-{case.preset}-{case.seq_len}.json"
    cmd = [sys.executable, str(PEER), "--preset", case.preset, "--warmup", str(warmup), "--steps", str(steps - warmup),
           "--batch", str(micro), "--seq-len", str(case.seq_len), "--float8", PEERS[name], "--out", str(result),
           *(["--smoke"] if smoke else [])]
    row = _finish(name, cmd, result, timeout)
    if "error" in row:
        return row
    return {**row, "ranks": 1, "process_group": None, "step_seconds": row["step_time_median_s"],
            "tokens_per_second": row["tokens_per_s"], "peak_bytes": row["peak_memory_bytes"],
            "peak_kind": "torch.cuda.max_memory_allocated" if not smoke else "n/a (CPU)"}


def _finish(name: str, cmd: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Run `cmd` (which writes `result`) and return its row."""
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stderr or b"")[-3000:]
        return {"run": name, "error": f"timed out after {timeout:.0f} s: {output.decode(errors='replace') if isinstance(output, bytes) else output}"}
    print(f"  {name}: {time.perf_counter() - started:.0f} s, exit {done.returncode}", flush=True)
    if done.returncode != 0 or not result.exists():
        return {"run": name, "error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-3000:]}"}
    return {"run": name, **json.loads(result.read_text())}


def efficiency_run(out: Path, timeout: float) -> dict[str, Any]:
    """bench/efficiency.py on this device (docs/efficiency.md's GPU column), its JSON written to `out`."""
    cmd = [sys.executable, str(HERE.parent / "efficiency.py"), *EFFICIENCY_ARGS, "--json", str(out)]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"efficiency": str(out), "error": f"timed out after {timeout:.0f} s"}
    print(done.stdout[-6000:], flush=True)
    print(f"  efficiency: {time.perf_counter() - started:.0f} s, exit {done.returncode}", flush=True)
    return {"efficiency": str(out), **({"error": done.stderr[-3000:]} if done.returncode else {})}


def _mib(value: int | None) -> str:
    return f"{value / MiB:,.0f}" if value else "n/a"


def _pct(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "n/a"


def flops_per_token(row: dict[str, Any]) -> tuple[float, float] | None:
    """(Megatron convention: causal attention halved, torchtitan's: attention unmasked) FLOPs per
    token of the row's model and sequence length (sizing/flops.py); None for a smoke row."""
    from trainctl.parallelism.sizing.flops import full_attention_flops_per_token, training_flops_per_token
    from trainctl.spec.presets import PRESETS

    config = PRESETS.get(row.get("preset") or "")
    if config is None or row.get("smoke"):
        return None
    seq = row["seq_len"]
    return training_flops_per_token(config, seq), full_attention_flops_per_token(config, seq)


def mfus(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """The row's MFU in both conventions, against the device's dense bf16 peak (float8 rows too, so
    the two precisions compare on one scale)."""
    from trainctl.parallelism.sizing.flops import peak_flops

    per_token = flops_per_token(row)
    peak = peak_flops(row.get("device"), "bfloat16")
    if per_token is None or peak is None or not row.get("tokens_per_second"):
        return None, None
    return tuple(f * row["tokens_per_second"] / (row.get("ranks", 1) * peak) for f in per_token)  # type: ignore[return-value]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | run | process group | step ms | tokens/s | MFU (causal) | MFU (full attn) | modelled step ms "
        "| measured / modelled | peak MiB | estimate MiB | estimator error |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        head = f"| {r.get('case', '')} | {r['run']}"
        if "skipped" in r:
            lines.append(f"{head} | not run: {r['skipped']} |" + " |" * 9)
            continue
        if "error" in r:
            lines.append(f"{head} | failed: {r['error'].strip().splitlines()[-1][:200] if r['error'].strip() else '?'} |" + " |" * 9)
            continue
        pg = r.get("process_group")
        group = f"{pg['backend']}, all-reduce {'ok' if pg['all_reduce_ok'] else 'WRONG'}" if pg else "none"
        error = _pct(r.get("estimate_error"))
        if r.get("estimate_error") is not None and not r["peak_kind"].startswith("torch.cuda"):
            error += " (RSS)"
        modelled = r.get("modelled_step_seconds")
        ratio = r.get("measured_over_modelled")
        causal, full = mfus(r)
        lines.append(
            f"{head} | {group} | {1000 * r['step_seconds']:.1f} | {r['tokens_per_second']:,.0f} | {_pct(causal)} | {_pct(full)} "
            f"| {f'{1000 * modelled:.1f}' if modelled else 'n/a'} | {f'{ratio:.2f}x' if ratio else 'n/a'} "
            f"| {_mib(r.get('peak_bytes'))} | {_mib(r.get('estimate_bytes'))} | {error} |"
        )
    return "\n".join(lines)


def peer_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Ours over torchtitan in tokens/s, per case and precision (`compile` / `torchtitan`, `fp8` /
    `torchtitan-fp8`), for the pairs where both ran."""
    done = {(r.get("case"), r["run"]): r for r in rows if "step_seconds" in r}
    ratios = {}
    for (case, name), ours in done.items():
        peer = done.get((case, {"compile": "torchtitan", "fp8": "torchtitan-fp8"}.get(name, "")))
        if peer is not None:
            ratios[f"{case} {name}"] = ours["tokens_per_second"] / peer["tokens_per_second"]
    return ratios


def timing_window(row: dict[str, Any], warmup: int, measured: int) -> dict[str, Any]:
    """A long (`--converge-steps`) row timed over the same steps as every other row: the median of
    steps warmup+1 .. warmup+measured, as for the peers, so a sustained run's clocks do not skew the
    comparison; the median over all its steady steps is kept as `step_seconds_long`."""
    times = row.get("step_seconds_all") or []
    if len(times) <= warmup + measured or "step_seconds_long" in row:
        return row
    median = statistics.median(times[warmup:warmup + measured])
    tokens = row["tokens_per_second"] * row["step_seconds"]
    return {**row, "step_seconds_long": row["step_seconds"], "tokens_per_second_long": row["tokens_per_second"],
            "step_seconds": median, "tokens_per_second": tokens / median,
            "measured_over_modelled": median / row["modelled_step_seconds"] if row.get("modelled_step_seconds") else None}


def convergence(rows: list[dict[str, Any]], tail: int = 50) -> dict[str, Any] | None:
    """Each long `CONVERGED` row's losses against `compile`'s over the same steps, in the case where they
    ran longest (the `--converge-steps` one): the mean of the last `tail` steps of each and their
    relative gap, and the largest per-step relative gap over those steps."""
    by_case: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if "losses" in r and r["run"] in CONVERGED:
            by_case.setdefault(r.get("case", ""), {})[r["run"]] = r["losses"]
    pairs = [(case, runs) for case, runs in by_case.items() if "compile" in runs and len(runs) > 1]
    if not pairs:
        return None
    case, runs = max(pairs, key=lambda p: min(len(v) for v in p[1].values()))
    reference = runs["compile"]
    n = min(len(v) for v in runs.values())
    tail = min(tail, max(1, n // 2))
    base = reference[n - tail:n]
    gaps = {}
    for name, losses in runs.items():
        if name == "compile":
            continue
        own = losses[n - tail:n]
        gaps[name] = {
            "tail_mean": statistics.fmean(own),
            "tail_mean_relative_gap": statistics.fmean(own) / statistics.fmean(base) - 1,
            "max_step_relative_gap": max(abs(x / y - 1) for x, y in zip(own, base, strict=True)),
        }
    return {"case": case, "steps": n, "tail": tail, "compile_tail_mean": statistics.fmean(base), "against_compile": gaps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, debug preset, gloo: check the script without a GPU")
    parser.add_argument("--cases", nargs="*", default=["llama-1b:2048", "llama-3b:2048", "llama-1b:8192"],
                        help="PRESET:SEQ_LEN model shapes and sequence lengths, in the order they run")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 6; smoke 3)")
    parser.add_argument("--converge-steps", type=int, default=0,
                        help="total steps of the first case's compile and fp8 rows (float8 against bf16); 0: as others")
    parser.add_argument("--warmup", type=int, help="steps left out per run (default 3; smoke 2)")
    parser.add_argument("--micro", type=int, help="sequences per micro-batch per rank (default 4; smoke 2)")
    parser.add_argument("--only", nargs="*", help="run only these (names: " + ", ".join(ORDER) + ")")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds for the whole script: no run starts after")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here (after every run)")
    parser.add_argument("--efficiency-json", type=Path, help="then run bench/efficiency.py here (" + " ".join(EFFICIENCY_ARGS) + ")")
    parser.add_argument("--merge", nargs="*", type=Path,
                        help="no runs: merge these saved --out files (rows in order) into --out and print the table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    smoke = args.smoke
    warmup = args.warmup if args.warmup is not None else (2 if smoke else 3)
    if args.worker:
        worker(args.worker, warmup, args.result)
        return 0
    if args.merge:
        return merge(args.merge, args.out)

    import torch

    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --smoke to check the script on CPU")
    deadline = time.monotonic() + args.budget
    steps = warmup + (args.steps if args.steps is not None else (3 if smoke else 6))
    micro = args.micro or (2 if smoke else 4)
    cases = [Case("debug", 64)] if smoke else [Case.parse(c) for c in args.cases]
    nccl_ranks = 2 if smoke else min(2, torch.cuda.device_count())
    if smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    machine = (f"{platform.machine()} CPU, torch {torch.__version__}" if smoke
               else f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda}, driver {_driver()}")
    print(f"{'SMOKE (CPU, not a measurement): ' if smoke else ''}{machine}; cases {', '.join(c.label for c in cases)}, "
          f"micro-batch {micro}, {warmup} warm-up + {steps - warmup} measured steps per run", flush=True)
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": smoke,
                               "micro_batch": micro, "warmup": warmup, "steps": steps, "rows": rows}

    def save() -> None:
        payload["torchtitan_ratio"] = peer_ratios(rows)
        payload["convergence"] = convergence(rows)
        if args.out:
            args.out.write_text(json.dumps(payload, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="trainctl-bench-gpu-") as tmp:
        workdir = Path(tmp)
        for index, case in enumerate(cases):
            for name in ORDER:
                if args.only and name not in args.only:
                    continue
                row_steps = args.converge_steps if index == 0 and name in CONVERGED and args.converge_steps else steps
                tag = {"case": case.label}
                left = deadline - time.monotonic()
                if left < 30:
                    rows.append({"run": name, **tag, "error": "not run: the --budget was spent"})
                    continue
                timeout = min(args.timeout, left)
                if name in PEERS and importlib.util.find_spec("torchtitan") is None:
                    rows.append({"run": name, **tag, "skipped": "torchtitan is not installed (its wheels: bench/torchtitan_peer.py)"})
                elif name in PEERS:
                    rows.append({**peer_run(name, case, warmup, row_steps, micro, smoke, workdir, timeout), **tag})
                else:
                    run_ = next(r for r in RUNS if r.name == name)
                    ranks = nccl_ranks if run_.torchrun else 1
                    job = job_spec(run_, smoke, ranks, row_steps, micro, case.seq_len, case.preset)
                    refused = smoke and run_.fp8 != "none" and _refusal(job)
                    if refused:
                        rows.append({"run": name, **tag, "skipped": f"refused on CPU, as it must be: {refused}"})
                    else:
                        label = name if not (smoke and run_.torchrun) else "gloo (smoke)"
                        row = run(label, job, warmup, ranks, run_.torchrun, workdir, timeout)
                        rows.append({**timing_window(row, warmup, steps - warmup), **tag})
                save()
    print(table(rows))
    for pair, ratio in payload["torchtitan_ratio"].items():
        print(f"ours / torchtitan, {pair}: {ratio:.3f}x tokens/s")
    if payload["convergence"]:
        print("losses against compile (bf16): " + json.dumps(payload["convergence"]))
    if args.efficiency_json:
        left = deadline - time.monotonic()
        payload["efficiency"] = efficiency_run(args.efficiency_json, left) if left >= 60 else {"error": "not run: the --budget was spent"}
        save()
    return 0 if all("error" not in r for r in rows) and "error" not in payload.get("efficiency", {}) else 1


def merge(paths: list[Path], out: Path | None) -> int:
    """Several calls' saved payloads as one: their rows in order (long rows timed over the common
    window), the ratios and the convergence recomputed, the machines and dates listed."""
    payloads = [json.loads(p.read_text()) for p in paths]
    first = payloads[0]
    rows = [timing_window(r, p["warmup"], p["steps"] - p["warmup"]) for p in payloads for r in p["rows"]
            if "not run: the --budget was spent" not in r.get("error", "")]
    merged = {**first, "date": ", ".join(sorted({p["date"] for p in payloads})),
              "machine": "; ".join(sorted({p["machine"] for p in payloads})), "merged_from": [p.name for p in paths],
              "rows": rows, "torchtitan_ratio": peer_ratios(rows), "convergence": convergence(rows)}
    if out:
        out.write_text(json.dumps(merged, indent=1) + "\n")
    print(table(rows))
    for pair, ratio in merged["torchtitan_ratio"].items():
        print(f"ours / torchtitan, {pair}: {ratio:.3f}x tokens/s")
    print("losses against compile (bf16): " + json.dumps(merged["convergence"]))
    return 0


def _refusal(job: dict[str, Any]) -> str:
    """The spec's refusal of `job`, or "" when it is accepted."""
    from pydantic import ValidationError

    from trainctl.spec.job import JobSpecBody

    try:
        JobSpecBody.model_validate(job)
    except ValidationError as err:
        return "; ".join(e["msg"] for e in err.errors())
    return ""


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
