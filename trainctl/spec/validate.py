"""Parsing and semantic validation of TrainingJob specs.

Every problem is a `FieldViolation` naming the dotted field path (`spec.parallelism.tp`), so the CLI,
the gRPC API (google.rpc.BadRequest) and the engine all report the same thing.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import yaml
from pydantic import ValidationError

from trainctl.spec import data_sources
from trainctl.spec.data_format import HOLDOUT_FORMATS, TOKEN_SHARD_INDEX
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.hf_config import weights_problem
from trainctl.spec.job import (
    STDLIB_CORPUS,
    TOKENIZER_AUTO,
    CommandSpec,
    DataSpec,
    JobSpecBody,
    ModelSpec,
    TrainingJob,
    TrainingSpec,
    resolve_tokenizer,
)
from trainctl.spec.path_fields import with_paths_under
from trainctl.spec.presets import ModelConfig, PretrainedConfigError, UnknownPresetError, resolve_model
from trainctl.spec.strict_yaml import StrictLoader
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


def violations_from_pydantic(exc: ValidationError, root: str = "<document>") -> list[FieldViolation]:
    """pydantic's errors as FieldViolations, the one formatting of them for every document trainctl
    reads (specs, topology maps, access files): the field's path (``spec.data.paths[0]``; ``root`` for
    the whole document), "unknown field" for a key the schema lacks, and a validator's message without
    pydantic's ``Value error, `` prefix."""
    out = []
    for error in exc.errors(include_input=False):
        path = ""
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{_path_part(part)}" if path else _path_part(part))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        out.append(FieldViolation(path or root, message))
    return out


def resolve_data_paths(patterns: list[str]) -> list[Path]:
    """Files matched by the spec's data globs, sorted, with `@stdlib` expanded."""
    files: set[Path] = set()
    for pattern in patterns:
        if pattern == STDLIB_CORPUS:
            root = Path(sysconfig.get_paths()["stdlib"])
            files.update(p for p in root.glob("*.py") if p.is_file())
        else:
            files.update(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    return sorted(files)


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
        model, problems = _resolved(spec.model, FileRule())
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


def evaluation_data_violations(spec: JobSpecBody, files: FileRule = FileRule()) -> list[FieldViolation]:
    """`data_violations` of `spec.evaluation.data` (none without it), its files under `files`, each
    naming its field under `spec.evaluation.data`."""
    if spec.evaluation is None or spec.evaluation.data is None:
        return []
    return [
        FieldViolation(v.field.replace("spec.data.", "spec.evaluation.data.", 1), v.description)
        for v in data_violations(spec.evaluation.data, model_dir=spec.model.from_pretrained, files=files)
    ]


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


def pretrained_violations(job: TrainingJob, files: FileRule = FileRule()) -> list[FieldViolation]:
    """`spec.model.from_pretrained`: the directory holds a config.json of a supported family and weights
    the engine loads (a safetensors file, or an index whose shards all exist), and the model it describes
    fits the layout and the data. Reads config.json and the index under `files`, never the weights."""
    return pretrained_check(job, files)[1]


def pretrained_check(job: TrainingJob, files: FileRule = FileRule()) -> tuple[ModelConfig | None, list[FieldViolation]]:
    """`pretrained_violations`, with the model shape config.json describes (None when the job imports no
    model or its config.json is unusable), so that a caller reads config.json once."""
    directory = job.spec.model.from_pretrained
    if directory is None:
        return None, []
    if not directory.strip():
        return None, [FieldViolation("spec.model.from_pretrained", "must be a Hugging Face model directory, not empty")]
    model, problems = _resolved(job.spec.model, files)
    if model is None:
        return None, problems
    weights = weights_problem(directory, files)
    return model, ([FieldViolation("spec.model.from_pretrained", weights)] if weights else []) + model_violations(model, job)


def _resolved(spec: ModelSpec, files: FileRule) -> tuple[ModelConfig | None, list[FieldViolation]]:
    """The model shape `spec` names (a preset, or config.json read under `files`), or the violation naming
    the field that says why there is none."""
    try:
        return resolve_model(spec, files), []
    except UnknownPresetError as exc:
        return None, [FieldViolation("spec.model.preset", str(exc))]
    except PretrainedConfigError as exc:
        return None, [FieldViolation("spec.model.from_pretrained", str(exc))]


def pretrained_warnings(job: TrainingJob, model: ModelConfig | None) -> list[FieldViolation]:
    """What is allowed but probably not meant for a `from_pretrained` model (`validate`, `plan` and
    CreateJob show these without refusing the job): a `spec.data.seq_len` past the `max_position_embeddings`
    of its config.json (`model`, as resolved from it), positions the model never trained on. No model (a
    config.json that cannot be used: `pretrained_violations` names that problem) gives no warning."""
    limit = None if model is None or job.spec.model.from_pretrained is None else model.max_position_embeddings
    seq_len = job.spec.data.seq_len
    if limit is None or seq_len <= limit:
        return []
    return [FieldViolation(
        "spec.data.seq_len",
        f"{seq_len} exceeds the model's max_position_embeddings {limit} (its config.json): it never trained on "
        f"positions past {limit}; the job runs as asked (set seq_len <= {limit} unless you mean to extend its context)",
    )]


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


def _shard_violations(patterns: list[str], files: FileRule) -> list[FieldViolation]:
    """data.format tokens: every path must be a directory written by `trainctl data prepare`, whose
    index (read under `files`) names shard files of the directory."""
    if not patterns:
        return [FieldViolation("spec.data.paths", "at least one prepared token-shard directory is required")]
    out = []
    for i, path in enumerate(patterns):
        try:
            _indexed_tokens(Path(os.path.expanduser(path)), f"spec.data.paths[{i}]", files)
        except FileRuleError as exc:
            out.append(FieldViolation(exc.field, exc.message))
    return out


def model_violations(model: ModelConfig, job: TrainingJob) -> list[FieldViolation]:
    """Rules relating the resolved model shape `model` to `job`'s layout and data."""
    par = job.spec.parallelism
    out: list[FieldViolation] = []

    def bad(field: str, description: str) -> None:
        out.append(FieldViolation(f"spec.model.{field}", description))

    if model.explicit_head_dim is None and model.dim % model.n_heads:
        bad("dim", f"{model.dim} is not divisible by n_heads {model.n_heads}")
    elif model.head_dim % 2:
        bad("dim", f"head dimension {model.head_dim} must be even for rotary embeddings")
    seq_len = job.spec.data.seq_len
    if model.sliding_window is not None and seq_len > model.sliding_window:
        out.append(FieldViolation(
            "spec.data.seq_len",
            f"{seq_len} exceeds the model's config.json sliding_window {model.sliding_window} "
            f"(spec.model.from_pretrained): the engine attends over the whole sequence, which equals the "
            f"model's sliding-window attention only for seq_len <= sliding_window",
        ))
    if model.n_heads % model.n_kv_heads:
        bad("n_kv_heads", f"n_heads {model.n_heads} is not divisible by n_kv_heads {model.n_kv_heads}")
    if model.n_heads % par.tp:
        bad("n_heads", f"{model.n_heads} is not divisible by tp = {par.tp}")
    if model.n_kv_heads % par.tp:
        bad("n_kv_heads", f"{model.n_kv_heads} is not divisible by tp = {par.tp}")
    if model.ffn_dim % par.tp:
        bad("ffn_dim", f"{model.ffn_dim} is not divisible by tp = {par.tp}")
    if model.vocab_size % par.tp:
        bad("vocab_size", f"{model.vocab_size} is not divisible by tp = {par.tp} (vocab-parallel embedding)")
    if resolve_tokenizer(job.spec.data, job.spec.model.from_pretrained) == "byte" and model.vocab_size < 256:
        bad("vocab_size", f"{model.vocab_size} is smaller than the byte tokenizer's 256 symbols")
    stages = par.pp * par.pp_virtual_stages
    if model.n_layers < stages:
        bad("n_layers", f"{model.n_layers} layers cannot fill pp x pp_virtual_stages = {stages} pipeline stages")
    if model.moe is None:
        if par.ep > 1:
            out.append(FieldViolation("spec.parallelism.ep", "expert parallelism needs an MoE model (spec.model.moe)"))
    else:
        if model.moe.top_k > model.moe.num_experts:
            bad("moe.top_k", f"{model.moe.top_k} exceeds num_experts {model.moe.num_experts}")
        if model.moe.num_experts % par.ep:
            bad("moe.num_experts", f"{model.moe.num_experts} is not divisible by ep = {par.ep}")
    return out


def _data_violations(patterns: list[str]) -> list[FieldViolation]:
    out = []
    if not patterns:
        return [FieldViolation("spec.data.paths", "at least one path or glob is required")]
    for i, pattern in enumerate(patterns):
        if pattern == STDLIB_CORPUS:
            continue
        matches = resolve_data_paths([pattern])
        if not matches:
            out.append(FieldViolation(f"spec.data.paths[{i}]", f"{pattern!r} matches no files"))
            continue
        unreadable = [p for p in matches if not os.access(p, os.R_OK)]
        if unreadable:
            out.append(FieldViolation(f"spec.data.paths[{i}]", f"{len(unreadable)} matched files are unreadable, e.g. {unreadable[0]}"))
    return out


def validate_job(job: TrainingJob, *, pool_gpus: int | None = None, check_data: bool = True) -> TrainingJob:
    """Raise SpecError if `job` breaks any semantic rule; return it otherwise."""
    violations = semantic_violations(job, pool_gpus=pool_gpus, check_data=check_data)
    if violations:
        raise SpecError(violations)
    return job


def load_job_file(path: str | os.PathLike[str]) -> TrainingJob:
    """Read and schema-validate a spec file, its relative paths resolved against the file's directory
    (trainctl.spec.path_fields)."""
    job = parse_yaml(bounded_spec_text(path))
    return job.model_copy(update={"spec": with_paths_under(job.spec, Path(path).parent)})


# ---- bounded parsing of untrusted spec text (issue 20: no input may crash or stall the parser) ----------

MAX_SPEC_BYTES = 1 << 20
"""Largest spec file or text accepted (1 MiB; a real spec is a few KiB)."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of YAML collections accepted (a spec is 4 levels deep)."""
MAX_PATH_PART = 64
"""Characters of one key shown in a violation's field path (a hostile key can be megabytes long, or
hold control characters, which are escaped)."""


class _SpecLoader(StrictLoader):
    """trainctl.spec.strict_yaml's loader (a key given twice is an error naming it and its lines), also
    refusing aliases (an alias bomb expands exponentially when validated), nesting deeper than
    MAX_YAML_DEPTH (which would exhaust the recursion limit) and mapping keys that are not text (`? `
    alone is a null key; a spec's keys are field names, labels and variables)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a job spec", mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        mapping = super().construct_mapping(node, deep=deep)
        for key in mapping:
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(None, None, f"mapping keys must be text, got {key!r}", node.start_mark)
        return mapping


def bounded_yaml_document(text: str) -> dict:
    """The mapping a spec's YAML text holds, or SpecError('<document>') saying why there is none."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError([FieldViolation("<document>", f"{len(text)} characters; a spec may hold at most {MAX_SPEC_BYTES}")])
    try:
        document = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line, whatever the error's layout
        raise SpecError([FieldViolation("<document>", f"malformed YAML{where}: {problem}")]) from None
    except (ValueError, OverflowError) as exc:  # a scalar no Python value can hold: an impossible date, a 5000-digit int
        raise SpecError([FieldViolation("<document>", f"malformed YAML value: {str(exc)[:200]}")]) from None
    if not isinstance(document, dict):
        raise SpecError([FieldViolation("<document>", "expected a mapping with apiVersion, kind, metadata and spec")])
    return document


def bounded_spec_text(path: str | os.PathLike[str]) -> str:
    """A spec file's text: at most MAX_SPEC_BYTES of UTF-8, else SpecError('<file>')."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError([FieldViolation("<file>", f"cannot read {path}: {exc.strerror}")]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([FieldViolation("<file>", f"{path} is larger than {MAX_SPEC_BYTES} bytes; a job spec is a few KiB")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([FieldViolation("<file>", f"{path} is not UTF-8 text (byte {exc.start})")]) from None


def _path_part(part: object) -> str:
    """One key of a field path as printable text on one line, shortened to MAX_PATH_PART characters; a
    key that is empty, starts or ends with blanks or holds ": " is quoted, so it stays visible."""
    text = str(part)
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    if not text or text != text.strip() or ": " in text:
        text = repr(text)
    return text if len(text) <= MAX_PATH_PART else text[:MAX_PATH_PART] + "..."

# ---- the files the data spec names, and what they can give (submit-time, cheap) ------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files of a Hugging Face tokenizer directory; a directory with none of them holds no tokenizer."""


def data_violations(data: DataSpec, *, model_dir: str | None = None, files: FileRule = FileRule()) -> list[FieldViolation]:
    """The files `data` names exist and are readable (text, JSONL or Parquet files, token-shard
    directories with an index, save_to_disk directories; the tokenizer file or directory), record data
    has its field (`data_sources`), chat data has a tokenizer with a chat template, and the corpus holds
    at least one sample (`corpus_capacity_violations`). `model_dir` is the job's from_pretrained
    directory (what `tokenizer: auto` means). Every file opened or handed on is under `files`, the job's
    rule (trainctl.spec.files): a tokenizer directory's every entry, since the ranks hand it whole to
    transformers. A service with confinement calls it only for paths its path policy let through
    (trainctl.service.security.paths)."""
    if data.format == "tokens":
        out = _shard_violations(data.paths, files)
    elif data.format == "arrow":
        out = [FieldViolation(f, p) for f, p in data_sources.arrow_problems(data, files)]
    else:
        out = _data_violations(data.paths)
    tokenizer = resolve_tokenizer(data, model_dir)
    tokenizer_path = Path(tokenizer).expanduser()
    tokenizer_problem = None if tokenizer == "byte" else _tokenizer_rule_problem(tokenizer_path, files)
    if tokenizer_problem:
        out.append(FieldViolation("spec.data.tokenizer", tokenizer_problem))
    elif tokenizer != "byte" and not (tokenizer_path.is_file() or tokenizer_path.is_dir()):
        out.append(FieldViolation("spec.data.tokenizer", f"tokenizer file or directory {tokenizer!r} does not exist"))
    elif tokenizer_path.is_dir() and not any((tokenizer_path / name).is_file() for name in TOKENIZER_FILES):
        meaning = "tokenizer: auto names the from_pretrained model directory " if data.tokenizer == TOKENIZER_AUTO else "directory "
        out.append(FieldViolation(
            "spec.data.tokenizer",
            f"{meaning}{tokenizer!r}, which holds none of {', '.join(TOKENIZER_FILES)}; name a tokenizer (or byte)",
        ))
    if data.messages_field is not None:
        if data.format in ("text", "tokens"):
            out.append(FieldViolation("spec.data.messages_field", f"chat records need format jsonl, parquet or arrow, not {data.format}"))
        elif not tokenizer_path.is_dir():
            out.append(FieldViolation(
                "spec.data.messages_field",
                f"chat records are rendered with the model's chat template: spec.data.tokenizer must be a Hugging Face "
                f"tokenizer directory (or the from_pretrained model's), not {tokenizer!r}",
            ))
    if out:
        return out
    if data.format in ("jsonl", "parquet"):
        paths = resolve_data_paths(data.paths)[: data.max_files]
        check = data_sources.jsonl_problem if data.format == "jsonl" else data_sources.parquet_problem
        problem = check(paths, data, files)
        return [FieldViolation(*problem)] if problem else []
    if data.format == "arrow":
        return []
    return corpus_capacity_violations(data, tokenizer, files)


def _tokenizer_rule_problem(path: Path, files: FileRule) -> str | None:
    """Why the tokenizer file, or an entry of the tokenizer directory, breaks the rule (None: none does)."""
    try:
        if path.is_dir():
            files.check_tree(path, "spec.data.tokenizer")
        else:
            files.check(path, "spec.data.tokenizer")
    except FileRuleError as exc:
        return exc.message
    return None


MAX_TOKENS_PER_BYTE = 3
"""Most tokens a tokenizer.json emits per byte of text: a byte-level BPE emits at most one per byte of
the decoded text, and an invalid byte decodes to U+FFFD, three bytes. Used only to bound a corpus's
tokens from its size without tokenizing it."""


def corpus_capacity_violations(data: DataSpec, tokenizer: str | None = None, files: FileRule = FileRule()) -> list[FieldViolation]:
    """`spec.data.seq_len` against what the data can give: the corpus must hold one sample of seq_len + 1
    tokens. Counted exactly from file sizes (byte tokenizer) or the shards' index (format tokens); for a
    tokenizer file, bounded from file sizes (MAX_TOKENS_PER_BYTE), so only a corpus too small under any
    tokenization is refused here and the ranks catch the rest. `tokenizer` is the resolved
    `data.tokenizer` (default: `data.tokenizer` resolved without a model directory); shard indexes are
    read under `files`. Call it once the paths are known valid (formats text and tokens)."""
    need = data.seq_len + 1
    try:
        tokens, what = _corpus_tokens(data, tokenizer or resolve_tokenizer(data, None), files)
    except FileRuleError as exc:
        return [FieldViolation(exc.field, exc.message)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [FieldViolation("spec.data.paths", f"cannot size the corpus: {exc!r}")]
    if tokens >= need:
        return []
    return [FieldViolation("spec.data.seq_len", f"a sample needs seq_len + 1 = {need} tokens but {what}")]


def _corpus_tokens(data: DataSpec, tokenizer: str, files: FileRule) -> tuple[int, str]:
    """Tokens the corpus holds (exact, or an upper bound for a tokenizer file) and how that was counted."""
    if data.format == "tokens":
        tokens = sum(
            _indexed_tokens(Path(os.path.expanduser(path)), f"spec.data.paths[{i}]", files) for i, path in enumerate(data.paths)
        )
        return tokens, f"the shards hold {tokens} tokens"
    files = resolve_data_paths(data.paths)[: data.max_files]
    size = sum(path.stat().st_size for path in files)
    if tokenizer == "byte":
        return size, f"the {len(files)} files hold {size} bytes, one token each"
    bound = size * MAX_TOKENS_PER_BYTE
    return bound, f"the {len(files)} files hold {size} bytes, at most {bound} tokens under any tokenizer"


def _indexed_tokens(directory: Path, field: str, files: FileRule) -> int:
    """Tokens a prepared token-shard directory holds, from its index.json read under `files`; each shard
    (and mask) file it names must be a file of the directory under the rule (checked, not opened).
    FileRuleError naming `field` when the directory has no such index."""
    index_path = files.check(directory / TOKEN_SHARD_INDEX, field)
    if not index_path.is_file():
        raise FileRuleError(field, f"{str(directory)!r} is not a token-shard directory (no {TOKEN_SHARD_INDEX}); build it with "
                                   "`trainctl data prepare`")
    index = files.read_json(index_path, field)
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
        raise FileRuleError(field, f"{index_path} is not a token-shard index (no shards list)")
    tokens = 0
    for shard in shards:
        for name in [shard.get("file")] + ([shard["mask"]] if "mask" in shard else []):
            files.member(directory, name, field, str(index_path))
        count = shard.get("tokens")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise FileRuleError(field, f"{index_path} gives a shard a token count that is not a whole number")
        tokens += count
    return tokens
