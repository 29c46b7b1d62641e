"""The rank worker's end of `trainctl.report`: a Unix datagram socket the program sends one JSON object
per step to, turned into the engine's `StepReport` so a command job's steps take the one metrics path
of built-in jobs (supervisor STEP events -> store, `get -o json`, Prometheus, progress lines).

A datagram is ``{"step": int, "loss": float, "sent": float?, "tokens": int?, "lr": float?, "grad_norm": float?,
"eval_loss": float?}``
(`trainctl.reporting`; ``tokens`` are the reported step's, ``sent`` the program's `time.monotonic()` at the
call, a clock the worker on the same host shares). A program may report every step or every N steps: the
step time is the wall time since this rank's previous report over the steps since it (`seconds_per_step`),
timed when each report was sent (`sent_time`), so how long this worker's reading thread waited for a CPU
does not count; and tokens per second is the step's tokens over that time. The first report of a
program's run (each generation starts a new one) carries no step time and no tokens per second: its
interval would hold the program's start-up (imports, rendezvous, loading a checkpoint) and, after a
restart, steps it resumed past. Metrics the datagram leaves out stay None (absent, not 0). A datagram
that is not such an object is dropped with a log line naming the problem.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainctl.parallelism.engine.step_report import StepReport

MAX_DATAGRAM = 65_536
SOCKET_NAME = "report.sock"


class ReportError(ValueError):
    """A datagram that is not a step report."""


def seconds_per_step(previous: tuple[int, float] | None, step: int, now: float) -> float | None:
    """Wall seconds per step between the previous report ``(step, monotonic time)`` and one of ``step``
    at ``now``; None for a run's first report and for one that does not advance the step."""
    if previous is None or step <= previous[0]:
        return None
    return (now - previous[1]) / (step - previous[0])


def sent_time(payload: Any, previous: float | None, received: float) -> float:
    """When a report was sent: its ``sent`` monotonic time where that lies between the previous accepted
    report's time and its receipt (a program's clock cannot run backwards or ahead of this one), else
    ``received``."""
    sent = payload.get("sent") if isinstance(payload, dict) else None
    if not isinstance(sent, int | float) or isinstance(sent, bool) or not math.isfinite(sent):
        return received
    if sent > received or (previous is not None and sent < previous):
        return received
    return float(sent)


def step_report_of(payload: Any, step_time: float | None) -> StepReport:
    """The StepReport a `trainctl.report` datagram describes, with ``step_time`` seconds per step (None:
    unknown); ReportError names the bad field."""
    if not isinstance(payload, dict):
        raise ReportError("a report must be a JSON object")
    step, loss = payload.get("step"), payload.get("loss")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ReportError(f"step must be an integer >= 0, got {step!r}")
    optional = ("lr", "grad_norm", "eval_loss")
    numbers = {"loss": loss, **{k: payload.get(k) for k in optional if payload.get(k) is not None}}
    for name, value in numbers.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise ReportError(f"{name} must be a finite number, got {value!r}")
    tokens = payload.get("tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise ReportError(f"tokens must be an integer >= 0, got {tokens!r}")
    rate = tokens / step_time if tokens is not None and step_time is not None and step_time > 0 else None
    return StepReport(
        step=step,
        loss=float(loss),
        grad_norm=None if "grad_norm" not in numbers else float(numbers["grad_norm"]),
        lr=None if "lr" not in numbers else float(numbers["lr"]),
        tokens=tokens,
        tokens_per_second=rate,
        mfu=None,
        step_time_seconds=step_time,
        eval_loss=None if "eval_loss" not in numbers else float(numbers["eval_loss"]),
        mfu_full_attention=None,  # trainctl does not see a command job's model: no MFU in either convention
    )


class ReportChannel:
    """A bound datagram socket in a private temporary directory and the thread that reads it. Use as a
    context manager; `path` goes to the program as ``TRAINCTL_REPORT_SOCKET``."""

    def __init__(self, on_report: Callable[[StepReport], None], on_problem: Callable[[str], None]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="trainctl-report-"))
        self.path = str(self._dir / SOCKET_NAME)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._on_report, self._on_problem = on_report, on_problem
        self._previous: tuple[int, float] | None = None
        """(step, monotonic time) of the run's newest accepted report."""
        self._thread = threading.Thread(target=self._serve, name="report-channel", daemon=True)

    def __enter__(self) -> ReportChannel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except OSError:  # closed
                return
            received = time.monotonic()
            try:
                payload = json.loads(data)
                now = sent_time(payload, self._previous[1] if self._previous else None, received)
                step = payload.get("step") if isinstance(payload, dict) else None
                step_time = seconds_per_step(self._previous, step, now) if isinstance(step, int) else None
                report = step_report_of(payload, step_time)
            except (ReportError, ValueError) as exc:
                self._on_problem(f"trainctl.report ignored: {exc}")
                continue
            self._previous = (report.step, now)
            self._on_report(report)
