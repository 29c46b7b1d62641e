"""The modelled step time of a job: what `trainctl plan` reports and what the layout search ranks by.

    step = compute_at_peak + kernel_efficiency + recompute + optimizer + pipeline_bubble + communication

- `compute_at_peak`: the step's training FLOPs (`estimator.flops_per_step`) divided evenly over the
  ranks, at the device's dense peak for the job's dtype: the lower bound MFU is measured against.
- `recompute`: the forward of the blocks activation checkpointing recomputes
  (`flops.recompute_flops_per_token`), at the same peak.
- `kernel_efficiency`: what the kernels take beyond those bounds. Forward, backward and recompute
  sustain a fraction of the dense peak (`SUSTAINED_FRACTION`: compiled and eager), and float8 linears
  (`training.fp8`) run their share of the FLOPs (`flops.float8_flops_per_token`) `FLOAT8_SPEEDUP`
  times faster than bf16 at that fraction, their casts included.
- `optimizer`: gradient clipping and the optimizer step over the parameters this rank updates
  (all of its stage's under DDP, its shard under ZeRO / FSDP; LoRA's adapters only), memory-bound:
  `OPTIMIZER_BYTES` per parameter at `HBM_FRACTION` of the device's memory bandwidth (0 where the
  bandwidth is not known).
- `pipeline_bubble`: the idle time the pipeline schedule adds to the busy time (compute and recompute
  at the peak rate; `pipeline_bubble.bubble_seconds`), with `global_batch_size / (dp x
  micro_batch_size)` micro-batches.
- `communication`: the exposed part of the placement's modelled communication, per dimension (the
  cost model's `seconds_by_dim`). Tensor-, expert- and pipeline-parallel transfers sit on the
  critical path and count whole. Data-parallel traffic (FSDP's prefetched all-gathers, gradient
  reduce-scatters and DDP's bucketed all-reduces run on their own stream during forward and backward)
  and context-parallel ring passes (each K/V transfer overlaps the attention of the shard in hand)
  are hidden behind compute up to the length of compute and recompute at the peak rate; the rest is
  exposed.

The bubble and the overlap window keep the peak-rate busy time they had before the kernel and
optimizer terms were measured. Scaling both to the sustained busy time is what the physics suggests,
but it is unmeasured here (no multi-GPU pipeline or multi-node FSDP runs on a GPU), and it moves the
layout search's choice for a 1,024-GPU Llama 3 70B from the published TP 8 x PP-across-servers
recipe to pure ZeRO-3 (tests/planning/test_layout_search.py): the multi-GPU measurement decides.

The fractions are measured, not assumed: on one H200 (docs/benchmarks.md, "GPU: float8"), compiled
llama-1b and llama-3b at seq 2048 and llama-1b at seq 8192 spent 0.54-0.60 of the dense bf16 peak
in forward and backward, eager llama-1b 0.39 (checkpointed eager 0.40); their float8 linears ran
1.24x as fast as bf16 on llama-3b and llama-1b at seq 8192; clipping and fused AdamW moved 40 bytes
per parameter at 0.55-0.59 of the memory bandwidth. Other devices are modelled with the same
fractions of their own peaks and bandwidths, unmeasured.

Modelled MFU is `compute_at_peak / total`: model FLOPs over the step, recomputation not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainctl.parallelism.sizing.flops import (
    adapter_params,
    block_linear_shapes,
    float8_flops_per_token,
    moe_layer_count,
    recompute_flops_per_token,
    training_flops_per_token,
)
from trainctl.parallelism.sizing.pipeline_bubble import bubble_seconds
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig

STEP_TERMS = ("compute_at_peak", "kernel_efficiency", "recompute", "optimizer", "pipeline_bubble", "communication")
"""The terms of a modelled step, in the order they are shown."""
SUSTAINED_FRACTION = {True: 0.56, False: 0.39}
"""Fraction of the dense peak that forward and backward sustain, compiled (`training.compile`) and
eager (module docstring)."""
FLOAT8_SPEEDUP = 1.24
"""How much faster float8 linears run their FLOPs than bf16 ones, casts included (module docstring)."""
OPTIMIZER_BYTES = {"adamw": 40, "sgd": 32, "adafactor": 24}
"""Bytes moved per updated parameter by clipping (read the gradient twice, write it once: 12) and the
optimizer (AdamW: read parameter, gradient and both moments, write parameter and moments: 28; SGD
with momentum 20; Adafactor's factored second moment about 12)."""
HBM_FRACTION = 0.57
"""Fraction of the memory bandwidth the clipping and optimizer kernels reach (module docstring)."""
OVERLAPPED_DIMS = ("dp", "cp")
"""Dimensions whose communication overlaps compute (module docstring)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by term (module docstring)."""

    compute_at_peak: float
    recompute: float
    pipeline_bubble: float
    communication: float
    """Exposed communication."""
    overlapped: float = 0.0
    """Communication hidden behind compute (not part of the step)."""
    kernel_efficiency: float = 0.0
    """Forward and backward beyond `compute_at_peak` (kernels below peak, float8's gain)."""
    optimizer: float = 0.0
    """Clipping and the optimizer step (memory-bound)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in STEP_TERMS)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation the model predicts, in (0, 1]."""
        return self.compute_at_peak / self.total if self.total > 0 else 0.0

    def terms(self) -> dict[str, float]:
        """The additive terms by name, in `STEP_TERMS` order; `recompute` only when there is some."""
        return {name: getattr(self, name) for name in STEP_TERMS if name != "recompute" or self.recompute}


def updated_parameters(config: ModelConfig, body: JobSpecBody) -> float:
    """Parameters one rank clips and steps: its pipeline stage's and tensor shard's (experts: its EP
    share), divided over dp_shard x cp under ZeRO / FSDP; under LoRA only the adapters."""
    par = body.parallelism
    if body.lora is not None:
        total = float(adapter_params(config, body.lora))
    else:
        shapes = block_linear_shapes(config)
        attention = sum(i * o for n, (i, o) in shapes.items() if n not in ("w1", "w2", "w3"))
        ffn = sum(i * o for n, (i, o) in shapes.items() if n in ("w1", "w2", "w3"))
        moe_layers = moe_layer_count(config)
        experts = 0.0
        if config.moe is not None:
            moe = config.moe
            experts = moe_layers * (moe.num_experts / par.ep * ffn + config.dim * moe.num_experts + (ffn if moe.shared_expert else 0))
        embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
        norms = config.dim * (2 * config.n_layers + 1)
        total = config.n_layers * attention + (config.n_layers - moe_layers) * ffn + experts + embeddings + norms
    total /= par.tp * par.pp
    sharded = par.zero_stage >= 1 and par.dp_shard * par.cp > 1
    return total / (par.dp_shard * par.cp) if sharded else total


def modelled_step_time(
    config: ModelConfig,
    body: JobSpecBody,
    peak_flops: float,
    communication: Mapping[str, float],
    *,
    memory_bandwidth: float | None = None,
    flops_per_token: float | None = None,
) -> StepTime:
    """The step time of `body` (a spec with a numeric micro_batch_size) at `peak_flops` per rank, with
    `communication` the modelled seconds per step of each parallel dimension (tp, cp, ep, pp, dp) and
    `memory_bandwidth` the device's bytes per second (`device_memory.gpu_memory_bandwidth`; None: the
    optimizer step is not priced). `flops_per_token` (`flops.training_flops_per_token`) may be passed
    by a caller that evaluates many layouts of one model."""
    par, training = body.parallelism, body.training
    seq_len = body.data.seq_len
    per_token = training_flops_per_token(config, seq_len, body.lora) if flops_per_token is None else flops_per_token
    tokens_per_rank = training.global_batch_size * seq_len / par.world_size
    fraction = SUSTAINED_FRACTION[training.compile]
    compute = per_token * tokens_per_rank / peak_flops
    float8_share = min(1.0, float8_flops_per_token(config, training.fp8) / per_token) if training.fp8 != "none" else 0.0
    recompute = recompute_flops_per_token(config, seq_len, training.activation_checkpointing, body.lora) * tokens_per_rank / peak_flops
    sustained = (compute * (1 - float8_share + float8_share / FLOAT8_SPEEDUP) + recompute) / fraction
    optimizer = (
        updated_parameters(config, body) * OPTIMIZER_BYTES[training.optimizer] / (memory_bandwidth * HBM_FRACTION)
        if memory_bandwidth else 0.0
    )
    busy = compute + recompute  # at the peak rate: the bubble's and the overlap's base (module docstring)
    micro_batches = training.global_batch_size // (par.dp * int(training.micro_batch_size))
    bubble = bubble_seconds(busy, par.pp_schedule, par.pp, micro_batches, par.pp_virtual_stages)
    overlappable = sum(seconds for dim, seconds in communication.items() if dim in OVERLAPPED_DIMS)
    critical = sum(seconds for dim, seconds in communication.items() if dim not in OVERLAPPED_DIMS)
    hidden = min(overlappable, busy)
    return StepTime(compute, recompute, bubble, critical + overlappable - hidden, hidden,
                    kernel_efficiency=sustained - busy, optimizer=optimizer)
