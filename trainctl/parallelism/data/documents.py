"""Documents of every data format, streamed, and the token stream they make.

Readers (one per `spec.data.format`) yield `Record`s, one document each, never holding a whole file:

- `text`: each file (sorted glob matches, at most `max_files`) is one document (its bytes).
- `jsonl`: each non-blank line is a JSON object, read line by line.
- `parquet`: each row, read a record batch at a time (within row groups) of the one column needed.
- `arrow`: each row of a `datasets.Dataset.save_to_disk` directory: its Arrow stream files (listed in
  state.json) memory-mapped with pyarrow and read a record batch at a time.

A record's value is `text_field` (a string) or, for chat data, `messages_field` (a list of {role,
content} messages). `token_stream` turns records into (token ids, loss mask or None) per document:
text is `tokenizer.document_tokens` (its encoding, then EOS when the tokenizer has one); a
conversation is its chat-template rendering, its assistant mask (`chat.conversation_tokens`), then
EOS (mask 0) when the rendering does not already end with it. Bad input is a `DataError` naming the
spec field and the file and line / record.

Every file is opened under the job's `FileRule` (trainctl.spec.files): each glob match is checked when
the files are listed and again when it is opened; an Arrow directory's state.json is read bounded and
each stream file it names must be a file of the directory (`spec.data_sources.arrow_stream_files`, the
submit-time check's own reading). A file the rule refuses is a `FileRuleError`, raised before it is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainctl.parallelism.data.chat import check_messages, conversation_tokens
from trainctl.parallelism.data.corpus import DataError, data_files
from trainctl.parallelism.data.tokenizer import Tokenizer, TransformersTokenizer, document_tokens
from trainctl.spec.data_sources import arrow_stream_files
from trainctl.spec.files import FileRule
from trainctl.spec.job import DataSpec

RECORD_BATCH_ROWS = 1024
"""Rows read at a time from Parquet and Arrow (bounds memory to one batch of one column)."""


@dataclass(frozen=True)
class Record:
    """One document: its field value (text, or a list of messages) and where it came from."""

    value: Any
    where: str
    """File and line (JSONL) or record index (Parquet, Arrow), for errors."""


def record_field(spec: DataSpec) -> str:
    """The field (column) each record's document is read from."""
    return spec.messages_field or spec.text_field


def field_name(spec: DataSpec) -> str:
    """The spec field naming the record field, for errors."""
    return "spec.data.messages_field" if spec.messages_field else "spec.data.text_field"


def source_files(spec: DataSpec, files: FileRule = FileRule()) -> list[Path]:
    """The files the format reads, in stream order (Arrow: each directory's data files), each obeying `files`."""
    if spec.format == "arrow":
        paths: list[Path] = []
        for i, raw in enumerate(spec.paths):
            paths.extend(arrow_stream_files(Path(os.path.expanduser(raw)), f"spec.data.paths[{i}]", files))
        if not paths:
            raise DataError(f"spec.data.paths: {spec.paths} hold no Arrow files")
        return paths
    return data_files(spec, files)


def read_records(spec: DataSpec, paths: list[Path], files: FileRule = FileRule()) -> Iterator[Record]:
    """Every record of `paths` under `spec.format`, in order, streamed; each file is checked against
    `files` right before it is opened."""
    reader = {"text": _text_records, "jsonl": _jsonl_records, "parquet": _parquet_records, "arrow": _arrow_records}[spec.format]
    for path in paths:
        files.check(path, "spec.data.paths")
        yield from reader(path, spec)


def _text_records(path: Path, spec: DataSpec) -> Iterator[Record]:
    try:
        yield Record(path.read_bytes(), str(path))
    except OSError as exc:
        raise DataError(f"spec.data.paths: cannot read {path}: {exc.strerror}") from exc


def _jsonl_records(path: Path, spec: DataSpec) -> Iterator[Record]:
    key = record_field(spec)
    try:
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as exc:  # the decoder refuses nesting past the recursion limit
                    raise DataError(f"spec.data.paths: {where} is not JSON: {exc}") from exc
                if not isinstance(obj, dict) or key not in obj:
                    raise DataError(f"{field_name(spec)}: {where} has no field {key!r}")
                yield Record(obj[key], where)
    except OSError as exc:
        raise DataError(f"spec.data.paths: cannot read {path}: {exc.strerror}") from exc


def _column_batches(batches: Iterator[Any], schema_names: list[str], path: Path, spec: DataSpec) -> Iterator[Record]:
    key = record_field(spec)
    if key not in schema_names:
        raise DataError(f"{field_name(spec)}: {path} has no column {key!r} (columns: {', '.join(schema_names)})")
    row = 0
    for batch in batches:
        for value in batch.column(key).to_pylist():
            yield Record(value, f"{path} record {row}")
            row += 1


def _parquet_records(path: Path, spec: DataSpec) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path, memory_map=True)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"spec.data.paths: {path} is not a readable Parquet file: {exc}") from exc
    names = parquet.schema_arrow.names
    batches = parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=[record_field(spec)]) if record_field(spec) in names else iter(())
    yield from _column_batches(batches, names, path, spec)


def _arrow_records(path: Path, spec: DataSpec) -> Iterator[Record]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
    except (OSError, ValueError) as exc:
        raise DataError(f"spec.data.paths: {path} is not a readable Arrow stream file: {exc}") from exc
    yield from _column_batches(iter(reader), reader.schema.names, path, spec)


def token_stream(
    spec: DataSpec, tokenizer: Tokenizer, paths: list[Path], files: FileRule = FileRule()
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """(token ids, loss mask) of every document of `paths` (opened under `files`); the mask is None for
    text (all tokens count)."""
    chat = spec.messages_field is not None
    if chat and not isinstance(tokenizer, TransformersTokenizer):
        raise DataError(
            "spec.data.messages_field: chat records are rendered with the model's chat template, which needs a Hugging "
            "Face tokenizer directory in spec.data.tokenizer (or the from_pretrained model's)"
        )
    for record in read_records(spec, paths, files):
        if chat:
            yield _conversation(tokenizer, record)
        else:
            yield document_tokens(tokenizer, _text_bytes(record, spec)), None


def _text_bytes(record: Record, spec: DataSpec) -> bytes:
    if isinstance(record.value, bytes):
        return record.value
    if not isinstance(record.value, str):
        raise DataError(f"spec.data.text_field: {record.where}: field {spec.text_field!r} is {type(record.value).__name__}, not text")
    return record.value.encode()


def _conversation(tokenizer: TransformersTokenizer, record: Record) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = conversation_tokens(tokenizer.hf, check_messages(record.value, record.where), record.where)
    if tokenizer.eos_id is not None and (len(ids) == 0 or ids[-1] != tokenizer.eos_id):
        ids = np.append(ids, np.int64(tokenizer.eos_id))
        mask = np.append(mask, np.uint8(0))
    return ids, mask
