"""The modelled step time of a job: what `trainctl plan` reports and what the layout search ranks by.

    step = compute_at_peak + recompute + pipeline_bubble + communication

- `compute_at_peak`: the step's training FLOPs (`estimator.flops_per_step`) divided evenly over the
  ranks, at the device's dense peak for the job's dtype: a lower bound (no kernel reaches peak).
- `recompute`: the forward of the blocks activation checkpointing recomputes
  (`flops.recompute_flops_per_token`), at the same peak.
- `pipeline_bubble`: the idle time the pipeline schedule adds to that busy time
  (`pipeline_bubble.bubble_seconds`), with `global_batch_size / (dp x micro_batch_size)` micro-batches.
- `communication`: the exposed part of the placement's modelled communication, per dimension (the
  cost model's `seconds_by_dim`). Tensor-, expert- and pipeline-parallel transfers sit on the
  critical path and count whole. Data-parallel traffic (FSDP's prefetched all-gathers, gradient
  reduce-scatters and DDP's bucketed all-reduces run on their own stream during forward and backward)
  and context-parallel ring passes (each K/V transfer overlaps the attention of the shard in hand)
  are hidden behind the busy time (compute + recompute) up to its length; the rest is exposed.

Modelled MFU is `compute_at_peak / total`: model FLOPs over the step, recomputation not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainctl.parallelism.sizing.flops import recompute_flops_per_token, training_flops_per_token
from trainctl.parallelism.sizing.pipeline_bubble import bubble_seconds
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig

STEP_TERMS = ("compute_at_peak", "recompute", "pipeline_bubble", "communication")
"""The terms of a modelled step, in the order they are shown."""
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

    @property
    def total(self) -> float:
        return self.compute_at_peak + self.recompute + self.pipeline_bubble + self.communication

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation the model predicts, in (0, 1]."""
        return self.compute_at_peak / self.total if self.total > 0 else 0.0

    def terms(self) -> dict[str, float]:
        """The additive terms by name, in `STEP_TERMS` order; `recompute` only when there is some."""
        return {name: getattr(self, name) for name in STEP_TERMS if name != "recompute" or self.recompute}


def modelled_step_time(
    config: ModelConfig,
    body: JobSpecBody,
    peak_flops: float,
    communication: Mapping[str, float],
    *,
    flops_per_token: float | None = None,
) -> StepTime:
    """The step time of `body` (a spec with a numeric micro_batch_size) at `peak_flops` per rank, with
    `communication` the modelled seconds per step of each parallel dimension (tp, cp, ep, pp, dp).
    `flops_per_token` (`flops.training_flops_per_token`) may be passed by a caller that evaluates many
    layouts of one model."""
    par, training = body.parallelism, body.training
    seq_len = body.data.seq_len
    per_token = training_flops_per_token(config, seq_len) if flops_per_token is None else flops_per_token
    tokens_per_rank = training.global_batch_size * seq_len / par.world_size
    compute = per_token * tokens_per_rank / peak_flops
    recompute = recompute_flops_per_token(config, seq_len, training.activation_checkpointing) * tokens_per_rank / peak_flops
    micro_batches = training.global_batch_size // (par.dp * int(training.micro_batch_size))
    bubble = bubble_seconds(compute + recompute, par.pp_schedule, par.pp, micro_batches, par.pp_virtual_stages)
    overlappable = sum(seconds for dim, seconds in communication.items() if dim in OVERLAPPED_DIMS)
    critical = sum(seconds for dim, seconds in communication.items() if dim not in OVERLAPPED_DIMS)
    hidden = min(overlappable, compute + recompute)
    return StepTime(compute, recompute, bubble, critical + overlappable - hidden, hidden)
