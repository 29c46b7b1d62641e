"""The TrainingJob spec: what a user writes in YAML and what every layer reads.

Pure pydantic, no torch, no Ray, no gRPC: the lowest layer, imported by parallelism/, workers/ and
service/ alike. Field-level rules (types, ranges, unknown keys) live here and in the sections of their own
(`model_spec`, `command_spec`; bounds in `bounds`, the base model in `strict_model`); rules that relate
fields to each other (divisibility, world size) live in `trainctl.spec.validate`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from trainctl.spec.bounds import (
    MAX_BATCH,
    MAX_DATA_PATHS,
    MAX_DEGREE,
    MAX_FILES,
    MAX_KEEP_LAST,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_LABELS_BYTES,
    MAX_LORA_RANK,
    MAX_PATH_LENGTH,
    MAX_PREFETCH,
    MAX_RESTARTS,
    MAX_SEQ_LEN,
    MAX_STEP_TIMEOUT_SECONDS,
    MAX_STEPS,
    MAX_VIRTUAL_STAGES,
)
from trainctl.spec.command_spec import CommandSpec
from trainctl.spec.data_format import DataFormat
from trainctl.spec.model_spec import ModelSpec
from trainctl.spec.strict_model import Int64, PathText, StrictModel, count

API_VERSION = "trainctl/v1"
KIND = "TrainingJob"
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _one_recursive_wildcard(pattern: str) -> str:
    """A data path with at most one `**` component: each further one makes matching walk the whole
    tree below it again (the cost multiplies), and one already matches files at any depth."""
    recursive = sum(part == "**" for part in re.split(r"[/\\]", pattern))
    if recursive > 1:
        raise ValueError(f"has {recursive} '**' components; at most one is allowed (it already matches any depth)")
    return pattern


DataPathText = Annotated[PathText, AfterValidator(_one_recursive_wildcard)]


class Metadata(StrictModel):
    name: str = Field(min_length=1, max_length=63)
    """Job name: a DNS-1123 label (lower-case letters, digits and '-', at most 63 characters)."""
    labels: dict[
        Annotated[str, Field(min_length=1, max_length=MAX_LABEL_KEY)], Annotated[str, Field(max_length=MAX_LABEL_VALUE)]
    ] = Field(default_factory=dict, max_length=MAX_LABELS)
    """Free-form key/value labels; `trainctl list --label k=v` filters on them. At most 64 labels, keys
    of 1 to 63 characters, values of at most 256, 16 KiB of keys and values in all."""

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError("must be a DNS-1123 label: lower-case letters, digits and '-', starting and ending alphanumeric")
        return value

    @field_validator("labels")
    @classmethod
    def _labels_size(cls, value: dict[str, str]) -> dict[str, str]:
        size = sum(len(k.encode()) + len(v.encode()) for k, v in value.items())
        if size > MAX_LABELS_BYTES:
            raise ValueError(f"labels hold {size} bytes of keys and values; at most {MAX_LABELS_BYTES}")
        return value



MAX_FIELD_NAME = 256
FieldName = Annotated[str, Field(min_length=1, max_length=MAX_FIELD_NAME)]

STDLIB_CORPUS = "@stdlib"
"""`data.paths` entry meaning the Python standard library's .py files (not a path)."""

TOKENIZER_AUTO = "auto"
"""`data.tokenizer` value meaning "the model's": the `from_pretrained` model directory when the job
has one, else `byte` (`resolve_tokenizer`)."""


class DataSpec(StrictModel):
    paths: list[DataPathText] = Field(default_factory=lambda: [STDLIB_CORPUS], max_length=MAX_DATA_PATHS)
    """Glob patterns of text, JSONL or Parquet files; directories for `tokens` and `arrow`. `@stdlib`
    means the Python standard library's .py files, a corpus present on every machine."""
    tokenizer: PathText = TOKENIZER_AUTO
    """`auto` (the model's: its `from_pretrained` directory when set, else `byte`), `byte` (a
    256-symbol byte-level tokenizer), the path of a local tokenizer.json, or a directory of Hugging
    Face tokenizer files (tokenizer.json, tokenizer_config.json with its chat template) loaded through
    `transformers.AutoTokenizer`."""
    seq_len: count(MAX_SEQ_LEN) = 128
    """Tokens per training sample (at most 2,097,152). Samples are cut from the token stream with no
    regard to documents (packing, the pre-training convention of Megatron-LM and torchtitan): a sample
    may hold several documents (separated by EOS when the tokenizer has one), attention is causal over
    the whole sample (across document boundaries) and positions run over the sample; a long document
    continues in other samples. Nothing is padded. Why there is no document masking: docs/engine.md,
    Training data."""
    seed: Int64 = 0
    """Seed of the sample order; the same seed gives the same order on any layout."""
    max_files: count(MAX_FILES) | None = 2000
    """Read at most this many files (sorted by path) of the matched set; None reads all."""
    format: DataFormat = "text"
    """`text`: each file is one document, tokenized at start-up. `tokens`: `paths` name directories of
    pre-tokenized, memory-mapped token shards written by `trainctl data prepare` (tokenizer and
    max_files are then those recorded at preparation). `jsonl` (one JSON object per line), `parquet`
    and `arrow` (directories written by `datasets.Dataset.save_to_disk`): one document per record,
    streamed once into cached token shards that every rank memory-maps."""
    text_field: FieldName = "text"
    """jsonl / parquet / arrow: the field (column) holding each record's text."""
    messages_field: FieldName | None = None
    """jsonl / parquet / arrow chat data: the field holding each record's conversation, a list of
    {role, content} messages, rendered with the tokenizer's chat template; the loss then covers the
    assistant tokens only. Set, it replaces `text_field`; needs a Hugging Face tokenizer directory."""
    prefetch: count(MAX_PREFETCH, 0) = 2
    """Batches a background thread prepares ahead of the training step (pinned memory on CUDA); 0
    loads each batch when it is needed."""


def resolve_tokenizer(data: DataSpec, model_dir: str | None) -> str:
    """The tokenizer `data.tokenizer` names: `auto` is `model_dir` (a Hugging Face model directory,
    `spec.model.from_pretrained`) when given, else `byte`; any other value is itself."""
    if data.tokenizer != TOKENIZER_AUTO:
        return data.tokenizer
    return model_dir if model_dir else "byte"


PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


class ParallelismSpec(StrictModel):
    dp_replicate: count(MAX_DEGREE) = 1
    """Data-parallel replicas (DDP, or the outer dimension of HSDP)."""
    dp_shard: count(MAX_DEGREE) = 1
    """Data-parallel ranks that shard state among themselves (ZeRO / FSDP)."""
    cp: count(MAX_DEGREE) = 1
    """Context parallel: ranks that split each sequence (ring attention)."""
    tp: count(MAX_DEGREE) = 1
    """Tensor parallel: ranks that split each layer's matrices."""
    pp: count(MAX_DEGREE) = 1
    """Pipeline parallel: stages."""
    ep: count(MAX_DEGREE) = 1
    """Expert parallel (MoE models): ranks that split the experts; carved from dp_shard x cp."""
    sequence_parallel: bool = False
    """With tp > 1, also shard norms and dropout activations along the sequence (Megatron SP)."""
    zero_stage: Literal[0, 1, 2, 3] = 3
    """How dp_shard ranks shard: 1 optimizer state, 2 + gradients, 3 + parameters (FSDP).
    Ignored when dp_shard is 1; 0 is only valid then."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble."""
    pp_virtual_stages: count(MAX_VIRTUAL_STAGES) = 1
    """Model chunks per pipeline rank (interleaved_1f1b needs 2 or more)."""
    cp_load_balance: bool = True
    """Zigzag (head-tail) sequence sharding so causal attention work is equal across CP ranks."""

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: pp x dp_replicate x dp_shard x cp x tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard): how many ways the batch is split."""
        return self.dp_replicate * self.dp_shard


class TrainingSpec(StrictModel):
    steps: count(MAX_STEPS) = 100
    """Optimizer steps to run (at most 10^9)."""
    global_batch_size: count(MAX_BATCH) = 8
    """Sequences per optimizer step, over all data-parallel ranks (at most 1,048,576)."""
    micro_batch_size: count(MAX_BATCH) | Literal["auto"] = 1
    """Sequences per forward/backward on one rank (one pipeline micro-batch under PP); the rest of
    the global batch is gradient accumulation. `auto`: the largest divisor of the per-rank batch whose
    estimated memory fits the device (confirmed by a probe step on CUDA)."""
    optimizer: Literal["adamw", "adafactor", "sgd"] = "adamw"
    """Optimizer: adamw, adafactor (factored second moments, no first moment) or sgd (momentum beta1)."""
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """AdamW / SGD kernel: foreach (multi-tensor) or fused (one kernel per step, CUDA and CPU
    float32); auto picks fused on CUDA, foreach elsewhere."""
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay floor, as a fraction of lr."""
    warmup_steps: count(MAX_STEPS, 0) = 10
    """Linear warm-up steps."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1 (SGD momentum)."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; bfloat16 keeps float32 master weights, optimizer state and reductions."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (every other block) or full."""
    compile: bool = False
    """torch.compile each decoder block, and the loss unless tensor parallelism shards the logits."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 matrix products in the large linear layers (torchao's Float8Linear; docs/engine.md,
    "Float8"): tensorwise (one scale per tensor; weights all-gathered in float8 under FSDP) or rowwise
    (one scale per row: closer to bf16, slower). The output head, MoE routers and layers too small to
    gain stay in bf16. Needs dtype bfloat16 and a GPU with float8 tensor cores (Ada, Hopper or newer);
    none: off."""
    seed: Int64 = 0
    """Seed of weight initialisation (identical on every layout)."""
    log_interval: count(MAX_STEPS) = 1
    """Report step metrics every this many steps."""
    empty_cache_steps: count(MAX_STEPS, 0) = 0
    """On CUDA, release the caching allocator's unused blocks every this many steps and report
    allocator retries and fragmentation (0: never). No effect on CPU."""


class CheckpointSpec(StrictModel):
    interval_steps: count(MAX_STEPS, 0) = 50
    """Save every this many steps (0: only at the end)."""
    keep_last: count(MAX_KEEP_LAST) = 3
    """Complete checkpoints to keep."""
    resume: bool = True
    """Resume from the newest complete checkpoint when the job (re)starts."""
    async_save: bool = False
    """Write checkpoints in the background: the step copies its state to host memory and training goes
    on while the shards are written; at most one save is in flight (the next save and the end of the
    run wait for it), and it becomes complete only once every rank has written it. The final
    checkpoint is written synchronously. Costs host memory for one copy of each rank's state."""
    memory_interval_steps: count(MAX_STEPS, 0) = 0
    """Every this many steps, keep each rank's shard of the state in host memory outside the rank: one
    copy on its own node, one on another node of the job (0: off). A restart on the same layout resumes
    from the newest snapshot every rank still has a copy of when it is newer than the newest complete
    checkpoint, so a failure recomputes at most this many steps; the checkpoints stay the durable record.
    Costs two copies of each rank's state in host memory (docs/reliability.md, "In-memory snapshots").
    Needs `resume`."""

    @model_validator(mode="after")
    def _snapshots_resume(self) -> CheckpointSpec:
        if self.memory_interval_steps and not self.resume:
            raise ValueError("spec.checkpoint.memory_interval_steps needs spec.checkpoint.resume: snapshots only serve resuming")
        return self


MAX_EVAL_BATCHES = 1_000_000
MAX_HOLDOUT_FRACTION = 0.5


class EvaluationSpec(StrictModel):
    """Held-out evaluation during training (docs/engine.md, Evaluation)."""

    data: DataSpec | None = None
    """A separate evaluation dataset (any format `spec.data` takes); its `seq_len` is the training
    data's (unset: taken from it). Exactly one of `data` and `holdout_fraction` is set."""
    holdout_fraction: float | None = Field(default=None, gt=0, le=MAX_HOLDOUT_FRACTION)
    """Hold out this fraction of the training data's documents for evaluation, chosen deterministically
    by document (never by sample), so no evaluated token is ever trained on (at most 0.5)."""
    interval_steps: count(MAX_STEPS, 0) = 0
    """Evaluate after every this many optimizer steps (0: only at the end, with `at_end`)."""
    batches: count(MAX_EVAL_BATCHES) = 1
    """Global batches (of `training.global_batch_size` sequences) each evaluation reads; every
    evaluation reads the same batches."""
    at_end: bool = True
    """Evaluate after the last step as well."""

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSpec:
        if (self.data is None) == (self.holdout_fraction is None):
            raise ValueError("spec.evaluation: set exactly one of data and holdout_fraction")
        if self.interval_steps == 0 and not self.at_end:
            raise ValueError("spec.evaluation: interval_steps 0 and at_end false never evaluate; set one of them")
        return self


MLFLOW_EXPERIMENT_MAX = 256


class TrackingSpec(StrictModel):
    """Where the service logs the job's run for experiment trackers (docs/observability.md, Tracking).
    Ranks never see a tracker or its credentials: the service logs what the job reports."""

    mlflow_tracking_uri: Annotated[str, Field(min_length=1, max_length=MAX_PATH_LENGTH)] | None = None
    """An MLflow tracking server for this job; it must be one the service allows (`trainctl serve
    --mlflow-allow`). Unset: the service's default server (`--mlflow-tracking-uri`), if any."""
    mlflow_experiment: Annotated[str, Field(min_length=1, max_length=MLFLOW_EXPERIMENT_MAX)] | None = None
    """The MLflow experiment the run is logged under (unset: `trainctl/<tenant>`)."""
    mlflow: bool = True
    """Log to MLflow when the service has a server for the job (False: never)."""
    tensorboard: bool = False
    """Write TensorBoard event files into the run directory's `tensorboard/` (needs the `tensorboard`
    package on the service)."""


MIN_HOST_MEMORY_GIB = 0.5
MAX_HOST_MEMORY_GIB = 65_536.0


class ResourcesSpec(StrictModel):
    gpus: count(MAX_DEGREE) = 1
    """Ranks (one GPU each); must equal the parallel layout's world size."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: CUDA where the node has GPUs, else CPU (gloo)."""
    host_memory_gib: float | None = Field(default=None, ge=MIN_HOST_MEMORY_GIB, le=MAX_HOST_MEMORY_GIB)
    """Host memory each rank may hold, in GiB (0.5 to 65,536): the private memory of an engine rank's
    process, or of each process of a command job's program, enforced by the kernel (RLIMIT_DATA). A rank
    that allocates past it fails the job at once, naming the limit. None: the node's memory divided among
    its GPU slots; a value above that share fails the rank (host memory is not reserved by the scheduler)."""


class ElasticSpec(StrictModel):
    min_gpus: count(MAX_DEGREE)
    """The fewest GPUs the job trains on: after losing a node with no GPU free to replace it, the job goes on with
    fewer data-parallel replicas (the same model-parallel degrees, global batch and micro-batch size, more gradient
    accumulation per replica) on no fewer than this many, resumed from its newest complete checkpoint; it grows
    back to `resources.gpus` when they are free again. A multiple of pp x cp x tp, at most `resources.gpus`."""


class SchedulingSpec(StrictModel):
    priority: int = Field(default=0, ge=-1000, le=1000)
    """Higher runs first; equal priorities run in submission order."""
    max_restarts: count(MAX_RESTARTS, 0) = 3
    """Group restarts after a rank failure before the job fails (at most 1000)."""
    step_timeout_seconds: float = Field(default=600.0, gt=0, le=MAX_STEP_TIMEOUT_SECONDS)
    """A rank that makes no step progress for this long counts as hung."""
    preemptible: bool = True
    """Whether the scheduler may stop the job (with a checkpoint at its next step boundary) to give its GPUs
    to a queued job of higher priority; the job resumes from that checkpoint when GPUs are free again."""
    elastic: ElasticSpec | None = None
    """Elastic data parallel (docs/reliability.md, "Elastic data parallel"): the job shrinks to the GPUs left after
    a node loss instead of waiting for a new node, and grows back when GPUs return. None: it waits (as without)."""


LoRATarget = Literal["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


class LoRASpec(StrictModel):
    rank: count(MAX_LORA_RANK) = 8
    """Rank r of each adapter: W x + (alpha / r) B A x with A [r, in], B [out, r] (at most 4096)."""
    alpha: float = Field(default=16.0, gt=0)
    """Adapter scale numerator (the update is scaled by alpha / rank)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training."""
    target_modules: list[LoRATarget] = Field(default_factory=lambda: ["wq", "wv"], min_length=1, max_length=7)
    """Projections that get adapters, by module name (wq, wk, wv, wo, w1, w2, w3) in every dense block."""


class JobSpecBody(StrictModel):
    model: ModelSpec = Field(default_factory=ModelSpec)
    """Model shape."""
    data: DataSpec = Field(default_factory=DataSpec)
    """Training data."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Parallel layout."""
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Optimisation."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """What the job needs from the pool."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Queueing and fault handling."""
    init_from: PathText | None = None
    """Start from the model weights of a checkpoint instead of a fresh initialisation: a `step_*`
    checkpoint directory, a checkpoint root (its newest complete checkpoint), a previous job's run
    directory (its `checkpoints/`), or `job:<id>`, an earlier job of the caller's tenant by id (the
    service resolves it to that job's run directory). Optimizer state and data position start fresh."""
    lora: LoRASpec | None = None
    """Low-rank adapters: freeze the model and train only adapters on `target_modules` (usually with
    init_from or model.from_pretrained); checkpoints then hold only the adapters. None: train every
    parameter."""
    evaluation: EvaluationSpec | None = None
    """Evaluate on held-out data during training (None: no evaluation)."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment tracking (MLflow, TensorBoard) of the job's run."""
    command: CommandSpec | None = None
    """Run this program on every rank instead of the built-in engine (a command job); `model`, `data`,
    `training`, `init_from` and `lora` must then be left unset. Without a `parallelism` section the
    layout is `resources.gpus` data-parallel ranks."""

    @model_validator(mode="before")
    @classmethod
    def _command_layout(cls, data: object) -> object:
        """A command job without a `parallelism` section declares `resources.gpus` data-parallel ranks."""
        if not isinstance(data, dict) or data.get("command") is None or data.get("parallelism") is not None:
            return data
        resources = data.get("resources")
        gpus = resources.get("gpus", 1) if isinstance(resources, dict) else getattr(resources, "gpus", 1)
        if isinstance(gpus, int) and not isinstance(gpus, bool) and 1 <= gpus <= MAX_DEGREE:
            return {**data, "parallelism": {"dp_replicate": gpus}}
        return data

    @model_validator(mode="after")
    def _evaluation_seq_len(self) -> JobSpecBody:
        """Evaluation data that names no seq_len takes the training data's."""
        evaluation = self.evaluation
        if evaluation is not None and evaluation.data is not None and "seq_len" not in evaluation.data.model_fields_set:
            data = evaluation.data.model_copy(update={"seq_len": self.data.seq_len})
            data.model_fields_set.add("seq_len")
            self.evaluation = evaluation.model_copy(update={"data": data})
        return self

    @model_validator(mode="after")
    def _fp8_where_it_runs(self) -> JobSpecBody:
        """Float8 needs bf16 compute and a GPU; LoRA's frozen base is not converted."""
        recipe = self.training.fp8
        if recipe == "none":
            return self
        if self.training.dtype != "bfloat16":
            raise ValueError(f"spec.training.fp8 {recipe!r} needs spec.training.dtype bfloat16 (the layers kept out of float8 run in it)")
        if self.resources.device == "cpu":
            raise ValueError(f"spec.training.fp8 {recipe!r} needs a GPU with float8 tensor cores; spec.resources.device is cpu")
        if self.lora is not None:
            raise ValueError(f"spec.training.fp8 {recipe!r} and spec.lora cannot be combined: LoRA's frozen base layers are not converted to float8")
        return self

    @model_validator(mode="after")
    def _one_weight_source(self) -> JobSpecBody:
        if self.init_from is not None and self.model.from_pretrained is not None:
            raise ValueError(
                "spec.init_from and spec.model.from_pretrained are mutually exclusive: the initial weights come "
                "from one of them"
            )
        return self


class TrainingJob(StrictModel):
    apiVersion: Literal["trainctl/v1"] = API_VERSION  # noqa: N815 - Kubernetes-style key
    """Always trainctl/v1."""
    kind: Literal["TrainingJob"] = KIND
    """Always TrainingJob."""
    metadata: Metadata
    """Name and labels."""
    spec: JobSpecBody = Field(default_factory=JobSpecBody)
    """What to train and how."""
