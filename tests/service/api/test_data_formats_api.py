"""CreateJob answers INVALID_ARGUMENT for input that is bad at submit time (the first JSONL line, a
Parquet file's missing column, an empty dataset, a model directory without config.json, an
unsupported architecture), naming the spec field and the file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from control_plane_fakes import ApiServer, ScriptedRuntime, start_api_server
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.wire.convert import job_to_proto
from trainctl.wire.errors import field_violations


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TrainctlClient]:
    server: ApiServer = start_api_server(tmp_path / "service", ScriptedRuntime())
    try:
        with TrainctlClient(server.target, token="") as c:
            yield c
    finally:
        server.stop()


def test_a_first_jsonl_line_that_is_not_json_is_invalid_argument(client: TrainctlClient, tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("{oops\n")
    job = small_job("bad-jsonl", data={"paths": [str(tmp_path / "a.jsonl")], "format": "jsonl"})
    with pytest.raises(grpc.RpcError) as info:
        client.create_job(job_to_proto(job))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(info.value)] == ["spec.data.paths"]
    assert "a.jsonl line 1 is not valid JSON" in info.value.details()


def test_a_parquet_file_without_the_column_is_invalid_argument(client: TrainctlClient, tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    job = small_job("bad-parquet", data={"paths": [str(tmp_path / "a.parquet")], "format": "parquet"})
    with pytest.raises(grpc.RpcError) as info:
        client.create_job(job_to_proto(job))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(info.value)] == ["spec.data.text_field"]


def _invalid_argument(client: TrainctlClient, job) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        client.create_job(job_to_proto(job))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_a_model_directory_without_config_json_is_invalid_argument(client: TrainctlClient, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    error = _invalid_argument(client, small_job("no-config", model={"from_pretrained": str(tmp_path / "model")},
                                                data={"tokenizer": "byte"}))
    assert [v.field for v in field_violations(error)] == ["spec.model.from_pretrained"]
    assert "holds no config.json" in error.details()


def test_an_unsupported_architecture_is_invalid_argument(client: TrainctlClient, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    error = _invalid_argument(client, small_job("gpt2", model={"from_pretrained": str(tmp_path / "model")},
                                                data={"tokenizer": "byte"}))
    assert [v.field for v in field_violations(error)] == ["spec.model.from_pretrained"]
    assert "model_type 'gpt2' is not supported" in error.details()


def test_an_empty_dataset_is_invalid_argument(client: TrainctlClient, tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n\n")
    error = _invalid_argument(client, small_job("empty", data={"paths": [str(tmp_path / "a.jsonl")], "format": "jsonl"}))
    assert [v.field for v in field_violations(error)] == ["spec.data.paths"]
    assert "hold no records" in error.details()
    assert list(client.list_jobs()) == []  # nothing was created; the service still answers
