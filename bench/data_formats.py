"""Data pipeline throughput per format against the tokens a training step consumes.

For each of `spec.data.format` jsonl (text field), parquet (column), arrow (`datasets.save_to_disk`
directory), chat jsonl (messages rendered with the tokenizer's chat template, assistant-token masks)
and tokens (shards written by `trainctl data prepare`), on one corpus of random-word documents and one
byte-level BPE tokenizer trained on it (a Hugging Face tokenizer directory with a chat template):

- *first read*: `build_dataset` with an empty cache: the records streamed, tokenized and written into
  the content-addressed token-shard cache, then mapped (for `tokens`: `prepare_shards`, the engine of
  `trainctl data prepare`, from the JSONL records; the training job itself never tokenizes);
- *cached read*: `build_dataset` again (a cache hit) and one pass of a `ShardedLoader` (dp 1, no
  prefetch) over every sample: what a rank pays per batch once the cache exists.

Both as tokens per second (stream tokens for the first read, tokens of the batches served for the
cached read), divided by the tokens per second of one training step of a small preset measured here
(`Trainer.train_step` in this process, the median of the timed steps): the loader must never be the
bottleneck, so the ratio must stay well above 1. One torch thread throughout, and everything measured
is single-threaded, so each figure is given per CPU second of this process (`time.process_time`, what
the ratios use: robust to other work on a shared machine) and per wall second.

    .venv/bin/python bench/data_formats.py --json bench/results-data-formats.json
    .venv/bin/python bench/data_formats.py --smoke      # seconds: small corpus, debug preset
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from trainctl.parallelism.data.corpus import ShardedLoader
from trainctl.parallelism.data.dataset import CACHE_ENV, build_dataset
from trainctl.parallelism.data.token_shards import prepare_shards
from trainctl.parallelism.data.tokenizer import load_tokenizer
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import DataSpec, JobSpecBody

WORDS = [
    "the", "model", "trains", "on", "text", "and", "every", "rank", "must", "agree", "while", "gradients",
    "flow", "through", "shards", "stages", "rings", "of", "attention", "so", "that", "one", "process",
    "many", "compute", "same", "numbers", "data", "loader", "token", "cache", "batch", "step", "layer",
    "weight", "optimizer", "schedule", "checkpoint", "resume", "sample", "order", "seed", "epoch",
    "document", "record", "column", "parquet", "arrow", "json",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
FORMATS = ("jsonl", "parquet", "arrow", "chat-jsonl", "tokens")


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def write_corpus(root: Path, documents: int, conversations: int, seed: int = 0) -> dict[str, Path]:
    """Text records (JSONL, Parquet, Arrow) and chat records (JSONL) under `root`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rng = random.Random(seed)
    texts = [" ".join(sentence(rng, 4, 20) for _ in range(rng.randint(2, 12))) for _ in range(documents)]
    chats = []
    for _ in range(conversations):
        messages = [{"role": "system", "content": sentence(rng, 4, 12)}]
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": sentence(rng, 4, 20)},
                         {"role": "assistant", "content": " ".join(sentence(rng, 4, 20) for _ in range(3))}]
        chats.append({"messages": messages})
    out = {name: root / name for name in ("jsonl", "parquet", "arrow", "chat-jsonl")}
    for path in out.values():
        path.mkdir(parents=True)
    half = documents // 2
    for i, part in enumerate((texts[:half], texts[half:])):
        (out["jsonl"] / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        pq.write_table(pa.table({"text": part}), out["parquet"] / f"part{i}.parquet", row_group_size=1024)
    Dataset.from_dict({"text": texts}).save_to_disk(str(out["arrow"]), num_shards=2)
    (out["chat-jsonl"] / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return out


def build_tokenizer(directory: Path, corpus: Path, vocab: int) -> Path:
    """A byte-level BPE of `vocab` tokens trained on the JSONL corpus, saved as a Hugging Face
    tokenizer directory with a chat template (generation markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for f in sorted(corpus.glob("*.jsonl")) for line in f.read_text().splitlines()]
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>",
                                        additional_special_tokens=SPECIAL[2:])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return directory


def data_spec(fmt: str, paths: dict[str, Path], tokenizer: Path, seq_len: int, prepared: Path) -> DataSpec:
    if fmt == "tokens":
        return DataSpec(paths=[str(prepared)], format="tokens", seq_len=seq_len, prefetch=0)
    if fmt == "chat-jsonl":
        return DataSpec(paths=[str(paths[fmt] / "*.jsonl")], format="jsonl", messages_field="messages",
                        tokenizer=str(tokenizer), seq_len=seq_len, prefetch=0)
    glob = {"jsonl": "*.jsonl", "parquet": "*.parquet"}.get(fmt)
    path = str(paths[fmt] / glob) if glob else str(paths[fmt])
    return DataSpec(paths=[path], format=fmt, tokenizer=str(tokenizer), seq_len=seq_len, prefetch=0)


def stream_tokens(dataset: Any) -> int:
    return int(sum(len(m) for m in dataset.maps))


class Timer:
    """Wall and CPU seconds of this process over a `with` block."""

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu


def rates(prefix: str, tokens: int, timer: Timer) -> dict[str, float]:
    return {f"{prefix}_wall_seconds": timer.wall, f"{prefix}_cpu_seconds": timer.cpu,
            f"{prefix}_tokens_per_cpu_second": tokens / timer.cpu, f"{prefix}_tokens_per_wall_second": tokens / timer.wall}


def measure_format(fmt: str, spec: DataSpec, vocab: int, batch: int, jsonl: Path, tokenizer: Path, cache: Path,
                   prepared: Path) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    with Timer() as first:
        if fmt == "tokens":
            prepare_shards([str(jsonl / "*.jsonl")], prepared, tokenizer=str(tokenizer), format="jsonl")
        dataset = build_dataset(spec, vocab)
    tokens = stream_tokens(dataset)
    with Timer() as cached:
        dataset = build_dataset(spec, vocab)
        loader = ShardedLoader(dataset, global_batch_size=batch, micro_batch_size=batch, dp_rank=0, dp_size=1)
        steps = dataset.n_samples // batch
        for _ in range(steps):
            loader.next_batch()
    served = steps * batch * spec.seq_len
    return {"format": fmt, "stream_tokens": tokens, "samples": dataset.n_samples, "masked": bool(dataset.masked),
            **rates("first_read", tokens, first), **rates("cached_read", served, cached)}


def measure_step(preset: str, vocab: int, seq_len: int, batch: int, steps: int, warmup: int, data: DataSpec) -> dict[str, Any]:
    """Median seconds of `Trainer.train_step` (data, forward/backward, optimizer) on one process."""
    job = JobSpecBody.model_validate({
        "model": {"preset": preset, "vocab_size": vocab},
        "data": data.model_dump(),
        "training": {"steps": warmup + steps, "global_batch_size": batch, "micro_batch_size": batch, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 0},
        "resources": {"gpus": 1, "device": "cpu"},
    })
    trainer = Trainer(job, device="cpu")
    timers = []
    for _ in range(warmup + steps):
        with Timer() as timer:
            trainer.train_step()
        timers.append(timer)
    cpu, wall = (statistics.median(getattr(t, kind) for t in timers[warmup:]) for kind in ("cpu", "wall"))
    tokens = batch * seq_len
    return {"preset": preset, "vocab_size": vocab, "seq_len": seq_len, "global_batch_size": batch, "timed_steps": steps,
            "median_step_cpu_seconds": cpu, "median_step_wall_seconds": wall,
            "tokens_per_cpu_second": tokens / cpu, "tokens_per_wall_second": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small corpus and the debug preset (seconds)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    documents, conversations, preset, steps = (400, 100, "debug", 2) if args.smoke else (20_000, 4_000, "small", 6)
    seq_len, batch, vocab = 256, 8, 2048

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        cache = root / "cache"
        os.environ[CACHE_ENV] = str(cache)
        paths = write_corpus(root / "corpus", documents, conversations)
        tokenizer = build_tokenizer(root / "tokenizer", paths["jsonl"], vocab)
        prepared = root / "prepared"
        load_tokenizer(str(tokenizer))  # imports transformers outside the timed reads
        rows = []
        for fmt in FORMATS:
            spec = data_spec(fmt, paths, tokenizer, seq_len, prepared)
            rows.append(measure_format(fmt, spec, vocab, batch, paths["jsonl"], tokenizer, cache, prepared))
        step = measure_step(preset, vocab, seq_len, batch, steps, 1, data_spec("tokens", paths, tokenizer, seq_len, prepared))

    for row in rows:
        for read in ("first_read", "cached_read"):
            row[f"{read}_ratio"] = row[f"{read}_tokens_per_cpu_second"] / step["tokens_per_cpu_second"]
    print(f"training step: preset {step['preset']} (vocab {vocab}), seq {seq_len} x batch {batch}: median "
          f"{step['median_step_cpu_seconds']:.3f} CPU s ({step['median_step_wall_seconds']:.3f} wall s) = "
          f"{step['tokens_per_cpu_second']:,.0f} tokens per CPU s")
    print("tokens per CPU second (x step: / the step's); wall-second figures in --json")
    print(f"{'format':<11} {'tokens':>10} {'first read':>12} {'x step':>8} {'cached read':>12} {'x step':>8}")
    for r in rows:
        print(f"{r['format']:<11} {r['stream_tokens']:>10,} {r['first_read_tokens_per_cpu_second']:>12,.0f} "
              f"{r['first_read_ratio']:>8.1f} {r['cached_read_tokens_per_cpu_second']:>12,.0f} {r['cached_read_ratio']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
            "torch": torch.__version__, "smoke": args.smoke, "documents": documents, "conversations": conversations,
            "step": step, "formats": rows,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
