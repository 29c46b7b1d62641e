"""Data: tokenizers, packing, seeded order, and the layout-independent global sample offset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainctl.parallelism.data.corpus import DataError, PackedDataset, ShardedLoader
from trainctl.parallelism.data.tokenizer import ByteTokenizer, load_tokenizer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.job import DataSpec


def spec(corpus: str, **kw) -> DataSpec:
    return DataSpec(paths=[corpus], seq_len=32, seed=kw.pop("seed", 3), **kw)


def test_byte_tokenizer_is_lossless():
    ids = ByteTokenizer().encode("héllo\n".encode())
    assert bytes(ids.astype("uint8").tolist()).decode() == "héllo\n"
    assert load_tokenizer("byte").vocab_size == 256


def test_tokenizer_file_errors_name_the_field(tmp_path: Path):
    with pytest.raises(ConfigurationError, match="spec.data.tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_packing_covers_the_corpus_in_order(corpus):
    ds = PackedDataset(spec(corpus), vocab_size=256)
    files = sorted(Path(corpus).parent.glob("*.txt"))
    stream = b"".join(f.read_bytes() for f in files)
    assert ds.n_samples == len(stream) // 33
    first = ds.tokens[0].astype("uint8").tobytes()
    assert first == stream[:33]


def test_order_is_seeded_and_each_epoch_is_a_permutation(corpus):
    a, b = PackedDataset(spec(corpus), 256), PackedDataset(spec(corpus), 256)
    other = PackedDataset(spec(corpus, seed=4), 256)
    n = a.n_samples
    assert [a.sample_id(i) for i in range(2 * n)] == [b.sample_id(i) for i in range(2 * n)]
    assert [a.sample_id(i) for i in range(n)] != [other.sample_id(i) for i in range(n)]
    for epoch in range(2):
        assert sorted(a.sample_id(i) for i in range(epoch * n, (epoch + 1) * n)) == list(range(n))
    assert [a.sample_id(i) for i in range(n)] != [a.sample_id(i) for i in range(n, 2 * n)]


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_ranks_split_the_global_batch(corpus, dp):
    ds = PackedDataset(spec(corpus), 256)
    whole = ShardedLoader(ds, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    ranks = [ShardedLoader(ds, global_batch_size=8, micro_batch_size=1, dp_rank=r, dp_size=dp) for r in range(dp)]
    for _ in range(3):
        expected = torch.cat([m.inputs for m in whole.next_batch()])
        got = torch.cat([m.inputs for loader in ranks for m in loader.next_batch()])
        assert torch.equal(got, expected)
    assert whole.offset == ranks[0].offset == 24


def test_offset_resumes_under_another_layout(corpus):
    ds = PackedDataset(spec(corpus), 256)
    dp4 = [ShardedLoader(ds, global_batch_size=8, micro_batch_size=1, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(5):
        for loader in dp4:
            loader.next_batch()
    resumed = ShardedLoader(ds, global_batch_size=8, micro_batch_size=4, dp_rank=1, dp_size=2, offset=dp4[0].offset)
    straight = ShardedLoader(ds, global_batch_size=8, micro_batch_size=4, dp_rank=1, dp_size=2)
    for _ in range(5):
        straight.next_batch()
    a, b = resumed.next_batch(), straight.next_batch()
    assert all(torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets) for x, y in zip(a, b, strict=True))
    assert torch.equal(a[0].inputs[:, 1:], a[0].targets[:, :-1])


def test_bad_data_is_named(tmp_path: Path, corpus):
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(DataError, match="spec.data.paths: .* fewer than one sample"):
        PackedDataset(spec(str(tmp_path / "small.txt")), 256)
    with pytest.raises(DataError, match="spec.data.paths: .* match no files"):
        PackedDataset(spec(str(tmp_path / "none-*.txt")), 256)
    with pytest.raises(DataError, match="spec.model.vocab_size"):
        PackedDataset(spec(corpus), 128)
    ds = PackedDataset(spec(corpus), 256)
    with pytest.raises(DataError, match="global_batch_size"):
        ShardedLoader(ds, global_batch_size=6, micro_batch_size=2, dp_rank=0, dp_size=4)
