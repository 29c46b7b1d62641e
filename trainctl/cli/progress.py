"""Live progress of a job from its event stream: step / total, loss, eval loss and perplexity, tokens/s, MFU,
ETA, state changes.

MFU is shown in both conventions: `MFU 41.2% (full-attn 44.9%)`, first Megatron's (causal attention
counted as half the score/value FLOPs), then torchtitan's (attention counted unmasked).

On a terminal a rich progress bar redraws in place and state changes and log lines scroll above it;
when stdout is not a terminal (CI logs, pipes) every event is one plain line. rich loads only for the bar.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from trainctl.observability.perplexity import perplexity
from trainctl.v1 import training_pb2 as pb

TERMINAL = frozenset({pb.SUCCEEDED, pb.FAILED, pb.CANCELLED})


def state_name(state: int) -> str:
    return pb.JobState.Name(state) if state else "-"


@dataclass
class Tracker:
    """Running numbers derived from the events seen so far."""

    total_steps: int
    step: int = 0
    loss: float | None = None
    first_loss: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    """MFU of the newest step, Megatron's convention (causal attention halved)."""
    mfu_full_attention: float | None = None
    """MFU of the newest step, torchtitan's convention (attention counted unmasked)."""
    eval_loss: float | None = None
    """The eval loss of the newest step that evaluated (None before the first)."""
    state: int = pb.JOB_STATE_UNSPECIFIED
    _step_times: list[tuple[float, int]] = field(default_factory=list)

    def on_step(self, metrics: pb.StepMetrics, now: float) -> None:
        self.step = metrics.step
        self.loss = metrics.loss
        if self.first_loss is None:
            self.first_loss = metrics.loss
        if metrics.HasField("tokens_per_second"):  # a command job's first report of a run has none
            self.tokens_per_second = metrics.tokens_per_second
        self.mfu = metrics.mfu if metrics.HasField("mfu") else None
        self.mfu_full_attention = metrics.mfu_full_attention if metrics.HasField("mfu_full_attention") else None
        if metrics.HasField("eval_loss"):
            self.eval_loss = metrics.eval_loss
        self._step_times = [*self._step_times[-19:], (now, metrics.step)]

    def eta_seconds(self) -> float | None:
        """Remaining steps times the recent seconds per step (None until two steps were seen, or when the
        total is unknown: 0, a command job)."""
        if len(self._step_times) < 2:
            return None
        (t0, s0), (t1, s1) = self._step_times[0], self._step_times[-1]
        if s1 <= s0 or not self.total_steps:
            return None
        return max(0.0, (self.total_steps - self.step) * (t1 - t0) / (s1 - s0))

    def line(self) -> str:
        parts = [f"step {self.step}/{self.total_steps}" if self.total_steps else f"step {self.step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f} ppl {perplexity(self.eval_loss)}")
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:,.0f} tok/s")
        mfu = f"MFU {self.mfu:.1%}" if self.mfu is not None else "MFU n/a"
        if self.mfu_full_attention is not None:  # Megatron's count first, then torchtitan's
            mfu += f" (full-attn {self.mfu_full_attention:.1%})"
        parts.append(mfu)
        eta = self.eta_seconds()
        parts.append(f"ETA {format_seconds(eta)}" if eta is not None else "ETA -")
        return "  ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def describe(event: pb.JobEvent) -> str | None:
    """One human line for a state change or a log line (None for step events)."""
    kind = event.WhichOneof("payload")
    if kind == "state_change":
        change = event.state_change
        reason = f": {change.reason}" if change.reason else ""
        return f"[{event.sequence}] {state_name(change.from_state)} -> {state_name(change.to_state)}{reason}"
    if kind == "log":
        rank = f"rank {event.log.rank} " if event.log.HasField("rank") else ""
        return f"[{event.sequence}] {rank}{event.log.level}: {event.log.message}"
    return None


def is_terminal(out: TextIO) -> bool:
    """Whether `out` is a terminal to redraw on, as rich decides it (its TTY_COMPATIBLE / TTY_INTERACTIVE
    variables force either answer)."""
    from rich.console import Console

    return Console(file=out).is_terminal


def follow(events: Iterable[pb.JobEvent], total_steps: int, out: TextIO, *, force_plain: bool = False) -> Tracker:
    """Render `events` until they end; returns the final numbers (state included)."""
    tracker = Tracker(total_steps=total_steps)
    if force_plain or not is_terminal(out):
        for event in events:
            _update(tracker, event)
            text = describe(event)
            if text is None:
                text = tracker.line()
            print(text, file=out, flush=True)
        return tracker
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=out, highlight=False, soft_wrap=True)
    columns = (TextColumn("[bold]{task.fields[state]}"), BarColumn(), TextColumn("{task.fields[line]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("job", total=total_steps, state="", line="")
        for event in events:
            _update(tracker, event)
            text = describe(event)
            if text is not None:
                bar.console.print(text)
            bar.update(task, completed=tracker.step, state=state_name(tracker.state), line=tracker.line())
    return tracker


def _update(tracker: Tracker, event: pb.JobEvent) -> None:
    kind = event.WhichOneof("payload")
    if kind == "step":  # timed by when the step happened: a replayed backlog arrives all at once
        step_time = event.step.time if event.step.HasField("time") else event.time
        tracker.on_step(event.step, step_time.ToNanoseconds() / 1e9 if step_time.seconds else time.time())
    elif kind == "state_change":
        tracker.state = event.state_change.to_state


def json_text(document: Any) -> str:
    """`document` as strict JSON, indented: a NaN or infinite number (a diverged run's loss) as the string
    "NaN", "Infinity" or "-Infinity", which JSON has no number for (json.dumps would write bare tokens
    that strict parsers such as jq refuse)."""
    def strict(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [strict(v) for v in value]
        return value

    return json.dumps(strict(document), indent=2, allow_nan=False)


def table(rows: list[list[str]], header: list[str]) -> str:
    """Rows under a header, in left-aligned columns two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows])
