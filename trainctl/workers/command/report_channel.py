"""The rank worker's end of `trainctl.report`: a Unix datagram socket the program sends one JSON object
per step to, turned into the engine's `StepReport` so a command job's steps take the one metrics path
of built-in jobs (supervisor STEP events -> store, `get -o json`, Prometheus, progress lines).

A datagram is ``{"step": int, "loss": float, "tokens": int?, "lr": float?, "grad_norm": float?}``
(`trainctl.reporting`). The step time is the interval between this rank's reports (from the program's
start for the first), and tokens per second is tokens over it. A datagram that is not such an object is
dropped with a log line naming the problem.
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


def step_report_of(payload: Any, step_time: float) -> StepReport:
    """The StepReport a `trainctl.report` datagram describes; ReportError names the bad field."""
    if not isinstance(payload, dict):
        raise ReportError("a report must be a JSON object")
    step, loss = payload.get("step"), payload.get("loss")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ReportError(f"step must be an integer >= 0, got {step!r}")
    numbers = {"loss": loss, **{k: payload.get(k) for k in ("lr", "grad_norm") if payload.get(k) is not None}}
    for name, value in numbers.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise ReportError(f"{name} must be a finite number, got {value!r}")
    tokens = payload.get("tokens") or 0
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ReportError(f"tokens must be an integer >= 0, got {tokens!r}")
    return StepReport(
        step=step,
        loss=float(loss),
        grad_norm=float(payload.get("grad_norm") or 0.0),
        lr=float(payload.get("lr") or 0.0),
        tokens=tokens,
        tokens_per_second=tokens / step_time if step_time > 0 else 0.0,
        mfu=None,
        step_time_seconds=step_time,
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
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._serve, name="report-channel", daemon=True)

    def __enter__(self) -> ReportChannel:
        self._last = time.monotonic()
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
            now = time.monotonic()
            try:
                report = step_report_of(json.loads(data), now - self._last)
            except (ReportError, ValueError) as exc:
                self._on_problem(f"trainctl.report ignored: {exc}")
                continue
            self._last = now
            self._on_report(report)
