"""`trainctl data prepare PATHS... --out DIR`: tokenize a corpus into memory-mapped token shards.

`--format` text (files, tokenized in parallel), jsonl, parquet or arrow (`datasets.save_to_disk`
directories; records streamed); `--messages-field` makes the records chat conversations, rendered
with the tokenizer directory's chat template, with assistant-only loss masks stored beside the tokens.
Train from the result with `data: {format: tokens, paths: [DIR]}`; the token stream (and so the
training run) is the same as reading the source with the same format, fields, tokenizer and max_files.

`add_arguments(parser)` declares it under the main parser's `data`; `python -m trainctl.cli.data_cmd` runs
it alone. The engine (torch) is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import get_args

from trainctl.cli.subcommand import run_alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trainctl.spec.data_format import DataFormat

    source_formats = [f for f in get_args(DataFormat) if f != "tokens"]  # every spec.data.format but its own output
    actions = parser.add_subparsers(dest="data_command", required=True)
    prep = actions.add_parser("prepare", help="tokenize text, JSONL, Parquet or Arrow data into memory-mapped token shards")
    prep.add_argument("paths", nargs="+", help="glob patterns of files (@stdlib: the Python standard library); "
                      "directories for --format arrow")
    prep.add_argument("--out", required=True, type=Path, help="output directory")
    prep.add_argument("--format", default="text", choices=source_formats, help="source format")
    prep.add_argument("--text-field", default="text", help="jsonl / parquet / arrow: the field holding each record's text")
    prep.add_argument("--messages-field", default=None,
                      help="chat data: the field holding each record's {role, content} messages (assistant-only loss masks)")
    prep.add_argument("--tokenizer", default="byte",
                      help="byte, the path of a tokenizer.json, or a Hugging Face tokenizer (or model) directory")
    prep.add_argument("--max-files", type=int, default=None, help="read at most this many files (sorted by path)")
    prep.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes")
    prep.add_argument("--shard-tokens", type=int, default=None,
                      help="tokens per shard file (default: the engine's DEFAULT_SHARD_TOKENS)")


def run(args: argparse.Namespace) -> int:
    from trainctl.parallelism.data.token_shards import DEFAULT_SHARD_TOKENS, prepare_shards
    from trainctl.parallelism.errors import ConfigurationError

    try:
        result = prepare_shards(
            args.paths, args.out, tokenizer=args.tokenizer, max_files=args.max_files, workers=args.workers,
            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, format=args.format, text_field=args.text_field,
            messages_field=args.messages_field,
        )
    except (ConfigurationError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    masks = " with loss masks" if result.masked else ""
    print(f"prepared {result.tokens} tokens{masks} from {result.files} files in {result.shards} shards under {result.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone("data", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
