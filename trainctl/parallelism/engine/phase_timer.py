"""Seconds per phase of one step, true on the device that runs it.

On CPU the host clock is the truth. On CUDA the host only queues kernels: a phase's host time ends
when its last kernel is queued, and whatever waits for the GPU next (the loss's all-reduce, the
gradient norm) absorbs the rest, so host times put the forward's and backward's GPU time in the
optimizer phase. There each phase boundary records a CUDA event on the current stream, and `finish`
waits for the last one and reads the device time between them. That wait ends the step on the
device (as a logged step does in torchtitan): the next step's host work no longer overlaps this
step's optimizer kernels.
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Start it at a step's start, `mark` the end of each phase in order, `finish` for the seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.names: list[str] = []
        self.marks: list[float | torch.cuda.Event] = [self._now()]

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now (on the device, under CUDA)."""
        self.names.append(phase)
        self.marks.append(self._now())

    def finish(self) -> dict[str, float]:
        """Seconds of each marked phase (on CUDA after the device has reached the last mark)."""
        if not self.cuda:
            return {n: b - a for n, a, b in zip(self.names, self.marks, self.marks[1:], strict=False)}
        self.marks[-1].synchronize()
        return {n: a.elapsed_time(b) / 1e3 for n, a, b in zip(self.names, self.marks, self.marks[1:], strict=False)}
