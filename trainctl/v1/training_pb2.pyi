import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MoEAuxLoss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOE_AUX_LOSS_UNSPECIFIED: _ClassVar[MoEAuxLoss]
    MOE_AUX_LOSS_PER_LAYER_SUM: _ClassVar[MoEAuxLoss]
    MOE_AUX_LOSS_TRANSFORMERS: _ClassVar[MoEAuxLoss]

class DataFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_FORMAT_UNSPECIFIED: _ClassVar[DataFormat]
    DATA_FORMAT_TEXT: _ClassVar[DataFormat]
    DATA_FORMAT_TOKENS: _ClassVar[DataFormat]
    DATA_FORMAT_JSONL: _ClassVar[DataFormat]
    DATA_FORMAT_PARQUET: _ClassVar[DataFormat]
    DATA_FORMAT_ARROW: _ClassVar[DataFormat]

class PipelineSchedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIPELINE_SCHEDULE_UNSPECIFIED: _ClassVar[PipelineSchedule]
    PIPELINE_SCHEDULE_GPIPE: _ClassVar[PipelineSchedule]
    PIPELINE_SCHEDULE_1F1B: _ClassVar[PipelineSchedule]
    PIPELINE_SCHEDULE_INTERLEAVED_1F1B: _ClassVar[PipelineSchedule]
    PIPELINE_SCHEDULE_ZERO_BUBBLE: _ClassVar[PipelineSchedule]

class Optimizer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_UNSPECIFIED: _ClassVar[Optimizer]
    OPTIMIZER_ADAMW: _ClassVar[Optimizer]
    OPTIMIZER_ADAFACTOR: _ClassVar[Optimizer]
    OPTIMIZER_SGD: _ClassVar[Optimizer]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Float8(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT8_UNSPECIFIED: _ClassVar[Float8]
    FLOAT8_NONE: _ClassVar[Float8]
    FLOAT8_TENSORWISE: _ClassVar[Float8]
    FLOAT8_ROWWISE: _ClassVar[Float8]

class ActivationCheckpointing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_CHECKPOINTING_UNSPECIFIED: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_NONE: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_SELECTIVE: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_FULL: _ClassVar[ActivationCheckpointing]

class OptimizerImpl(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_IMPL_UNSPECIFIED: _ClassVar[OptimizerImpl]
    OPTIMIZER_IMPL_AUTO: _ClassVar[OptimizerImpl]
    OPTIMIZER_IMPL_FOREACH: _ClassVar[OptimizerImpl]
    OPTIMIZER_IMPL_FUSED: _ClassVar[OptimizerImpl]

class Device(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_UNSPECIFIED: _ClassVar[Device]
    DEVICE_AUTO: _ClassVar[Device]
    DEVICE_CUDA: _ClassVar[Device]
    DEVICE_CPU: _ClassVar[Device]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    QUEUED: _ClassVar[JobState]
    SCHEDULED: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    RESTARTING: _ClassVar[JobState]
    CANCELLING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
    PREEMPTED: _ClassVar[JobState]

class JobView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_VIEW_UNSPECIFIED: _ClassVar[JobView]
    JOB_VIEW_BASIC: _ClassVar[JobView]
    JOB_VIEW_FULL: _ClassVar[JobView]

class ParameterType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARAMETER_TYPE_UNSPECIFIED: _ClassVar[ParameterType]
    PARAMETER_TYPE_FLOAT: _ClassVar[ParameterType]
    PARAMETER_TYPE_INT: _ClassVar[ParameterType]
    PARAMETER_TYPE_CHOICE: _ClassVar[ParameterType]

class ObjectiveDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECTIVE_DIRECTION_UNSPECIFIED: _ClassVar[ObjectiveDirection]
    OBJECTIVE_DIRECTION_MINIMIZE: _ClassVar[ObjectiveDirection]
    OBJECTIVE_DIRECTION_MAXIMIZE: _ClassVar[ObjectiveDirection]

class EarlyStoppingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_RULE_UNSPECIFIED: _ClassVar[EarlyStoppingRule]
    EARLY_STOPPING_RULE_NONE: _ClassVar[EarlyStoppingRule]
    EARLY_STOPPING_RULE_MEDIAN: _ClassVar[EarlyStoppingRule]
    EARLY_STOPPING_RULE_SUCCESSIVE_HALVING: _ClassVar[EarlyStoppingRule]

class SweepAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWEEP_ALGORITHM_UNSPECIFIED: _ClassVar[SweepAlgorithm]
    SWEEP_ALGORITHM_TPE: _ClassVar[SweepAlgorithm]
    SWEEP_ALGORITHM_RANDOM: _ClassVar[SweepAlgorithm]

class SweepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWEEP_STATE_UNSPECIFIED: _ClassVar[SweepState]
    SWEEP_STATE_RUNNING: _ClassVar[SweepState]
    SWEEP_STATE_SUCCEEDED: _ClassVar[SweepState]
    SWEEP_STATE_FAILED: _ClassVar[SweepState]
    SWEEP_STATE_CANCELLED: _ClassVar[SweepState]

class TrialState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRIAL_STATE_UNSPECIFIED: _ClassVar[TrialState]
    TRIAL_STATE_RUNNING: _ClassVar[TrialState]
    TRIAL_STATE_COMPLETE: _ClassVar[TrialState]
    TRIAL_STATE_PRUNED: _ClassVar[TrialState]
    TRIAL_STATE_FAILED: _ClassVar[TrialState]
    TRIAL_STATE_CANCELLED: _ClassVar[TrialState]
MOE_AUX_LOSS_UNSPECIFIED: MoEAuxLoss
MOE_AUX_LOSS_PER_LAYER_SUM: MoEAuxLoss
MOE_AUX_LOSS_TRANSFORMERS: MoEAuxLoss
DATA_FORMAT_UNSPECIFIED: DataFormat
DATA_FORMAT_TEXT: DataFormat
DATA_FORMAT_TOKENS: DataFormat
DATA_FORMAT_JSONL: DataFormat
DATA_FORMAT_PARQUET: DataFormat
DATA_FORMAT_ARROW: DataFormat
PIPELINE_SCHEDULE_UNSPECIFIED: PipelineSchedule
PIPELINE_SCHEDULE_GPIPE: PipelineSchedule
PIPELINE_SCHEDULE_1F1B: PipelineSchedule
PIPELINE_SCHEDULE_INTERLEAVED_1F1B: PipelineSchedule
PIPELINE_SCHEDULE_ZERO_BUBBLE: PipelineSchedule
OPTIMIZER_UNSPECIFIED: Optimizer
OPTIMIZER_ADAMW: Optimizer
OPTIMIZER_ADAFACTOR: Optimizer
OPTIMIZER_SGD: Optimizer
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
FLOAT8_UNSPECIFIED: Float8
FLOAT8_NONE: Float8
FLOAT8_TENSORWISE: Float8
FLOAT8_ROWWISE: Float8
ACTIVATION_CHECKPOINTING_UNSPECIFIED: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_NONE: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_SELECTIVE: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_FULL: ActivationCheckpointing
OPTIMIZER_IMPL_UNSPECIFIED: OptimizerImpl
OPTIMIZER_IMPL_AUTO: OptimizerImpl
OPTIMIZER_IMPL_FOREACH: OptimizerImpl
OPTIMIZER_IMPL_FUSED: OptimizerImpl
DEVICE_UNSPECIFIED: Device
DEVICE_AUTO: Device
DEVICE_CUDA: Device
DEVICE_CPU: Device
JOB_STATE_UNSPECIFIED: JobState
QUEUED: JobState
SCHEDULED: JobState
RUNNING: JobState
RESTARTING: JobState
CANCELLING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState
PREEMPTED: JobState
JOB_VIEW_UNSPECIFIED: JobView
JOB_VIEW_BASIC: JobView
JOB_VIEW_FULL: JobView
PARAMETER_TYPE_UNSPECIFIED: ParameterType
PARAMETER_TYPE_FLOAT: ParameterType
PARAMETER_TYPE_INT: ParameterType
PARAMETER_TYPE_CHOICE: ParameterType
OBJECTIVE_DIRECTION_UNSPECIFIED: ObjectiveDirection
OBJECTIVE_DIRECTION_MINIMIZE: ObjectiveDirection
OBJECTIVE_DIRECTION_MAXIMIZE: ObjectiveDirection
EARLY_STOPPING_RULE_UNSPECIFIED: EarlyStoppingRule
EARLY_STOPPING_RULE_NONE: EarlyStoppingRule
EARLY_STOPPING_RULE_MEDIAN: EarlyStoppingRule
EARLY_STOPPING_RULE_SUCCESSIVE_HALVING: EarlyStoppingRule
SWEEP_ALGORITHM_UNSPECIFIED: SweepAlgorithm
SWEEP_ALGORITHM_TPE: SweepAlgorithm
SWEEP_ALGORITHM_RANDOM: SweepAlgorithm
SWEEP_STATE_UNSPECIFIED: SweepState
SWEEP_STATE_RUNNING: SweepState
SWEEP_STATE_SUCCEEDED: SweepState
SWEEP_STATE_FAILED: SweepState
SWEEP_STATE_CANCELLED: SweepState
TRIAL_STATE_UNSPECIFIED: TrialState
TRIAL_STATE_RUNNING: TrialState
TRIAL_STATE_COMPLETE: TrialState
TRIAL_STATE_PRUNED: TrialState
TRIAL_STATE_FAILED: TrialState
TRIAL_STATE_CANCELLED: TrialState

class ObjectMeta(_message.Message):
    __slots__ = ("name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MoESpec(_message.Message):
    __slots__ = ("num_experts", "top_k", "shared_expert", "aux_loss_coef", "interval", "aux_loss")
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_FIELD_NUMBER: _ClassVar[int]
    num_experts: int
    top_k: int
    shared_expert: bool
    aux_loss_coef: float
    interval: int
    aux_loss: MoEAuxLoss
    def __init__(self, num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., shared_expert: _Optional[bool] = ..., aux_loss_coef: _Optional[float] = ..., interval: _Optional[int] = ..., aux_loss: _Optional[_Union[MoEAuxLoss, str]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("preset", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "moe", "from_pretrained")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    FFN_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    NORM_EPS_FIELD_NUMBER: _ClassVar[int]
    MOE_FIELD_NUMBER: _ClassVar[int]
    FROM_PRETRAINED_FIELD_NUMBER: _ClassVar[int]
    preset: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    moe: MoESpec
    from_pretrained: str
    def __init__(self, preset: _Optional[str] = ..., vocab_size: _Optional[int] = ..., dim: _Optional[int] = ..., n_layers: _Optional[int] = ..., n_heads: _Optional[int] = ..., n_kv_heads: _Optional[int] = ..., ffn_dim: _Optional[int] = ..., rope_theta: _Optional[float] = ..., norm_eps: _Optional[float] = ..., moe: _Optional[_Union[MoESpec, _Mapping]] = ..., from_pretrained: _Optional[str] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("paths", "tokenizer", "seq_len", "seed", "max_files", "all_files", "format", "prefetch", "text_field", "messages_field")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_FILES_FIELD_NUMBER: _ClassVar[int]
    ALL_FILES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_FIELD_NUMBER: _ClassVar[int]
    paths: StringList
    tokenizer: str
    seq_len: int
    seed: int
    max_files: int
    all_files: bool
    format: DataFormat
    prefetch: int
    text_field: str
    messages_field: str
    def __init__(self, paths: _Optional[_Union[StringList, _Mapping]] = ..., tokenizer: _Optional[str] = ..., seq_len: _Optional[int] = ..., seed: _Optional[int] = ..., max_files: _Optional[int] = ..., all_files: _Optional[bool] = ..., format: _Optional[_Union[DataFormat, str]] = ..., prefetch: _Optional[int] = ..., text_field: _Optional[str] = ..., messages_field: _Optional[str] = ...) -> None: ...

class ParallelismSpec(_message.Message):
    __slots__ = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "sequence_parallel", "zero_stage", "pp_schedule", "pp_virtual_stages", "cp_load_balance")
    DP_REPLICATE_FIELD_NUMBER: _ClassVar[int]
    DP_SHARD_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ZERO_STAGE_FIELD_NUMBER: _ClassVar[int]
    PP_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PP_VIRTUAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    CP_LOAD_BALANCE_FIELD_NUMBER: _ClassVar[int]
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    sequence_parallel: bool
    zero_stage: int
    pp_schedule: PipelineSchedule
    pp_virtual_stages: int
    cp_load_balance: bool
    def __init__(self, dp_replicate: _Optional[int] = ..., dp_shard: _Optional[int] = ..., cp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., ep: _Optional[int] = ..., sequence_parallel: _Optional[bool] = ..., zero_stage: _Optional[int] = ..., pp_schedule: _Optional[_Union[PipelineSchedule, str]] = ..., pp_virtual_stages: _Optional[int] = ..., cp_load_balance: _Optional[bool] = ...) -> None: ...

class TrainingSpec(_message.Message):
    __slots__ = ("steps", "global_batch_size", "micro_batch_size", "micro_batch_auto", "optimizer", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "dtype", "activation_checkpointing", "compile", "seed", "log_interval", "optimizer_impl", "empty_cache_steps", "fp8")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_AUTO_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOG_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_IMPL_FIELD_NUMBER: _ClassVar[int]
    EMPTY_CACHE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FP8_FIELD_NUMBER: _ClassVar[int]
    steps: int
    global_batch_size: int
    micro_batch_size: int
    micro_batch_auto: bool
    optimizer: Optimizer
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    grad_clip: float
    dtype: DType
    activation_checkpointing: ActivationCheckpointing
    compile: bool
    seed: int
    log_interval: int
    optimizer_impl: OptimizerImpl
    empty_cache_steps: int
    fp8: Float8
    def __init__(self, steps: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., micro_batch_auto: _Optional[bool] = ..., optimizer: _Optional[_Union[Optimizer, str]] = ..., lr: _Optional[float] = ..., min_lr_ratio: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., grad_clip: _Optional[float] = ..., dtype: _Optional[_Union[DType, str]] = ..., activation_checkpointing: _Optional[_Union[ActivationCheckpointing, str]] = ..., compile: _Optional[bool] = ..., seed: _Optional[int] = ..., log_interval: _Optional[int] = ..., optimizer_impl: _Optional[_Union[OptimizerImpl, str]] = ..., empty_cache_steps: _Optional[int] = ..., fp8: _Optional[_Union[Float8, str]] = ...) -> None: ...

class CheckpointSpec(_message.Message):
    __slots__ = ("interval_steps", "keep_last", "resume", "async_save", "memory_interval_steps")
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SAVE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    interval_steps: int
    keep_last: int
    resume: bool
    async_save: bool
    memory_interval_steps: int
    def __init__(self, interval_steps: _Optional[int] = ..., keep_last: _Optional[int] = ..., resume: _Optional[bool] = ..., async_save: _Optional[bool] = ..., memory_interval_steps: _Optional[int] = ...) -> None: ...

class ResourcesSpec(_message.Message):
    __slots__ = ("gpus", "device", "host_memory_gib")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_GIB_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    device: Device
    host_memory_gib: float
    def __init__(self, gpus: _Optional[int] = ..., device: _Optional[_Union[Device, str]] = ..., host_memory_gib: _Optional[float] = ...) -> None: ...

class SchedulingSpec(_message.Message):
    __slots__ = ("priority", "max_restarts", "step_timeout_seconds", "preemptible", "elastic")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    priority: int
    max_restarts: int
    step_timeout_seconds: float
    preemptible: bool
    elastic: ElasticSpec
    def __init__(self, priority: _Optional[int] = ..., max_restarts: _Optional[int] = ..., step_timeout_seconds: _Optional[float] = ..., preemptible: _Optional[bool] = ..., elastic: _Optional[_Union[ElasticSpec, _Mapping]] = ...) -> None: ...

class ElasticSpec(_message.Message):
    __slots__ = ("min_gpus",)
    MIN_GPUS_FIELD_NUMBER: _ClassVar[int]
    min_gpus: int
    def __init__(self, min_gpus: _Optional[int] = ...) -> None: ...

class LoRASpec(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: StringList
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Union[StringList, _Mapping]] = ...) -> None: ...

class EvaluationSpec(_message.Message):
    __slots__ = ("data", "holdout_fraction", "interval_steps", "batches", "at_end")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HOLDOUT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    AT_END_FIELD_NUMBER: _ClassVar[int]
    data: DataSpec
    holdout_fraction: float
    interval_steps: int
    batches: int
    at_end: bool
    def __init__(self, data: _Optional[_Union[DataSpec, _Mapping]] = ..., holdout_fraction: _Optional[float] = ..., interval_steps: _Optional[int] = ..., batches: _Optional[int] = ..., at_end: _Optional[bool] = ...) -> None: ...

class TrackingSpec(_message.Message):
    __slots__ = ("mlflow_tracking_uri", "mlflow_experiment", "mlflow", "tensorboard")
    MLFLOW_TRACKING_URI_FIELD_NUMBER: _ClassVar[int]
    MLFLOW_EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    MLFLOW_FIELD_NUMBER: _ClassVar[int]
    TENSORBOARD_FIELD_NUMBER: _ClassVar[int]
    mlflow_tracking_uri: str
    mlflow_experiment: str
    mlflow: bool
    tensorboard: bool
    def __init__(self, mlflow_tracking_uri: _Optional[str] = ..., mlflow_experiment: _Optional[str] = ..., mlflow: _Optional[bool] = ..., tensorboard: _Optional[bool] = ...) -> None: ...

class CommandSpec(_message.Message):
    __slots__ = ("program", "args", "working_dir", "env", "no_progress_timeout_seconds")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NO_PROGRESS_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    program: str
    args: StringList
    working_dir: str
    env: _containers.ScalarMap[str, str]
    no_progress_timeout_seconds: float
    def __init__(self, program: _Optional[str] = ..., args: _Optional[_Union[StringList, _Mapping]] = ..., working_dir: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., no_progress_timeout_seconds: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("model", "data", "parallelism", "training", "checkpoint", "resources", "scheduling", "init_from", "lora", "command", "evaluation", "tracking")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    TRACKING_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    data: DataSpec
    parallelism: ParallelismSpec
    training: TrainingSpec
    checkpoint: CheckpointSpec
    resources: ResourcesSpec
    scheduling: SchedulingSpec
    init_from: str
    lora: LoRASpec
    command: CommandSpec
    evaluation: EvaluationSpec
    tracking: TrackingSpec
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., parallelism: _Optional[_Union[ParallelismSpec, _Mapping]] = ..., training: _Optional[_Union[TrainingSpec, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSpec, _Mapping]] = ..., resources: _Optional[_Union[ResourcesSpec, _Mapping]] = ..., scheduling: _Optional[_Union[SchedulingSpec, _Mapping]] = ..., init_from: _Optional[str] = ..., lora: _Optional[_Union[LoRASpec, _Mapping]] = ..., command: _Optional[_Union[CommandSpec, _Mapping]] = ..., evaluation: _Optional[_Union[EvaluationSpec, _Mapping]] = ..., tracking: _Optional[_Union[TrackingSpec, _Mapping]] = ...) -> None: ...

class RankPlacement(_message.Message):
    __slots__ = ("rank", "node", "gpu", "coords")
    class CoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    COORDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    gpu: int
    coords: _containers.ScalarMap[str, int]
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., gpu: _Optional[int] = ..., coords: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_second", "mfu", "step_time_seconds", "breakdown", "peak_memory_bytes", "time", "eval_loss", "mfu_full_attention")
    class BreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    MFU_FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    tokens_per_second: float
    mfu: float
    step_time_seconds: float
    breakdown: _containers.ScalarMap[str, float]
    peak_memory_bytes: int
    time: _timestamp_pb2.Timestamp
    eval_loss: float
    mfu_full_attention: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., mfu: _Optional[float] = ..., step_time_seconds: _Optional[float] = ..., breakdown: _Optional[_Mapping[str, float]] = ..., peak_memory_bytes: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., eval_loss: _Optional[float] = ..., mfu_full_attention: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("state", "reason", "create_time", "schedule_time", "start_time", "end_time", "update_time", "steps_done", "total_steps", "first_loss", "last_loss", "restarts", "tokens_per_second", "mfu", "placement", "run_dir", "last_eval_loss", "mfu_full_attention", "preemptions", "preempt_time")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    MFU_FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_TIME_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    reason: str
    create_time: _timestamp_pb2.Timestamp
    schedule_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    steps_done: int
    total_steps: int
    first_loss: float
    last_loss: float
    restarts: int
    tokens_per_second: float
    mfu: float
    placement: _containers.RepeatedCompositeFieldContainer[RankPlacement]
    run_dir: str
    last_eval_loss: float
    mfu_full_attention: float
    preemptions: int
    preempt_time: _timestamp_pb2.Timestamp
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., schedule_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., steps_done: _Optional[int] = ..., total_steps: _Optional[int] = ..., first_loss: _Optional[float] = ..., last_loss: _Optional[float] = ..., restarts: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., mfu: _Optional[float] = ..., placement: _Optional[_Iterable[_Union[RankPlacement, _Mapping]]] = ..., run_dir: _Optional[str] = ..., last_eval_loss: _Optional[float] = ..., mfu_full_attention: _Optional[float] = ..., preemptions: _Optional[int] = ..., preempt_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "api_version", "kind", "metadata", "spec", "status", "metrics")
    ID_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    id: str
    api_version: str
    kind: str
    metadata: ObjectMeta
    spec: JobSpec
    status: JobStatus
    metrics: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    def __init__(self, id: _Optional[str] = ..., api_version: _Optional[str] = ..., kind: _Optional[str] = ..., metadata: _Optional[_Union[ObjectMeta, _Mapping]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., metrics: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("from_state", "to_state", "reason")
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    from_state: JobState
    to_state: JobState
    reason: str
    def __init__(self, from_state: _Optional[_Union[JobState, str]] = ..., to_state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("level", "message", "rank")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    level: str
    message: str
    rank: int
    def __init__(self, level: _Optional[str] = ..., message: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("sequence", "job_id", "time", "state_change", "step", "log")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    job_id: str
    time: _timestamp_pb2.Timestamp
    state_change: StateChange
    step: StepMetrics
    log: LogLine
    def __init__(self, sequence: _Optional[int] = ..., job_id: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state_change: _Optional[_Union[StateChange, _Mapping]] = ..., step: _Optional[_Union[StepMetrics, _Mapping]] = ..., log: _Optional[_Union[LogLine, _Mapping]] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job", "request_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job: Job
    request_id: str
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id", "view")
    ID_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    id: str
    view: JobView
    def __init__(self, id: _Optional[str] = ..., view: _Optional[_Union[JobView, str]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "labels", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    labels: _containers.ScalarMap[str, str]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[JobState, str]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("id", "after_sequence", "follow")
    ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    id: str
    after_sequence: int
    follow: bool
    def __init__(self, id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("field", "description")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    field: str
    description: str
    def __init__(self, field: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("rank", "bytes")
    class BytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bytes: _containers.ScalarMap[str, int]
    def __init__(self, rank: _Optional[int] = ..., bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PlanJobResponse(_message.Message):
    __slots__ = ("valid", "violations", "world_size", "grid", "placement", "placement_cost_seconds", "memory", "step_time_seconds", "step_time_breakdown", "fits_now", "pool_gpus", "free_gpus", "notes")
    class GridEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StepTimeBreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALID_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    FITS_NOW_FIELD_NUMBER: _ClassVar[int]
    POOL_GPUS_FIELD_NUMBER: _ClassVar[int]
    FREE_GPUS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    world_size: int
    grid: _containers.ScalarMap[str, int]
    placement: _containers.RepeatedCompositeFieldContainer[RankPlacement]
    placement_cost_seconds: float
    memory: _containers.RepeatedCompositeFieldContainer[RankMemory]
    step_time_seconds: float
    step_time_breakdown: _containers.ScalarMap[str, float]
    fits_now: bool
    pool_gpus: int
    free_gpus: int
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, valid: _Optional[bool] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., world_size: _Optional[int] = ..., grid: _Optional[_Mapping[str, int]] = ..., placement: _Optional[_Iterable[_Union[RankPlacement, _Mapping]]] = ..., placement_cost_seconds: _Optional[float] = ..., memory: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., step_time_seconds: _Optional[float] = ..., step_time_breakdown: _Optional[_Mapping[str, float]] = ..., fits_now: _Optional[bool] = ..., pool_gpus: _Optional[int] = ..., free_gpus: _Optional[int] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "job_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    job_id: str
    def __init__(self, index: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "labels", "gpus", "alive")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    alive: bool
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., alive: _Optional[bool] = ...) -> None: ...

class Cluster(_message.Message):
    __slots__ = ("nodes", "total_gpus", "free_gpus", "used_gpus", "topology_source", "queued_jobs", "running_jobs", "preempted_jobs", "tenants", "scale_up")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GPUS_FIELD_NUMBER: _ClassVar[int]
    FREE_GPUS_FIELD_NUMBER: _ClassVar[int]
    USED_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_JOBS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SCALE_UP_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    total_gpus: int
    free_gpus: int
    used_gpus: int
    topology_source: str
    queued_jobs: int
    running_jobs: int
    preempted_jobs: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantShare]
    scale_up: ScaleUp
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., total_gpus: _Optional[int] = ..., free_gpus: _Optional[int] = ..., used_gpus: _Optional[int] = ..., topology_source: _Optional[str] = ..., queued_jobs: _Optional[int] = ..., running_jobs: _Optional[int] = ..., preempted_jobs: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ..., scale_up: _Optional[_Union[ScaleUp, _Mapping]] = ...) -> None: ...

class ScaleUp(_message.Message):
    __slots__ = ("job_id", "nodes", "request_time")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    request_time: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., request_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("tenant", "used_gpus", "guaranteed_gpus", "borrowed_gpus")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_GPUS_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_GPUS_FIELD_NUMBER: _ClassVar[int]
    BORROWED_GPUS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    used_gpus: int
    guaranteed_gpus: int
    borrowed_gpus: int
    def __init__(self, tenant: _Optional[str] = ..., used_gpus: _Optional[int] = ..., guaranteed_gpus: _Optional[int] = ..., borrowed_gpus: _Optional[int] = ...) -> None: ...

class SweepValue(_message.Message):
    __slots__ = ("int_value", "float_value", "string_value", "bool_value")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    float_value: float
    string_value: str
    bool_value: bool
    def __init__(self, int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ...) -> None: ...

class SweepParameter(_message.Message):
    __slots__ = ("path", "type", "low", "high", "log", "values")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: ParameterType
    low: SweepValue
    high: SweepValue
    log: bool
    values: _containers.RepeatedCompositeFieldContainer[SweepValue]
    def __init__(self, path: _Optional[str] = ..., type: _Optional[_Union[ParameterType, str]] = ..., low: _Optional[_Union[SweepValue, _Mapping]] = ..., high: _Optional[_Union[SweepValue, _Mapping]] = ..., log: _Optional[bool] = ..., values: _Optional[_Iterable[_Union[SweepValue, _Mapping]]] = ...) -> None: ...

class SweepObjective(_message.Message):
    __slots__ = ("metric", "direction", "step")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    metric: str
    direction: ObjectiveDirection
    step: int
    def __init__(self, metric: _Optional[str] = ..., direction: _Optional[_Union[ObjectiveDirection, str]] = ..., step: _Optional[int] = ...) -> None: ...

class EarlyStopping(_message.Message):
    __slots__ = ("rule", "min_steps", "startup_trials", "reduction_factor")
    RULE_FIELD_NUMBER: _ClassVar[int]
    MIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TRIALS_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    rule: EarlyStoppingRule
    min_steps: int
    startup_trials: int
    reduction_factor: int
    def __init__(self, rule: _Optional[_Union[EarlyStoppingRule, str]] = ..., min_steps: _Optional[int] = ..., startup_trials: _Optional[int] = ..., reduction_factor: _Optional[int] = ...) -> None: ...

class SweepSpec(_message.Message):
    __slots__ = ("template", "parameters", "objective", "trials", "parallel_trials", "algorithm", "startup_trials", "seed", "early_stopping")
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TRIALS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TRIALS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    template: JobSpec
    parameters: _containers.RepeatedCompositeFieldContainer[SweepParameter]
    objective: SweepObjective
    trials: int
    parallel_trials: int
    algorithm: SweepAlgorithm
    startup_trials: int
    seed: int
    early_stopping: EarlyStopping
    def __init__(self, template: _Optional[_Union[JobSpec, _Mapping]] = ..., parameters: _Optional[_Iterable[_Union[SweepParameter, _Mapping]]] = ..., objective: _Optional[_Union[SweepObjective, _Mapping]] = ..., trials: _Optional[int] = ..., parallel_trials: _Optional[int] = ..., algorithm: _Optional[_Union[SweepAlgorithm, str]] = ..., startup_trials: _Optional[int] = ..., seed: _Optional[int] = ..., early_stopping: _Optional[_Union[EarlyStopping, _Mapping]] = ...) -> None: ...

class Trial(_message.Message):
    __slots__ = ("number", "job_id", "params", "state", "objective", "objective_step", "reason", "job_state", "steps_done", "create_time", "end_time")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SweepValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SweepValue, _Mapping]] = ...) -> None: ...
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    number: int
    job_id: str
    params: _containers.MessageMap[str, SweepValue]
    state: TrialState
    objective: float
    objective_step: int
    reason: str
    job_state: JobState
    steps_done: int
    create_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, number: _Optional[int] = ..., job_id: _Optional[str] = ..., params: _Optional[_Mapping[str, SweepValue]] = ..., state: _Optional[_Union[TrialState, str]] = ..., objective: _Optional[float] = ..., objective_step: _Optional[int] = ..., reason: _Optional[str] = ..., job_state: _Optional[_Union[JobState, str]] = ..., steps_done: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SweepStatus(_message.Message):
    __slots__ = ("state", "reason", "create_time", "update_time", "end_time", "trials", "best_trial", "best_objective")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    BEST_TRIAL_FIELD_NUMBER: _ClassVar[int]
    BEST_OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    state: SweepState
    reason: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    trials: _containers.RepeatedCompositeFieldContainer[Trial]
    best_trial: int
    best_objective: float
    def __init__(self, state: _Optional[_Union[SweepState, str]] = ..., reason: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., trials: _Optional[_Iterable[_Union[Trial, _Mapping]]] = ..., best_trial: _Optional[int] = ..., best_objective: _Optional[float] = ...) -> None: ...

class Sweep(_message.Message):
    __slots__ = ("id", "api_version", "kind", "metadata", "spec", "status")
    ID_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    api_version: str
    kind: str
    metadata: ObjectMeta
    spec: SweepSpec
    status: SweepStatus
    def __init__(self, id: _Optional[str] = ..., api_version: _Optional[str] = ..., kind: _Optional[str] = ..., metadata: _Optional[_Union[ObjectMeta, _Mapping]] = ..., spec: _Optional[_Union[SweepSpec, _Mapping]] = ..., status: _Optional[_Union[SweepStatus, _Mapping]] = ...) -> None: ...

class CreateSweepRequest(_message.Message):
    __slots__ = ("sweep", "request_id")
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    sweep: Sweep
    request_id: str
    def __init__(self, sweep: _Optional[_Union[Sweep, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetSweepRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListSweepsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSweepsResponse(_message.Message):
    __slots__ = ("sweeps", "next_page_token")
    SWEEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sweeps: _containers.RepeatedCompositeFieldContainer[Sweep]
    next_page_token: str
    def __init__(self, sweeps: _Optional[_Iterable[_Union[Sweep, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelSweepRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchSweepRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...
