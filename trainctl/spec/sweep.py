"""The Sweep spec: a hyperparameter search whose trials are ordinary TrainingJobs (docs/sweeps.md).

Pure pydantic, like the job spec. A Sweep holds a job template (a TrainingJob's `spec`), a search
space over the template's fields by dotted path (`spec.training.lr`), an objective (a reported step
metric, minimised or maximised, at a step or the last), how many trials run in all and at once, and
an early-stopping rule. `sweep_violations` names every problem by field (`spec.parameters[0].low`);
`trial_job` builds trial N's job, the one place a parameter's value is written into a spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError

from trainctl.spec.bounded_yaml import bounded_spec_text, bounded_yaml_document
from trainctl.spec.bounds import MAX_STEPS
from trainctl.spec.job import API_VERSION, JobSpecBody, Metadata, TrainingJob
from trainctl.spec.path_fields import with_paths_under
from trainctl.spec.pydantic_violations import violations_from_pydantic
from trainctl.spec.strict_model import StrictModel, count
from trainctl.spec.text import printable, unstorable_problem
from trainctl.spec.validate import FieldViolation, SpecError, semantic_violations

SWEEP_KIND = "Sweep"
MAX_PARAMETERS = 32
MAX_CHOICES = 256
MAX_TRIALS = 10_000
MAX_PARAMETER_PATH = 256

SWEEP_LABEL = "trainctl.sweep"
"""Label every trial job carries: the id of its sweep (`trainctl list --label trainctl.sweep=ID`)."""
TRIAL_LABEL = "trainctl.trial"
"""Label every trial job carries: its trial number within the sweep."""

BUILTIN_METRICS = (
    "loss", "eval_loss", "grad_norm", "lr", "tokens_per_second", "step_time_seconds", "peak_memory_bytes", "mfu",
    "mfu_full_attention",
)
"""Step metrics a built-in job reports (trainctl.service.store's step_metrics columns; eval_loss on the
steps that evaluated, with `spec.evaluation`; mfu in Megatron's convention, causal attention halved, and
mfu_full_attention in torchtitan's, attention unmasked: either ranks trials the same way)."""
COMMAND_METRICS = ("loss", "eval_loss", "grad_norm", "lr", "tokens_per_second", "step_time_seconds")
"""Step metrics a command job reports through `trainctl.report` (loss; eval_loss, lr and grad_norm when the
program passes them; the step's throughput and time, measured by its rank worker)."""

UNSEARCHABLE = ("spec.command.program", "spec.command.working_dir", "spec.data.paths", "spec.data.tokenizer",
                "spec.model.from_pretrained", "spec.init_from", "spec.resources")
"""Paths a parameter may not set: files (each must pass the tenant path policy once, at CreateSweep) and
the GPUs a trial holds (the quota check counts parallel_trials x the template's GPUs)."""

Scalar = bool | int | float | Annotated[str, Field(max_length=1024)]


class SweepParameter(StrictModel):
    path: str = Field(min_length=1, max_length=MAX_PARAMETER_PATH)
    """Dotted path of the job field the parameter sets, e.g. `spec.training.lr`, `spec.lora.rank`, or
    `spec.command.env.LR` (a command job's environment variable; the value is passed as text)."""
    type: Literal["float", "int", "choice"]
    """`float` and `int`: a value in [low, high] (uniform, or log-uniform with `log`); `choice`: one of `values`."""
    low: int | float | None = None
    """Lowest value (float and int parameters)."""
    high: int | float | None = None
    """Highest value (float and int parameters); above `low`."""
    log: bool = False
    """Sample uniformly in log space (float and int parameters); the range must lie above 0."""
    values: list[Scalar] | None = Field(default=None, max_length=MAX_CHOICES)
    """The candidates of a `choice` parameter (numbers, strings or booleans)."""


class SweepObjective(StrictModel):
    metric: str = Field(default="loss", max_length=64)
    """The reported step metric to optimise: loss (any job), eval_loss (the loss on held-out data, on the
    steps that evaluated), grad_norm, lr, tokens_per_second, step_time_seconds; built-in jobs also
    peak_memory_bytes, mfu (Megatron's convention: causal attention halved) and mfu_full_attention
    (torchtitan's: attention unmasked)."""
    direction: Literal["minimize", "maximize"] = "minimize"
    """Whether smaller or larger values are better."""
    step: count(MAX_STEPS) | None = None
    """The objective is the metric at this step: the newest report at or before it that carries the metric
    (eval_loss is only on the steps that evaluated); None: the trial's newest report that carries it."""


class EarlyStopping(StrictModel):
    rule: Literal["none", "median", "successive_halving"] = "none"
    """`median`: stop a trial whose best value so far is worse than the median of the other trials at
    the same step (Optuna's MedianPruner); `successive_halving`: keep the best 1/reduction_factor of the
    trials at each rung of min_steps x reduction_factor^k steps (Optuna's SuccessiveHalvingPruner, the
    synchronous-free rule of ASHA). A stopped trial's job ends CANCELLED with reason `pruned at step N: ...`."""
    min_steps: count(MAX_STEPS) = 1
    """Steps every trial runs before it may be stopped (median: warm-up; successive halving: the first rung)."""
    startup_trials: count(MAX_TRIALS, 0) = 2
    """median: trials that must have finished before any is stopped."""
    reduction_factor: count(64, 2) = 3
    """successive_halving: the fraction (1/reduction_factor) of trials promoted at each rung."""


class SweepSpecBody(StrictModel):
    template: JobSpecBody = Field(default_factory=JobSpecBody)
    """The `spec` of every trial's TrainingJob, before the parameters are set."""
    parameters: list[SweepParameter] = Field(min_length=1, max_length=MAX_PARAMETERS)
    """The search space: one entry per field searched."""
    objective: SweepObjective = Field(default_factory=SweepObjective)
    """What a trial is judged by."""
    trials: count(MAX_TRIALS) = 12
    """Trials in all (each one job)."""
    parallel_trials: count(MAX_TRIALS) = 2
    """Trials whose jobs exist (queued or running) at once; at most `trials` and within the tenant's quota."""
    algorithm: Literal["tpe", "random"] = "tpe"
    """How parameters are chosen: `tpe` (Optuna's Tree-structured Parzen Estimator, after
    `startup_trials` random ones) or `random`."""
    startup_trials: count(MAX_TRIALS, 0) = 4
    """tpe: trials sampled at random before the model takes over."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the sampler."""
    early_stopping: EarlyStopping = Field(default_factory=EarlyStopping)
    """When to stop a trial that is doing badly."""


class Sweep(StrictModel):
    apiVersion: Literal["trainctl/v1"] = API_VERSION  # noqa: N815 - Kubernetes-style key
    """Always trainctl/v1."""
    kind: Literal["Sweep"] = SWEEP_KIND
    """Always Sweep."""
    metadata: Metadata
    """Name and labels (trial jobs get the labels too)."""
    spec: SweepSpecBody
    """The template, search space, objective and limits."""


# ---- parsing -------------------------------------------------------------------------------------------


def parse_sweep_object(document: dict) -> Sweep:
    """Validate a decoded mapping into a Sweep (schema only); SpecError names each bad field."""
    try:
        return Sweep.model_validate(document)
    except ValidationError as exc:
        raise SpecError(violations_from_pydantic(exc)) from exc


def load_sweep_file(path: str) -> Sweep:
    """Read and schema-validate a Sweep spec file, its template's relative paths resolved against the
    file's directory (trainctl.spec.path_fields)."""
    sweep = parse_sweep_object(bounded_yaml_document(bounded_spec_text(path)))
    try:
        template = with_paths_under(sweep.spec.template, Path(path).parent)
    except SpecError as exc:
        raise SpecError([FieldViolation("spec.template" + v.field.removeprefix("spec"), v.description)
                         for v in exc.violations]) from None
    return sweep.model_copy(update={"spec": sweep.spec.model_copy(update={"template": template})})


def document_kind(path: str) -> str:
    """The `kind` a spec file declares (TrainingJob when it names none)."""
    kind = bounded_yaml_document(bounded_spec_text(path)).get("kind", "TrainingJob")
    return kind if isinstance(kind, str) else "TrainingJob"


# ---- trial jobs ----------------------------------------------------------------------------------------


def trial_name(sweep_name: str, number: int) -> str:
    """Trial `number`'s job name: the sweep's name (shortened to fit 63 characters) and `-t<number>`."""
    suffix = f"-t{number}"
    return sweep_name[: 63 - len(suffix)].rstrip("-") + suffix


def trial_job(sweep: Sweep, sweep_id: str, number: int, params: dict[str, Any]) -> TrainingJob:
    """Trial `number`'s job: the template with `params` (path -> value) set, the sweep's labels and the
    trial labels. SpecError names the parameter path of a value the job refuses."""
    labels = {**sweep.metadata.labels, SWEEP_LABEL: sweep_id, TRIAL_LABEL: str(number)}
    document = {
        "metadata": {"name": trial_name(sweep.metadata.name, number), "labels": labels},
        "spec": sweep.spec.template.model_dump(exclude_unset=True),
    }
    for path, value in params.items():
        _assign(document, path, value)
    try:
        return TrainingJob.model_validate(document)
    except ValidationError as exc:
        raise SpecError(violations_from_pydantic(exc)) from exc


def _assign(document: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = document
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = str(value) if _is_text_map(path) else value


def _is_text_map(path: str) -> bool:
    return path.startswith("spec.command.env.")


# ---- validation ----------------------------------------------------------------------------------------


def sweep_violations(sweep: Sweep, *, pool_gpus: int | None = None) -> list[FieldViolation]:
    """Every rule `sweep` breaks beyond its schema: the template's own (named `spec.template.*`), each
    parameter's path and range, each parameter's extreme values in the template, the objective, the limits."""
    spec = sweep.spec
    template_job = TrainingJob(metadata=sweep.metadata, spec=spec.template)
    out = [
        FieldViolation("spec.template" + v.field.removeprefix("spec"), v.description)
        for v in semantic_violations(template_job, pool_gpus=pool_gpus, check_data=False)
    ]
    seen: set[str] = set()
    for i, parameter in enumerate(spec.parameters):
        where = f"spec.parameters[{i}]"
        problem = path_problem(parameter.path)
        if problem is None and parameter.path in seen:
            problem = "searched twice"
        seen.add(parameter.path)
        if problem is not None:
            out.append(FieldViolation(f"{where}.path", f"{parameter.path!r}: {problem}"))
            continue
        range_problems = _range_violations(parameter, where)
        out += range_problems
        if not range_problems and not out:
            out += _extreme_violations(sweep, parameter, where)
    out += _objective_violations(sweep)
    if spec.parallel_trials > spec.trials:
        out.append(FieldViolation("spec.parallel_trials", f"{spec.parallel_trials} is more than spec.trials ({spec.trials})"))
    return out


def path_problem(path: str) -> str | None:
    """Why `path` names no searchable field of a TrainingJob, or None; a part of `path` it quotes is
    shown `printable` (a NUL as ``\\x00``)."""
    if (problem := unstorable_problem(path)) is not None:
        return problem
    if not path.startswith("spec.") and path != "spec":
        return "a searchable field's path starts with 'spec.' (e.g. spec.training.lr)"
    if any(path == p or path.startswith(p + ".") for p in UNSEARCHABLE):
        return "not searchable (a file path, or the GPUs a trial holds)"
    model: type[BaseModel] = TrainingJob
    parts = path.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return f"{printable('.'.join(parts[: i + 1]))} is not a field"
        inner = _model_in(info.annotation)
        last = i == len(parts) - 1
        if inner is not None:
            if last:
                return "names a section, not a field"
            model = inner
            continue
        if _is_str_map(info.annotation):
            if len(parts) - i != 2 or not parts[-1]:
                return f"{'.'.join(parts[: i + 1])} is a map: name one key (e.g. {'.'.join(parts[: i + 1])}.LR)"
            return None
        if get_origin(info.annotation) in (list, dict):
            return "a list or map field cannot be searched"
        return None if last else f"{'.'.join(parts[: i + 1])} is not a section"
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _is_str_map(annotation: Any) -> bool:
    return get_origin(annotation) is dict


def _range_violations(parameter: SweepParameter, where: str) -> list[FieldViolation]:
    if parameter.type == "choice":
        wrong = [f"{where}.{name}" for name in ("low", "high") if getattr(parameter, name) is not None]
        if parameter.log:
            wrong.append(f"{where}.log")
        out = [FieldViolation(field, "only float and int parameters have a range") for field in wrong]
        if not parameter.values:
            out.append(FieldViolation(f"{where}.values", "a choice parameter needs at least one value"))
        elif len(set(map(repr, parameter.values))) != len(parameter.values):
            out.append(FieldViolation(f"{where}.values", "holds a value twice"))
        return out
    out = []
    if parameter.values is not None:
        out.append(FieldViolation(f"{where}.values", f"only choice parameters have values ({parameter.type}: low and high)"))
    for name in ("low", "high"):
        value = getattr(parameter, name)
        if value is None:
            out.append(FieldViolation(f"{where}.{name}", f"a {parameter.type} parameter needs {name}"))
        elif parameter.type == "int" and not float(value).is_integer():
            out.append(FieldViolation(f"{where}.{name}", f"{value} is not an integer"))
    if out:
        return out
    assert parameter.low is not None and parameter.high is not None
    if parameter.low >= parameter.high:
        kind = "empty" if parameter.low == parameter.high else "inverted"
        out.append(FieldViolation(f"{where}.high", f"{kind} range: high ({parameter.high}) must be above low ({parameter.low})"))
    elif parameter.log and parameter.low <= 0:
        out.append(FieldViolation(f"{where}.low", f"a log range must lie above 0; low is {parameter.low}"))
    return out


def parameter_extremes(parameter: SweepParameter) -> list[tuple[str, Any]]:
    """(field suffix, value) of the values that bound a parameter: low and high, or every choice."""
    if parameter.type == "choice":
        return [(f"values[{j}]", v) for j, v in enumerate(parameter.values or ())]
    cast = int if parameter.type == "int" else float
    return [("low", cast(parameter.low)), ("high", cast(parameter.high))]


def _extreme_violations(sweep: Sweep, parameter: SweepParameter, where: str) -> list[FieldViolation]:
    """A parameter's bounds set alone in the template must give valid jobs (combinations that fail are
    failed trials, with the reason)."""
    out = []
    for suffix, value in parameter_extremes(parameter):
        try:
            job = trial_job(sweep, "validation", 0, {parameter.path: value})
        except SpecError as exc:
            problems = exc.violations
        else:
            problems = semantic_violations(job, check_data=False)
        out += [FieldViolation(f"{where}.{suffix}", f"{value!r} makes an invalid job: {p}") for p in problems[:1]]
    return out


def _objective_violations(sweep: Sweep) -> list[FieldViolation]:
    objective, template = sweep.spec.objective, sweep.spec.template
    command = template.command is not None
    reported = COMMAND_METRICS if command else BUILTIN_METRICS
    out = []
    if objective.metric not in reported:
        kind = "a command job (trainctl.report)" if command else "a built-in job"
        out.append(FieldViolation("spec.objective.metric", f"{objective.metric!r} is not reported by {kind}; one of {', '.join(reported)}"))
    elif objective.metric == "eval_loss" and not command and template.evaluation is None:
        out.append(FieldViolation("spec.objective.metric", "eval_loss is reported only by a job that evaluates: "
                                  "set spec.template.evaluation"))
    if objective.step is not None and not command:
        steps = [template.training.steps]
        for parameter in sweep.spec.parameters:
            if parameter.path == "spec.training.steps":
                steps += [int(v) for _, v in parameter_extremes(parameter) if isinstance(v, int | float)]
        if objective.step > min(steps):
            out.append(FieldViolation("spec.objective.step", f"step {objective.step} is beyond the {min(steps)} steps a trial may run"))
    return out
