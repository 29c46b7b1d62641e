"""Data formats jsonl, parquet and arrow: one token stream whichever way it is read, chat records
masked exactly as transformers masks assistant tokens, the global sample offset resumable under any
data-parallel size, the cache built once, and bad input refused with the file and line named.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_sources import build_tokenizer, conversations, documents, write_format, write_jsonl
from harness import tiny_job

from trainctl.cli.main import main as trainctl_main
from trainctl.parallelism.data.chat import ChatError
from trainctl.parallelism.data.corpus import IGNORE_INDEX, DataError, ShardedLoader
from trainctl.parallelism.data.dataset import build_dataset, cache_root
from trainctl.parallelism.data.token_shards import TokenShardDataset
from trainctl.parallelism.data.tokenizer import ByteTokenizer, load_tokenizer
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.job import DataSpec, JobSpecBody

FORMATS = ["jsonl", "parquet", "arrow"]
VOCAB = 256


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    """Tokenizer directories by whether their chat template has generation markers."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {markers: str(build_tokenizer(root / f"markers-{markers}", markers=markers)) for markers in (True, False)}


def stream(dataset: TokenShardDataset) -> tuple[np.ndarray, np.ndarray | None]:
    """The whole token stream of a shard dataset and its mask (None: unmasked)."""
    tokens = np.concatenate([np.asarray(m, dtype=np.int64) for m in dataset.maps])
    if not dataset.masked:
        return tokens, None
    return tokens, np.concatenate([np.asarray(m) for m in dataset.mask_maps])


def reference_chat_stream(tokenizer_dir: str, convs: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    """What transformers itself gives: each conversation's ids and assistant mask (the template with
    generation markers), EOS (mask 0) after each."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids, mask = [], []
    for messages in convs:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids += list(out["input_ids"]) + [hf.eos_token_id]
        mask += list(out["assistant_masks"]) + [0]
    return np.asarray(ids), np.asarray(mask, dtype=np.uint8)


# ---- one token stream ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_text_records_give_the_documents_tokens_in_order(tmp_path, tokenizers, fmt):
    docs = documents(40, seed=1)
    path = write_format(fmt, tmp_path / fmt, [{"body": d, "other": 1} for d in docs])
    tok = tokenizers[True]
    dataset = build_dataset(DataSpec(paths=[path], format=fmt, text_field="body", tokenizer=tok, seq_len=16), VOCAB)
    hf = load_tokenizer(tok)
    want = np.concatenate([np.append(hf.encode(d.encode()), hf.eos_id) for d in docs])
    tokens, mask = stream(dataset)
    assert mask is None and not dataset.masked
    np.testing.assert_array_equal(tokens, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_byte_records_equal_text_files_of_the_same_documents(tmp_path, fmt):
    docs = documents(12, seed=2)
    for i, d in enumerate(docs):
        (tmp_path / f"doc{i:02d}.txt").write_text(d)
    path = write_format(fmt, tmp_path / fmt, [{"text": d} for d in docs])
    text = build_dataset(DataSpec(paths=[str(tmp_path / "*.txt")], tokenizer="byte", seq_len=16, seed=5), VOCAB)
    records = build_dataset(DataSpec(paths=[path], format=fmt, tokenizer="byte", seq_len=16, seed=5), VOCAB)
    assert records.n_samples == text.n_samples
    assert torch.equal(records.samples(0, records.n_samples), text.samples(0, text.n_samples))


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prepare_gives_the_stream_of_reading_the_format(tmp_path, tokenizers, fmt, chat):
    records = [{"messages": c} for c in conversations(30)] if chat else [{"text": d} for d in documents(30)]
    path = write_format(fmt, tmp_path / fmt, records)
    fields = {"messages_field": "messages"} if chat else {}
    direct = build_dataset(DataSpec(paths=[path], format=fmt, tokenizer=tokenizers[True], seq_len=16, **fields), VOCAB)
    out = tmp_path / "prepared"
    argv = ["data", "prepare", path, "--out", str(out), "--format", fmt, "--tokenizer", tokenizers[True], "--shard-tokens", "100"]
    if chat:
        argv += ["--messages-field", "messages"]
    assert trainctl_main(argv) == 0
    prepared = TokenShardDataset(DataSpec(paths=[str(out)], format="tokens", seq_len=16), VOCAB)
    assert len(prepared.maps) > 1  # several shards, so boundaries are crossed
    for got, want in zip(stream(prepared), stream(direct), strict=True):
        np.testing.assert_array_equal(got, want)
    assert torch.equal(prepared.samples(0, 20), direct.samples(0, 20))
    if chat:
        assert torch.equal(prepared.sample_masks(0, 20), direct.sample_masks(0, 20))


# ---- chat masking ----------------------------------------------------------------------------------
@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "prefix-rendering"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_mask_equals_transformers_assistant_mask(tmp_path, tokenizers, fmt, markers):
    convs = conversations(25, seed=3)
    path = write_format(fmt, tmp_path / fmt, [{"messages": c, "id": i} for i, c in enumerate(convs)])
    spec = DataSpec(paths=[path], format=fmt, messages_field="messages", tokenizer=tokenizers[markers], seq_len=16)
    tokens, mask = stream(build_dataset(spec, VOCAB))
    want_tokens, want_mask = reference_chat_stream(tokenizers[True], convs)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(mask, want_mask)
    assert 0 < mask.sum() < len(mask)


def test_loader_masks_targets_and_counts_the_global_batch(tmp_path, tokenizers):
    path = write_format("jsonl", tmp_path / "chat", [{"messages": c} for c in conversations(40)])
    spec = DataSpec(paths=[path], format="jsonl", messages_field="messages", tokenizer=tokenizers[True], seq_len=16, seed=2)
    dataset = build_dataset(spec, VOCAB)
    counted = 0
    for rank in range(2):
        loader = ShardedLoader(dataset, global_batch_size=8, micro_batch_size=2, dp_rank=rank, dp_size=2, offset=8)
        batch = loader.next_batch()
        samples = dataset.samples(8 + 4 * rank, 4)
        masks = dataset.sample_masks(8 + 4 * rank, 4)
        targets = torch.cat([m.targets for m in batch])
        assert torch.equal(torch.cat([m.inputs for m in batch]), samples[:, :-1])
        assert torch.equal(targets, torch.where(masks[:, 1:], samples[:, 1:], IGNORE_INDEX))
        counted += int((targets != IGNORE_INDEX).sum())
        assert {m.loss_tokens for m in batch} == {loader_tokens := batch[0].loss_tokens}
    assert loader_tokens == counted


# ---- resume: the global sample offset ------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_under_another_dp_size_reads_every_sample_once(tmp_path, tokenizers, fmt):
    path = write_format(fmt, tmp_path / fmt, [{"text": d} for d in documents(60, seed=4)])
    dataset = build_dataset(DataSpec(paths=[path], format=fmt, tokenizer=tokenizers[True], seq_len=16, seed=9), VOCAB)
    batch, steps = 8, dataset.n_samples // 8
    assert steps >= 4

    def read(dp: int, offset: int, n_steps: int) -> tuple[list[tuple[int, ...]], int]:
        loaders = [ShardedLoader(dataset, global_batch_size=batch, micro_batch_size=1, dp_rank=r, dp_size=dp, offset=offset)
                   for r in range(dp)]
        rows = []
        for _ in range(n_steps):
            for loader in loaders:
                rows += [tuple(m.inputs[0].tolist()) for m in loader.next_batch()]
        return rows, loaders[0].offset

    first, offset = read(2, 0, 2)
    second, _ = read(4, offset, steps - 2)
    everything = [tuple(r[:-1].tolist()) for r in dataset.samples(0, dataset.n_samples)]
    assert sorted(first + second) == sorted(everything[: steps * batch])
    assert len(set(first + second)) == steps * batch


# ---- the cache ------------------------------------------------------------------------------------
def test_the_cache_is_built_once_and_rebuilt_when_a_file_changes(tmp_path, tokenizers):
    path = write_format("jsonl", tmp_path / "docs", [{"text": d} for d in documents(20)])
    spec = DataSpec(paths=[path], format="jsonl", tokenizer=tokenizers[True], seq_len=8)
    first = build_dataset(spec, VOCAB)
    entries = {p.name for p in cache_root().iterdir()}
    again = build_dataset(spec, VOCAB)
    assert {p.name for p in cache_root().iterdir()} == entries
    assert torch.equal(first.samples(0, 4), again.samples(0, 4))
    write_jsonl(tmp_path / "docs" / "a.jsonl", [{"text": "one more document"}])
    build_dataset(spec, VOCAB)
    assert len({p.name for p in cache_root().iterdir()} - entries) == 2  # a new directory and its lock


# ---- bad input ------------------------------------------------------------------------------------
def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": broken\n')
    with pytest.raises(DataError, match=r"a\.jsonl line 3 is not JSON"):
        build_dataset(DataSpec(paths=[str(tmp_path / "a.jsonl")], format="jsonl", tokenizer="byte", seq_len=4), VOCAB)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_field_names_it_and_the_file(tmp_path, fmt):
    path = write_format(fmt, tmp_path / fmt, [{"content": d} for d in documents(4)])
    with pytest.raises(DataError, match=r"spec\.data\.text_field: .*has no (field|column) 'text'"):
        build_dataset(DataSpec(paths=[path], format=fmt, tokenizer="byte", seq_len=4), VOCAB)


def test_an_empty_dataset_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.jsonl").write_text("\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    for fmt in ("jsonl", "parquet"):
        with pytest.raises(DataError, match="hold no documents"):
            build_dataset(DataSpec(paths=[str(tmp_path / f"empty.{fmt}")], format=fmt, tokenizer="byte", seq_len=4), VOCAB)


def test_an_unknown_role_names_file_and_record(tmp_path, tokenizers):
    convs = conversations(3)
    convs[1][0] = {"role": "narrator", "content": "the model"}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    spec = DataSpec(paths=[str(path)], format="jsonl", messages_field="messages", tokenizer=tokenizers[True], seq_len=4)
    with pytest.raises(ChatError, match=r"chat\.jsonl line 2: message 0 has unknown role 'narrator'"):
        build_dataset(spec, VOCAB)


def test_chat_needs_a_tokenizer_directory(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(2)])
    spec = DataSpec(paths=[str(path)], format="jsonl", messages_field="messages", tokenizer="byte", seq_len=4)
    with pytest.raises(ConfigurationError, match="spec.data.messages_field"):
        build_dataset(spec, VOCAB)


def test_a_template_that_rewrites_earlier_turns_is_refused_without_markers(tmp_path, tokenizers):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers[False])
    # Renders the last message differently from the others: a prefix's rendering is not a prefix of the whole.
    hf.chat_template = "{% for m in messages %}{% if loop.last %}<|end|> {% endif %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    directory = tmp_path / "rewriting"
    hf.save_pretrained(str(directory))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(2)])
    spec = DataSpec(paths=[str(path)], format="jsonl", messages_field="messages", tokenizer=str(directory), seq_len=4)
    with pytest.raises(ChatError, match=r"generation %\} markers"):
        build_dataset(spec, VOCAB)


def test_tokenizer_auto_is_the_model_directory_else_byte(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in documents(10)])
    spec = DataSpec(paths=[str(path)], format="jsonl", seq_len=8)
    assert spec.tokenizer == "auto"
    byte = build_dataset(spec, VOCAB)
    want = np.concatenate([ByteTokenizer().encode(d.encode()) for d in documents(10)])
    np.testing.assert_array_equal(stream(byte)[0], want)
    model = build_dataset(spec, VOCAB, model_dir=tokenizers[True])
    assert stream(model)[0].max() < 64 and json.loads((Path(tokenizers[True]) / "tokenizer_config.json").read_text())


def _train_and_record(rank: int, world_size: int, body_json: str, checkpoint_dir: str, steps: int) -> list[list[int]]:
    """Resume from the newest checkpoint (if any), train `steps` recording this rank's input rows, save."""
    trainer = Trainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu",
                      checkpoint_dir=checkpoint_dir)
    trainer.maybe_resume()
    rows = []
    for _ in range(steps):
        batch = trainer.loader.next_batch()
        rows += [row.tolist() for micro in batch for row in micro.inputs]
        trainer.forward_backward(batch)
        trainer.optimizer_step()
    trainer.save_checkpoint()
    return rows


@pytest.mark.parametrize("fmt", FORMATS)
def test_trainer_resumed_under_another_dp_size_trains_every_sample_once(pool, tmp_path, tokenizers, fmt):
    path = write_format(fmt, tmp_path / fmt, [{"messages": c} for c in conversations(80, seed=6)])
    data = {"paths": [path], "format": fmt, "messages_field": "messages", "tokenizer": tokenizers[True]}
    ckpt = str(tmp_path / "ckpt")
    first = pool.run(_train_and_record, 2, tiny_job("", data=data, dp_shard=2).model_dump_json(), ckpt, 2)
    second = pool.run(_train_and_record, 4, tiny_job("", data=data, dp_shard=4).model_dump_json(), ckpt, 2)
    trained = [row for rows in first + second for row in rows]
    dataset = build_dataset(tiny_job("", data=data).data, VOCAB)
    want = [row[:-1].tolist() for row in dataset.samples(0, 4 * 8)]
    assert sorted(trained) == sorted(want)
    assert len({tuple(r) for r in trained}) == len(trained)
