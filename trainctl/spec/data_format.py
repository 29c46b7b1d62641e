"""The formats a job's data may come in (`spec.data.format`), apart from the spec models so that the
CLI's parser can offer them without loading pydantic."""

from __future__ import annotations

from typing import Literal

DataFormat = Literal["text", "tokens", "jsonl", "parquet", "arrow"]

HOLDOUT_FORMATS: tuple[DataFormat, ...] = ("text", "jsonl", "parquet", "arrow")
"""Formats whose documents `spec.evaluation.holdout_fraction` can hold out: every one but `tokens`,
whose prepared shards keep no document boundaries."""

TOKEN_SHARD_INDEX = "index.json"
"""The index file of a token-shard directory (`format: tokens`): written by
trainctl.parallelism.data.token_shards, checked by spec validation."""
