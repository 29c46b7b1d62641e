"""RunDirectory names every part of a job's run directory (the on-disk layout the service, supervisors,
ranks and users rely on), and `resolve_checkpoint` tells a run directory from a checkpoint root by what
the path holds."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import trainctl.parallelism.run_directory as run_directory
from trainctl.parallelism.checkpoint.layout import COMPLETE, step_dir_name
from trainctl.parallelism.checkpoint.source import CheckpointNotFoundError, resolve_checkpoint
from trainctl.parallelism.run_directory import RunDirectory


def save(root: Path, step: int) -> Path:
    """A complete (empty) checkpoint of `step` in checkpoint root `root`, as the engine leaves one."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / COMPLETE).write_text(json.dumps({"files": {}}))
    return path


def test_the_layout_on_disk(tmp_path: Path) -> None:
    run = RunDirectory.of_job(tmp_path / "runs", "job-1")
    assert run.root == tmp_path / "runs" / "job-1"
    assert run.events == run.root / "events.jsonl"
    assert run.ray_session == run.root / "ray_session"
    assert run.checkpoints == run.root / "checkpoints"
    assert run.run_spec == run.root / "checkpoints" / "job.json"
    assert run.logs == run.root / "logs"
    assert RunDirectory.run_spec_in(tmp_path / "ckpt") == tmp_path / "ckpt" / "job.json"


@pytest.mark.parametrize("job_id", ["../x", "a/b", "", ".hidden", "x" * 129])
def test_a_job_id_that_is_not_one_safe_path_component_is_refused(tmp_path: Path, job_id: str) -> None:
    with pytest.raises(ValueError, match="job id"):
        RunDirectory.of_job(tmp_path, job_id)


def test_built_again_from_the_string_handed_down(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    built = RunDirectory.of_job(tmp_path / "link", "job-1")
    again = RunDirectory.at(str(built.root))
    assert again.root == (tmp_path / "real" / "job-1").resolve()
    assert RunDirectory.at(built) == RunDirectory.at(built.root) == again
    with pytest.raises(ValueError, match="empty"):
        RunDirectory.at("")


def test_create_makes_the_directory_and_its_checkpoints_once(tmp_path: Path) -> None:
    run = RunDirectory.of_job(tmp_path / "runs", "job-1")
    assert RunDirectory.laid_out_at(run.root) is None
    assert run.create() == run and run.checkpoints.is_dir()
    save(run.checkpoints, 2)
    run.create()  # again: what is there stays
    assert RunDirectory.laid_out_at(run.root) == run
    assert (run.checkpoints / step_dir_name(2) / COMPLETE).is_file()


def test_a_run_directory_is_known_by_its_parts_and_a_checkpoint_root_is_not_one(tmp_path: Path) -> None:
    logged = RunDirectory(tmp_path / "logged")
    logged.root.mkdir()
    logged.events.write_text("")
    assert RunDirectory.laid_out_at(logged.root) == logged
    root = tmp_path / "root"
    save(root, 4)
    assert RunDirectory.laid_out_at(root) is None


def test_resolve_checkpoint_takes_a_step_a_checkpoint_root_or_a_run_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    save(root, 2)
    newest_in_root = save(root, 4)
    run = RunDirectory.of_job(tmp_path / "runs", "job-1").create()
    save(run.checkpoints, 6)
    newest_in_run = save(run.checkpoints, 8)
    assert resolve_checkpoint(newest_in_root) == newest_in_root
    assert resolve_checkpoint(root) == newest_in_root
    assert resolve_checkpoint(run.root) == newest_in_run
    assert resolve_checkpoint(run.checkpoints) == newest_in_run


def test_resolve_checkpoint_says_where_it_looked(tmp_path: Path) -> None:
    run = RunDirectory.of_job(tmp_path / "runs", "job-1").create()
    with pytest.raises(CheckpointNotFoundError, match=r"in its checkpoints/ \(it is a run directory\)"):
        resolve_checkpoint(run.root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint there .*step_\* directories in it\)"):
        resolve_checkpoint(empty)


def test_the_module_imports_the_standard_library_only() -> None:
    tree = ast.parse(Path(run_directory.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}
