"""A TrainingJob from spec text, and the semantic rules that relate its fields.

Every problem is a `FieldViolation` naming the dotted field path (`spec.parallelism.tp`), so the CLI,
the gRPC API (google.rpc.BadRequest) and the engine all report the same thing. `semantic_violations`
gathers them all: the layout, batch, resource and command-job rules here, the model's
(trainctl.spec.model_checks) and the data's (trainctl.spec.data_checks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from trainctl.spec.bounded_yaml import bounded_spec_text, bounded_yaml_document
from trainctl.spec.command_spec import CommandSpec
from trainctl.spec.data_checks import data_violations, evaluation_data_violations
from trainctl.spec.data_format import HOLDOUT_FORMATS
from trainctl.spec.elastic import model_parallel_size, shrunk_candidates
from trainctl.spec.files import FileRule
from trainctl.spec.job import DataSpec, JobSpecBody, Metadata, TrainingJob, TrainingSpec
from trainctl.spec.model_checks import model_shape, model_violations, pretrained_violations
from trainctl.spec.model_spec import ModelSpec
from trainctl.spec.path_fields import with_paths_under
from trainctl.spec.presets import ModelConfig
from trainctl.spec.pydantic_violations import violations_from_pydantic
from trainctl.spec.violations import (
    FieldViolation as FieldViolation,  # re-exported: most callers import it here
)
from trainctl.spec.violations import SpecError as SpecError


def parse_yaml(text: str) -> TrainingJob:
    """Parse YAML text into a TrainingJob, raising SpecError that names each bad field."""
    return parse_object(bounded_yaml_document(text))


def parse_object(document: dict) -> TrainingJob:
    """Validate a decoded mapping into a TrainingJob (schema only)."""
    try:
        return TrainingJob.model_validate(document)
    except ValidationError as exc:
        raise SpecError(violations_from_pydantic(exc)) from exc



def load_job_file(path: str | os.PathLike[str]) -> TrainingJob:
    """Read and schema-validate a spec file, its relative paths resolved against the file's directory
    (trainctl.spec.path_fields)."""
    job = parse_yaml(bounded_spec_text(path))
    return job.model_copy(update={"spec": with_paths_under(job.spec, Path(path).parent)})


def semantic_violations(job: TrainingJob, *, pool_gpus: int | None = None, check_data: bool = True) -> list[FieldViolation]:
    """Rules that relate fields: layout vs. model shape, batch arithmetic, resources, data.

    With check_data False no file is read: a `spec.model.from_pretrained` model's shape rules are then
    left to `pretrained_violations`, which the service calls once the path rule let the path through."""
    spec = job.spec
    if spec.command is not None:
        return _command_job_violations(spec, pool_gpus=pool_gpus, check_paths=check_data)
    par = spec.parallelism
    train = spec.training
    out: list[FieldViolation] = _resource_violations(spec, pool_gpus)

    def bad(field: str, description: str) -> None:
        out.append(FieldViolation(field, description))

    model: ModelConfig | None = None
    if spec.model.from_pretrained is not None:
        if check_data:
            out.extend(pretrained_violations(job))
    else:
        model, problems = model_shape(spec.model, FileRule())
        out.extend(problems)

    if par.dp_shard > 1 and par.zero_stage == 0:
        bad("spec.parallelism.zero_stage", "zero_stage 0 (plain DDP) with dp_shard > 1: use dp_replicate for DDP")
    if (par.dp_shard * par.cp) % par.ep:
        bad("spec.parallelism.ep", f"ep={par.ep} must divide dp_shard x cp = {par.dp_shard * par.cp}")
    if par.sequence_parallel and par.tp == 1:
        bad("spec.parallelism.sequence_parallel", "sequence parallelism needs tp > 1")
    if par.pp_schedule == "interleaved_1f1b" and par.pp_virtual_stages < 2:
        bad("spec.parallelism.pp_virtual_stages", "interleaved_1f1b needs at least 2 virtual stages per rank")
    if par.pp_virtual_stages > 1 and par.pp_schedule not in ("interleaved_1f1b", "zero_bubble"):
        bad("spec.parallelism.pp_virtual_stages", f"virtual stages need an interleaved schedule, not {par.pp_schedule}")

    per_rank, rem = divmod(train.global_batch_size, par.dp)
    if rem:
        bad("spec.training.global_batch_size", f"{train.global_batch_size} is not divisible by dp_replicate x dp_shard = {par.dp}")
    elif train.micro_batch_size == "auto":
        if par.pp > 1:
            bad("spec.training.micro_batch_size", "auto needs pp = 1 (the pipeline schedule fixes the micro-batch count)")
    elif per_rank % train.micro_batch_size:
        bad(
            "spec.training.micro_batch_size",
            f"the per-rank batch global_batch_size / dp = {per_rank} is not divisible by micro_batch_size {train.micro_batch_size}",
        )
    elif par.pp > 1:
        microbatches = per_rank // train.micro_batch_size
        if microbatches < par.pp:
            bad(
                "spec.training.global_batch_size",
                f"pipeline needs at least pp = {par.pp} micro-batches per step, the batch gives {microbatches} "
                "(global_batch_size / dp / micro_batch_size)",
            )
        elif par.pp_virtual_stages > 1 and microbatches % par.pp:
            bad("spec.training.global_batch_size", f"interleaved schedules need micro-batches ({microbatches}) divisible by pp = {par.pp}")

    seq = spec.data.seq_len
    if par.cp > 1:
        chunks = 2 * par.cp if par.cp_load_balance else par.cp
        if seq % chunks:
            bad("spec.data.seq_len", f"{seq} is not divisible by {chunks} (context-parallel chunks)")
    local_seq = seq // par.cp
    if par.sequence_parallel and (seq % par.cp or local_seq % par.tp):
        bad(
            "spec.data.seq_len",
            f"the per-CP-rank sequence seq_len / cp = {seq} / {par.cp} must be divisible by tp = {par.tp} (sequence parallel)",
        )

    if model is not None:
        out.extend(model_violations(model, job))

    out.extend(_evaluation_violations(spec))
    out.extend(_elastic_violations(job))
    if check_data:
        out.extend(data_violations(spec.data, model_dir=spec.model.from_pretrained))
        out.extend(evaluation_data_violations(spec))
    out.extend(_efficiency_violations(job))
    return out


def _evaluation_violations(spec: JobSpecBody) -> list[FieldViolation]:
    """`spec.evaluation` against the training data: the same seq_len, a format documents can be held out of."""
    evaluation = spec.evaluation
    if evaluation is None:
        return []
    if evaluation.data is not None and evaluation.data.seq_len != spec.data.seq_len:
        return [FieldViolation(
            "spec.evaluation.data.seq_len", f"{evaluation.data.seq_len} must equal spec.data.seq_len = {spec.data.seq_len}"
        )]
    if evaluation.holdout_fraction is not None and spec.data.format not in HOLDOUT_FORMATS:
        return [FieldViolation(
            "spec.evaluation.holdout_fraction",
            f"spec.data.format {spec.data.format} (prepared token shards) keeps no document boundaries to hold "
            "documents out by; set spec.evaluation.data to separate evaluation data instead",
        )]
    return []



def _resource_violations(spec: JobSpecBody, pool_gpus: int | None) -> list[FieldViolation]:
    """`resources.gpus` against the layout's world size and the pool."""
    par = spec.parallelism
    out = []
    world = par.world_size
    if spec.resources.gpus != world:
        out.append(FieldViolation(
            "spec.resources.gpus",
            f"{spec.resources.gpus} GPUs requested but the layout pp x dp_replicate x dp_shard x cp x tp = "
            f"{par.pp} x {par.dp_replicate} x {par.dp_shard} x {par.cp} x {par.tp} = {world} ranks",
        ))
    if pool_gpus is not None and spec.resources.gpus > pool_gpus:
        out.append(FieldViolation(
            "spec.resources.gpus", f"{spec.resources.gpus} GPUs requested but the pool can never hold more than {pool_gpus}"
        ))
    return out


def elastic_layouts(spec: JobSpecBody, max_gpus: int) -> Iterator[JobSpecBody]:
    """The layouts an elastic job's `spec` may shrink to on at most `max_gpus` GPUs, largest first
    (`trainctl.spec.elastic.shrunk_candidates`), each one every rule of the spec accepts (checked without
    reading files: the submitted job's were checked at submit)."""
    for body in shrunk_candidates(spec, max_gpus):
        job = TrainingJob.model_construct(metadata=Metadata.model_construct(name="elastic"), spec=body)  # rules read spec only
        if not semantic_violations(job, check_data=False):
            yield body


def layout_on(spec: JobSpecBody, gpus: int) -> JobSpecBody | None:
    """The body a job of `spec` runs on `gpus` GPUs: `spec` on `resources.gpus`, else the elastic layout of that
    size (`elastic_layouts`: one per size), or None when it has none. A plan's size names its layout, so a
    supervisor, a relaunch and the scheduler derive it from the plan alone."""
    if gpus == spec.resources.gpus:
        return spec
    return next((body for body in elastic_layouts(spec, gpus) if body.resources.gpus == gpus), None)


def _elastic_violations(job: TrainingJob) -> list[FieldViolation]:
    """`scheduling.elastic` against the layout: a minimum of whole replicas below `resources.gpus`, from which at
    least one smaller layout is valid, and checkpoints resumed from."""
    spec = job.spec
    elastic = spec.scheduling.elastic
    if elastic is None:
        return []
    field = "spec.scheduling.elastic.min_gpus"
    unit = model_parallel_size(spec.parallelism)
    if elastic.min_gpus % unit:
        return [FieldViolation(field, f"{elastic.min_gpus} is not a multiple of pp x cp x tp = {unit} (one data-parallel replica)")]
    if elastic.min_gpus >= spec.resources.gpus:
        return [FieldViolation(field, f"{elastic.min_gpus} leaves nothing to shrink: it must be below resources.gpus = {spec.resources.gpus}")]
    if not spec.checkpoint.resume:
        return [FieldViolation("spec.checkpoint.resume", "an elastic job resumes from its checkpoints when it shrinks or grows: it must be true")]
    if spec.resources.gpus != spec.parallelism.world_size or next(elastic_layouts(spec, spec.resources.gpus), None) is not None:
        return []
    return [FieldViolation(
        field,
        f"no smaller layout from {spec.resources.gpus} down to {elastic.min_gpus} GPUs keeps every rule (the global batch "
        f"{spec.training.global_batch_size} split evenly into micro-batches of every replica, shard groups whole under HSDP)",
    )]


ENGINE_SECTIONS = (("model", ModelSpec), ("data", DataSpec), ("training", TrainingSpec))
"""The built-in engine's sections, which a command job leaves at their defaults."""


def _command_job_violations(spec: JobSpecBody, *, pool_gpus: int | None, check_paths: bool) -> list[FieldViolation]:
    """A command job: no built-in engine field is set, the declared layout matches `resources.gpus`, and
    (with ``check_paths``) its working directory exists."""
    out = _resource_violations(spec, pool_gpus)
    for section, model in ENGINE_SECTIONS:
        given, default = getattr(spec, section), model()
        out.extend(
            FieldViolation(
                f"spec.{section}.{name}",
                "is a built-in engine setting; a job with spec.command runs its own program and cannot set it",
            )
            for name in type(given).model_fields
            if getattr(given, name) != getattr(default, name)
        )
    for name in ("init_from", "lora"):
        if getattr(spec, name) is not None:
            out.append(FieldViolation(
                f"spec.{name}", "is a built-in engine setting; a job with spec.command runs its own program and cannot set it"
            ))
    if spec.scheduling.elastic is not None:
        out.append(FieldViolation(
            "spec.scheduling.elastic", "elastic data parallel is the built-in engine's; a command job's program owns its layout",
        ))
    if spec.checkpoint.memory_interval_steps:
        out.append(FieldViolation(
            "spec.checkpoint.memory_interval_steps",
            "in-memory snapshots are the built-in engine's; a command job saves its state in its own program",
        ))
    if spec.evaluation is not None:
        out.append(FieldViolation(
            "spec.evaluation", "a command job evaluates in its own program and reports eval_loss through trainctl.report"
        ))
    if check_paths and spec.command is not None:
        out.extend(working_dir_violations(spec.command))
    return out


def working_dir_violations(command: CommandSpec) -> list[FieldViolation]:
    """`spec.command.working_dir`, when set, is an existing directory."""
    directory = command.working_dir
    if directory is None:
        return []
    if not directory.strip():
        return [FieldViolation("spec.command.working_dir", "must be a directory, not empty")]
    path = Path(os.path.expanduser(directory))
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        return [FieldViolation("spec.command.working_dir", f"{directory!r} {what}")]
    return []



def _efficiency_violations(job: TrainingJob) -> list[FieldViolation]:
    """Rules of the optimizer kernel, LoRA and init_from fields."""
    spec = job.spec
    par = spec.parallelism
    out: list[FieldViolation] = []
    if spec.training.optimizer == "adafactor" and spec.training.optimizer_impl == "fused":
        out.append(FieldViolation("spec.training.optimizer_impl", "adafactor has no fused kernel; use auto or foreach"))
    if spec.lora is not None:
        for dim in ("tp", "pp", "cp", "ep"):
            if getattr(par, dim) > 1:
                out.append(FieldViolation(
                    f"spec.parallelism.{dim}",
                    f"LoRA composes with data parallelism (DDP, ZeRO-1/2, FSDP, HSDP) only; {dim} must be 1",
                ))
    if spec.init_from is not None and not spec.init_from.strip():
        out.append(FieldViolation("spec.init_from", "must be a checkpoint path, not empty"))
    return out


def validate_job(job: TrainingJob, *, pool_gpus: int | None = None, check_data: bool = True) -> TrainingJob:
    """Raise SpecError if `job` breaks any semantic rule; return it otherwise."""
    violations = semantic_violations(job, pool_gpus=pool_gpus, check_data=check_data)
    if violations:
        raise SpecError(violations)
    return job
