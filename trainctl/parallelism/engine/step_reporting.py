"""A rank's reports of its steps: the step's wall time to `on_step_time` on every rank, and on global rank 0
a `StepReport` to `on_step` with what follows from that time (tokens per second, MFU in Megatron's and
torchtitan's conventions), the peak memory, and the checkpoint's time and size when the step saved one."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.sizing.flops import (
    full_attention_flops_per_token,
    mfu,
    peak_flops,
    training_flops_per_token,
)
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StepReporter:
    """Reports the steps of one rank of `job` training `config` (``on_step``: called on rank 0 only)."""

    def __init__(
        self,
        job: JobSpecBody,
        config: ModelConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        on_step: Callable[[StepReport], Any] | None,
        on_step_time: Callable[[int, float], Any] | None,
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.on_step, self.on_step_time = on_step, on_step_time
        self.tokens_per_step = job.training.global_batch_size * job.data.seq_len
        self.flops_per_token = training_flops_per_token(config, job.data.seq_len, job.lora)
        self.flops_per_token_full_attention = full_attention_flops_per_token(config, job.data.seq_len, job.lora)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None, job.training.dtype)

    def report(
        self,
        step: int,
        t0: float,
        lr: float,
        loss: float,
        norm: float,
        breakdown: dict[str, float],
        checkpoint_started: float | None,
        checkpoint_bytes: int | None,
        eval_loss: float | None = None,
    ) -> None:
        """Report step `step`, which started at ``t0``: its time from every rank, its StepReport from rank 0
        (with the checkpoint's time and size when the step saved one, and its eval loss; the time of
        an evaluation, `breakdown["evaluation"]`, is left out of the step's time)."""
        now = time.perf_counter()
        if checkpoint_started is not None:
            breakdown["checkpoint"] = now - checkpoint_started
        elapsed = now - t0 - breakdown.get("evaluation", 0.0)
        if self.on_step_time is not None:
            self.on_step_time(step, elapsed)
        if self.on_step is None or self.rank != 0:
            return
        tps = self.tokens_per_step / elapsed
        self.on_step(
            StepReport(
                step=step,
                loss=loss,
                grad_norm=norm,
                lr=lr,
                tokens=self.tokens_per_step,
                tokens_per_second=tps,
                mfu=mfu(self.flops_per_token, tps, self.world_size, self.peak_flops),
                mfu_full_attention=mfu(self.flops_per_token_full_attention, tps, self.world_size, self.peak_flops),
                step_time_seconds=elapsed,
                breakdown=breakdown,
                peak_memory_bytes=_peak_memory(self.device),
                checkpoint_bytes=checkpoint_bytes,
                eval_loss=eval_loss,
            )
        )
