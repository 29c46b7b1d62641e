"""The step report: metrics of one optimizer step, as the engine makes it and as the supervisor's event
log and the service's metrics read it back (`to_dict` / `from_dict`)."""

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
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used by the step."""
    tokens: int
    """Tokens trained in the step (global_batch_size x seq_len)."""
    tokens_per_second: float
    """Global tokens per second of the step."""
    mfu: float | None
    """Model FLOPs utilisation, None when the device's peak FLOPS is unknown (CPU)."""
    step_time_seconds: float
    """Wall time of the step on this rank."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: data, forward_backward, optimizer (incl. clipping), checkpoint."""
    peak_memory_bytes: int = 0
    """Peak CUDA memory allocated, or the process's peak RSS on CPU."""
    checkpoint_bytes: int | None = None
    """Size of the checkpoint this step saved (its files and marker), None when it saved none."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (Ray calls, event log, JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        """Inverse of `to_dict`. ``step`` and ``loss`` are required; a missing or null metric reads as 0
        (``mfu`` and ``checkpoint_bytes`` stay None), and keys that are not fields are ignored."""
        checkpoint_bytes = data.get("checkpoint_bytes")
        return cls(
            step=int(data["step"]),
            loss=float(data["loss"]),
            grad_norm=float(data.get("grad_norm") or 0.0),
            lr=float(data.get("lr") or 0.0),
            tokens=int(data.get("tokens") or 0),
            tokens_per_second=float(data.get("tokens_per_second") or 0.0),
            mfu=None if data.get("mfu") is None else float(data["mfu"]),
            step_time_seconds=float(data.get("step_time_seconds") or 0.0),
            breakdown={str(k): float(v) for k, v in (data.get("breakdown") or {}).items()},
            peak_memory_bytes=int(data.get("peak_memory_bytes") or 0),
            checkpoint_bytes=None if checkpoint_bytes is None else int(checkpoint_bytes),
        )
