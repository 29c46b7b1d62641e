"""The step report: metrics of one optimizer step, as the engine makes it and as the supervisor's event
log and the service's metrics read it back (`to_dict` / `from_dict`).

The built-in engine fills every metric. A command job's program reports what it chooses
(`trainctl.report`): a metric it never passes, or a rate its report cannot give, is None, and stays
absent downstream (the store, `get -o json`, Prometheus, `trainctl report`) rather than reading as 0."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepReport:
    """Metrics of one optimizer step (global values, identical on every rank)."""

    step: int
    """1-based number of the optimizer step just completed."""
    loss: float
    """Global mean training loss of the step (cross-entropy, plus the aux loss of MoE models)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None: not reported)."""
    lr: float | None
    """Learning rate used by the step (None: not reported)."""
    tokens: int | None
    """Tokens trained in the step (global_batch_size x seq_len; None: not reported)."""
    tokens_per_second: float | None
    """Global tokens per second of the step (None: not reported, or no rate known)."""
    mfu: float | None
    """Model FLOPs utilisation in Megatron's convention (causal attention halved:
    `flops.training_flops_per_token`), None when the device's peak FLOPS is unknown (CPU)."""
    step_time_seconds: float | None
    """Wall time of the step on this rank (None: no time known)."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: data, forward_backward, optimizer (incl. clipping), checkpoint."""
    peak_memory_bytes: int | None = None
    """Peak CUDA memory allocated, or the process's peak RSS on CPU (None: not reported)."""
    checkpoint_bytes: int | None = None
    """Size of the checkpoint committed at this step (its files and marker), None when none was: the one
    this step saved, or under `checkpoint.async_save` the earlier step's save committed at this one."""
    eval_loss: float | None = None
    """Global mean loss on the evaluation data (`spec.evaluation`) after this step, None when the step
    ran no evaluation."""
    mfu_full_attention: float | None = None
    """Model FLOPs utilisation in torchtitan's convention (attention counted unmasked:
    `flops.full_attention_flops_per_token`), None when the device's peak FLOPS is unknown, for command
    jobs, and in logs written before it existed."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (Ray calls, event log, JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        """Inverse of `to_dict`. ``step`` and ``loss`` are required; a missing or null metric reads as None
        (not reported), and keys that are not fields are ignored."""

        def number(name: str, kind: type[float] | type[int]) -> Any:
            value = data.get(name)
            return None if value is None else kind(value)

        return cls(
            step=int(data["step"]),
            loss=float(data["loss"]),
            grad_norm=number("grad_norm", float),
            lr=number("lr", float),
            tokens=number("tokens", int),
            tokens_per_second=number("tokens_per_second", float),
            mfu=number("mfu", float),
            step_time_seconds=number("step_time_seconds", float),
            breakdown={str(k): float(v) for k, v in (data.get("breakdown") or {}).items()},
            peak_memory_bytes=number("peak_memory_bytes", int),
            checkpoint_bytes=number("checkpoint_bytes", int),
            eval_loss=number("eval_loss", float),
            mfu_full_attention=number("mfu_full_attention", float),
        )
