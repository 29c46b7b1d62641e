"""Training data: files from the spec, tokenized, packed into fixed-length samples, in seeded order.

The corpus is the sorted list of files matched by `spec.data.paths` (at most `max_files`), each
tokenized and concatenated, then cut into non-overlapping samples of `seq_len + 1` tokens (inputs are
the first `seq_len`, targets the last `seq_len`). Epoch `e` visits samples in the order
`randperm(n_samples)` drawn from a generator seeded by (seed, e) (`SampleOrder`, which the token-shard
format shares).

The loader's position is a GLOBAL SAMPLE OFFSET: global batch `t` is global samples
`[t * global_batch_size, (t + 1) * global_batch_size)`, and data-parallel rank `r` of `dp` takes the
contiguous slice `[r * B / dp, (r + 1) * B / dp)` of it. The offset does not depend on the layout, so a
checkpoint taken under one layout resumes under any other. Context- and tensor-parallel peers (same
dp coordinate) read the same samples.

Loss masks. A masked dataset (chat data: only the assistant's tokens are trained on) also gives a
mask per sample token; the loader sets the targets the loss leaves out to `IGNORE_INDEX` and gives
every micro-batch `loss_tokens`, the number of targets the loss covers in the WHOLE global batch
(computed from the batch's masks on every rank, no collective), which the engine divides the summed
token losses by. Unmasked datasets give `loss_tokens = None` and the engine's per-micro-batch mean.

Every file a glob of `spec.data.paths` matches is checked against the job's `FileRule`
(trainctl.spec.files) before it is read (`data_files`); `@stdlib`, the built-in corpus, is the service's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainctl.parallelism.data.holdout import HOLDOUT_FIELD, Holdout
from trainctl.parallelism.data.tokenizer import Tokenizer, document_tokens, load_tokenizer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.data_checks import resolve_data_paths
from trainctl.spec.files import FileRule
from trainctl.spec.job import STDLIB_CORPUS, DataSpec, resolve_tokenizer

IGNORE_INDEX = -100
"""Target id of a position the loss leaves out (PyTorch's and transformers' convention)."""


class DataError(ConfigurationError):
    """The data the spec names cannot be used (names the spec field)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """How token ids are stored (packed samples in memory, token shards on disk): uint16 when the
    vocabulary fits, else int32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def data_files(spec: DataSpec, files: FileRule) -> list[Path]:
    """The files `spec.data.paths` match, sorted, at most `max_files`, each obeying `files` (the
    built-in corpus's files excepted); DataError when there are none."""
    matched = resolve_data_paths(spec.paths)
    if spec.max_files is not None:
        matched = matched[: spec.max_files]
    if not matched:
        raise DataError(f"spec.data.paths: {spec.paths} match no files")
    builtin = set(resolve_data_paths([STDLIB_CORPUS])) if STDLIB_CORPUS in spec.paths else set()
    return [path if path in builtin else files.check(path, "spec.data.paths") for path in matched]


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SampleOrder:
    """The seeded order of the sample stream, shared by every dataset format.

    Epoch `e` visits the `n_samples` packed samples in the order `randperm(n_samples)` of a generator
    seeded by a hash of (seed, e); `sample_id(i)` is the packed sample the i-th global sample is.
    """

    def __init__(self, seed: int, n_samples: int):
        self.seed = seed
        self.n_samples = n_samples
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def sample_id(self, global_index: int) -> int:
        """Which packed sample the `global_index`-th sample of the seeded stream is."""
        epoch, within = divmod(global_index, self.n_samples)
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.n_samples, generator=generator)
            self._perm_epoch = epoch
        return int(self._perm[within])


class PackedDataset:
    """Token stream of the spec's files (one document each), packed into samples of `seq_len + 1` tokens;
    with `holdout`, only the files on its side (data.holdout)."""

    masked = False
    """Every target counts (text has no loss mask)."""

    def __init__(
        self, spec: DataSpec, vocab_size: int, tokenizer: Tokenizer | None = None, files: FileRule = FileRule(),
        holdout: Holdout | None = None,
    ):
        tokenizer = tokenizer or load_tokenizer(resolve_tokenizer(spec, None), files)
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"spec.model.vocab_size: {vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})"
            )
        paths = data_files(spec, files)
        if holdout is not None:  # each file is one document
            kept = [path for i, path in enumerate(paths) if holdout.keeps(i)]
            if not kept:
                raise DataError(
                    f"{HOLDOUT_FIELD}: none of the {len(paths)} documents (files) of spec.data.paths falls on the "
                    f"{holdout.side} side of a {holdout.fraction} holdout; use more documents or another fraction"
                )
            paths = kept
        chunks = []
        for path in paths:
            try:
                chunks.append(document_tokens(tokenizer, path.read_bytes()))
            except OSError as exc:
                raise DataError(f"spec.data.paths: cannot read {path}: {exc.strerror}") from exc
        tokens = np.concatenate(chunks)
        self.sample_len = spec.seq_len + 1
        self.n_samples = len(tokens) // self.sample_len
        if self.n_samples == 0:
            raise DataError(
                f"spec.data.paths: the {len(paths)} files hold {len(tokens)} tokens, fewer than one sample of "
                f"seq_len + 1 = {self.sample_len}"
            )
        self.tokens = tokens[: self.n_samples * self.sample_len].astype(token_dtype(vocab_size)).reshape(
            self.n_samples, self.sample_len
        )
        self.n_files = len(paths)
        self.order = SampleOrder(spec.seed, self.n_samples)

    def sample_id(self, global_index: int) -> int:
        """Which packed sample the `global_index`-th sample of the seeded stream is."""
        return self.order.sample_id(global_index)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples [start, start + count) as an int64 tensor [count, seq_len + 1]."""
        ids = [self.sample_id(i) for i in range(start, start + count)]
        return torch.from_numpy(self.tokens[ids].astype(np.int64))

    def sample_masks(self, start: int, count: int) -> None:
        """No loss masks (see `TokenShardDataset.sample_masks`)."""
        return None


@dataclass(frozen=True)
class MicroBatch:
    """Inputs and next-token targets, both [micro_batch_size, seq_len] int64 (targets the loss leaves
    out are IGNORE_INDEX)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    loss_tokens: int | None = None
    """Targets the loss covers in the whole global batch this micro-batch belongs to; None when the
    data has no mask (every target counts, and the loss is the per-micro-batch mean)."""


class ShardedLoader:
    """This data-parallel rank's share of each global batch, split into micro-batches."""

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        offset: int = 0,
    ):
        per_rank, rem = divmod(global_batch_size, dp_size)
        if rem or per_rank % micro_batch_size:
            raise DataError(
                f"spec.training.global_batch_size: {global_batch_size} must split into dp = {dp_size} ranks x "
                f"whole micro-batches of {micro_batch_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp = {dp_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.dp_rank = dp_rank
        self.offset = offset
        """Global sample offset of the next batch (the resumable data position)."""

    @property
    def n_micro(self) -> int:
        """Micro-batches per step on this rank."""
        return self.per_rank // self.micro_batch_size

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch; advances the offset by one global batch."""
        start = self.offset + self.dp_rank * self.per_rank
        samples = self.dataset.samples(start, self.per_rank)
        targets = samples[:, 1:]
        loss_tokens = None
        if self.dataset.masked:
            targets = targets.masked_fill(~self.dataset.sample_masks(start, self.per_rank)[:, 1:], IGNORE_INDEX)
            loss_tokens = int(self.dataset.sample_masks(self.offset, self.global_batch_size)[:, 1:].sum())
        self.offset += self.global_batch_size
        return [
            MicroBatch(inputs=x[:, :-1].contiguous(), targets=y.contiguous(), loss_tokens=loss_tokens)
            for x, y in zip(samples.split(self.micro_batch_size), targets.split(self.micro_batch_size), strict=True)
        ]
