"""`trainctl export` writes a complete Hugging Face model and `trainctl generate` stops where transformers does.

An imported model (a tiny Llama saved with `save_pretrained`, with the chat tokenizer of
tests/data_sources.py, special-token ids of its own and `max_position_embeddings` 128) is fine-tuned
with LoRA for 2 steps and exported: the export holds the source's config.json key for key, its
generation_config.json and tokenizer files byte for byte, every file mode 0644, and loads with
`AutoTokenizer` and `AutoModelForCausalLM`. With the end-of-sequence id set to a token greedy decoding
reaches at step k, transformers' `generate` (greedy, the chat template applied) stops there, and so do
`trainctl generate --chat` (the same reply) and the engine's `generate`. A preset run gets no invented
ids: with the byte tokenizer no generation_config.json, with a tokenizer directory that tokenizer's ids
and files; a tokenizer file linked outside its directory is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from data_sources import build_tokenizer, documents
from harness import tiny_job
from hf_models import SHAPE

from trainctl.cli.main import main as trainctl_main
from trainctl.parallelism.checkpoint.hf_files import TOKENIZER_FILES
from trainctl.parallelism.checkpoint.pretrained import load_weights, open_checkpoint
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.model.generate import chat_prompt, generate
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.job import JobSpecBody

transformers = pytest.importorskip("transformers")

SPECIAL = {"bos_token_id": 3, "eos_token_id": 1, "pad_token_id": 0}
"""The source's own ids (<|user|>, <eos>, <unk> of the data_sources tokenizer), not LlamaConfig's defaults."""
PROMPT = "the model trains on text"
NEW_TOKENS = 12


def source_model(directory: Path) -> Path:
    """A tiny random Llama (vocabulary 64, which holds the tokenizer's) with the chat tokenizer."""
    config = transformers.LlamaConfig(**{**SHAPE, "vocab_size": 64}, **SPECIAL, initializer_range=0.5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    return build_tokenizer(directory)


def train(job: JobSpecBody, root: Path) -> Path:
    """Run `job` for its steps in this process; its checkpoint root."""
    Trainer(job, device="cpu", checkpoint_dir=root / "checkpoints").run()
    return root / "checkpoints"


def corpus(root: Path) -> str:
    root.mkdir(parents=True)
    for i, text in enumerate(documents(30)):
        (root / f"{i}.txt").write_text(text)
    return str(root / "*.txt")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source model directory, the checkpoint root of a 2-step LoRA fine-tune of it)."""
    root = tmp_path_factory.mktemp("imported")
    source = source_model(root / "model")
    job = tiny_job(corpus(root / "docs"), steps=2, model={"from_pretrained": str(source)}, data={"tokenizer": "auto"})
    job = JobSpecBody.model_validate({**job.model_dump(), "lora": {"rank": 4, "target_modules": ["wq", "wv", "w2"]}})
    return source, train(job, root / "run")


def modes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*") if p.is_file()}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_export_of_an_imported_model_is_the_source_model_with_trained_weights(imported, tmp_path: Path) -> None:
    source, run = imported
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(run), "--out", str(out)]) == 0

    tokenizer_files = {name for name in TOKENIZER_FILES if (source / name).is_file()}
    assert tokenizer_files >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert set(modes(out)) == {"model.safetensors", "config.json", "generation_config.json", *tokenizer_files}
    assert set(modes(out).values()) == {0o644}
    for name in ("config.json", "generation_config.json"):  # float32 weights, as the source's: no key differs
        assert read_json(out / name) == read_json(source / name), name
    for name in tokenizer_files:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    config = read_json(out / "config.json")
    assert {key: config[key] for key in SPECIAL} == SPECIAL and config["max_position_embeddings"] == 128

    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.encode(PROMPT) == theirs.encode(PROMPT) and len(tokenizer.encode(PROMPT)) == 5
    assert tokenizer.chat_template == theirs.chat_template and tokenizer.eos_token_id == SPECIAL["eos_token_id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.generation_config.pad_token_id == SPECIAL["pad_token_id"]

    half = tmp_path / "bf16"  # the weights' dtype is the one key that follows the export, not the source
    assert trainctl_main(["export", str(run), "--out", str(half), "--dtype", "bfloat16"]) == 0
    assert read_json(half / "config.json") == {**read_json(source / "config.json"), "dtype": "bfloat16"}


def with_eos(source: Path, run: Path, root: Path, eos: list[int]) -> Path:
    """A copy of `run` whose recorded job names a copy of `source` whose end-of-sequence ids are `eos`
    (config.json: the first; generation_config.json: all)."""
    model = shutil.copytree(source, root / "model")
    for name, value in (("config.json", eos[0]), ("generation_config.json", eos)):
        (model / name).write_text(json.dumps({**read_json(model / name), "eos_token_id": value}))
    copy = shutil.copytree(run, root / "run" / "checkpoints")
    job = json.loads((copy / "job.json").read_text())
    job["model"]["from_pretrained"] = str(model)
    (copy / "job.json").write_text(JobSpecBody.model_validate(job).model_dump_json())
    return copy


def test_generation_stops_at_the_end_of_sequence_token_as_in_transformers(imported, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    source, run = imported
    checkpoint = open_checkpoint(run)
    engine = build_model(checkpoint.config, 0)
    engine.load_state_dict(load_weights(checkpoint))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    prompt = torch.tensor([chat_prompt(hf_tokenizer, PROMPT)])
    free = generate(engine, prompt, max_new_tokens=NEW_TOKENS)[0, prompt.shape[1] :].tolist()
    eos_id = SPECIAL["eos_token_id"]
    step = next((k for k in range(2, NEW_TOKENS) if free[k] not in free[:k] and eos_id not in free[: k + 1]), None)
    assert step is not None, f"greedy decoding gives no new token from step 2 on: {free}"
    eos = [free[step], eos_id]

    stopping = with_eos(source, run, tmp_path, eos)
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(stopping), "--out", str(out)]) == 0
    assert read_json(out / "generation_config.json")["eos_token_id"] == eos
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    assert chat["input_ids"].tolist() == prompt.tolist()
    theirs = model.generate(**chat, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    assert theirs == prompt[0].tolist() + free[: step + 1]  # stopped at the eos token, after step + 1 tokens

    assert generate(engine, prompt, max_new_tokens=NEW_TOKENS, stop_ids=eos)[0].tolist() == theirs
    capsys.readouterr()
    assert trainctl_main(["generate", str(stopping), "--prompt", PROMPT, "--chat", "--max-new-tokens",
                          str(NEW_TOKENS), "--device", "cpu"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(free[:step]) + "\n"


def test_batched_generation_pads_rows_that_ended(imported) -> None:
    _, run = imported
    checkpoint = open_checkpoint(run)
    engine = build_model(checkpoint.config, 0)
    engine.load_state_dict(load_weights(checkpoint))
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    free = generate(engine, prompt, max_new_tokens=8)
    stop = int(free[0, 4])  # row 0 ends at once
    rows = generate(engine, prompt, max_new_tokens=8, stop_ids=[stop], pad_id=63)
    assert rows[0, 4:].tolist() == [stop] + [63] * (rows.shape[1] - 5)
    if stop not in free[1, 4:].tolist():  # row 1 never ends: it runs to the limit, as without stop ids
        assert torch.equal(rows[1], free[1])


def test_a_preset_export_names_only_the_ids_its_tokenizer_knows(base_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "byte"
    assert trainctl_main(["export", str(base_run), "--out", str(out)]) == 0
    assert modes(out) == {"model.safetensors": 0o644, "config.json": 0o644}  # the byte tokenizer has no HF form
    assert {read_json(out / "config.json")[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")} == {None}
    capsys.readouterr()
    assert trainctl_main(["generate", str(base_run), "--prompt", PROMPT, "--chat", "--device", "cpu"]) == 1
    refusal = "--chat needs a Hugging Face tokenizer directory with a chat template; the job's tokenizer is 'byte'"
    assert refusal in capsys.readouterr().err

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    run = train(tiny_job(corpus(tmp_path / "docs"), steps=1, data={"tokenizer": str(tokenizer)}), tmp_path / "run")
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(run), "--out", str(out)]) == 0
    assert set(modes(out).values()) == {0o644} and (out / "chat_template.jinja").is_file()
    assert read_json(out / "generation_config.json") == {"_from_model_config": True, "eos_token_id": 1}
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token_id == read_json(out / "config.json")["eos_token_id"] == 1
    assert loaded.encode(PROMPT) == transformers.AutoTokenizer.from_pretrained(str(tokenizer)).encode(PROMPT)

    outside = tmp_path / "elsewhere.json"
    (tokenizer / "tokenizer_config.json").rename(outside)
    os.symlink(outside, tokenizer / "tokenizer_config.json")
    capsys.readouterr()
    assert trainctl_main(["export", str(run), "--out", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "spec.data.tokenizer" in err and "tokenizer_config.json" in err and "outside its directory" in err
