"""GPU benchmarks in one call: MFU of a ~1B Llama against torchtitan, the NCCL path, the memory
estimator's and the step-time model's error (docs/benchmarks.md, "GPU").

    python3 bench/gpu.py --out bench/results-gpu.json --efficiency-json bench/efficiency-results-gpu.json
    .venv/bin/python bench/gpu.py --smoke        # the same code paths on CPU, tiny models

Five runs of the engine's own `Trainer` and one of torchtitan, each in a fresh process (its own CUDA
context and peak counters), on the same job: preset `llama-1b` (16 layers, dim 2048, GQA 32/8,
vocab 128,256; 1.5 B parameters), bfloat16 autocast over fp32 master weights, gradients and AdamW
state (fused), seq 2048, one micro-batch of 4 sequences, byte-level data from the standard library:

1. ``eager``: one GPU, one process, no process group.
2. ``compile``: the same with ``training.compile`` (each decoder block and the loss compiled).
3. ``nccl``: the compiled job under ``torchrun`` with an NCCL process group (an all-reduce checked at
   start): 2 ranks with FSDP (``dp_shard: 2``) when the machine has 2 GPUs, else 1 rank (NCCL refuses
   two ranks on one GPU).
4. ``torchtitan``: bench/torchtitan_peer.py, torchtitan's own Trainer on the same shape, batch and
   sequence length (its wheels on the path); our ``compile`` over it is the ratio reported.
5. ``checkpointed``: eager with ``activation_checkpointing: full``.
6. ``lora``: eager with LoRA rank 16 on every projection.

Per run, ``--warmup`` steps are left out (compilation, allocator growth); over the ``--steps`` that
follow: the median step time and tokens/s, MFU as the Trainer reports it (`flops.mfu`), the step time
`trainctl plan` models for the job on this GPU (`step_time.modelled_step_time` at `flops.peak_flops`,
no communication on one GPU) and measured / modelled, and peak memory against
`estimator.estimate_memory(...).total_bytes` (error = estimate / measured - 1; target within 10 %).
Memory phases: the allocated bytes at a step's start, at the end of forward, at the peaks of forward,
backward and the optimizer step, and after each (`PHASES`; the largest over the measured steps), so a
wrong estimate shows where it goes wrong. Dynamo's graph-break count is recorded for the compiled runs.

``--efficiency-json F`` then runs bench/efficiency.py on the GPU (docs/efficiency.md's GPU column).
``--budget S`` starts no run after S seconds, so a leased machine's time is never overrun; each row is
written to ``--out`` as soon as it is measured.

``--smoke`` runs the same steps on CPU with the ``debug`` preset, seq 64, gloo with 2 torchrun ranks
instead of NCCL and torchtitan's tiny smoke model (its row says "not run" where torchtitan is not
installed, as in the project's virtualenv): it checks the script, not the hardware. It reports no
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


RUNS = (
    Run("eager"),
    Run("compile", compile=True),
    Run("nccl", compile=True, torchrun=True),
    Run("checkpointed", activation_checkpointing="full"),
    Run("lora", lora=True),
)
LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}
"""The LoRA run's adapters: rank 16 on every projection of every block."""


def job_spec(run_: Run, smoke: bool, ranks: int, steps: int, micro: int, seq_len: int) -> dict[str, Any]:
    """The benchmark job (JobSpecBody fields) for one run."""
    job: dict[str, Any] = {
        "model": {"preset": "debug" if smoke else "llama-1b"},
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
    modelled = modelled_step_time(config, trainer.job, peak, {}) if peak else None
    from torch._dynamo.utils import counters

    out = {
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
    result = workdir / f"{name}.json"
    tail = [str(HERE), "--worker", json.dumps(job), "--warmup", str(warmup), "--result", str(result)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), *tail]
    else:
        cmd = [sys.executable, *tail]
    return _finish(name, cmd, result, timeout)


def peer_run(warmup: int, steps: int, micro: int, seq_len: int, smoke: bool, workdir: Path, timeout: float) -> dict[str, Any]:
    """torchtitan training the same model shape, batch and sequence length (bench/torchtitan_peer.py),
    its row in this script's terms."""
    result = workdir / "torchtitan.json"
    cmd = [sys.executable, str(PEER), "--warmup", str(warmup), "--steps", str(steps - warmup), "--batch", str(micro),
           "--seq-len", str(seq_len), "--out", str(result), *(["--smoke"] if smoke else [])]
    row = _finish("torchtitan", cmd, result, timeout)
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


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | process group | step ms | tokens/s | MFU | modelled step ms | measured / modelled | peak MiB "
        "| estimate MiB | estimator error |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['run']} | not run: {r['skipped']} |" + " |" * 8)
            continue
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'].strip().splitlines()[-1][:200] if r['error'].strip() else '?'} |" + " |" * 8)
            continue
        pg = r.get("process_group")
        group = f"{pg['backend']}, all-reduce {'ok' if pg['all_reduce_ok'] else 'WRONG'}" if pg else "none"
        error = _pct(r.get("estimate_error"))
        if r.get("estimate_error") is not None and not r["peak_kind"].startswith("torch.cuda"):
            error += " (RSS)"
        modelled = r.get("modelled_step_seconds")
        ratio = r.get("measured_over_modelled")
        estimate = r.get("estimate_bytes")
        lines.append(
            f"| {r['run']} | {group} | {1000 * r['step_seconds']:.1f} | {r['tokens_per_second']:,.0f} | {_pct(r['mfu'])} "
            f"| {f'{1000 * modelled:.1f}' if modelled else 'n/a'} | {f'{ratio:.2f}x' if ratio else 'n/a'} "
            f"| {_mib(r.get('peak_bytes'))} | {_mib(estimate)} | {error} |"
        )
    return "\n".join(lines)


def peer_ratio(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Our compiled run over torchtitan's: tokens/s and MFU ratios (None unless both ran)."""
    ours = next((r for r in rows if r["run"] == "compile" and "step_seconds" in r), None)
    peer = next((r for r in rows if r["run"] == "torchtitan" and "step_seconds" in r), None)
    if ours is None or peer is None:
        return None
    ratio = {"tokens_per_second": ours["tokens_per_second"] / peer["tokens_per_second"]}
    if ours["mfu"] and peer.get("mfu"):
        ratio["mfu"] = ours["mfu"] / peer["mfu"]
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, debug preset, gloo: check the script without a GPU")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 6; smoke 3)")
    parser.add_argument("--warmup", type=int, help="steps left out per run (default 3; smoke 2)")
    parser.add_argument("--micro", type=int, help="sequences per micro-batch per rank (default 4; smoke 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; smoke 64)")
    parser.add_argument("--only", nargs="*", help="run only these (names: " + ", ".join(r.name for r in RUNS) + ", torchtitan)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds for the whole script: no run starts after")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here (after every run)")
    parser.add_argument("--efficiency-json", type=Path, help="then run bench/efficiency.py here (" + " ".join(EFFICIENCY_ARGS) + ")")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    smoke = args.smoke
    warmup = args.warmup if args.warmup is not None else (2 if smoke else 3)
    if args.worker:
        worker(args.worker, warmup, args.result)
        return 0

    import torch

    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --smoke to check the script on CPU")
    deadline = time.monotonic() + args.budget
    steps = warmup + (args.steps if args.steps is not None else (3 if smoke else 6))
    micro = args.micro or (2 if smoke else 4)
    seq_len = args.seq_len or (64 if smoke else 2048)
    nccl_ranks = 2 if smoke else min(2, torch.cuda.device_count())
    if smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    machine = (f"{platform.machine()} CPU, torch {torch.__version__}" if smoke
               else f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda}, driver {_driver()}")
    print(f"{'SMOKE (CPU, not a measurement): ' if smoke else ''}{machine}; seq {seq_len}, micro-batch {micro}, "
          f"{warmup} warm-up + {steps - warmup} measured steps per run", flush=True)
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": smoke,
                               "seq_len": seq_len, "micro_batch": micro, "warmup": warmup, "steps": steps, "rows": rows}

    def save() -> None:
        payload["torchtitan_ratio"] = peer_ratio(rows)
        if args.out:
            args.out.write_text(json.dumps(payload, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="trainctl-bench-gpu-") as tmp:
        workdir = Path(tmp)
        for name in [r.name for r in RUNS[:3]] + ["torchtitan"] + [r.name for r in RUNS[3:]]:
            if args.only and name not in args.only:
                continue
            left = deadline - time.monotonic()
            if left < 30:
                rows.append({"run": name, "error": "not run: the --budget was spent"})
                continue
            timeout = min(args.timeout, left)
            if name == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
                rows.append({"run": name, "skipped": "torchtitan is not installed (its wheels: bench/torchtitan_peer.py)"})
            elif name == "torchtitan":
                rows.append(peer_run(warmup, steps, micro, seq_len, smoke, workdir, timeout))
            else:
                run_ = next(r for r in RUNS if r.name == name)
                ranks = nccl_ranks if run_.torchrun else 1
                job = job_spec(run_, smoke, ranks, steps, micro, seq_len)
                rows.append(run(name if not (smoke and run_.torchrun) else "gloo (smoke)", job, warmup, ranks, run_.torchrun, workdir, timeout))
            save()
    print(table(rows))
    if payload["torchtitan_ratio"]:
        print("ours (compile) / torchtitan: " + ", ".join(f"{k} {v:.3f}x" for k, v in payload["torchtitan_ratio"].items()))
    if args.efficiency_json:
        left = deadline - time.monotonic()
        payload["efficiency"] = efficiency_run(args.efficiency_json, left) if left >= 60 else {"error": "not run: the --budget was spent"}
        save()
    return 0 if all("error" not in r for r in rows) and "error" not in payload.get("efficiency", {}) else 1


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
