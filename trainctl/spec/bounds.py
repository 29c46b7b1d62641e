"""Upper bounds of a job spec's counts and lengths (docs/security.md, "Request bounds"): far above any
real job, low enough that no server-side computation on a spec (validation, planning, estimation) can
run away. Pure constants: the spec's sections, the Hugging Face config reader and the service read them.
"""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The proto carries every integer as int64: a spec value outside this range has no wire form."""

MAX_VOCAB = 4_194_304
MAX_DIM = 65_536
MAX_FFN_DIM = 262_144
MAX_LAYERS = 1_024
MAX_HEADS = 1_024
MAX_EXPERTS = 1_024
MAX_SEQ_LEN = 2_097_152
MAX_BATCH = 1_048_576
MAX_STEPS = 1_000_000_000
MAX_DEGREE = 65_536
MAX_VIRTUAL_STAGES = 64
MAX_FILES = 10_000_000
MAX_PREFETCH = 64
MAX_KEEP_LAST = 1_000
MAX_RESTARTS = 1_000
MAX_STEP_TIMEOUT_SECONDS = 7 * 24 * 3600.0
MAX_LORA_RANK = 4_096
MAX_DATA_PATHS = 1_024
MAX_PATH_LENGTH = 4_096
MAX_LABELS = 64
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 256
MAX_LABELS_BYTES = 16_384
MAX_COMMAND_ARGS = 1_024
MAX_COMMAND_ARG_LENGTH = 16_384
MAX_ENV_VARS = 256
MAX_ENV_BYTES = 65_536
