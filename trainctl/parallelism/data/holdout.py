"""Held-out documents (`spec.evaluation.holdout_fraction`): which documents evaluate and which train.

A document is held out when a hash of (the data's seed, its index in the document stream) falls below
the fraction: `holdout_fraction` of the documents in expectation, chosen by document and never by
sample, so no token of an evaluated document is ever trained on. The document index is its position
in the format's document stream (`documents.read_records`): for `text` the sorted file list, for
`jsonl` / `parquet` / `arrow` the records of the files in order. The training dataset keeps the other
documents and the evaluation dataset exactly the held-out ones; both are packed and ordered as any
dataset is. Prepared token shards (`format: tokens`) keep no document boundaries, so they cannot be
split this way (`spec.data_format.HOLDOUT_FORMATS`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

HOLDOUT_FIELD = "spec.evaluation.holdout_fraction"


def held_out(seed: int, document: int, fraction: float) -> bool:
    """Whether document `document` of a dataset seeded `seed` is held out for evaluation."""
    digest = hashlib.sha256(f"holdout:{seed}:{document}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


@dataclass(frozen=True)
class Holdout:
    """One side of a held-out split: the evaluation documents (`evaluation` True) or the training ones."""

    fraction: float
    seed: int
    evaluation: bool

    def keeps(self, document: int) -> bool:
        """Whether this side's dataset holds document `document`."""
        return held_out(self.seed, document, self.fraction) == self.evaluation

    @property
    def side(self) -> str:
        """The side in words, for errors and the data cache's key."""
        return "held-out" if self.evaluation else "training"
