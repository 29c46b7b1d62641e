"""A rank's program output: every line kept in a bounded, rotated file, forwarded (rate-limited) to the
supervisor as a log line, and the last stderr lines kept for the failure reason.

The file ``<run_dir>/logs/rank-<R>.log`` holds stdout and stderr lines in arrival order (stderr lines
prefixed ``stderr: ``), rotated at `LOG_FILE_BYTES` with `LOG_FILE_BACKUPS` older files. At most
`FORWARD_LINES_PER_SECOND` lines per second (bursts of `FORWARD_BURST`) become log events, each cut at
`FORWARD_LINE_CHARS`; the next forwarded line says how many were left out (they are in the file).
Forwarded lines and the stderr tail are `storable` (trainctl.spec.text: a NUL shown as ``\x00``), as the
job's record will hold them; the file keeps the lines as the program wrote them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from logging.handlers import RotatingFileHandler
from pathlib import Path

from trainctl.spec.text import storable

LOG_FILE_BYTES = 8 * 2**20
LOG_FILE_BACKUPS = 3
FORWARD_LINES_PER_SECOND = 50.0
FORWARD_BURST = 200.0
FORWARD_LINE_CHARS = 2_000
STDERR_TAIL_LINES = 20
STDERR_PREFIX = "stderr: "


def rank_log_path(log_dir: str | Path, rank: int) -> Path:
    """The current log file of ``rank`` (rotated copies end in ``.1``, ``.2``, ...)."""
    return Path(log_dir) / f"rank-{rank}.log"


class RankOutput:
    """Takes a program's lines (`line`) from its stdout and stderr readers; thread-safe."""

    def __init__(
        self, log_dir: str | Path, rank: int, forward: Callable[[str], None], *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` (seconds, monotonic) times the forwarding rate and `last_line_at`."""
        path = rank_log_path(log_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = RotatingFileHandler(path, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8")
        self._forward = forward
        self._lock = threading.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._clock = clock
        self._tokens = FORWARD_BURST
        self._refilled = clock()
        self._skipped = 0
        self.last_line_at = clock()
        """Monotonic time of the newest line (or of the start)."""

    def line(self, text: str, *, stderr: bool) -> None:
        """One line of output (without its newline)."""
        stored = STDERR_PREFIX + text if stderr else text
        self._file.emit(logging.makeLogRecord({"msg": stored}))
        with self._lock:
            self.last_line_at = self._clock()
            if stderr:
                self._stderr.append(storable(text))
            if not self._take_token():
                self._skipped += 1
                return
            skipped, self._skipped = self._skipped, 0
        note = f" [{skipped} earlier line(s) not forwarded; see the rank's log file]" if skipped else ""
        self._forward(storable(stored[:FORWARD_LINE_CHARS]) + note)

    def stderr_tail(self) -> list[str]:
        """The last stderr lines, oldest first."""
        with self._lock:
            return list(self._stderr)

    def close(self) -> None:
        """Close the log file."""
        self._file.close()

    def _take_token(self) -> bool:
        now = self._clock()
        self._tokens = min(FORWARD_BURST, self._tokens + (now - self._refilled) * FORWARD_LINES_PER_SECOND)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
