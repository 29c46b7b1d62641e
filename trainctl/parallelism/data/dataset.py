"""The one dataset interface over every format, and the token-shard cache the record formats stream into.

`build_dataset(spec, vocab_size, model_dir)` returns a dataset with `n_samples`, `sample_id`,
`samples(start, count)`, `sample_masks(start, count)` and `masked` (what `ShardedLoader` reads):

- `text`: `PackedDataset` (tokenized in memory at start-up, as before).
- `tokens`: `TokenShardDataset` over the prepared directories.
- `jsonl`, `parquet`, `arrow`: streamed once through `token_shards.prepare_shards` (the code of
  `trainctl data prepare`, so reading a format directly and preparing it give one token stream by
  construction) into a cache directory, then memory-mapped like `tokens`.

A `Holdout` (data.holdout, `spec.evaluation.holdout_fraction`) keeps one side of a split by document:
`text` drops the other side's files before tokenizing, the record formats drop the other side's
records from the stream they cache (each side its own cache entry); `tokens` cannot be split.

The cache. Directory `<cache root>/<key>`, where the root is `$TRAINCTL_DATA_CACHE` (default
`~/.cache/trainctl/data`) and the key a SHA-256 of what determines the stream: format, fields,
tokenizer (name and the bytes of its files, weights excluded), the source files (path, size,
mtime) and the shard format version. One process per machine builds it: ranks take an exclusive
`flock` on `<key>.lock`; the first finds no directory, writes `<key>.tmp-<pid>` and renames it into
place (atomic); the others wait on the lock, then map what it wrote. A changed source file or
tokenizer gives a new key; stale entries are left for the operator to delete.

The job's `FileRule` (trainctl.spec.files) covers every file of the job's data: the source files, the
tokenizer files the key hashes and the tokenizer loads, prepared shard directories. The cache itself
is this machine's, written by the ranks: it is read under the default rule (bounded reads only).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from trainctl.parallelism.data.corpus import DataError, PackedDataset
from trainctl.parallelism.data.documents import source_files
from trainctl.parallelism.data.holdout import HOLDOUT_FIELD, Holdout
from trainctl.parallelism.data.token_shards import FORMAT_VERSION, TokenShardDataset, prepare_shards
from trainctl.parallelism.data.tokenizer import FIELD as TOKENIZER_FIELD
from trainctl.parallelism.data.tokenizer import load_tokenizer
from trainctl.spec.data_format import HOLDOUT_FORMATS, TOKEN_SHARD_INDEX
from trainctl.spec.files import FileRule
from trainctl.spec.job import DataSpec, resolve_tokenizer

CACHE_ENV = "TRAINCTL_DATA_CACHE"
DEFAULT_CACHE = "~/.cache/trainctl/data"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
"""Files of a model directory left out of the tokenizer's fingerprint (weights, not tokenizer files)."""


def build_dataset(
    spec: DataSpec, vocab_size: int, model_dir: str | None = None, files: FileRule = FileRule(),
    holdout: Holdout | None = None,
) -> PackedDataset | TokenShardDataset:
    """The dataset `spec.format` names, its files opened under `files`. `model_dir` is the job's
    `from_pretrained` directory, what `tokenizer: auto` means. With `holdout`, only the documents on
    its side (data.holdout; every format but `tokens`, which keeps no document boundaries)."""
    tokenizer = resolve_tokenizer(spec, model_dir)
    if holdout is not None and spec.format not in HOLDOUT_FORMATS:
        raise DataError(
            f"{HOLDOUT_FIELD}: data.format {spec.format} keeps no document boundaries to hold documents out by; "
            "set spec.evaluation.data instead"
        )
    if spec.format == "tokens":
        return TokenShardDataset(spec, vocab_size, files=files)
    if spec.format == "text":
        return PackedDataset(spec, vocab_size, load_tokenizer(tokenizer, files), files, holdout)
    root = cached_shards(spec, tokenizer, files, holdout)
    return TokenShardDataset(spec, vocab_size, roots=[("spec.data.paths", root)])


def cache_root() -> Path:
    """Where cached token shards live on this machine."""
    return Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def cache_key(spec: DataSpec, tokenizer: str, files: FileRule = FileRule(), holdout: Holdout | None = None) -> str:
    """What determines the token stream of `spec` under `tokenizer` (and `holdout`'s side of it), hashed
    (its files read under `files`)."""
    paths = source_files(spec, files)
    digest = hashlib.sha256()
    head = {
        "version": FORMAT_VERSION, "format": spec.format, "text_field": spec.text_field,
        "messages_field": spec.messages_field, "tokenizer": tokenizer,
    }
    if holdout is not None:
        head["holdout"] = [holdout.fraction, holdout.seed, holdout.evaluation]
    digest.update(json.dumps(head, sort_keys=True).encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    _hash_tokenizer(digest, tokenizer, files)
    return digest.hexdigest()[:32]


def _hash_tokenizer(digest: hashlib._Hash, tokenizer: str, files: FileRule) -> None:
    if tokenizer == "byte":
        return
    path = files.check(tokenizer, TOKENIZER_FIELD)
    if path.is_file():
        digest.update(path.read_bytes())
    elif path.is_dir():
        for item in sorted(path.iterdir()):
            if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES):
                digest.update(item.name.encode() + b"\0" + files.check(item, TOKENIZER_FIELD).read_bytes())


def cached_shards(spec: DataSpec, tokenizer: str, files: FileRule = FileRule(), holdout: Holdout | None = None) -> Path:
    """The cache directory holding `spec`'s token stream (`holdout`'s side of it), built here if no
    process built it yet (the job's files read under `files`)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(spec, tokenizer, files, holdout)
    target = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / TOKEN_SHARD_INDEX).is_file():
            building = root / f"{key}.tmp-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            try:
                prepare_shards(
                    spec.paths, building, tokenizer=tokenizer, max_files=spec.max_files, format=spec.format,
                    text_field=spec.text_field, messages_field=spec.messages_field, files=files, holdout=holdout,
                )
                shutil.rmtree(target, ignore_errors=True)  # a directory left without an index
                building.rename(target)
            finally:
                shutil.rmtree(building, ignore_errors=True)
    return target
