"""`trainctl generate JOB|CHECKPOINT_DIR --prompt TEXT`: sample text from a trained model.

Greedy by default (`--temperature 0`); `--temperature T --top-p P --seed S` samples. `--no-cache`
recomputes the whole sequence each step instead of using the KV cache (same greedy text, slower).
Runs on CUDA when available (`--device`).

Generation stops at an end-of-sequence token: the eos ids of the generation config `trainctl export`
writes for the model (`hf_files.generation_config`: the source model's generation_config.json, else its
config's or the tokenizer's eos id), as transformers' `generate` stops on the export; without one it
runs `--max-new-tokens`. The text printed is the prompt and its continuation, the stop token left out.
`--chat` renders the prompt as one user message with the tokenizer's chat template and the generation
prompt (as `apply_chat_template(..., add_generation_prompt=True)`, within the data pipeline's limits)
and prints the reply only. Sampling settings of a generation config are not applied: the flags decide.

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
    parser.add_argument("--prompt", required=True, help="text to continue (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="render the prompt as a user message with the model's chat template; print the reply")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--no-cache", action="store_true", help="recompute every step instead of using the KV cache")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def run(args: argparse.Namespace) -> int:
    import torch

    from trainctl.parallelism.checkpoint.hf_export import ExportError, export_config
    from trainctl.parallelism.checkpoint.hf_files import generation_config, special_ids_of, stop_ids
    from trainctl.parallelism.checkpoint.pretrained import CheckpointNotFoundError, load_weights
    from trainctl.parallelism.data.tokenizer import TransformersTokenizer, load_tokenizer
    from trainctl.parallelism.model.generate import chat_prompt, decode, generate
    from trainctl.parallelism.model.transformer import Transformer
    from trainctl.spec.job import resolve_tokenizer

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    try:
        source = resolve_source(args.source, getattr(args, "server", None))
        name = resolve_tokenizer(source.job.data, source.job.model.from_pretrained)
        tokenizer = load_tokenizer(name)
        hf = tokenizer.hf if isinstance(tokenizer, TransformersTokenizer) else None
        if args.chat and hf is None:
            raise ValueError(
                f"--chat needs a Hugging Face tokenizer directory with a chat template; the job's tokenizer is {name!r}"
            )
        ids = chat_prompt(hf, args.prompt) if args.chat else [int(i) for i in tokenizer.encode(args.prompt.encode())]
        config = export_config(source, torch.float32, special_ids=special_ids_of(hf))
        stops = stop_ids(generation_config(source, config))
        with torch.device("meta"):
            model = Transformer(source.config)
        model.load_state_dict(load_weights(source), assign=True)
        model.to(device)
        out = generate(
            model, torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, use_cache=not args.no_cache, seed=args.seed, stop_ids=stops,
        )[0].tolist()
    except (CheckpointNotFoundError, ExportError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if out[-1] in stops and len(out) > len(ids):
        out = out[:-1]
    shown = out[len(ids):] if args.chat else out
    print(hf.decode(shown) if hf is not None else decode(name, shown))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone("generate", __doc__, add_arguments, run, argv, job_ids=True)


if __name__ == "__main__":
    sys.exit(main())
