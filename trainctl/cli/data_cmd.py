"""`trainctl data prepare PATHS... --out DIR`: tokenize text files in parallel into memory-mapped shards.

Train from the result with `data: {format: tokens, paths: [DIR]}`; the token stream (and so the
training run) is the same as `format: text` with the same paths, tokenizer and max_files.

`register(subparsers)` adds the command to the main parser; `python -m trainctl.cli.data_cmd` runs it alone.
The engine (torch) is imported when the command runs, not when the parser is built, so `trainctl --help`
and the client commands start without it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainctl.cli.subcommand import register_command, run_alone


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `data` (with `prepare`) to the main parser; returns its parser."""
    return register_command(subparsers, "data", "prepare training data (pre-tokenized token shards)", add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="data_command", required=True)
    prep = actions.add_parser("prepare", help="tokenize text files into memory-mapped token shards")
    prep.add_argument("paths", nargs="+", help="glob patterns of text files (@stdlib: the Python standard library)")
    prep.add_argument("--out", required=True, type=Path, help="output directory")
    prep.add_argument("--tokenizer", default="byte", help="byte, or the path of a tokenizer.json")
    prep.add_argument("--max-files", type=int, default=None, help="read at most this many files (sorted by path)")
    prep.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes")
    prep.add_argument("--shard-tokens", type=int, default=None,
                      help="tokens per shard file (default: the engine's DEFAULT_SHARD_TOKENS)")


def run(args: argparse.Namespace) -> int:
    from trainctl.parallelism.data.corpus import DataError
    from trainctl.parallelism.data.token_shards import DEFAULT_SHARD_TOKENS, prepare_shards

    try:
        result = prepare_shards(
            args.paths, args.out, tokenizer=args.tokenizer, max_files=args.max_files, workers=args.workers,
            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        )
    except (DataError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"prepared {result.tokens} tokens from {result.files} files in {result.shards} shards under {result.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone("data", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
