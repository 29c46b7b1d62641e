"""Submit-time checks of record data (jsonl, parquet, arrow) and chat specs: each bad input answers a
violation naming the spec field and the file, without reading more than a line, a footer or a schema."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainctl.spec.data_checks import data_violations
from trainctl.spec.job import DataSpec, resolve_tokenizer


def violations(**data) -> dict[str, str]:
    return {v.field: v.description for v in data_violations(DataSpec(**data))}


def jsonl(path: Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_good_record_data_passes(tmp_path: Path) -> None:
    assert violations(paths=[jsonl(tmp_path / "a.jsonl", "", json.dumps({"text": "x"}))], format="jsonl") == {}
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "a.parquet")
    assert violations(paths=[str(tmp_path / "a.parquet")], format="parquet") == {}


def test_first_jsonl_line_not_json_names_file_and_line(tmp_path: Path) -> None:
    got = violations(paths=[jsonl(tmp_path / "a.jsonl", "", "{not json")], format="jsonl")
    assert "a.jsonl line 2 is not valid JSON" in got["spec.data.paths"]


def test_missing_field_names_it_and_the_file(tmp_path: Path) -> None:
    got = violations(paths=[jsonl(tmp_path / "a.jsonl", json.dumps({"body": "x"}))], format="jsonl", text_field="content")
    assert got == {"spec.data.text_field": f"{tmp_path / 'a.jsonl'} line 1 has no field 'content'"}
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    got = violations(paths=[str(tmp_path / "a.parquet")], format="parquet", text_field="content")
    assert "a.parquet has no column 'content' (columns: text)" in got["spec.data.text_field"]


def test_empty_data_is_refused(tmp_path: Path) -> None:
    assert "hold no records" in violations(paths=[jsonl(tmp_path / "a.jsonl", "")], format="jsonl")["spec.data.paths"]
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "a.parquet")
    assert "hold no rows" in violations(paths=[str(tmp_path / "a.parquet")], format="parquet")["spec.data.paths"]


def test_missing_files_and_arrow_directories(tmp_path: Path) -> None:
    assert "matches no files" in violations(paths=[str(tmp_path / "*.jsonl")], format="jsonl")["spec.data.paths[0]"]
    got = violations(paths=[str(tmp_path)], format="arrow")
    assert "save_to_disk" in got["spec.data.paths[0]"]


def test_arrow_schema_is_checked(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_list([{"text": "a"}, {"text": "b"}]).save_to_disk(str(tmp_path / "ds"))
    assert violations(paths=[str(tmp_path / "ds")], format="arrow") == {}
    got = violations(paths=[str(tmp_path / "ds")], format="arrow", text_field="body")
    assert "has no column 'body'" in got["spec.data.text_field"]


@pytest.mark.parametrize("tokenizer", ["byte", "auto"])
def test_chat_needs_a_tokenizer_directory(tmp_path: Path, tokenizer: str) -> None:
    path = jsonl(tmp_path / "a.jsonl", json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    got = violations(paths=[path], format="jsonl", messages_field="messages", tokenizer=tokenizer)
    assert "tokenizer directory" in got["spec.data.messages_field"]


def test_chat_needs_a_record_format(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 1000)
    got = violations(paths=[str(tmp_path / "a.txt")], messages_field="messages", tokenizer=str(tmp_path))
    assert "jsonl, parquet or arrow" in got["spec.data.messages_field"]


def test_missing_tokenizer_directory(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "a.jsonl", json.dumps({"text": "x"}))
    assert "does not exist" in violations(paths=[path], format="jsonl", tokenizer=str(tmp_path / "nope"))["spec.data.tokenizer"]


def test_tokenizer_auto_resolves_to_the_model_directory_else_byte() -> None:
    assert resolve_tokenizer(DataSpec(), None) == "byte"
    assert resolve_tokenizer(DataSpec(), "/models/llama") == "/models/llama"
    assert resolve_tokenizer(DataSpec(tokenizer="byte"), "/models/llama") == "byte"
    assert resolve_tokenizer(DataSpec(tokenizer="/tok.json"), None) == "/tok.json"
