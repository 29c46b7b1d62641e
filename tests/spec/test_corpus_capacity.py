"""seq_len against what the data can give, checked at submit from file sizes and shard indexes."""

from __future__ import annotations

import json
from pathlib import Path

from trainctl.spec.data_checks import MAX_TOKENS_PER_BYTE, corpus_capacity_violations, data_violations
from trainctl.spec.job import DataSpec


def problems(**data) -> list[str]:
    return [str(v) for v in corpus_capacity_violations(DataSpec(**data))]


def test_byte_level_text_is_counted_exactly_from_file_sizes(tmp_path: Path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"x" * 50)
    pattern = str(tmp_path / "*.txt")
    assert problems(paths=[pattern], seq_len=99) == []  # 100 bytes: one sample of 100 tokens
    [problem] = problems(paths=[pattern], seq_len=100)
    assert problem == "spec.data.seq_len: a sample needs seq_len + 1 = 101 tokens but the 2 files hold 100 bytes, one token each"
    assert problems(paths=[pattern], seq_len=99, max_files=1)  # only the first file is read


def test_a_tokenizer_file_is_refused_only_when_no_tokenization_could_fill_a_sample(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"y" * 10)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    assert problems(paths=[str(tmp_path / "a.txt")], tokenizer=str(tokenizer), seq_len=10 * MAX_TOKENS_PER_BYTE - 1) == []
    [problem] = problems(paths=[str(tmp_path / "a.txt")], tokenizer=str(tokenizer), seq_len=10 * MAX_TOKENS_PER_BYTE)
    assert "at most 30 tokens under any tokenizer" in problem


def test_token_shards_are_counted_from_their_index(tmp_path: Path) -> None:
    for name, tokens in (("one", [40, 20]), ("two", [5])):
        (tmp_path / name).mkdir()
        index = {"version": 1, "shards": [{"file": f"shard_{i:05d}.bin", "tokens": t} for i, t in enumerate(tokens)]}
        (tmp_path / name / "index.json").write_text(json.dumps(index))
    dirs = [str(tmp_path / "one"), str(tmp_path / "two")]
    assert problems(format="tokens", paths=dirs, seq_len=64) == []
    assert "the shards hold 65 tokens" in problems(format="tokens", paths=dirs, seq_len=65)[0]
    (tmp_path / "two" / "index.json").write_text('{"shards": 3}')
    assert problems(format="tokens", paths=dirs, seq_len=8) == [
        f"spec.data.paths[1]: {tmp_path / 'two' / 'index.json'} is not a token-shard index (no shards list)"
    ]


def test_capacity_is_judged_only_once_the_files_exist(tmp_path: Path) -> None:
    fields = [v.field for v in data_violations(DataSpec(paths=[str(tmp_path / "none-*.txt")], seq_len=4096))]
    assert fields == ["spec.data.paths[0]"]
