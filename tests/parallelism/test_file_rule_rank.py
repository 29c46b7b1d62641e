"""The job's `FileRule` on the ranks: every file the engine opens for a job (weights and the index
naming them, config.json, tokenizer files, data files and the indexes naming them, `init_from`'s
checkpoint) is checked where it is opened. Each escape (a symlink out of the data roots, an index
entry that is absolute or climbs with `..`, a link into another tenant's run directory) raises
`FileRuleError` naming the spec field before the file is read, and the message never holds what the
outside file contains.

"Before it is read" is shown two ways: the library that would read the file is replaced by one that
records its calls (none may come), or the outside file is garbage whose reading would fail with
another error (a corrupt safetensors file, a broken Arrow stream, a shard of the wrong size).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from data_sources import build_tokenizer, documents, write_arrow, write_jsonl
from harness import tiny_job
from hf_models import BYTES, save_family

from trainctl.parallelism.checkpoint import hf_import
from trainctl.parallelism.checkpoint.hf_import import HFWeights
from trainctl.parallelism.checkpoint.layout import COMPLETE, METADATA
from trainctl.parallelism.checkpoint.pretrained import read_model_state
from trainctl.parallelism.checkpoint.source import open_checkpoint
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.token_shards import TokenShardDataset, prepare_shards
from trainctl.parallelism.data.tokenizer import load_tokenizer
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import DataSpec, JobSpecBody
from trainctl.spec.presets import resolve_model

SECRET = "SECRET-CONTENT-OF-A-FILE-OUTSIDE-THE-ROOTS"
WEIGHTS = "spec.model.from_pretrained"


@dataclass(frozen=True)
class Tree:
    """A data root, a secret file outside it, and a service run directory with this job's run (`mine`)
    and another tenant's (`theirs`), under the rule a job gets (roots: the data root)."""

    root: Path
    secret: Path
    runs: Path
    rule: FileRule

    def unconfined(self) -> FileRule:
        """The rule of a service without data roots: only other tenants' run directories are refused."""
        return FileRule((), self.rule.runs_dir, self.rule.readable_runs)


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    root, outside, runs = tmp_path / "root", tmp_path / "outside", tmp_path / "runs"
    for directory in (root, outside, runs / "mine", runs / "theirs"):
        directory.mkdir(parents=True)
    secret = outside / "secret.bin"
    secret.write_text(SECRET * 64)
    rule = FileRule((os.path.realpath(root),), os.path.realpath(runs), frozenset({"mine"}))
    return Tree(root, secret, runs, rule)


def refused(err: pytest.ExceptionInfo, field: str, rule_text: str) -> None:
    """The error names `field` and the rule broken, and holds nothing of the secret file."""
    assert isinstance(err.value, FileRuleError), err.value
    assert err.value.field == field and rule_text in err.value.message, str(err.value)
    assert SECRET not in str(err.value)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture
def opened_safetensors(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file hf_import hands to safetensors' `safe_open`, recorded (and then opened)."""
    calls: list[str] = []
    real = hf_import.safe_open

    def recording(path: str, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf_import, "safe_open", recording)
    return calls


def model_copy(llama: Path, target: Path) -> Path:
    shutil.copytree(llama, target)
    return target


# ---- Hugging Face weights and config ---------------------------------------------------------------


def test_a_model_file_symlinked_out_of_the_roots_is_refused_unopened(tree: Tree, llama: Path, opened_safetensors) -> None:
    model = model_copy(llama, tree.root / "model")
    config = resolve_model(JobSpecBody.model_validate({"model": {"from_pretrained": str(model)}}).model)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(tree.secret)  # read, it would be a corrupt safetensors file
    with pytest.raises(FileRuleError) as err:
        HFWeights(model, config, tree.rule)
    refused(err, WEIGHTS, "resolves through a symlink outside the data roots")
    assert opened_safetensors == []

    # The Trainer reads its weights under its rule: the same refusal from the whole rank.
    (tree.root / "doc.txt").write_text("a document\n" * 50)
    job = tiny_job(str(tree.root / "doc.txt"), model={"from_pretrained": str(model)}, data=BYTES)
    with pytest.raises(FileRuleError) as err:
        Trainer(job, device="cpu", file_rule=tree.rule)
    refused(err, WEIGHTS, "outside the data roots")
    assert opened_safetensors == []


@pytest.mark.parametrize("entry", ["absolute", "climbing", "symlink"])
def test_weight_map_entries_that_leave_the_model_directory_are_refused(
    tree: Tree, llama: Path, opened_safetensors, entry: str
) -> None:
    model = model_copy(llama, tree.root / "model")
    config = resolve_model(JobSpecBody.model_validate({"model": {"from_pretrained": str(model)}}).model)
    hostile = {
        "absolute": (str(tree.secret), "an absolute path"),
        "climbing": (os.path.relpath(tree.secret, model), "climbs out of its directory"),
        "symlink": ("shard-2.safetensors", "resolves outside its directory through a symlink"),
    }
    name, rule_text = hostile[entry]
    (model / "shard-2.safetensors").symlink_to(tree.secret)
    weight_map = dict.fromkeys(["model.embed_tokens.weight", "model.norm.weight"], "model.safetensors")
    weight_map["model.layers.0.mlp.up_proj.weight"] = name
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FileRuleError) as err:
        HFWeights(model, config, FileRule())  # the default rule too: index entries stay in their directory
    refused(err, WEIGHTS, rule_text)
    assert "model.safetensors.index.json names" in err.value.message
    with pytest.raises(FileRuleError):
        HFWeights(model, config, tree.rule)
    assert opened_safetensors == []  # every entry is checked before any shard is opened


def test_an_index_symlinked_out_of_the_roots_is_refused(tree: Tree, llama: Path, opened_safetensors) -> None:
    model = model_copy(llama, tree.root / "model")
    config = resolve_model(JobSpecBody.model_validate({"model": {"from_pretrained": str(model)}}).model)
    (model / "model.safetensors.index.json").symlink_to(tree.secret)  # read, it would not be JSON
    with pytest.raises(FileRuleError) as err:
        HFWeights(model, config, tree.rule)
    refused(err, WEIGHTS, "outside the data roots")
    assert opened_safetensors == []


def test_a_config_json_symlinked_out_of_the_roots_fails_the_trainer_as_a_configuration_error(tree: Tree, llama: Path) -> None:
    model = model_copy(llama, tree.root / "model")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(tree.secret)  # read, it would not be JSON
    job = tiny_job(str(tree.root / "*.txt"), model={"from_pretrained": str(model)}, data=BYTES)
    with pytest.raises(ConfigurationError, match=f"^{WEIGHTS}: .*outside the data roots") as err:
        Trainer(job, device="cpu", file_rule=tree.rule)
    assert SECRET not in str(err.value) and "not valid JSON" not in str(err.value)


# ---- tokenizers ------------------------------------------------------------------------------------


def test_a_tokenizer_directory_with_a_file_linked_outside_is_refused_before_transformers_sees_it(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    tokenizer = build_tokenizer(tree.root / "tok")
    assert load_tokenizer(str(tokenizer), tree.rule).vocab_size > 0  # inside the roots: loads

    def never(*_args, **_kwargs):
        raise AssertionError("AutoTokenizer.from_pretrained was called on a directory the rule refuses")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    (tokenizer / "chat_template.jinja").symlink_to(tree.secret)  # transformers would render it into prompts
    with pytest.raises(FileRuleError) as err:
        load_tokenizer(str(tokenizer), tree.rule)
    refused(err, "spec.data.tokenizer", "outside the data roots")


def test_a_tokenizer_file_symlinked_outside_is_refused_unread(tree: Tree) -> None:
    (tree.root / "tokenizer.json").symlink_to(tree.secret)  # read, it would not be a loadable tokenizer.json
    with pytest.raises(FileRuleError) as err:
        load_tokenizer(str(tree.root / "tokenizer.json"), tree.rule)
    refused(err, "spec.data.tokenizer", "outside the data roots")
    with pytest.raises(ConfigurationError, match="not a loadable tokenizer.json"):  # what reading it gives
        load_tokenizer(str(tree.root / "tokenizer.json"), FileRule())


# ---- data ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["absolute", "climbing"])
def test_an_arrow_state_naming_a_file_outside_its_directory_is_refused(tree: Tree, entry: str) -> None:
    arrow = write_arrow(tree.root / "arrow", [{"body": d} for d in documents(40)])
    state = json.loads((arrow / "state.json").read_text())
    state["_data_files"][0]["filename"] = str(tree.secret) if entry == "absolute" else os.path.relpath(tree.secret, arrow)
    (arrow / "state.json").write_text(json.dumps(state))
    spec = DataSpec(paths=[str(arrow)], format="arrow", text_field="body", tokenizer="byte", seq_len=16)
    for rule in (tree.rule, FileRule()):  # read, it would not be an Arrow stream (a DataError)
        with pytest.raises(FileRuleError) as err:
            build_dataset(spec, 256, files=rule)
        refused(err, "spec.data.paths[0]", "state.json names")


def test_a_token_shard_index_naming_a_shard_outside_is_refused(tree: Tree) -> None:
    docs = tree.root / "docs"
    docs.mkdir()
    for i, text in enumerate(documents(30)):
        (docs / f"{i:02d}.txt").write_text(text)
    shards = tree.root / "shards"
    prepare_shards([str(docs / "*.txt")], shards, files=tree.rule)
    spec = DataSpec(paths=[str(shards)], format="tokens", seq_len=16)
    assert TokenShardDataset(spec, 256, files=tree.rule).n_samples > 0
    index = json.loads((shards / "index.json").read_text())
    index["shards"][0]["file"] = str(tree.secret)
    (shards / "index.json").write_text(json.dumps(index))
    with pytest.raises(FileRuleError) as err:
        TokenShardDataset(spec, 256, files=tree.rule)
    refused(err, "spec.data.paths[0]", "an absolute path")

    index["shards"][0]["file"] = "shard_00000.bin"
    (shards / "index.json").write_text(json.dumps(index))
    (shards / "shard_00000.bin").unlink()
    (shards / "shard_00000.bin").symlink_to(tree.secret)  # mapped, its size would not match the index
    with pytest.raises(FileRuleError) as err:
        build_dataset(spec, 256, files=tree.rule)
    refused(err, "spec.data.paths[0]", "through a symlink")


def test_a_glob_match_symlinked_outside_is_refused_before_any_file_is_read(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tree.root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a document inside the root\n" * 20)
    (docs / "b.txt").symlink_to(tree.secret)
    read: list[Path] = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    spec = DataSpec(paths=[str(docs / "*.txt")], tokenizer="byte", seq_len=16)
    with pytest.raises(FileRuleError) as err:
        build_dataset(spec, 256, files=tree.rule)
    refused(err, "spec.data.paths", "outside the data roots")
    assert read == []  # not even the file inside the root: every match is checked first

    write_jsonl(docs / "a.jsonl", [{"text": d} for d in documents(20)])
    (docs / "b.jsonl").symlink_to(tree.secret)  # read, it would not be JSON
    records = DataSpec(paths=[str(docs / "*.jsonl")], format="jsonl", tokenizer="byte", seq_len=16)
    with pytest.raises(FileRuleError) as err:
        build_dataset(records, 256, files=tree.rule)
    refused(err, "spec.data.paths", "outside the data roots")
    assert read == []


def test_a_data_file_linked_into_another_tenants_run_directory_is_refused(tree: Tree) -> None:
    (tree.runs / "theirs" / "notes.txt").write_text(SECRET * 64)
    (tree.runs / "mine" / "notes.txt").write_text("my own run's notes\n" * 20)
    docs = tree.root / "docs"
    docs.mkdir()
    (docs / "mine.txt").symlink_to(tree.runs / "mine" / "notes.txt")
    spec = DataSpec(paths=[str(docs / "*.txt")], tokenizer="byte", seq_len=16)
    assert build_dataset(spec, 256, files=tree.rule).n_samples > 0  # this job's own run: readable whatever the roots
    (docs / "theirs.txt").symlink_to(tree.runs / "theirs" / "notes.txt")
    for rule, rule_text in ((tree.rule, "outside the data roots"), (tree.unconfined(), "run directory of a job")):
        with pytest.raises(FileRuleError) as err:
            build_dataset(spec, 256, files=rule)
        refused(err, "spec.data.paths", rule_text)


# ---- init_from checkpoints -------------------------------------------------------------------------


def fake_checkpoint(run: Path) -> Path:
    """A complete checkpoint's markers in `run`'s checkpoints/ (a DCP metadata file of garbage, a
    manifest, the recorded job): all `open_checkpoint` reads, none of it loadable weights."""
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / METADATA).write_bytes(b"not a pickle")
    (step / COMPLETE).write_text(json.dumps({"files": {METADATA: len(b"not a pickle")}}))
    (run / "checkpoints" / "job.json").write_text(tiny_job("@stdlib").model_dump_json())
    return step


def test_init_from_in_another_tenants_run_directory_is_refused_and_ones_own_is_read(tree: Tree) -> None:
    fake_checkpoint(tree.runs / "theirs")
    mine = fake_checkpoint(tree.runs / "mine")
    assert open_checkpoint(tree.runs / "mine", files=tree.rule).path == mine  # a readable run, outside the roots
    for rule, rule_text in ((tree.rule, "outside the data roots"), (tree.unconfined(), "run directory of a job")):
        with pytest.raises(FileRuleError) as err:
            open_checkpoint(tree.runs / "theirs", files=rule)
        refused(err, "spec.init_from", rule_text)
    (tree.root / "link").symlink_to(tree.runs / "theirs" / "checkpoints")
    with pytest.raises(FileRuleError) as err:
        open_checkpoint(tree.root / "link", files=tree.unconfined())
    refused(err, "spec.init_from", "run directory of a job")


def test_init_from_files_that_escape_are_refused_before_dcp_reads_them(tree: Tree) -> None:
    run = tree.root / "run"
    step = fake_checkpoint(run)
    assert open_checkpoint(run, files=tree.rule).path == step

    (step / "__0_0.distcp").symlink_to(tree.secret)  # DCP would open it for the tensors its metadata names
    with pytest.raises(FileRuleError) as err:
        read_model_state(step, tree.rule)  # read, the metadata would be an unpickling error
    refused(err, "spec.init_from", "outside the data roots")

    manifest = {"files": {METADATA: 12, os.path.relpath(tree.secret, step): 1}}
    (step / COMPLETE).write_text(json.dumps(manifest))
    with pytest.raises(FileRuleError) as err:
        open_checkpoint(run, files=FileRule())
    refused(err, "spec.init_from", "climbs out of its directory")

    (step / COMPLETE).write_text(json.dumps({"files": {METADATA: 12}}))
    (run / "checkpoints" / "job.json").unlink()
    (run / "checkpoints" / "job.json").symlink_to(tree.secret)  # read, it would not be a job record
    with pytest.raises(FileRuleError) as err:
        open_checkpoint(run, files=tree.rule)
    refused(err, "spec.init_from", "outside the data roots")
