"""The fields of a job spec that name files or directories, and a spec file's relative paths made absolute.

`path_fields(spec)` lists every value of a `JobSpecBody` that names a place in the file system, as a
`PathField` (the dotted field, the value, whether it is a glob): `spec.model.from_pretrained`,
`spec.data.paths[i]` (globs for text, JSONL and Parquet; directories for token shards and Arrow;
`@stdlib` is not a path), `spec.data.tokenizer` (unless `byte` or `auto`), the same two of
`spec.evaluation.data`, `spec.init_from` (unless
`job:<id>`, a reference to an earlier job) and `spec.command.working_dir`; of the last three a blank
value is left to the spec's own rules (an empty data path or tokenizer is listed: it names no file). This is the one list: the service's path policy (trainctl.service.security.paths) walks it,
and `with_paths_under` rewrites it.

`with_paths_under(spec, directory)` is the spec with each relative path joined to `directory` and
normalised (a spec file's directory: `load_job_file` calls it, so `trainctl validate|plan|submit FILE`,
the torchrun launcher and the demo read `model: {from_pretrained: tiny-qwen2}` beside FILE whatever the
current directory). Absolute paths and `~` paths (expanded where they are used, as before) stay as
written; in a glob the directory's own glob characters are escaped. A spec that arrives over gRPC has
no directory: the service refuses its relative paths.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from trainctl.spec.bounds import MAX_PATH_LENGTH
from trainctl.spec.job import STDLIB_CORPUS, TOKENIZER_AUTO, DataSpec, JobSpecBody
from trainctl.spec.violations import FieldViolation, SpecError

JOB_REFERENCE_PREFIX = "job:"
"""`init_from: job:<id>` names the checkpoints of the caller's earlier job `<id>`, not a path."""
TOKENIZER_NAMES = frozenset({"byte", TOKENIZER_AUTO})
"""`data.tokenizer` values that name a tokenizer rather than a file."""
GLOB_FORMATS = frozenset({"text", "jsonl", "parquet"})
"""`data.format`s whose `paths` are glob patterns of files; the others name directories literally."""


@dataclass(frozen=True)
class PathField:
    """One path a spec names: its dotted field (`spec.data.paths[0]`), its value, whether it is a glob."""

    field: str
    value: str
    glob: bool = False


def _map_paths(spec: JobSpecBody, change: Callable[[PathField], str]) -> JobSpecBody:
    """`spec` with each path field's value replaced by `change(field)` (the one list of path fields);
    `spec` itself when nothing changed."""

    def mapped(field: str, value: str | None, *, is_glob: bool = False, skip: bool = False) -> str | None:
        if value is None or skip:
            return value
        return change(PathField(field, value, is_glob))

    def optional(field: str, value: str | None, skip: bool = False) -> str | None:
        """An optional path: blank is the spec's own error (it names no path)."""
        return mapped(field, value, skip=skip or value is None or not value.strip())

    def changed(block: BaseModel, **values: object) -> BaseModel:
        update = {name: value for name, value in values.items() if value != getattr(block, name)}
        return block.model_copy(update=update) if update else block

    def data_paths(data: DataSpec, field: str) -> BaseModel:
        globs = data.format in GLOB_FORMATS
        paths = [mapped(f"{field}.paths[{i}]", p, is_glob=globs, skip=p == STDLIB_CORPUS) for i, p in enumerate(data.paths)]
        tokenizer = mapped(f"{field}.tokenizer", data.tokenizer, skip=data.tokenizer in TOKENIZER_NAMES)
        return changed(data, paths=paths, tokenizer=tokenizer)

    command, evaluation = spec.command, spec.evaluation
    data = data_paths(spec.data, "spec.data")
    init_from = optional("spec.init_from", spec.init_from,
                         skip=spec.init_from is not None and spec.init_from.startswith(JOB_REFERENCE_PREFIX))
    pretrained = optional("spec.model.from_pretrained", spec.model.from_pretrained)
    working_dir = optional("spec.command.working_dir", command.working_dir) if command is not None else None
    eval_data = data_paths(evaluation.data, "spec.evaluation.data") if evaluation is not None and evaluation.data else None
    return changed(
        spec,
        data=data,
        evaluation=changed(evaluation, data=eval_data) if eval_data is not None else evaluation,
        model=changed(spec.model, from_pretrained=pretrained),
        init_from=init_from,
        command=changed(command, working_dir=working_dir) if command is not None else None,
    )


def path_fields(spec: JobSpecBody) -> list[PathField]:
    """Every path `spec` names (see the module docstring), in field order."""
    found: list[PathField] = []

    def record(field: PathField) -> str:
        found.append(field)
        return field.value

    _map_paths(spec, record)
    return found


def is_relative(value: str) -> bool:
    """Whether `value` is a relative path (`~` paths are not: they are expanded where they are used;
    nor is a blank value: it is no path)."""
    return bool(value.strip()) and not os.path.isabs(value) and not value.startswith("~")


def with_paths_under(spec: JobSpecBody, directory: str | os.PathLike[str]) -> JobSpecBody:
    """`spec` with every relative path joined to `directory` (made absolute) and normalised; SpecError
    naming the field when a result is longer than a path field may be."""
    base = os.path.abspath(directory)
    too_long: list[FieldViolation] = []

    def absolute(field: PathField) -> str:
        if not is_relative(field.value):
            return field.value
        joined = os.path.normpath(os.path.join(glob.escape(base) if field.glob else base, field.value))
        if len(joined) > MAX_PATH_LENGTH:
            too_long.append(FieldViolation(field.field, f"{len(joined)} characters once joined to the spec file's "
                                                        f"directory {base}; at most {MAX_PATH_LENGTH}"))
        return joined

    resolved = _map_paths(spec, absolute)
    if too_long:
        raise SpecError(too_long)
    return resolved
