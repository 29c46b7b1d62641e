"""Submit-time checks of record data (`data.format` jsonl, parquet, arrow), cheap and bounded ones only.

What is read, every file through the job's `FileRule` (trainctl.spec.files: where it may lie, how much
of it is read): the first non-blank line of the first JSONL files (at most `MAX_LINE_BYTES`, depth
bounded: is it a JSON object with the field?), each Parquet file's footer (schema and row count, no
data pages; its length, from the file's last 8 bytes, at most `MAX_PARQUET_FOOTER_BYTES`), each Arrow
directory's state.json (each file it names must stay in the directory) and the schema at the head of
its first stream file (at most `MAX_ARROW_SCHEMA_BYTES`). Everything else (later lines, empty records,
chat roles) fails the job's ranks with a ConfigurationError naming file and line / record. pyarrow is
imported only for Parquet and Arrow.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from trainctl.spec.files import MAX_RECORD_TOKENS, FileRule, FileRuleError, loads_bounded
from trainctl.spec.job import DataSpec

ARROW_STATE = "state.json"
PARQUET_MAGIC = b"PAR1"
MAX_PARQUET_FOOTER_BYTES = 16 << 20
"""Largest Parquet footer (file metadata) read at submit; a real one is KiBs, a wide many-row-group one MiBs."""
ARROW_CONTINUATION = b"\xff\xff\xff\xff"
MAX_ARROW_SCHEMA_BYTES = 16 << 20
"""Largest schema message at the head of an Arrow stream file read at submit."""


def record_field(data: DataSpec) -> tuple[str, str]:
    """(spec field, record field) each record's document is read from."""
    if data.messages_field:
        return "spec.data.messages_field", data.messages_field
    return "spec.data.text_field", data.text_field


def jsonl_problem(paths: list[Path], data: DataSpec, files: FileRule = FileRule()) -> tuple[str, str] | None:
    """(spec field, problem) of the first JSONL record, None when it is fine."""
    field, key = record_field(data)
    for path in paths:
        try:
            first = files.first_line(path, "spec.data.paths")
            if first is None:
                continue
            number, line = first
            record = loads_bounded(line, f"{path} line {number}", "spec.data.paths", MAX_RECORD_TOKENS)
        except FileRuleError as exc:
            return exc.field, exc.message
        if not isinstance(record, dict) or key not in record:
            return field, f"{path} line {number} has no field {key!r}"
        return None
    return "spec.data.paths", f"the {len(paths)} JSONL files hold no records"


def parquet_footer_problem(path: Path, files: FileRule) -> str | None:
    """Why `path` has no Parquet footer pyarrow may read (None: it has one): the rule refuses the file,
    it does not end in the Parquet magic, or its footer is longer than MAX_PARQUET_FOOTER_BYTES or the file."""
    try:
        checked = files.check(path, "spec.data.paths")
        with open(checked, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(size - 8, 0))
            tail = handle.read(8)
    except FileRuleError as exc:
        return exc.message
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if len(tail) < 8 or tail[4:] != PARQUET_MAGIC:
        return f"{path} is not a Parquet file (it does not end in {PARQUET_MAGIC.decode()})"
    (footer,) = struct.unpack("<I", tail[:4])
    if footer > MAX_PARQUET_FOOTER_BYTES:
        return f"{path} has a {footer}-byte footer, more than the {MAX_PARQUET_FOOTER_BYTES} trainctl reads at submit"
    if footer + 12 > size:
        return f"{path} is not a readable Parquet file: its footer length {footer} exceeds the file"
    return None


def parquet_problem(paths: list[Path], data: DataSpec, files: FileRule = FileRule()) -> tuple[str, str] | None:
    """(spec field, problem) from the Parquet footers: the column exists, some rows exist."""
    import pyarrow.parquet as pq

    field, key = record_field(data)
    rows = 0
    for path in paths:
        problem = parquet_footer_problem(path, files)
        if problem:
            return "spec.data.paths", problem
        try:
            meta = pq.read_metadata(path)
        except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError
            return "spec.data.paths", f"{path} is not a readable Parquet file: {exc}"
        names = meta.schema.to_arrow_schema().names
        if key not in names:
            return field, f"{path} has no column {key!r} (columns: {', '.join(names)})"
        rows += meta.num_rows
    return None if rows else ("spec.data.paths", f"the {len(paths)} Parquet files hold no rows")


def arrow_stream_files(directory: Path, field: str, files: FileRule) -> list[Path]:
    """The stream files of a save_to_disk directory, from its state.json (`_data_files[].filename`, each
    a file of the directory under the rule); FileRuleError when there is no such state.json."""
    state_path = files.check(directory / ARROW_STATE, field)
    if not state_path.is_file():
        raise FileRuleError(field, f"{str(directory)!r} is not a directory written by datasets' save_to_disk (no {ARROW_STATE})")
    state = files.read_json(state_path, field)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) and "filename" in entry for entry in entries):
        raise FileRuleError(field, f"{state_path} is not a save_to_disk state (no _data_files list of filenames)")
    return [files.member(directory, entry["filename"], field, str(state_path)) for entry in entries]


def arrow_schema_problem(path: Path, field: str, files: FileRule) -> str | None:
    """Why the stream file `path` opens with no schema message pyarrow may read (None: it does): the
    rule refuses it, or its first message is longer than MAX_ARROW_SCHEMA_BYTES."""
    try:
        with open(files.check(path, field), "rb") as handle:
            head = handle.read(8)
    except FileRuleError as exc:
        return exc.message
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    prefix = head[4:8] if head[:4] == ARROW_CONTINUATION else head[:4]
    if len(prefix) == 4 and struct.unpack("<i", prefix)[0] > MAX_ARROW_SCHEMA_BYTES:
        return f"{path} starts with a message longer than the {MAX_ARROW_SCHEMA_BYTES} bytes trainctl reads at submit"
    return None


def arrow_problems(data: DataSpec, files: FileRule = FileRule()) -> list[tuple[str, str]]:
    """(spec field, problem) of each Arrow directory: a save_to_disk state.json naming files of the
    directory, the column in the first file's schema."""
    out: list[tuple[str, str]] = []
    field, key = record_field(data)
    for i, raw in enumerate(data.paths):
        where = f"spec.data.paths[{i}]"
        try:
            names = arrow_stream_files(Path(os.path.expanduser(raw)), where, files)
        except FileRuleError as exc:
            out.append((exc.field, exc.message))
            continue
        if not names:
            continue
        import pyarrow as pa

        first = names[0]
        problem = arrow_schema_problem(first, where, files)
        if problem:
            out.append((where, problem))
            continue
        try:
            with pa.memory_map(str(first), "r") as source:
                schema = pa.ipc.open_stream(source).schema
        except (OSError, ValueError) as exc:
            out.append((where, f"{first} is not a readable Arrow stream file: {exc}"))
            continue
        if key not in schema.names:
            out.append((field, f"{first} has no column {key!r} (columns: {', '.join(schema.names)})"))
    return out
