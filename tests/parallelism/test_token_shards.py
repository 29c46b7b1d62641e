"""Prepared token shards: same token stream as on-the-fly tokenization, same training, prefetch
that changes nothing but timing, and clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from harness import tiny_job

from trainctl.cli.main import main as trainctl_main
from trainctl.parallelism.data.corpus import DataError, PackedDataset, ShardedLoader
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.token_shards import PrefetchLoader, TokenShardDataset, prepare_shards
from trainctl.parallelism.data.tokenizer import ByteTokenizer
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.data_checks import resolve_data_paths
from trainctl.spec.files import FileRuleError
from trainctl.spec.job import DataSpec, JobSpecBody, TrainingJob
from trainctl.spec.validate import semantic_violations


@pytest.fixture(scope="module")
def shards(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared by 2 worker processes into small shards (samples straddle shard files)."""
    out = tmp_path_factory.mktemp("shards")
    result = prepare_shards([corpus], out, workers=2, shard_tokens=5000)
    assert result.shards > 3 and result.files == 6
    return out


def test_prepared_stream_equals_on_the_fly_tokenization(corpus: str, shards: Path) -> None:
    expected = np.concatenate([ByteTokenizer().encode(p.read_bytes()) for p in resolve_data_paths([corpus])])
    dataset = TokenShardDataset(DataSpec(paths=[str(shards)], format="tokens"), 256)
    assert int(dataset.starts[-1]) == len(expected)
    np.testing.assert_array_equal(dataset.tokens(0, len(expected)), expected)
    np.testing.assert_array_equal(dataset.tokens(4990, 25), expected[4990:5015])  # across a shard boundary

    text = PackedDataset(DataSpec(paths=[corpus], seq_len=32, seed=3), 256)
    tokens = TokenShardDataset(DataSpec(paths=[str(shards)], format="tokens", seq_len=32, seed=3), 256)
    assert tokens.n_samples == text.n_samples
    span = text.n_samples + 40  # into the second epoch
    assert torch.equal(tokens.samples(0, span), text.samples(0, span))


def test_training_from_shards_equals_training_from_text(corpus: str, shards: Path) -> None:
    torch.set_num_threads(1)
    text = tiny_job(corpus, steps=3, training={"micro_batch_size": 4})
    data = {**text.data.model_dump(), "paths": [str(shards)], "format": "tokens"}
    prepared = JobSpecBody.model_validate({**text.model_dump(), "data": data})
    assert Trainer(prepared, device="cpu").run().losses == Trainer(text, device="cpu").run().losses


def test_prefetch_gives_the_same_batches_and_resumable_offset(corpus: str) -> None:
    spec = DataSpec(paths=[corpus], seq_len=16)
    dataset = build_dataset(spec, 256)
    kwargs = {"global_batch_size": 8, "micro_batch_size": 2, "dp_rank": 1, "dp_size": 2}
    plain = ShardedLoader(dataset, **kwargs)
    ahead = PrefetchLoader(ShardedLoader(dataset, **kwargs), depth=3)
    try:
        for _ in range(4):
            got, want = ahead.next_batch(), plain.next_batch()
            assert ahead.offset == plain.offset
            assert all(torch.equal(g.inputs, w.inputs) and torch.equal(g.targets, w.targets) for g, w in zip(got, want, strict=True))
        assert ahead.n_micro == plain.n_micro == 2
        ahead.offset = plain.offset = 8  # a resume drops what was prepared ahead
        assert torch.equal(ahead.next_batch()[0].inputs, plain.next_batch()[0].inputs)
    finally:
        ahead.close()


def test_data_prepare_command_and_errors(corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "prepared"
    assert trainctl_main(["data", "prepare", corpus, "--out", str(out), "--workers", "1", "--max-files", "2"]) == 0
    assert "from 2 files" in capsys.readouterr().out
    assert (out / "index.json").is_file()
    assert trainctl_main(["data", "prepare", str(tmp_path / "none*.txt"), "--out", str(out)]) == 1
    assert "match no files" in capsys.readouterr().err

    with pytest.raises(DataError, match=r"spec.data.paths\[0\].*not a token-shard directory"):
        TokenShardDataset(DataSpec(paths=[str(tmp_path)], format="tokens"), 256)
    job = TrainingJob.model_validate({"metadata": {"name": "x"}, "spec": {"data": {"paths": [str(tmp_path)], "format": "tokens"}}})
    assert [v.field for v in semantic_violations(job)] == ["spec.data.paths[0]"]
    with pytest.raises(DataError, match="spec.model.vocab_size"):
        TokenShardDataset(DataSpec(paths=[str(out)], format="tokens"), 128)


def test_a_damaged_or_hostile_index_is_a_configuration_error(corpus: str, tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    prepare_shards([corpus], out, max_files=1)
    index = (out / "index.json").read_text()
    spec = DataSpec(paths=[str(out)], format="tokens")
    for damaged, error, message in (
        (index.replace("shard_00000.bin", "../../etc/passwd"), FileRuleError, "climbs out of its directory"),
        (index.replace("shard_00000.bin", "/etc/passwd"), FileRuleError, "an absolute path"),
        (index.replace("shard_00000.bin", "shard_99999.bin"), DataError, "cannot map a shard"),
        (index.replace('"dtype"', '"no_dtype"'), DataError, "malformed index.json"),
        ("[1, 2]", DataError, "malformed index.json"),
    ):
        (out / "index.json").write_text(damaged)
        with pytest.raises(error, match=message) as err:
            TokenShardDataset(spec, 256)
        assert err.value.args[0].startswith("spec.data.paths[0]: ")
