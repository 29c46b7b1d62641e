"""Which checkpoint a path names and what wrote it, without torch: a `step_*` checkpoint, a checkpoint
root (its newest complete one) or a job's run directory (trainctl.parallelism.run_directory: its
`checkpoints/`), and the job recorded beside it as `job.json` (`write_run_spec`). The service checks `init_from` with `init_from_problem` at
submit time; `trainctl.parallelism.checkpoint.pretrained` loads the weights.

Everything is read under the job's `FileRule` (trainctl.spec.files): the path itself, the markers and
manifests (`layout`), `job.json` (bounded) and the config.json of the model it names; a file the rule
refuses is a `FileRuleError` naming `spec.init_from`, raised before the file is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from trainctl.parallelism.checkpoint import layout
from trainctl.parallelism.checkpoint.layout import FIELD
from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.layouts.grid import LayoutError
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.files import MAX_JSON_BYTES, FileRule, FileRuleError
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig, PretrainedConfigError, UnknownPresetError


class CheckpointNotFoundError(ConfigurationError, FileNotFoundError):
    """The path names no usable checkpoint (the message says what was looked for)."""


@dataclass(frozen=True)
class Pretrained:
    """A resolved checkpoint: where it is, the job that wrote it, its model shape."""

    path: Path
    job: JobSpecBody
    config: ModelConfig


def write_run_spec(checkpoint_dir: str | Path, job: JobSpecBody) -> None:
    """Record `job` in `checkpoint_dir/job.json` (atomically; call on one rank)."""
    spec_file = RunDirectory.run_spec_in(checkpoint_dir)
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = spec_file.with_name(f".{spec_file.name}.tmp")
    tmp.write_text(job.model_dump_json(indent=2))
    tmp.replace(spec_file)


def resolve_checkpoint(path: str | Path, files: FileRule = FileRule()) -> Path:
    """The complete `step_*` checkpoint `path` names, read under `files`. `path` may be what a user
    passes: a `step_*` checkpoint (one with a `COMPLETE` marker: itself, checked intact), a job's run
    directory (laid out as one, `RunDirectory.laid_out_at`: the newest in its `checkpoints/`) or a
    checkpoint root (any other directory: the newest `step_*` in it)."""
    path = files.check(path, FIELD)
    if (path / layout.COMPLETE).is_file():
        problem = layout.checkpoint_problem(path, files)
        if problem is not None:
            raise CheckpointNotFoundError(f"{path}: the checkpoint is damaged: {problem}")
        return path
    run = RunDirectory.laid_out_at(path)
    root = path if run is None else run.checkpoints
    found = layout.latest_checkpoint(root, files=files)
    if found is not None:
        return found[1]
    looked_in = "it" if run is None else f"its {run.checkpoints.name}/ (it is a run directory)"
    raise CheckpointNotFoundError(
        f"{path}: no complete checkpoint there (looked for a step_* directory with {layout.COMPLETE}, "
        f"and for step_* directories in {looked_in})"
    )


def open_checkpoint(path: str | Path, job: JobSpecBody | None = None, files: FileRule = FileRule()) -> Pretrained:
    """Resolve `path` and the job that wrote it (its recorded job.json unless `job` is given), read under `files`."""
    step_dir = resolve_checkpoint(path, files)
    if job is None:
        spec_file = files.check(RunDirectory.run_spec_in(step_dir.parent), FIELD)
        if not spec_file.is_file():
            raise CheckpointNotFoundError(
                f"{step_dir}: the run recorded no {spec_file.name} beside its checkpoints; pass the job spec explicitly"
            )
        raw = files.read_bytes(spec_file, FIELD, MAX_JSON_BYTES)
        try:
            job = JobSpecBody.model_validate_json(raw)
        except ValidationError as exc:
            raise CheckpointNotFoundError(f"{spec_file}: not a readable job record: {exc}") from exc
    if job.command is not None:
        raise CheckpointNotFoundError(
            f"{step_dir}: written by a command job, whose program keeps checkpoints in its own format: no model to load"
        )
    try:
        config = ResolvedJob.resolve(job, files).config
    except (UnknownPresetError, PretrainedConfigError, LayoutError) as exc:
        raise CheckpointNotFoundError(f"{step_dir}: the model it was written for is unknown: {exc}") from exc
    return Pretrained(path=step_dir, job=job, config=config)


def _weight_shape(config: ModelConfig) -> dict[str, object]:
    """The fields of a model shape that decide its parameters' names and shapes."""
    moe = config.moe
    return {
        "vocab_size": config.vocab_size, "dim": config.dim, "n_layers": config.n_layers, "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads, "ffn_dim": config.ffn_dim, "head_dim": config.head_dim,
        "qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm, "tie_embeddings": config.tie_embeddings,
        "moe": None if moe is None else (moe.num_experts, moe.shared_expert, moe.interval),
    }


def init_from_problem(path: str, model: ModelConfig, files: FileRule = FileRule()) -> str | None:
    """Why `path` cannot be the init_from of a job training `model`, or None: it names no intact complete
    checkpoint, its run recorded no job, its files break `files`, or its model's parameters differ. Reads
    markers, manifests and the recorded job only, never the weights (the submit-time check; loading
    catches the rest)."""
    try:
        source = open_checkpoint(path, files=files)
    except CheckpointNotFoundError as exc:
        return str(exc)
    except FileRuleError as exc:
        return exc.message
    except OSError as exc:  # a name too long, a directory without permission
        return f"{path}: {exc.strerror or exc}"
    theirs, ours = _weight_shape(source.config), _weight_shape(model)
    differ = [f"{name} {theirs[name]} (this job: {ours[name]})" for name in ours if theirs[name] != ours[name]]
    if differ:
        return f"{source.path} holds a model of another shape: {', '.join(differ)}"
    return None
