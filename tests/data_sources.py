"""Test data in every format: a tiny local Hugging Face tokenizer with a chat template, documents and
conversations written as text, JSONL, Parquet and Arrow (`datasets.save_to_disk`), and the
`spec.data` sections of jobs that train on them (`format_data`).

The tokenizer is a `tokenizers` WordLevel model over the engine tests' WORDS plus chat special
tokens (fits the debug model's 256-token vocabulary), wrapped in `PreTrainedTokenizerFast` and saved
with `save_pretrained`; `markers=True` gives its template `{% generation %}` blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SPECIAL = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
WORDS = sorted({
    "the", "model", "trains", "on", "text", "and", "every", "rank", "must", "agree", "loss", "while", "gradients",
    "flow", "through", "shards", "stages", "rings", "of", "attention", "so", "that", "one", "process", "many",
    "compute", "same", "numbers", "hello", "yes", "no", "why", "because", ".", ",", "?",
})

_TURN = "<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
_ASSISTANT_MARKED = "<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
_ASSISTANT_PLAIN = "<|assistant|> {{ m['content'] }} <|end|> "


def chat_template(markers: bool) -> str:
    """A chat template (with or without generation markers) that renders the same text either way."""
    assistant = _ASSISTANT_MARKED if markers else _ASSISTANT_PLAIN
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}" + assistant + "{% else %}" + _TURN
        + "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )


def build_tokenizer(directory: Path, *, markers: bool = True) -> Path:
    """Save a tiny tokenizer (vocabulary < 256) with a chat template under `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", additional_special_tokens=SPECIAL[2:]
    )
    tokenizer.chat_template = chat_template(markers)
    tokenizer.save_pretrained(str(directory))
    return directory


def sentence(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` short deterministic text documents."""
    rng = random.Random(seed)
    return [sentence(rng, 5, 40) for _ in range(n)]


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` deterministic conversations (some with a system turn, one to three exchanges)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng)})
            messages.append({"role": "assistant", "content": sentence(rng, 2, 20)})
        out.append(messages)
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]], row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_arrow(directory: Path, records: list[dict[str, Any]]) -> Path:
    from datasets import Dataset

    Dataset.from_list(records).save_to_disk(str(directory), max_shard_size="4KB")
    return directory


def write_format(fmt: str, root: Path, records: list[dict[str, Any]]) -> str:
    """`records` in `fmt` under `root`, split in two files / shards; the spec.data.paths entry."""
    root.mkdir(parents=True, exist_ok=True)
    half = len(records) // 2
    if fmt == "jsonl":
        write_jsonl(root / "a.jsonl", records[:half])
        write_jsonl(root / "b.jsonl", records[half:])
        return str(root / "*.jsonl")
    if fmt == "parquet":
        write_parquet(root / "a.parquet", records[:half])
        write_parquet(root / "b.parquet", records[half:])
        return str(root / "*.parquet")
    if fmt == "arrow":
        return str(write_arrow(root / "arrow", records))
    raise ValueError(fmt)


def format_data(kind: str, root: Path, tokenizer: Path, n: int = 80, seed: int = 0) -> dict[str, Any]:
    """Write `n` records of `kind` under `root`: text records in a record format (`jsonl`, `parquet`,
    `arrow`), or chat records in JSONL (`chat-jsonl`); the `spec.data` section that trains on them with
    `tokenizer` (a `build_tokenizer` directory)."""
    if kind == "chat-jsonl":
        path = write_format("jsonl", root, [{"messages": c, "id": i} for i, c in enumerate(conversations(n, seed))])
        return {"paths": [path], "format": "jsonl", "messages_field": "messages", "tokenizer": str(tokenizer)}
    path = write_format(kind, root, [{"body": d, "id": i} for i, d in enumerate(documents(n, seed))])
    return {"paths": [path], "format": kind, "text_field": "body", "tokenizer": str(tokenizer)}
