"""`trainctl generate JOB|CHECKPOINT_DIR --prompt TEXT`: sample text from a trained model.

Greedy by default (`--temperature 0`); `--temperature T --top-p P --seed S` samples. `--no-cache`
recomputes the whole sequence each step instead of using the KV cache (same greedy text, slower).
Runs on CUDA when available (`--device`).

`add_arguments(parser)` declares it under the main parser's `generate`; `python -m trainctl.cli.generate_cmd`
runs it alone. The engine (torch) is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import sys

from trainctl.cli.export_cmd import resolve_source
from trainctl.cli.subcommand import run_alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="JOB|CHECKPOINT_DIR", help="job id, checkpoint, checkpoint root or run directory")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--no-cache", action="store_true", help="recompute every step instead of using the KV cache")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def run(args: argparse.Namespace) -> int:
    import torch

    from trainctl.parallelism.checkpoint.hf_export import ExportError
    from trainctl.parallelism.checkpoint.pretrained import CheckpointNotFoundError, load_weights
    from trainctl.parallelism.model.generate import decode, encode, generate
    from trainctl.parallelism.model.transformer import Transformer
    from trainctl.spec.job import resolve_tokenizer

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    try:
        source = resolve_source(args.source, getattr(args, "server", None))
        with torch.device("meta"):
            model = Transformer(source.config)
        model.load_state_dict(load_weights(source), assign=True)
        model.to(device)
        tokenizer = resolve_tokenizer(source.job.data, source.job.model.from_pretrained)
        prompt = torch.tensor([encode(tokenizer, args.prompt)], device=device)
        out = generate(
            model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            use_cache=not args.no_cache, seed=args.seed,
        )
    except (CheckpointNotFoundError, ExportError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(decode(tokenizer, out[0].tolist()))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone("generate", __doc__, add_arguments, run, argv, job_ids=True)


if __name__ == "__main__":
    sys.exit(main())
