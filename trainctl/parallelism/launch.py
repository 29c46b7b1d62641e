"""Run a job spec's training loop under torchrun: `python -m trainctl.parallelism.launch job.yaml`.

    torchrun --nproc-per-node 8 -m trainctl.parallelism.launch examples/demo.yaml --checkpoint-dir ckpt

`--metrics-jsonl PATH` also writes every step report of global rank 0 to PATH, one JSON object per line
(the StepReport fields plus `time`, the Unix time the report was made), flushed as it is written: the
same record the service keeps for a step, for scripts and benchmarks (bench/engine/service_overhead.py).

Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (torchrun sets them; a plain
`python -m ...` without them runs a single process). The same Trainer runs inside a RankWorker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from trainctl.parallelism.engine.distributed import init_distributed, resolve_device, teardown
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.validate import SpecError, load_job_file, validate_job


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"environment variable {name}={value!r} is not an integer") from None


def _progress(total: int, metrics: TextIO | None = None) -> Callable[[StepReport], None]:
    """The on_step callback: a progress line on stdout and, with `metrics`, one JSON line per report."""

    def report(r: StepReport) -> None:
        if metrics is not None:
            metrics.write(json.dumps({**r.to_dict(), "time": time.time()}) + "\n")
            metrics.flush()
        # MFU in Megatron's convention (causal attention halved), then torchtitan's (attention unmasked)
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        if r.mfu_full_attention is not None:
            mfu += f" (full-attn {100 * r.mfu_full_attention:.1f}%)"
        print(
            f"step {r.step}/{total} loss {r.loss:.4f} grad_norm {r.grad_norm:.3f} lr {r.lr:.2e} "
            f"tokens/s {r.tokens_per_second:,.0f} mfu {mfu} step {r.step_time_seconds * 1000:.0f} ms",
            flush=True,
        )

    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainctl.parallelism.launch", description=__doc__.splitlines()[0])
    parser.add_argument("job", help="TrainingJob YAML file")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint directory (resumes from it)")
    parser.add_argument(
        "--metrics-jsonl",
        type=Path,
        default=None,
        help="append rank 0's step reports to this file, one JSON object per line (StepReport fields + time)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        job = validate_job(load_job_file(args.job))
    except SpecError as exc:
        for violation in exc.violations:
            print(f"{args.job}: {violation}", file=sys.stderr)
        return 2
    body = job.spec
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if world_size != body.parallelism.world_size:
        print(
            f"{args.job}: spec.parallelism needs {body.parallelism.world_size} ranks but WORLD_SIZE is {world_size}",
            file=sys.stderr,
        )
        return 2
    # torchrun's LOCAL_RANK picks this process's GPU on its node.
    device = resolve_device(body.resources.device, _env_int("LOCAL_RANK", rank))
    if world_size > 1:
        init_distributed(
            rank,
            world_size,
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            _env_int("MASTER_PORT", 29500),
            device=device,
            timeout_seconds=body.scheduling.step_timeout_seconds,
        )
    metrics = args.metrics_jsonl.open("a", encoding="utf-8") if args.metrics_jsonl and rank == 0 else None
    try:
        trainer = Trainer(
            body,
            rank=rank,
            world_size=world_size,
            device=device,
            checkpoint_dir=args.checkpoint_dir,
            on_step=_progress(body.training.steps, metrics),
        )
        result = trainer.run()
    finally:
        teardown()
        if metrics is not None:
            metrics.close()
    if rank == 0:
        first = result.losses[0] if result.losses else None
        print(f"done: {result.steps_completed} steps, loss {first} -> {result.final_loss}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
