"""`trainctl export JOB|CHECKPOINT_DIR --out DIR`: the trained model as a complete Hugging Face model
directory in its family (an imported model's own, `MixtralForCausalLM` for MoE, `LlamaForCausalLM` for
presets): model.safetensors, config.json (an imported model's own keys), generation_config.json and the
tokenizer files of the job's tokenizer (chat template included), loadable with `AutoTokenizer` and
`AutoModelForCausalLM` (trainctl.parallelism.checkpoint.hf_export, hf_files).

JOB is a job id on the server (its run directory's newest checkpoint, with the job's spec); a path is a
`step_*` checkpoint, a checkpoint root or a run directory (its spec from the `job.json` the Trainer
recorded beside the checkpoints). LoRA runs are exported with the adapters merged.

`add_arguments(parser)` declares it under the main parser's `export`; `python -m trainctl.cli.export_cmd`
runs it alone. The engine (torch) is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trainctl.cli.subcommand import run_alone

if TYPE_CHECKING:
    from trainctl.parallelism.checkpoint.pretrained import Pretrained

DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes the weights may be written in (torch's names)."""


def resolve_source(source: str, server: str | None) -> Pretrained:
    """A checkpoint path, or a job id looked up on the server (its run directory and spec)."""
    from trainctl.parallelism.checkpoint.pretrained import CheckpointNotFoundError, open_checkpoint
    from trainctl.parallelism.run_directory import RunDirectory

    if Path(source).expanduser().exists():
        return open_checkpoint(source)
    import grpc

    from trainctl.cli.client import ServerUnreachable, TrainctlClient
    from trainctl.wire.convert import job_from_proto

    try:
        with TrainctlClient(server, fail_fast=True) as client:
            job = client.get_job(source)
    except ServerUnreachable as exc:
        raise CheckpointNotFoundError(f"{source!r} is not a checkpoint path, and to look it up as a job id: {exc}") from None
    except grpc.RpcError as exc:
        raise CheckpointNotFoundError(
            f"{source!r} is neither a checkpoint path nor a job the server knows ({exc.code().name}: {exc.details()})"
        ) from None
    if not job.status.run_dir:
        raise CheckpointNotFoundError(f"job {source} has no run directory yet (state: {job.status.state})")
    return open_checkpoint(RunDirectory(Path(job.status.run_dir)).checkpoints, job=job_from_proto(job).spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="JOB|CHECKPOINT_DIR", help="job id, checkpoint, checkpoint root or run directory")
    parser.add_argument("--out", required=True, type=Path,
                        help="output directory (model.safetensors, config.json, generation_config.json, tokenizer files)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the written weights")


def run(args: argparse.Namespace) -> int:
    import torch

    from trainctl.parallelism.checkpoint.hf_export import ExportError, export_checkpoint
    from trainctl.parallelism.checkpoint.pretrained import CheckpointNotFoundError

    try:
        source = resolve_source(args.source, getattr(args, "server", None))
        files = export_checkpoint(source, args.out, getattr(torch, args.dtype))
    except (CheckpointNotFoundError, ExportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {source.path} -> " + ", ".join(str(f) for f in files))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone("export", __doc__, add_arguments, run, argv, job_ids=True)


if __name__ == "__main__":
    sys.exit(main())
