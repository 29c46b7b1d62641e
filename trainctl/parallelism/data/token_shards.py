"""Pre-tokenized, memory-mapped token shards (`data.format: tokens`) and the prefetching loader.

On disk (written by `prepare_shards`, the engine of `trainctl data prepare`):

    DIR/index.json           {"version", "tokenizer", "vocab_size", "dtype", "files", "shards": [{"file", "tokens"}]}
    DIR/shard_00000.bin      raw little-endian token ids (uint16 when the vocabulary fits, else int32)

The token stream is the files of the text corpus, sorted, each tokenized whole and concatenated: the
same stream `data.PackedDataset` builds at start-up, so training from shards equals training from
text. Files are tokenized in parallel (a process pool, results consumed in file order) and written
shard by shard, so memory stays bounded by the pool's in-flight files. `TokenShardDataset` memory-maps
the shards (nothing is read until a sample is) and serves the same packed samples in the same seeded
order, so the loader's global sample offset means the same thing for both formats.

`PrefetchLoader` wraps a `data.ShardedLoader`: one background thread prepares the next `depth`
batches (pinned memory on CUDA) while the step runs; `offset` stays the global sample offset of the
next batch the trainer will take, and setting it (resume) drops the prepared batches.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainctl.parallelism.data.corpus import (
    DataError,
    MicroBatch,
    PackedDataset,
    SampleOrder,
    ShardedLoader,
    token_dtype,
)
from trainctl.parallelism.data.tokenizer import load_tokenizer
from trainctl.spec.job import DataSpec
from trainctl.spec.validate import resolve_data_paths

INDEX = "index.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 24


@dataclass(frozen=True)
class PrepareResult:
    """What `prepare_shards` wrote."""

    out_dir: Path
    files: int
    tokens: int
    shards: int


def _encode_file(args: tuple[str, str]) -> np.ndarray:
    tokenizer_name, path = args
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from exc
    return load_tokenizer(tokenizer_name).encode(data)


def _encoded(files: list[Path], tokenizer: str, workers: int) -> Iterator[np.ndarray]:
    jobs = [(tokenizer, str(p)) for p in files]
    if workers <= 1:
        yield from map(_encode_file, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(_encode_file, jobs, chunksize=max(1, len(jobs) // (8 * workers)))


def prepare_shards(
    patterns: list[str],
    out_dir: str | Path,
    *,
    tokenizer: str = "byte",
    max_files: int | None = None,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> PrepareResult:
    """Tokenize the files `patterns` match (sorted, at most `max_files`) into shards under `out_dir`."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    files = resolve_data_paths(patterns)
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise DataError(f"data paths {patterns} match no files")
    vocab_size = load_tokenizer(tokenizer).vocab_size
    dtype = token_dtype(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX).exists():
        (out / INDEX).unlink()  # the directory is not a valid dataset until the new index is written
    shards: list[dict[str, Any]] = []
    buffer: list[np.ndarray] = []
    buffered = 0

    def flush(final: bool) -> None:
        nonlocal buffer, buffered
        while buffered >= shard_tokens or (final and buffered):
            joined = np.concatenate(buffer)
            take = joined[:shard_tokens]
            name = f"shard_{len(shards):05d}.bin"
            take.astype(dtype).tofile(out / name)
            shards.append({"file": name, "tokens": int(len(take))})
            rest = joined[shard_tokens:]
            buffer, buffered = ([rest] if len(rest) else []), len(rest)

    for tokens in _encoded(files, tokenizer, workers):
        buffer.append(tokens)
        buffered += len(tokens)
        flush(final=False)
    flush(final=True)
    index = {
        "version": FORMAT_VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size, "dtype": dtype.name,
        "files": [str(p) for p in files], "shards": shards,
    }
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / INDEX)
    return PrepareResult(out_dir=out, files=len(files), tokens=sum(s["tokens"] for s in shards), shards=len(shards))


class TokenShardDataset:
    """The packed samples of prepared shard directories (`spec.data.paths`, in order), memory-mapped."""

    def __init__(self, spec: DataSpec, vocab_size: int):
        self.maps: list[np.memmap] = []
        for i, raw in enumerate(spec.paths):
            root = Path(os.path.expanduser(raw))
            try:
                index = json.loads((root / INDEX).read_text())
            except (OSError, ValueError) as exc:
                raise DataError(
                    f"spec.data.paths[{i}]: {raw!r} is not a token-shard directory ({exc}); build it with `trainctl data prepare`"
                ) from exc
            if index.get("version") != FORMAT_VERSION:
                raise DataError(f"spec.data.paths[{i}]: {raw!r} has index version {index.get('version')}, expected {FORMAT_VERSION}")
            if not isinstance(index, dict) or not isinstance(index.get("vocab_size"), int):
                raise DataError(f"spec.data.paths[{i}]: {raw!r} has a malformed {INDEX} (no integer vocab_size)")
            if index["vocab_size"] > vocab_size:
                raise DataError(
                    f"spec.model.vocab_size: {vocab_size} is smaller than the vocabulary the shards in {raw!r} were "
                    f"tokenized with ({index['vocab_size']})"
                )
            self.maps.extend(_mapped_shards(root, index, f"spec.data.paths[{i}]"))
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        total = int(self.starts[-1])
        self.sample_len = spec.seq_len + 1
        self.n_samples = total // self.sample_len
        if self.n_samples == 0:
            raise DataError(f"spec.data.paths: the shards hold {total} tokens, fewer than one sample of {self.sample_len}")
        self.order = SampleOrder(spec.seed, self.n_samples)

    def sample_id(self, global_index: int) -> int:
        """Which packed sample the `global_index`-th sample of the seeded stream is (as `PackedDataset`)."""
        return self.order.sample_id(global_index)

    def tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream (int64)."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            lo = start + filled - int(self.starts[shard])
            piece = self.maps[shard][lo : lo + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        return out

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples [start, start + count) as an int64 tensor [count, seq_len + 1]."""
        rows = [self.tokens(self.sample_id(i) * self.sample_len, self.sample_len) for i in range(start, start + count)]
        return torch.from_numpy(np.stack(rows))


def _mapped_shards(root: Path, index: dict[str, Any], field: str) -> list[np.memmap]:
    """The shards `index` lists, memory-mapped, each checked against its recorded token count."""
    maps = []
    try:
        dtype = np.dtype(index["dtype"])
        for shard in index["shards"]:
            name = shard["file"]
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise DataError(f"{field}: {str(root)!r} has an {INDEX} naming shard {name!r}, not a file in the directory")
            mapped = np.memmap(root / name, dtype=dtype, mode="r")
            if len(mapped) != shard["tokens"]:
                raise DataError(f"{field}: {shard['file']} holds {len(mapped)} tokens, index says {shard['tokens']}")
            maps.append(mapped)
    except DataError:
        raise
    except (KeyError, TypeError) as exc:
        raise DataError(f"{field}: {str(root)!r} has a malformed {INDEX}: {exc!r}") from exc
    except (OSError, ValueError) as exc:  # a shard missing, unreadable or empty
        raise DataError(f"{field}: cannot map a shard of {str(root)!r}: {exc}") from exc
    return maps


def build_dataset(spec: DataSpec, vocab_size: int) -> PackedDataset | TokenShardDataset:
    """The dataset `spec.data.format` names."""
    return TokenShardDataset(spec, vocab_size) if spec.format == "tokens" else PackedDataset(spec, vocab_size)


class PrefetchLoader:
    """A `ShardedLoader` whose next `depth` batches are prepared by a background thread."""

    def __init__(self, loader: ShardedLoader, depth: int, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"spec.data.prefetch: depth must be at least 1 to prefetch, got {depth}")
        self.loader = loader
        self.depth = depth
        self.pin_memory = pin_memory
        self._offset = loader.offset
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainctl-prefetch")
        self._pending: deque[Future[list[MicroBatch]]] = deque()

    def __getattr__(self, name: str) -> Any:  # n_micro, global_batch_size, ... of the wrapped loader
        return getattr(self.__dict__["loader"], name)

    @property
    def offset(self) -> int:
        """Global sample offset of the next batch `next_batch` returns."""
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._drain()
        self.loader.offset = value
        self._offset = value

    def _load(self) -> list[MicroBatch]:
        batch = self.loader.next_batch()
        if self.pin_memory:
            batch = [MicroBatch(m.inputs.pin_memory(), m.targets.pin_memory()) for m in batch]
        return batch

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def next_batch(self) -> list[MicroBatch]:
        """The next global batch's micro-batches for this rank (same as the wrapped loader's)."""
        while len(self._pending) <= self.depth:
            self._pending.append(self._pool.submit(self._load))
        batch = self._pending.popleft().result()
        self._offset += self.loader.global_batch_size
        return batch

    def close(self) -> None:
        """Stop the background thread (prepared batches are dropped)."""
        self._drain()
        self._pool.shutdown(wait=True)


def build_loader(dataset: PackedDataset | TokenShardDataset, spec: DataSpec, device: torch.device, **kwargs: Any) -> ShardedLoader | PrefetchLoader:
    """A `ShardedLoader` over `dataset` (keyword arguments as ShardedLoader's), prefetching when
    `spec.prefetch` > 0 (pinned memory on CUDA)."""
    loader = ShardedLoader(dataset, **kwargs)
    if spec.prefetch == 0:
        return loader
    return PrefetchLoader(loader, spec.prefetch, pin_memory=device.type == "cuda")
