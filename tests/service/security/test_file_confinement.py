"""Every file the service opens for a CreateJob or PlanJob lies where the job's FileRule allows (issue 32):
two tenants, authentication and one data root (which also holds the service's data directory, so run
directories lie under it). Bob names directories inside the root whose *content* escapes it: a symlinked
config.json, weights or tokenizer file, a safetensors index, Arrow state.json or token-shard index naming
a file by an absolute path, by `..` or through a symlink, and links into Alice's run directory. Each is
refused with INVALID_ARGUMENT naming the spec field, the file and the rule, and no answer carries the
secret written in the files it points at; the same directories without the escape are accepted. Hostile
content inside the root (JSON nested 50,000 deep, a first JSONL record longer than the bound, a Parquet
footer claiming 2 GiB, a model directory without weights) is refused the same way. On SQLite and on
PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from data_sources import build_tokenizer, write_arrow
from secure_service import SecureService, Tokens, bearer, start_service, stub, write_access_file
from small_jobs import small_job

from trainctl.spec.files import MAX_LINE_BYTES
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_to_proto
from trainctl.wire.errors import field_violations

SECRET = "SECRET-VALUE-FROM-OUTSIDE"
DEEP = "[" * 50_000 + "]" * 50_000
SHARD_TOKENS = 4096


@dataclass(frozen=True)
class Tree:
    """The data root with intact directories of every kind, and a directory outside it holding secrets."""

    root: Path
    outside: Path
    model: Path  # a tiny Llama saved by transformers (config.json, model.safetensors) with tokenizer files
    tokenizer: Path
    arrow: Path
    shards: Path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return write_access_file(tmp_path_factory.mktemp("access"))


def write_secrets(outside: Path) -> None:
    """Files outside the root, each holding SECRET where a reader would echo it."""
    import pyarrow as pa

    (outside / "config.json").write_text(json.dumps({"model_type": SECRET, "architectures": [SECRET]}))
    (outside / "model.safetensors").write_text(SECRET)
    (outside / "tokenizer_config.json").write_text(json.dumps({"chat_template": SECRET}))
    (outside / "tokenizer.json").write_text(SECRET)
    (outside / "shard.bin").write_text(SECRET)
    table = pa.table({SECRET: ["x"]})
    with pa.OSFile(str(outside / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    import transformers

    root, outside = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("outside")
    write_secrets(outside)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = root / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(str(model))
    build_tokenizer(model)
    tokenizer = build_tokenizer(root / "tokenizer")
    arrow = write_arrow(root / "arrow", [{"text": "the model trains on text " * 20} for _ in range(8)])
    shards = root / "shards"
    shards.mkdir()
    (shards / "shard_00000.bin").write_bytes(bytes(2 * SHARD_TOKENS))  # uint16 tokens
    (shards / "index.json").write_text(json.dumps({
        "version": 1, "tokenizer": "byte", "vocab_size": 256, "dtype": "uint16", "masked": False, "files": [],
        "shards": [{"file": "shard_00000.bin", "tokens": SHARD_TOKENS}],
    }))
    return Tree(root, outside, model, tokenizer, arrow, shards)


@pytest.fixture
def service(tree: Tree, tokens: Tokens, store_location: str, tmp_path: Path) -> Iterator[SecureService]:
    data_dir = tree.root / "services" / tmp_path.name
    data_dir.mkdir(parents=True)
    svc = start_service(data_dir, tokens.path, data_roots=[tree.root], store_location=store_location)
    yield svc
    svc.stop()


# ---- the directories: an intact copy with one thing changed -----------------------------------------------


def copy_of(source: Path, target: Path, change: Callable[[Path], None]) -> str:
    """`target`: a copy of the directory `source` changed by `change(target)` (made once)."""
    if not target.exists():
        shutil.copytree(source, target, symlinks=True)
        change(target)
    return str(target)


def link(name: str, to: Path) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to(to)
    return change


def weight_map(entry: Callable[[Path], str]) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": entry(directory)}}))
    return change


def arrow_files(entry: Callable[[Path], str]) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        state = json.loads((directory / "state.json").read_text())
        state["_data_files"] = [{"filename": entry(directory)}]
        (directory / "state.json").write_text(json.dumps(state))
    return change


def shard_files(entry: Callable[[Path], str]) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        index = json.loads((directory / "index.json").read_text())
        index["shards"] = [{"file": entry(directory), "tokens": SHARD_TOKENS}]
        (directory / "index.json").write_text(json.dumps(index))
    return change


def climbing(target: Path) -> Callable[[Path], str]:
    return lambda directory: os.path.relpath(target, directory)


def model_job(name: str, directory: str, tokenizer: str = "byte"):
    return small_job(name, model={"from_pretrained": directory}, data={"tokenizer": tokenizer})


def tokenizer_job(name: str, directory: str):
    return small_job(name, data={"tokenizer": directory})


def arrow_job(name: str, directory: str):
    return small_job(name, data={"format": "arrow", "paths": [directory]})


def shard_job(name: str, directory: str):
    return small_job(name, data={"format": "tokens", "paths": [directory]})


def escapes(tree: Tree, service: SecureService, alices_run: Path) -> list[tuple[str, object, str, str]]:
    """(what, job, the field its refusal names, the rule the refusal states)."""
    out, model, tok, arrow, shards = tree.outside, tree.model, tree.tokenizer, tree.arrow, tree.shards
    at, here = tree.root / "escapes", service.data_dir / "escapes"  # `here`: links into this service's run directories
    roots = "outside the data roots"
    link_out = "resolves outside its directory through a symlink"
    foreign = "run directory of a job that is not this job's tenant's"
    stream = json.loads((arrow / "state.json").read_text())["_data_files"][0]["filename"]
    outside_weights = out / "model.safetensors"
    return [
        ("config.json symlinked out", model_job("a", copy_of(model, at / "config", link("config.json", out / "config.json"))),
         "spec.model.from_pretrained", roots),
        ("weights symlinked out", model_job("b", copy_of(model, at / "weights", link("model.safetensors", outside_weights))),
         "spec.model.from_pretrained", roots),
        ("weight_map entry absolute", model_job("c", copy_of(model, at / "wm-abs", weight_map(lambda _d: str(outside_weights)))),
         "spec.model.from_pretrained", "an absolute path"),
        ("weight_map entry ../..", model_job("d", copy_of(model, at / "wm-up", weight_map(climbing(outside_weights)))),
         "spec.model.from_pretrained", "climbs out of its directory"),
        ("tokenizer_config.json symlinked out",
         tokenizer_job("e", copy_of(tok, at / "tok-config", link("tokenizer_config.json", out / "tokenizer_config.json"))),
         "spec.data.tokenizer", roots),
        ("tokenizer.json symlinked out",
         tokenizer_job("f", copy_of(tok, at / "tok-json", link("tokenizer.json", out / "tokenizer.json"))),
         "spec.data.tokenizer", roots),
        ("tokenizer auto: the model's tokenizer_config.json symlinked out",
         model_job("g", copy_of(model, at / "auto-tok", link("tokenizer_config.json", out / "tokenizer_config.json")), "auto"),
         "spec.data.tokenizer", roots),
        ("Arrow state.json filename absolute",
         arrow_job("h", copy_of(arrow, at / "arrow-abs", arrow_files(lambda _d: str(out / "data.arrow")))),
         "spec.data.paths[0]", "an absolute path"),
        ("Arrow state.json filename ../..", arrow_job("i", copy_of(arrow, at / "arrow-up", arrow_files(climbing(out / "data.arrow")))),
         "spec.data.paths[0]", "climbs out of its directory"),
        ("Arrow stream file symlinked out", arrow_job("j", copy_of(arrow, at / "arrow-link", link(stream, out / "data.arrow"))),
         "spec.data.paths[0]", link_out),
        ("token-shard index naming a shard by ../..",
         shard_job("k", copy_of(shards, at / "shards-up", shard_files(climbing(out / "shard.bin")))),
         "spec.data.paths[0]", "climbs out of its directory"),
        ("token-shard index naming a shard by an absolute path",
         shard_job("l", copy_of(shards, at / "shards-abs", shard_files(lambda _d: str(out / "shard.bin")))),
         "spec.data.paths[0]", "an absolute path"),
        ("token shard symlinked out", shard_job("m", copy_of(shards, at / "shards-link", link("shard_00000.bin", out / "shard.bin"))),
         "spec.data.paths[0]", link_out),
        ("config.json linked into Alice's run directory",
         model_job("n", copy_of(model, here / "run-model", link("config.json", alices_run / "config.json"))),
         "spec.model.from_pretrained", foreign),
        ("tokenizer.json linked into Alice's run directory",
         tokenizer_job("o", copy_of(tok, here / "run-tokenizer", link("tokenizer.json", alices_run / "tokenizer.json"))),
         "spec.data.tokenizer", foreign),
    ]


def alices_run_directory(service: SecureService, tokens: Tokens) -> Path:
    """The run directory of a job of Alice's (tenant vision), holding files with the secret."""
    with service.channel() as ch:
        job = stub(ch).CreateJob(pb.CreateJobRequest(job=job_to_proto(small_job("alice-base"))),
                                 metadata=bearer(tokens.alice), timeout=10)
    run = service.data_dir / "runs" / job.id
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_type": SECRET}))
    (run / "tokenizer.json").write_text(SECRET)
    return run


def refusal(client, job, token: str) -> list[str]:
    """`job`'s CreateJob refusal (INVALID_ARGUMENT) as 'field: description' lines; PlanJob must say the same."""
    message = job_to_proto(job)
    with pytest.raises(grpc.RpcError) as info:
        client.CreateJob(pb.CreateJobRequest(job=message), metadata=bearer(token), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert SECRET not in (info.value.details() or "")
    got = [f"{v.field}: {v.description}" for v in field_violations(info.value)]
    plan = client.PlanJob(pb.PlanJobRequest(job=message), metadata=bearer(token), timeout=30)
    assert not plan.valid and [f"{v.field}: {v.description}" for v in plan.violations] == got
    return got


def test_files_escaping_the_root_are_refused_without_their_content(service: SecureService, tokens: Tokens, tree: Tree) -> None:
    cases = escapes(tree, service, alices_run_directory(service, tokens))
    with service.channel() as ch:
        client = stub(ch)
        for what, job, field, rule in cases:
            got = refusal(client, job, tokens.bob)
            assert not any(SECRET in line for line in got), (what, got)
            named = [line for line in got if line.startswith(f"{field}: ")]
            assert named and rule in named[0], (what, got)
        for job in (model_job("intact-model", str(tree.model)), model_job("intact-auto", str(tree.model), "auto"),
                    tokenizer_job("intact-tokenizer", str(tree.tokenizer)), arrow_job("intact-arrow", str(tree.arrow)),
                    shard_job("intact-shards", str(tree.shards))):
            created = client.CreateJob(pb.CreateJobRequest(job=job_to_proto(job)), metadata=bearer(tokens.bob), timeout=30)
            assert created.status.state == pb.QUEUED, job.metadata.name


def hostile_content(tree: Tree) -> list[tuple[str, object, str, str]]:
    """(what, job, field, what the refusal says): files inside the root whose content is hostile."""
    base = tree.root / "hostile"
    if not base.exists():
        base.mkdir()
        (base / "no-weights").mkdir()
        shutil.copy(tree.model / "config.json", base / "no-weights" / "config.json")
        (base / "deep.jsonl").write_text(DEEP + "\n")
        with open(base / "long.jsonl", "wb") as handle:
            handle.truncate(MAX_LINE_BYTES + 1)  # NUL bytes, no newline
        (base / "huge-footer.parquet").write_bytes(b"PAR1" + (2**31 - 1).to_bytes(4, "little") + b"PAR1")
    return [
        ("config.json 50,000 deep",
         model_job("p", copy_of(tree.model, base / "deep-config", lambda d: (d / "config.json").write_text(DEEP))),
         "spec.model.from_pretrained", "nested deeper than 64 levels"),
        ("no weights", model_job("q", str(base / "no-weights")), "spec.model.from_pretrained",
         "holds neither model.safetensors nor model.safetensors.index.json"),
        ("first JSONL record 50,000 deep", small_job("r", data={"format": "jsonl", "paths": [str(base / "deep.jsonl")]}),
         "spec.data.paths", "deep.jsonl line 1 is nested deeper than 64 levels"),
        ("first JSONL line past the bound", small_job("s", data={"format": "jsonl", "paths": [str(base / "long.jsonl")]}),
         "spec.data.paths", f"no complete record in its first {MAX_LINE_BYTES} bytes"),
        ("Parquet footer of 2 GiB", small_job("t", data={"format": "parquet", "paths": [str(base / "huge-footer.parquet")]}),
         "spec.data.paths", "footer"),
        ("Arrow state.json 50,000 deep",
         arrow_job("u", copy_of(tree.arrow, base / "deep-state", lambda d: (d / "state.json").write_text(DEEP))),
         "spec.data.paths[0]", "nested deeper than 64 levels"),
        ("token-shard index 50,000 deep",
         shard_job("v", copy_of(tree.shards, base / "deep-index", lambda d: (d / "index.json").write_text(DEEP))),
         "spec.data.paths[0]", "nested deeper than 64 levels"),
    ]


def test_hostile_content_inside_the_root_is_invalid_argument(service: SecureService, tokens: Tokens, tree: Tree) -> None:
    with service.channel() as ch:
        client = stub(ch)
        for what, job, field, says in hostile_content(tree):
            got = refusal(client, job, tokens.bob)
            named = [line for line in got if line.startswith(f"{field}: ")]
            assert named and says in named[0], (what, got)
