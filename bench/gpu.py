"""GPU benchmarks in one call: the NCCL path, MFU of a ~1B Llama, and the memory estimator's error.

    .venv/bin/python bench/gpu.py --out bench/results-gpu.json     # a CUDA machine; one GPU is enough
    .venv/bin/python bench/gpu.py --smoke                           # the same code paths on CPU, tiny model

Three runs of the engine's own `Trainer`, each in a fresh process (its own CUDA context, peak-memory
counters and compile caches), on the same job: preset `llama-1b` (16 layers, dim 2048, GQA 32/8,
vocab 128,256; 1.5 B parameters), bfloat16 (fp32 master weights, gradients and AdamW state), seq
2048, one micro-batch of 4 sequences per rank, AdamW fused, no activation checkpointing, byte-level
data from the standard library:

1. ``eager``: one GPU, one process, no process group.
2. ``compile``: the same with ``training.compile`` (each decoder block compiled).
3. ``nccl``: the compiled job under ``torchrun --nproc-per-node N`` with an NCCL process group
   (N = 2 and FSDP over ``dp_shard: 2`` when the machine has 2 GPUs or more; N = 1 otherwise, since
   NCCL refuses two ranks on one GPU: the group then carries the start-up all-reduce check only).

Per run, ``--warmup`` steps are left out (compilation, allocator growth); then over ``--steps``
steps: the median step time and tokens/s, MFU as the Trainer reports it (`flops.mfu`: FLOPs per
token from `flops.training_flops_per_token` x tokens/s / (ranks x the device's dense bf16 peak from
`flops.peak_flops`); None when the device is not in the table), the peak memory of rank 0
(`torch.cuda.max_memory_allocated`, counters reset after the warm-up steps) and the estimator's
prediction for rank 0 (`estimator.estimate_memory(...).total_bytes`) with its error
(estimate / measured - 1; target within 10 %).

``--smoke`` runs exactly these steps on CPU with the ``debug`` preset, seq 64, gloo instead of NCCL
and 2 torchrun ranks: it checks the script, not the hardware. It reports no MFU (CPU peaks are
unknown), and its "measured" peak is the process's peak RSS, which is not comparable with the
estimate (the interpreter, torch and compile caches are in it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20
HERE = Path(__file__).resolve()
VENV_BIN = Path(sys.executable).parent


def job_spec(smoke: bool, compile_: bool, ranks: int, steps: int, micro: int, seq_len: int) -> dict[str, Any]:
    """The benchmark job (JobSpecBody fields) for one run."""
    return {
        "model": {"preset": "debug" if smoke else "llama-1b"},
        "data": {"seq_len": seq_len, "max_files": 50 if smoke else 200, "prefetch": 2},
        "parallelism": {"dp_shard": ranks},
        "training": {
            "steps": steps,
            "global_batch_size": micro * ranks,
            "micro_batch_size": micro,
            "warmup_steps": 2,
            "dtype": "bfloat16",
            "compile": compile_,
            "optimizer_impl": "auto",  # fused on CUDA, foreach on CPU
        },
        "checkpoint": {"interval_steps": 0, "resume": False},
        "resources": {"gpus": ranks, "device": "cpu" if smoke else "cuda"},
    }


# ---- one run (a worker process) ----------------------------------------------------------------------
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
    from trainctl.parallelism.sizing.estimator import estimate_memory
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
    reports: list[StepReport] = []

    def on_step(report: StepReport) -> None:
        reports.append(report)
        if report.step == warmup and device.type == "cuda":  # peak memory of the steady-state steps only
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)

    try:
        started = time.perf_counter()
        trainer = Trainer(body, rank=rank, world_size=world, device=device, on_step=on_step)
        result = trainer.run()
        wall = time.perf_counter() - started
    finally:
        teardown()
    if rank != 0:
        return
    steady = [r for r in reports if r.step > warmup]
    mfus = [r.mfu for r in steady if r.mfu is not None]
    measured_peak = steady[-1].peak_memory_bytes
    estimate = estimate_memory(resolve_model(body.model), trainer.job, rank)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "ranks": world,
        "process_group": group or None,
        "compile": body.training.compile,
        "dtype": body.training.dtype,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "steps_measured": len(steady),
        "step_seconds": statistics.median(r.step_time_seconds for r in steady),
        "tokens_per_second": statistics.median(r.tokens_per_second for r in steady),
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_bytes": measured_peak,
        "peak_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (not comparable)",
        "estimate_bytes": estimate.total_bytes,
        "estimate_parts": {
            "params": estimate.params_bytes, "grads": estimate.grads_bytes,
            "optimizer": estimate.optimizer_bytes, "activations": estimate.activations_bytes,
        },
        "estimate_error": estimate.total_bytes / measured_peak - 1 if measured_peak else None,
        "final_loss": result.final_loss,
        "wall_seconds": wall,
    }
    result_path.write_text(json.dumps(out, indent=1))


# ---- the driver --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(name: str, job: dict[str, Any], warmup: int, ranks: int, torchrun: bool, workdir: Path, timeout: float) -> dict[str, Any]:
    """One run in a fresh process (under torchrun when asked); its measurements."""
    result = workdir / f"{name}.json"
    tail = [str(HERE), "--worker", json.dumps(job), "--warmup", str(warmup), "--result", str(result)]
    if torchrun:
        cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), *tail]
    else:
        cmd = [sys.executable, *tail]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not result.exists():
        return {"run": name, "error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"}
    print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
    return {"run": name, **json.loads(result.read_text())}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | device | ranks | process group | compile | step ms | tokens/s | MFU | peak MiB (measured) "
        "| estimate MiB | estimator error |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'].splitlines()[-1][:200]} |" + " |" * 9)
            continue
        pg = r["process_group"]
        group = f"{pg['backend']}, all-reduce {'ok' if pg['all_reduce_ok'] else 'WRONG'}" if pg else "none"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        error = f"{100 * r['estimate_error']:+.1f}%" if r["estimate_error"] is not None else "n/a"
        if not r["peak_kind"].startswith("torch.cuda"):
            error += " (RSS)"
        lines.append(
            f"| {r['run']} | {r['device']} | {r['ranks']} | {group} | {r['compile']} | {1000 * r['step_seconds']:.1f} "
            f"| {r['tokens_per_second']:,.0f} | {mfu} | {r['peak_bytes'] / MiB:,.0f} | {r['estimate_bytes'] / MiB:,.0f} "
            f"| {error} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, debug preset, gloo: check the script without a GPU")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 10; smoke 3)")
    parser.add_argument("--warmup", type=int, help="steps left out per run (default 3; smoke 2)")
    parser.add_argument("--micro", type=int, help="sequences per micro-batch per rank (default 4; smoke 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; smoke 64)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
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
    steps = warmup + (args.steps if args.steps is not None else (3 if smoke else 10))
    micro = args.micro or (2 if smoke else 4)
    seq_len = args.seq_len or (64 if smoke else 2048)
    nccl_ranks = 2 if smoke else min(2, torch.cuda.device_count())
    if smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    machine = (f"{platform.machine()} CPU, torch {torch.__version__}" if smoke
               else f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda}")
    print(f"{'SMOKE (CPU, not a measurement): ' if smoke else ''}{machine}; seq {seq_len}, micro-batch {micro}, "
          f"{warmup} warm-up + {steps - warmup} measured steps per run", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainctl-bench-gpu-") as tmp:
        workdir = Path(tmp)
        for name, compile_, ranks, torchrun in (
            ("eager", False, 1, False),
            ("compile", True, 1, False),
            ("nccl" if not smoke else "gloo (smoke)", True, nccl_ranks, True),
        ):
            job = job_spec(smoke, compile_, ranks, steps, micro, seq_len)
            rows.append(run(name, job, warmup, ranks, torchrun, workdir, args.timeout))
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "smoke": smoke, "seq_len": seq_len, "micro_batch": micro,
                                        "warmup": warmup, "steps": steps, "rows": rows}, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
