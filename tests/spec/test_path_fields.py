"""Relative paths in a spec file resolve against the file's directory (trainctl.spec.path_fields), for
every path field and whatever the current directory; absolute and `~` paths, `@stdlib`, `byte` / `auto`
and `job:<id>` stay as written; a glob under a directory whose name holds glob characters still matches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from trainctl.spec.bounds import MAX_PATH_LENGTH
from trainctl.spec.data_checks import resolve_data_paths
from trainctl.spec.path_fields import path_fields
from trainctl.spec.sweep import load_sweep_file
from trainctl.spec.validate import SpecError, load_job_file


def write_spec(path: Path, spec: dict, kind: str = "TrainingJob") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"apiVersion": "trainctl/v1", "kind": kind, "metadata": {"name": "paths"}, "spec": spec}))
    return path


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current directory that is not the spec file's."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_every_relative_path_field_resolves_against_the_spec_files_directory(tmp_path: Path, elsewhere: Path) -> None:
    specs = tmp_path / "project" / "specs"
    engine = write_spec(specs / "engine.yaml", {
        "model": {"from_pretrained": "../models/tiny"},
        "data": {"paths": ["data/*.jsonl", "@stdlib", "/abs/b.txt", "~/c.txt"], "tokenizer": "./tok/tokenizer.json"},
    })
    resumed = write_spec(specs / "resumed.yaml", {"init_from": "runs/old", "data": {"tokenizer": "byte"}})
    command = write_spec(specs / "command.yaml", {"command": {"program": "python", "args": ["x.py"], "working_dir": "code"}})
    spec = load_job_file(engine).spec
    assert spec.model.from_pretrained == str(tmp_path / "project" / "models" / "tiny")
    assert spec.data.paths == [str(specs / "data" / "*.jsonl"), "@stdlib", "/abs/b.txt", "~/c.txt"]
    assert spec.data.tokenizer == str(specs / "tok" / "tokenizer.json")
    resumed_spec = load_job_file(resumed).spec
    assert (resumed_spec.init_from, resumed_spec.data.tokenizer) == (str(specs / "runs" / "old"), "byte")
    assert load_job_file(command).spec.command.working_dir == str(specs / "code")
    assert load_job_file(os.path.relpath(engine)) == load_job_file(engine), "the file named relative to the cwd"


def test_names_that_are_not_paths_stay_as_written(tmp_path: Path, elsewhere: Path) -> None:
    spec = load_job_file(write_spec(tmp_path / "a.yaml", {"init_from": "job:alpha-1", "data": {"tokenizer": "auto"}})).spec
    assert (spec.init_from, spec.data.tokenizer, spec.data.paths) == ("job:alpha-1", "auto", ["@stdlib"])
    assert path_fields(spec) == []
    written = write_spec(tmp_path / "b.yaml", {"model": {"from_pretrained": "  "}, "data": {"paths": [""]}})
    blank = load_job_file(written).spec  # blank values: the spec's own rules name them
    assert (blank.model.from_pretrained, blank.data.paths) == ("  ", [""])


def test_a_glob_under_a_directory_named_with_glob_characters_still_matches(tmp_path: Path, elsewhere: Path) -> None:
    specs = tmp_path / "runs[1]"
    (specs / "data").mkdir(parents=True)
    (specs / "data" / "a.txt").write_text("hello")
    (specs / "shards").mkdir()
    spec = load_job_file(write_spec(specs / "job.yaml", {"data": {"paths": ["data/*.txt"]}})).spec
    assert resolve_data_paths(spec.data.paths) == [specs / "data" / "a.txt"]
    shards = load_job_file(write_spec(specs / "tokens.yaml", {"data": {"paths": ["shards"], "format": "tokens"}})).spec
    assert shards.data.paths == [str(specs / "shards")], "token-shard directories are named literally, not globbed"


def test_a_path_too_long_once_resolved_names_its_field(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "long.yaml", {"model": {"from_pretrained": "m" * (MAX_PATH_LENGTH - 1)}})
    with pytest.raises(SpecError) as error:
        load_job_file(spec)
    [violation] = error.value.violations
    assert violation.field == "spec.model.from_pretrained" and str(MAX_PATH_LENGTH) in violation.description


def test_a_sweep_files_template_paths_resolve_too(tmp_path: Path, elsewhere: Path) -> None:
    body = {"template": {"model": {"from_pretrained": "tiny"}, "data": {"tokenizer": "byte"}},
            "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2}],
            "objective": {"metric": "loss"}, "trials": 2}
    sweep = load_sweep_file(str(write_spec(tmp_path / "sweeps" / "s.yaml", body, kind="Sweep")))
    assert sweep.spec.template.model.from_pretrained == str(tmp_path / "sweeps" / "tiny")
    body["template"]["model"]["from_pretrained"] = "m" * MAX_PATH_LENGTH
    with pytest.raises(SpecError) as error:
        load_sweep_file(str(write_spec(tmp_path / "sweeps" / "long.yaml", body, kind="Sweep")))
    assert [v.field for v in error.value.violations] == ["spec.template.model.from_pretrained"]
