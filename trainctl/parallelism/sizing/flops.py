"""Model FLOPs per token and the peak-FLOPS table behind MFU.

Training FLOPs per token (forward + backward = 3 x forward, one multiply-add = 2 FLOPs), in two
conventions that differ only in how causal attention is counted:

    Megatron (causal attention halved; the default, `training_flops_per_token`):
        6 * N_active  +  6 * n_layers * seq_len * (n_heads * head_dim)
    torchtitan (attention counted unmasked, `full_attention_flops_per_token`):
        6 * N_active  + 12 * n_layers * seq_len * (n_heads * head_dim)

`N_active` counts the matrix-multiply parameters one token passes through: per layer wq, wk, wv, wo,
and the SwiGLU w1, w2, w3 (for an MoE layer: the router, top_k routed experts and the shared
expert), plus the output projection. The embedding lookup does no multiplies and is excluded, and so
are norm weights (torchtitan's N counts them: a few hundred thousand parameters, so its FLOPs/token
for Llama 1B at seq 2048 is 8,220,192,768 where ours in its convention is 8,219,787,264). The second
term is attention's QK^T and AV (no weights), per layer 2 * 2 * keys * d forward FLOPs times 3 for
training: under Megatron's convention a causal query meets seq_len / 2 keys on average; under
torchtitan's every query meets all seq_len keys (the masked half counted as work).

LoRA (`lora`, the job's `LoRASpec`): frozen base weights get no weight-gradient GEMM, so a frozen
matmul parameter costs 4 FLOPs per token (forward 2 + input gradient 2) instead of 6; the adapters
(`lora_a` [r, in] and `lora_b` [out, r] on each target projection of every dense block, as
`model/lora.py` builds them) are trained and cost 6; attention's score and value products keep their
factor (they have no weights, and their input gradients are still needed):

    4 * N_active  +  6 * N_adapters  +  attention term

Activation checkpointing adds one forward of each recomputed block (`recompute_flops_per_token`;
Megatron's causal count, as the kernels do it, adapters included under LoRA); MFU does not count it
(model FLOPs, not hardware FLOPs).

MFU = FLOPs per token x tokens per second / (ranks x peak FLOPS per device), reported in both
conventions (`mfu` Megatron's, `mfu_full_attention` torchtitan's), so a number can be compared with
either project's tables. Peaks are dense (no sparsity) vendor numbers for the compute dtype; fp32 is
the non-tensor-core rate since PyTorch does not use TF32 for matmuls by default; float8 is listed
only for devices with float8 tensor cores (Ada, Hopper, Blackwell), and MFU is always taken against
the bf16 peak, float8 jobs included, so the two precisions compare on one scale. Devices not in the
table (including every CPU) have an unknown peak, and MFU is reported as None rather than guessed.
"""

from __future__ import annotations

from trainctl.parallelism.layouts.float8_rule import converts_shape
from trainctl.parallelism.model.lora_names import PARENTS
from trainctl.spec.job import LoRASpec
from trainctl.spec.presets import ModelConfig

PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # (substring of torch.cuda.get_device_name, {dtype: dense peak FLOP/s}); first match wins.
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12, "float8": 1513e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12, "float8": 1671e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12, "float8": 1979e12}),
    ("H200", {"bfloat16": 989e12, "float32": 67e12, "float8": 1979e12}),
    ("GH200", {"bfloat16": 989e12, "float32": 67e12, "float8": 1979e12}),
    ("GB200", {"bfloat16": 2500e12, "float32": 90e12, "float8": 5000e12}),  # the B200 of a GB200 superchip, at 1,200 W
    ("B200", {"bfloat16": 2250e12, "float32": 80e12, "float8": 4500e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 91.6e12, "float8": 733e12}),
    ("L4", {"bfloat16": 121e12, "float32": 30.3e12, "float8": 242e12}),
)


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for `dtype`, or None when unknown (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    for key, peaks in PEAK_FLOPS:
        if key in device_name:
            return peaks.get(dtype)
    return None


def moe_layer_count(config: ModelConfig) -> int:
    """Decoder layers with an MoE feed-forward (`ModelConfig.is_moe_layer`: every `interval`-th)."""
    return 0 if config.moe is None else config.n_layers // config.moe.interval


def active_matmul_params(config: ModelConfig) -> int:
    """Matrix-multiply parameters one token passes through (N_active above), in closed form."""
    head_dim = config.head_dim
    attention = 2 * config.dim * config.n_heads * head_dim + 2 * config.dim * config.n_kv_heads * head_dim
    dense_ffn = 3 * config.dim * config.ffn_dim
    moe_layers = moe_layer_count(config)
    total = config.dim * config.vocab_size + config.n_layers * attention + (config.n_layers - moe_layers) * dense_ffn
    if config.moe is not None:
        moe = config.moe
        total += moe_layers * (config.dim * moe.num_experts + moe.top_k * dense_ffn + (dense_ffn if moe.shared_expert else 0))
    return total


def block_linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of a dense decoder block's linears, unsharded."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    d, f = config.dim, config.ffn_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w1": (d, f), "w2": (f, d), "w3": (d, f)}


def float8_blocks(config: ModelConfig, recipe: str) -> set[str]:
    """The linears of a dense block that train in float8 under `training.fp8` (layouts/float8.py's
    rule on the unsharded shapes, as torchtitan's filter applies it; MoE experts never do)."""
    if recipe == "none":
        return set()
    return {n for n, (i, o) in block_linear_shapes(config).items() if converts_shape(n, i, o, recipe)}


def float8_weight_elements(config: ModelConfig, recipe: str, layer: int) -> int:
    """Weight elements of decoder block `layer` (unsharded) that train in float8 (an MoE layer's experts
    are not linears: only its attention converts)."""
    shapes, names = block_linear_shapes(config), float8_blocks(config, recipe)
    if config.is_moe_layer(layer):
        names -= {"w1", "w2", "w3"}
    return sum(shapes[n][0] * shapes[n][1] for n in names)


def float8_flops_per_token(config: ModelConfig, recipe: str) -> int:
    """Training FLOPs per token of the matrix products that run in float8 (6 per converted weight
    element of every block; attention's score and value products and the head stay in bf16)."""
    return 6 * sum(float8_weight_elements(config, recipe, layer) for layer in range(config.n_layers))


def adapter_params(config: ModelConfig, lora: LoRASpec | None) -> int:
    """LoRA adapter parameters (trained; N_adapters above): r x (in + out) for each target projection of
    every dense block (MoE layers' experts get none: `lora.target_names`), 0 without LoRA."""
    if lora is None:
        return 0
    in_out = block_linear_shapes(config)
    moe_layers = moe_layer_count(config)
    total = 0
    for target in set(lora.target_modules):
        layers = config.n_layers - moe_layers if PARENTS[target] == "feed_forward" else config.n_layers
        total += layers * lora.rank * sum(in_out[target])
    return total


def matmul_flops_per_token(config: ModelConfig, lora: LoRASpec | None = None) -> int:
    """Training FLOPs per token of the weight matmuls: 6 * N_active, or under LoRA 4 * N_active (frozen)
    + 6 * N_adapters (module docstring)."""
    if lora is None:
        return 6 * active_matmul_params(config)
    return 4 * active_matmul_params(config) + 6 * adapter_params(config, lora)


def attention_flops_per_token(config: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Training FLOPs per token of attention's QK^T and AV: 6 * n_layers * seq_len * n_heads * head_dim with
    causal attention halved (Megatron), twice that counted unmasked (`causal=False`, torchtitan)."""
    return (6 if causal else 12) * config.n_layers * seq_len * config.n_heads * config.head_dim


def training_flops_per_token(config: ModelConfig, seq_len: int, lora: LoRASpec | None = None) -> int:
    """Forward + backward FLOPs per trained token, Megatron's convention (causal attention halved): the
    FLOPs behind `StepReport.mfu`, the step-time model and the estimator (module docstring)."""
    return matmul_flops_per_token(config, lora) + attention_flops_per_token(config, seq_len)


def full_attention_flops_per_token(config: ModelConfig, seq_len: int, lora: LoRASpec | None = None) -> int:
    """Forward + backward FLOPs per trained token, torchtitan's convention (attention counted unmasked):
    the FLOPs behind `StepReport.mfu_full_attention` (module docstring)."""
    return matmul_flops_per_token(config, lora) + attention_flops_per_token(config, seq_len, causal=False)


def recomputed_layers(n_layers: int, activation_checkpointing: str) -> int:
    """Decoder blocks whose forward backward runs again: every one under `full`, the even-numbered
    ones under `selective` (the engine's `apply_activation_checkpointing`), none under `none`."""
    return {"full": n_layers, "selective": (n_layers + 1) // 2}.get(activation_checkpointing, 0)


def recompute_flops_per_token(config: ModelConfig, seq_len: int, activation_checkpointing: str,
                              lora: LoRASpec | None = None) -> float:
    """FLOPs per trained token that activation checkpointing adds: one more forward of each recomputed
    block (2 FLOPs per matmul parameter, adapters included under LoRA, plus the causal attention forward;
    the output layer is never recomputed)."""
    matmuls = 2 * (active_matmul_params(config) - config.dim * config.vocab_size + adapter_params(config, lora))
    blocks = matmuls + attention_flops_per_token(config, seq_len) / 3
    return blocks * recomputed_layers(config.n_layers, activation_checkpointing) / config.n_layers


def mfu(flops_per_token: float, tokens_per_second: float, ranks: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the device peak is unknown."""
    if peak is None or peak <= 0 or ranks < 1:
        return None
    return flops_per_token * tokens_per_second / (ranks * peak)
