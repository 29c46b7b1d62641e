"""How a serving process ends on SIGTERM or SIGINT: a graceful stop, then exit within a bounded time
whatever the RPC handlers are doing.

Python joins every non-daemon thread at exit (the gRPC handler pool's included), so one handler stuck
in a long computation would keep a stopped service alive forever, and interpreter finalization with a
Ray driver attached took from 1 to over 10 s on a loaded machine. The stop closes everything the
service opened, so the process then leaves with `os._exit` (logs and streams flushed); a watchdog ends
it if the stop itself overruns the deadline; a second signal ends it at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

STOP_DEADLINE_SECONDS = 9.0
"""From the first signal to process exit at the latest (the stop's own grace period included)."""
EXIT_FORCED = 1
"""Exit status when the deadline or a second signal cut the stop short."""


def install_stop_signals(stop: Callable[[], None], deadline: float = STOP_DEADLINE_SECONDS) -> None:
    """On SIGTERM / SIGINT run `stop` (in the main thread), then end the process, within `deadline` at most."""
    stopping = threading.Event()

    def handle(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stopping.is_set():
            log.warning("second %s during the stop: exiting now", name)
            exit_now(EXIT_FORCED)
        stopping.set()
        watchdog = threading.Timer(deadline, _overrun, args=(deadline,))
        watchdog.daemon = True
        watchdog.start()
        stop()
        log.info("stopped; exiting without waiting for RPC handlers still running")
        exit_now(0)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _overrun(deadline: float) -> None:
    log.error("the stop took longer than %.0f s: exiting now", deadline)
    exit_now(EXIT_FORCED)


def exit_now(status: int) -> None:
    """Flush the logs and standard streams, then end the process without joining its threads."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing left to save
            stream.flush()
    os._exit(status)
