"""The model a job trains against the rest of it: the shape a preset or `from_pretrained`'s config.json
gives, the directory's weights, and the rules relating that shape to the layout and the data."""

from __future__ import annotations

from trainctl.spec.files import FileRule
from trainctl.spec.hf_config import weights_problem
from trainctl.spec.job import TrainingJob, resolve_tokenizer
from trainctl.spec.model_spec import ModelSpec
from trainctl.spec.presets import ModelConfig, PretrainedConfigError, UnknownPresetError, resolve_model
from trainctl.spec.violations import FieldViolation


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
    model, problems = model_shape(job.spec.model, files)
    if model is None:
        return None, problems
    weights = weights_problem(directory, files)
    return model, ([FieldViolation("spec.model.from_pretrained", weights)] if weights else []) + model_violations(model, job)


def model_shape(spec: ModelSpec, files: FileRule) -> tuple[ModelConfig | None, list[FieldViolation]]:
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
