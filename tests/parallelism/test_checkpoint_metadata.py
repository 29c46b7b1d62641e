"""Reading a DCP checkpoint unpickles nothing but what DCP writes (trainctl.parallelism.checkpoint.dcp_reader).

A checkpoint named by `spec.init_from` may be a directory a tenant wrote inside a data root, and torch's
own reader `pickle.load`s its `.metadata` (and `torch.load`s its non-tensor items with
`weights_only=False`): a pickle whose reduce calls `os.system` would run on every rank. Here real
checkpoints of the engine load through trainctl's reader (with torch's unrestricted readers made to
fail), and hostile ones are refused naming the spec field, the file and the global, while the marker
file their payload would create never appears. Each payload is shown to work: plain `pickle` (or
torch's own planner) runs it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import tiny_job
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from trainctl.parallelism.checkpoint import dcp_reader
from trainctl.parallelism.checkpoint.dcp import load_checkpoint, save_checkpoint
from trainctl.parallelism.checkpoint.layout import COMPLETE, METADATA, latest_checkpoint
from trainctl.parallelism.checkpoint.pretrained import read_model_state
from trainctl.parallelism.checkpoint.source import init_from_problem
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.model.transformer import build_model
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model


class Payload:
    """An object whose unpickling calls `call(*args)`."""

    def __init__(self, call: Callable[..., object], args: tuple[object, ...]):
        self.call = call
        self.args = args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.call, self.args


PAYLOADS = {
    "os.system": lambda marker: (Payload(os.system, (f"touch {marker}",)), "posix.system"),
    "builtins.exec": lambda marker: (Payload(exec, (f"open({str(marker)!r}, 'w').close()",)), "builtins.exec"),
    "subprocess.Popen": lambda marker: (Payload(subprocess.Popen, (["touch", str(marker)],)), "subprocess.Popen"),
}
"""Per payload: (its object writing `marker` when unpickled, the global the refusal names)."""
HOSTILE = "hostile"


def appeared(marker: Path, unpickled: object) -> bool:
    """Whether `marker` exists once the payload's effect is done (a Popen it started has exited)."""
    if isinstance(unpickled, subprocess.Popen):
        unpickled.wait(timeout=30)
    return marker.exists()


def copy_run(base_run: Path, root: Path) -> Path:
    """A copy of `base_run`'s newest checkpoint and recorded job as `root/run` (a run directory); its step dir."""
    _, step = latest_checkpoint(base_run)
    run = RunDirectory(root / "run")
    target = run.checkpoints / step.name
    shutil.copytree(step, target)
    shutil.copy(RunDirectory.run_spec_in(base_run), run.run_spec)
    return target


def rewrite_metadata(step: Path, edit: Callable[[object], None]) -> bytes:
    """Apply `edit` to `step`'s DCP metadata (read with torch's reader: this checkpoint is the test's own),
    write it back and fix its size in the COMPLETE manifest, so the checkpoint stays intact; the new bytes."""
    metadata = FileSystemReader(str(step)).read_metadata()
    edit(metadata)
    raw = pickle.dumps(metadata)
    (step / METADATA).write_bytes(raw)
    manifest = json.loads((step / COMPLETE).read_text())
    manifest["files"][METADATA] = len(raw)
    (step / COMPLETE).write_text(json.dumps(manifest))
    return raw


def hostile_checkpoint(base_run: Path, root: Path, payload: Payload) -> tuple[Path, bytes]:
    """A copy of `base_run` in `root` whose metadata also holds `payload`; its step dir and metadata bytes."""
    step = copy_run(base_run, root)
    return step, rewrite_metadata(step, lambda metadata: metadata.planner_data.__setitem__(HOSTILE, payload))


def confined(*directories: Path) -> FileRule:
    return FileRule(tuple(os.path.realpath(d) for d in directories))


# ---- real checkpoints ------------------------------------------------------------------------------


def test_engine_checkpoints_load_without_torchs_unrestricted_readers(
    base_run: Path, corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unrestricted(*_args, **_kwargs):
        raise AssertionError("torch's unrestricted DCP reader was used")

    monkeypatch.setattr(FileSystemReader, "read_metadata", unrestricted)
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", unrestricted)
    torch.set_num_threads(1)

    # init_from: the whole model's weights, read under a rule confining them to the run
    step = copy_run(base_run, tmp_path / "root")
    weights = read_model_state(step, confined(tmp_path / "root"))
    job = JobSpecBody.model_validate_json(RunDirectory.run_spec_in(base_run).read_text())
    expected = build_model(resolve_model(job.model), 0).state_dict()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in expected.items()}

    # resume: model, optimizer and the non-tensor items (step, data offset, scheduler)
    checkpoints = tmp_path / "resume"
    shutil.copytree(base_run, checkpoints)
    result = Trainer(tiny_job(corpus, steps=4, training={"micro_batch_size": 4}), device="cpu", checkpoint_dir=checkpoints).run()
    assert result.resumed_from_step == 3 and result.steps_completed == 4


# ---- hostile metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_a_metadata_pickle_calling_a_global_is_refused_without_running_it(base_run: Path, tmp_path: Path, payload) -> None:
    marker = tmp_path / "marker"
    hostile, refused = payload(marker)
    step, raw = hostile_checkpoint(base_run, tmp_path / "root", hostile)

    with pytest.raises(ConfigurationError) as err:
        read_model_state(step, confined(tmp_path / "root"))  # init_from, export, generate
    assert str(err.value) == (
        f"spec.init_from: {step / METADATA}: the DCP metadata references the global {refused}, which no "
        "checkpoint's metadata holds; refused without loading the checkpoint"
    )
    with pytest.raises(ConfigurationError, match=f"^spec.checkpoint.resume: {step / METADATA}: .* the global {refused},"):
        load_checkpoint(step, {"train": {"step": 0}})  # a job's own resume
    assert not marker.exists()

    assert appeared(marker, pickle.loads(raw).planner_data[HOSTILE])  # what torch's pickle.load would have done


def test_a_non_tensor_item_calling_a_global_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    hostile, refused = PAYLOADS["os.system"](marker)
    path = save_checkpoint(tmp_path / "ckpt", 1, {"w": torch.ones(2), "train": {"step": hostile}}, keep_last=1)
    with pytest.raises(ConfigurationError, match=f"^spec.checkpoint.resume: {path}: its item train.step references the global {refused};"):
        load_checkpoint(path, {"w": torch.zeros(2), "train": {"step": 0}})
    assert not marker.exists()

    # torch's own planner loads the item with weights_only=False
    dcp.load({"w": torch.zeros(2), "train": {"step": 0}}, checkpoint_id=str(path), no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("name", ["../../outside/__0_0.distcp", "/etc/hostname"])
def test_a_storage_entry_naming_a_file_outside_the_checkpoint_is_refused(base_run: Path, tmp_path: Path, name: str) -> None:
    step = copy_run(base_run, tmp_path / "root")

    def point_outside(metadata) -> None:
        info = next(iter(metadata.storage_data.values()))
        info.relative_path = name

    rewrite_metadata(step, point_outside)
    with pytest.raises(FileRuleError) as err:
        read_model_state(step, FileRule())  # the default rule too: DCP opens `step / relative_path`
    assert err.value.field == "spec.init_from" and f"{step / METADATA} names {name!r}" in err.value.message


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (pickle.dumps([1, 2, 3]), "not a DCP metadata file (it holds a list)"),
        (b"not a pickle", "not a DCP metadata file (UnpicklingError: "),
        (pickle.dumps({"x": 1})[:-3], "not a DCP metadata file ("),
    ],
    ids=["another-value", "garbage", "truncated"],
)
def test_a_metadata_file_that_is_not_dcp_metadata_is_a_configuration_error(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / METADATA).write_bytes(content)
    with pytest.raises(ConfigurationError) as err:
        read_model_state(tmp_path)
    assert str(err.value).startswith(f"spec.init_from: {tmp_path / METADATA}: {why}")


def test_a_metadata_file_over_the_bound_is_refused_unread(base_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = copy_run(base_run, tmp_path / "root")
    monkeypatch.setattr(dcp_reader, "MAX_METADATA_BYTES", 1000)
    with pytest.raises(FileRuleError, match=f"^spec.init_from: {step / METADATA} is larger than 1000 bytes"):
        read_model_state(step)


# ---- submit and the rank ---------------------------------------------------------------------------


def test_a_hostile_init_from_passes_submit_unread_and_fails_the_rank_as_a_configuration_error(
    base_run: Path, corpus: str, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    hostile, refused = PAYLOADS["os.system"](marker)
    root = tmp_path / "root"
    step, _ = hostile_checkpoint(base_run, root, hostile)
    job = JobSpecBody.model_validate(
        {**tiny_job(corpus, steps=1, training={"micro_batch_size": 4}).model_dump(), "init_from": str(root / "run")}
    )
    rule = confined(root, Path(corpus).parent)

    # CreateJob's check reads the markers, manifest and recorded job, never the pickle: the checkpoint looks intact.
    assert init_from_problem(job.init_from, resolve_model(job.model), rule) is None
    assert not marker.exists()

    # The rank refuses it before unpickling: a ConfigurationError, which fails the job without restarts.
    with pytest.raises(ConfigurationError) as err:
        Trainer(job, device="cpu", file_rule=rule)
    assert str(err.value).startswith(f"spec.init_from: {step / METADATA}: the DCP metadata references the global {refused},")
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)  # as it reaches the supervisor
    assert not marker.exists()


def test_a_checkpoint_recorded_as_a_command_jobs_is_refused_by_name(base_run: Path, tmp_path: Path) -> None:
    """A command job's program keeps its own checkpoint format: naming its run as init_from is a clear
    refusal (CreateJob's check and `trainctl export` alike), never an error about a missing model shape."""
    run = tmp_path / "run"
    shutil.copytree(base_run.parent, run)
    command_job = JobSpecBody.model_validate({"command": {"program": "python", "args": ["train.py"]},
                                              "resources": {"gpus": 1, "device": "cpu"}})
    RunDirectory(run).run_spec.write_text(command_job.model_dump_json())
    problem = init_from_problem(str(run), resolve_model(tiny_job("unused").model))
    assert problem is not None and "written by a command job" in problem, problem
