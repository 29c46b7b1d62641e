"""Pre-tokenized, memory-mapped token shards (`data.format: tokens`) and the prefetching loader.

On disk (written by `prepare_shards`, the engine of `trainctl data prepare`):

    DIR/index.json           {"version", "tokenizer", "vocab_size", "dtype", "masked", "files",
                              "shards": [{"file", "tokens", "mask"?}]}
    DIR/shard_00000.bin      raw little-endian token ids (uint16 when the vocabulary fits, else int32)
    DIR/mask_00000.bin       chat data only: one uint8 per token, 1 where the token is a target the
                             loss covers (the assistant's), 0 elsewhere

The token stream is the documents of the source, in order, each tokenized (`documents.token_stream`:
EOS after each when the tokenizer has one) and concatenated: the same stream `data.PackedDataset`
builds at start-up for text and the one the jsonl / parquet / arrow formats cache (`data.dataset`),
so training from shards equals training from the source. Text files are tokenized in parallel (a
process pool, results consumed in file order); records of the other formats are streamed in one
process. Either way shards are written one at a time, so memory stays bounded. `TokenShardDataset`
memory-maps the shards (nothing is read until a sample is) and serves the same packed samples in the
same seeded order, so the loader's global sample offset means the same thing for every format.

`PrefetchLoader` wraps a `data.ShardedLoader`: one background thread prepares the next `depth`
batches (pinned memory on CUDA) while the step runs; `offset` stays the global sample offset of the
next batch the trainer will take, and setting it (resume) drops the prepared batches.

Files are opened under the job's `FileRule` (trainctl.spec.files): the source files and the tokenizer
(`documents`, `tokenizer`), a shard directory's index.json (read bounded) and every shard or mask it
names, which must be a file of the directory; a file the rule refuses is a `FileRuleError`, raised
before it is read.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, replace
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
from trainctl.parallelism.data.documents import source_files, token_stream
from trainctl.parallelism.data.holdout import HOLDOUT_FIELD, Holdout
from trainctl.parallelism.data.tokenizer import document_tokens, load_tokenizer
from trainctl.spec.data_format import TOKEN_SHARD_INDEX
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import DataSpec

FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 24


@dataclass(frozen=True)
class PrepareResult:
    """What `prepare_shards` wrote."""

    out_dir: Path
    files: int
    tokens: int
    shards: int
    masked: bool
    """Whether loss masks were written beside the tokens (chat data)."""


def _encode_file(args: tuple[str, str, FileRule]) -> np.ndarray:
    tokenizer_name, path, files = args
    try:
        data = files.check(path, "spec.data.paths").read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from exc
    return document_tokens(load_tokenizer(tokenizer_name, files), data)


def _encoded_text(paths: list[Path], tokenizer: str, workers: int, files: FileRule) -> Iterator[tuple[np.ndarray, None]]:
    """Text files tokenized in a process pool, results in file order (each opened under `files`)."""
    jobs = [(tokenizer, str(p), files) for p in paths]
    if workers <= 1:
        for job in jobs:
            yield _encode_file(job), None
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for tokens in pool.map(_encode_file, jobs, chunksize=max(1, len(jobs) // (8 * workers))):
            yield tokens, None


class ShardWriter:
    """Writes a token stream (and its loss mask) into shards of `shard_tokens` under `out`."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, masked: bool):
        self.out = out
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.masked = masked
        self.shards: list[dict[str, Any]] = []
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._buffered = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        """Append one document (mask None: every token counts)."""
        self._tokens.append(tokens)
        if self.masked:
            self._masks.append(np.ones(len(tokens), dtype=np.uint8) if mask is None else mask.astype(np.uint8))
        self._buffered += len(tokens)
        self._flush(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """Write what is buffered; the shard list for the index."""
        self._flush(final=True)
        return self.shards

    def _flush(self, final: bool) -> None:
        while self._buffered >= self.shard_tokens or (final and self._buffered):
            tokens = np.concatenate(self._tokens)
            n = min(self.shard_tokens, len(tokens))
            entry: dict[str, Any] = {"file": f"shard_{len(self.shards):05d}.bin", "tokens": int(n)}
            tokens[:n].astype(self.dtype).tofile(self.out / entry["file"])
            self._tokens = [tokens[n:]] if len(tokens) > n else []
            if self.masked:
                masks = np.concatenate(self._masks)
                entry["mask"] = f"mask_{len(self.shards):05d}.bin"
                masks[:n].tofile(self.out / entry["mask"])
                self._masks = [masks[n:]] if len(masks) > n else []
            self.shards.append(entry)
            self._buffered = len(tokens) - n


def prepare_shards(
    patterns: list[str],
    out_dir: str | Path,
    *,
    tokenizer: str = "byte",
    max_files: int | None = None,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: str = "text",
    text_field: str = "text",
    messages_field: str | None = None,
    files: FileRule = FileRule(),
    holdout: Holdout | None = None,
) -> PrepareResult:
    """Tokenize the documents of `patterns` under `format` (text: the files, sorted, at most
    `max_files`, tokenized by `workers` processes; jsonl / parquet / arrow: their records, streamed in
    this process) into shards under `out_dir`; chat records (`messages_field`) also write masks. Every
    source and tokenizer file is opened under `files`. With `holdout`, only the documents on its side
    are written (data.holdout)."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if format == "tokens":
        raise ValueError("token shards are prepared already")
    spec = DataSpec(
        paths=patterns, tokenizer=tokenizer, max_files=max_files, format=format, text_field=text_field,
        messages_field=messages_field,
    )
    paths = source_files(spec, files)
    tok = load_tokenizer(tokenizer, files)
    dtype = token_dtype(tok.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / TOKEN_SHARD_INDEX).exists():
        (out / TOKEN_SHARD_INDEX).unlink()  # the directory is not a valid dataset until the new index is written
    masked = messages_field is not None
    writer = ShardWriter(out, dtype, shard_tokens, masked)
    stream = _encoded_text(paths, tokenizer, workers, files) if format == "text" else token_stream(spec, tok, paths, files)
    documents = 0
    for document, (tokens, mask) in enumerate(stream):
        documents += 1
        if holdout is None or holdout.keeps(document):
            writer.add(tokens, mask)
    shards = writer.finish()
    if not shards and holdout is not None and documents:
        raise DataError(
            f"{HOLDOUT_FIELD}: none of the {documents} documents of spec.data.paths falls on the {holdout.side} side "
            f"of a {holdout.fraction} holdout; use more documents or another fraction"
        )
    if not shards:
        raise DataError(f"spec.data.paths: {patterns} hold no documents ({len(paths)} files read)")
    index = {
        "version": FORMAT_VERSION, "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "dtype": dtype.name,
        "masked": masked, "files": [str(p) for p in paths], "shards": shards,
    }
    tmp = out / f".{TOKEN_SHARD_INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / TOKEN_SHARD_INDEX)
    return PrepareResult(
        out_dir=out, files=len(paths), tokens=sum(s["tokens"] for s in shards), shards=len(shards), masked=masked
    )


class TokenShardDataset:
    """The packed samples of prepared shard directories, memory-mapped: `roots` in order (default:
    `spec.data.paths`), every file opened under `files`. Directories with masks (chat) make the dataset
    `masked`; unmasked ones then count every token."""

    def __init__(
        self, spec: DataSpec, vocab_size: int, roots: list[tuple[str, Path]] | None = None, files: FileRule = FileRule()
    ):
        if roots is None:
            roots = [(f"spec.data.paths[{i}]", Path(os.path.expanduser(raw))) for i, raw in enumerate(spec.paths)]
        self.maps: list[np.memmap] = []
        self.mask_maps: list[np.memmap | None] = []
        for field, root in roots:
            index_path = files.check(root / TOKEN_SHARD_INDEX, field)
            try:
                index = files.read_json(index_path, field)
            except FileRuleError as exc:  # missing, unreadable, too large or not JSON
                raise DataError(
                    f"{field}: {str(root)!r} is not a token-shard directory ({exc.message}); build it with `trainctl data prepare`"
                ) from None
            if not isinstance(index, dict):
                raise DataError(f"{field}: {str(root)!r} has a malformed {TOKEN_SHARD_INDEX} (not a JSON object)")
            if index.get("version") != FORMAT_VERSION:
                raise DataError(f"{field}: {str(root)!r} has index version {index.get('version')}, expected {FORMAT_VERSION}")
            if not isinstance(index.get("vocab_size"), int):
                raise DataError(f"{field}: {str(root)!r} has a malformed {TOKEN_SHARD_INDEX} (no integer vocab_size)")
            if index["vocab_size"] > vocab_size:
                raise DataError(
                    f"spec.model.vocab_size: {vocab_size} is smaller than the vocabulary the shards in {str(root)!r} were "
                    f"tokenized with ({index['vocab_size']})"
                )
            tokens, masks = _mapped_shards(root, index, field, files)
            self.maps.extend(tokens)
            self.mask_maps.extend(masks)
        self.masked = any(m is not None for m in self.mask_maps)
        """Whether some targets are left out of the loss (`sample_masks`)."""
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

    def _read(self, maps: list[np.memmap | None], start: int, length: int, dtype: type) -> np.ndarray:
        out = np.ones(length, dtype=dtype)  # a shard without a mask counts every token
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            lo = start + filled - int(self.starts[shard])
            n = min(length - filled, len(self.maps[shard]) - lo)
            mapped = maps[shard]
            if mapped is not None:
                out[filled : filled + n] = mapped[lo : lo + n]
            filled += n
            shard += 1
        return out

    def tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream (int64)."""
        return self._read(self.maps, start, length, np.int64)  # type: ignore[arg-type]

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples [start, start + count) as an int64 tensor [count, seq_len + 1]."""
        rows = [self.tokens(self.sample_id(i) * self.sample_len, self.sample_len) for i in range(start, start + count)]
        return torch.from_numpy(np.stack(rows))

    def sample_masks(self, start: int, count: int) -> torch.Tensor | None:
        """Loss masks of global samples [start, start + count) as a bool tensor [count, seq_len + 1]
        (True: the token is a target the loss covers); None when the dataset is not masked."""
        if not self.masked:
            return None
        rows = [
            self._read(self.mask_maps, self.sample_id(i) * self.sample_len, self.sample_len, np.uint8)
            for i in range(start, start + count)
        ]
        return torch.from_numpy(np.stack(rows)).bool()


def _mapped_shards(
    root: Path, index: dict[str, Any], field: str, files: FileRule
) -> tuple[list[np.memmap], list[np.memmap | None]]:
    """The shards `index` lists and their masks (None where absent), each a file of `root` obeying
    `files`, memory-mapped and checked against its recorded token count."""
    maps, masks = [], []
    source = str(root / TOKEN_SHARD_INDEX)
    try:
        dtype = np.dtype(index["dtype"])
        for shard in index["shards"]:
            token_file = files.member(root, shard["file"], field, source)
            mask_file = files.member(root, shard["mask"], field, source) if "mask" in shard else None
            mapped = np.memmap(token_file, dtype=dtype, mode="r")
            mask = np.memmap(mask_file, dtype=np.uint8, mode="r") if mask_file is not None else None
            for arr, name in ((mapped, shard["file"]), (mask, shard.get("mask"))):
                if arr is not None and len(arr) != shard["tokens"]:
                    raise DataError(f"{field}: {name} holds {len(arr)} entries, index says {shard['tokens']}")
            maps.append(mapped)
            masks.append(mask)
    except (DataError, FileRuleError):
        raise
    except (KeyError, TypeError) as exc:
        raise DataError(f"{field}: {str(root)!r} has a malformed {TOKEN_SHARD_INDEX}: {exc!r}") from exc
    except (OSError, ValueError) as exc:  # a shard missing, unreadable or empty
        raise DataError(f"{field}: cannot map a shard of {str(root)!r}: {exc}") from exc
    return maps, masks


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
            batch = [replace(m, inputs=m.inputs.pin_memory(), targets=m.targets.pin_memory()) for m in batch]
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
