"""Model FLOPs per token and the peak-FLOPS table behind MFU.

Training FLOPs per token (forward + backward = 3 x forward, one multiply-add = 2 FLOPs):

    6 * N_active  +  6 * n_layers * seq_len * (n_heads * head_dim)

`N_active` counts the matrix-multiply parameters one token passes through: per layer wq, wk, wv, wo,
and the SwiGLU w1, w2, w3 (for an MoE layer: the router, top_k routed experts and the shared
expert), plus the output projection. The embedding lookup does no multiplies and is excluded. The
second term is causal attention: per layer a token's query meets seq_len / 2 keys on average, for
QK^T and AV, so 2 * 2 * (seq_len / 2) * d forward FLOPs, times 3 for training. Activation
checkpointing adds one forward of each recomputed block (`recompute_flops_per_token`); MFU does not
count it (model FLOPs, not hardware FLOPs).

MFU = FLOPs per token x tokens per second / (ranks x peak FLOPS per device). Peaks are dense (no
sparsity) vendor numbers for the compute dtype; fp32 is the non-tensor-core rate since PyTorch does
not use TF32 for matmuls by default. Devices not in the table (including every CPU) have an unknown
peak, and MFU is reported as None rather than guessed.
"""

from __future__ import annotations

from trainctl.spec.presets import ModelConfig

PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # (substring of torch.cuda.get_device_name, {dtype: dense peak FLOP/s}); first match wins.
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("GH200", {"bfloat16": 989e12, "float32": 67e12}),
    ("GB200", {"bfloat16": 2500e12, "float32": 90e12}),  # the B200 of a GB200 superchip, at 1,200 W
    ("B200", {"bfloat16": 2250e12, "float32": 80e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 91.6e12}),
    ("L4", {"bfloat16": 121e12, "float32": 30.3e12}),
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


def training_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token (formula in the module docstring)."""
    return 6 * active_matmul_params(config) + 6 * config.n_layers * seq_len * config.n_heads * config.head_dim


def recomputed_layers(n_layers: int, activation_checkpointing: str) -> int:
    """Decoder blocks whose forward backward runs again: every one under `full`, the even-numbered
    ones under `selective` (the engine's `apply_activation_checkpointing`), none under `none`."""
    return {"full": n_layers, "selective": (n_layers + 1) // 2}.get(activation_checkpointing, 0)


def recompute_flops_per_token(config: ModelConfig, seq_len: int, activation_checkpointing: str) -> float:
    """FLOPs per trained token that activation checkpointing adds: one more forward of each recomputed
    block (a third of a block's training FLOPs; the output layer is never recomputed)."""
    blocks = training_flops_per_token(config, seq_len) - 6 * config.dim * config.vocab_size
    return blocks / 3 * recomputed_layers(config.n_layers, activation_checkpointing) / config.n_layers


def mfu(flops_per_token: float, tokens_per_second: float, ranks: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the device peak is unknown."""
    if peak is None or peak <= 0 or ranks < 1:
        return None
    return flops_per_token * tokens_per_second / (ranks * peak)
