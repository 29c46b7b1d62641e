"""Submit-time checks of record data (`data.format` jsonl, parquet, arrow), cheap ones only.

What is read: the first non-blank line of the first JSONL file (is it a JSON object with the field?),
each Parquet file's footer (schema and row count, no data pages), each Arrow directory's state.json
and the schema at the head of its first stream file. Everything else (later lines, empty records,
chat roles) fails the job's ranks with a ConfigurationError naming file and line / record. pyarrow is
imported only for Parquet and Arrow; without it those checks are left to the ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from trainctl.spec.job import DataSpec

ARROW_STATE = "state.json"


def record_field(data: DataSpec) -> tuple[str, str]:
    """(spec field, record field) each record's document is read from."""
    if data.messages_field:
        return "spec.data.messages_field", data.messages_field
    return "spec.data.text_field", data.text_field


def jsonl_problem(files: list[Path], data: DataSpec) -> tuple[str, str] | None:
    """(spec field, problem) of the first JSONL record, None when it is fine."""
    field, key = record_field(data)
    for path in files:
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    return "spec.data.paths", f"{path} line {number} is not JSON: {exc}"
                if not isinstance(obj, dict) or key not in obj:
                    return field, f"{path} line {number} has no field {key!r}"
                return None
    return "spec.data.paths", f"the {len(files)} JSONL files hold no records"


def parquet_problem(files: list[Path], data: DataSpec) -> tuple[str, str] | None:
    """(spec field, problem) from the Parquet footers: the column exists, some rows exist."""
    if importlib.util.find_spec("pyarrow") is None:
        return None
    import pyarrow.parquet as pq

    field, key = record_field(data)
    rows = 0
    for path in files:
        try:
            meta = pq.read_metadata(path)
        except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError
            return "spec.data.paths", f"{path} is not a readable Parquet file: {exc}"
        names = meta.schema.to_arrow_schema().names
        if key not in names:
            return field, f"{path} has no column {key!r} (columns: {', '.join(names)})"
        rows += meta.num_rows
    return None if rows else ("spec.data.paths", f"the {len(files)} Parquet files hold no rows")


def arrow_problems(data: DataSpec) -> list[tuple[str, str]]:
    """(spec field, problem) of each Arrow directory: a save_to_disk state.json, the column in the
    first file's schema."""
    out: list[tuple[str, str]] = []
    field, key = record_field(data)
    for i, raw in enumerate(data.paths):
        directory = Path(os.path.expanduser(raw))
        try:
            names = [entry["filename"] for entry in json.loads((directory / ARROW_STATE).read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            out.append((f"spec.data.paths[{i}]", f"{raw!r} is not a directory written by datasets' save_to_disk (no readable {ARROW_STATE})"))
            continue
        if not names or importlib.util.find_spec("pyarrow") is None:
            continue
        import pyarrow as pa

        first = directory / str(names[0])
        try:
            schema = pa.ipc.open_stream(pa.memory_map(str(first), "r")).schema
        except (OSError, ValueError) as exc:
            out.append((f"spec.data.paths[{i}]", f"{first} is not a readable Arrow stream file: {exc}"))
            continue
        if key not in schema.names:
            out.append((field, f"{first} has no column {key!r} (columns: {', '.join(schema.names)})"))
    return out
