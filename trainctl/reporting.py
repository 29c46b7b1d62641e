"""`trainctl.report`: the one call a command job's program adds to show its steps in trainctl.

Dependency-free (the standard library only: no torch, no Ray), so any program can import it. Each call
sends one datagram to the program's own rank worker (the Unix socket named by ``TRAINCTL_REPORT_SOCKET``,
set by trainctl), never to the service; the worker turns it into the step report built-in jobs make
(docs/command-jobs.md). Outside a trainctl job (the variable unset) a call does nothing.
"""

from __future__ import annotations

import json
import os
import socket
import time

REPORT_SOCKET_ENV = "TRAINCTL_REPORT_SOCKET"


def report(
    step: int, loss: float, *, tokens: int | None = None, lr: float | None = None, grad_norm: float | None = None,
    eval_loss: float | None = None,
) -> None:
    """Report a finished optimizer step: its number, its loss and, optionally, the tokens that step
    trained (over all ranks, like the built-in engine's), its learning rate and gradient norm, and the
    loss on the program's evaluation data when it evaluated after this step (pass it only then). Report
    every step or every N steps: step time and tokens per second come from the steps and the wall time
    between a rank's reports. A metric left out is absent from the job's metrics, not 0. Every rank may
    call it; the first report of each step is the job's, the others time the step on their rank."""
    path = os.environ.get(REPORT_SOCKET_ENV)
    if not path:
        return
    payload: dict[str, int | float] = {"step": int(step), "loss": float(loss), "sent": time.monotonic()}
    if tokens is not None:
        payload["tokens"] = int(tokens)
    if lr is not None:
        payload["lr"] = float(lr)
    if grad_norm is not None:
        payload["grad_norm"] = float(grad_norm)
    if eval_loss is not None:
        payload["eval_loss"] = float(eval_loss)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(json.dumps(payload).encode(), path)
        except OSError:  # the worker is gone (the job is stopping): the program's own work goes on
            return
