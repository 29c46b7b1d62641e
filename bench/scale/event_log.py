"""A job's event log at 1,000 to 1,000,000 steps (issue 38): what the supervisor holds in memory, what
opening the log again costs (a supervisor restarted by Ray, or relaunched by the service), and what a
poll costs, new events and old pages, from the live log and from the file once the supervisor is gone.

    .venv/bin/python bench/scale/event_log.py --out bench/scale/results-event-log.json
    .venv/bin/python bench/scale/event_log.py --steps 1000 10000      # a quick look

Each size is a log of one STATE event and N STEP events whose reports carry every StepReport field and
straggler statistics, as a real job's do. The first 1,000 are appended through `EventLog.append` (the
supervisor's path: one file write per event); the rest are written as the same JSON lines directly and
then taken in by one `EventLog.open` and one more stride of appends, so a million-step log is built in
seconds rather than the 12 minutes of appending it. Memory is tracemalloc's count of the live log's
objects; times are medians of `--reps` repetitions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from trainctl.workers import events
from trainctl.workers.events import Event, EventKind, EventLog, JobState

REPORT = {
    "loss": 2.5, "grad_norm": 1.0, "lr": 3e-4, "tokens": 8192, "tokens_per_second": 6e4, "mfu": 0.47,
    "mfu_full_attention": 0.49, "step_time_seconds": 0.137,
    "breakdown": {"data": 1e-4, "forward_backward": 0.118, "optimizer": 0.023},
    "peak_memory_bytes": 36742647296, "checkpoint_bytes": None, "eval_loss": None,
    "straggler": {"step": 0, "ranks": 8, "slowest_rank": 3, "slowest_seconds": 0.14, "fastest_rank": 1,
                  "fastest_seconds": 0.13, "median_seconds": 0.135, "ratio": 1.07},
}
APPENDED = 1000
"""Events appended through the supervisor's path at every size (the rest are written directly)."""


def build(path: Path, steps: int) -> tuple[EventLog, float]:
    """The log of `steps` steps at `path`, open as the supervisor holds it; the median append in seconds."""
    log = EventLog.open(path)
    log.append(EventKind.STATE, state=JobState.RUNNING, reason="ranks up", generation=0)
    direct = max(steps - APPENDED - events.INDEX_STRIDE, 0)
    with path.open("a", encoding="utf-8") as out:
        for step in range(1, direct + 1):
            event = Event(seq=step + 1, time=time.time(), kind=EventKind.STEP, rank=0, generation=0,
                          step={**REPORT, "step": step})
            out.write(event.to_json() + "\n")
    log = EventLog.open(path)
    appends = []
    for step in range(direct + 1, steps + 1):
        started = time.perf_counter()
        log.append(EventKind.STEP, rank=0, generation=0, step={**REPORT, "step": step})
        appends.append(time.perf_counter() - started)
    return log, statistics.median(appends)


def median_seconds(call, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(steps: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trainctl-event-log-") as tmp:
        path = Path(tmp) / "events.jsonl"
        _, append = build(path, steps)
        tracemalloc.start()
        log = EventLog.open(path)
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        last = log.last_seq
        return {
            "steps": steps,
            "events": last,
            "file_bytes": path.stat().st_size,
            "memory_bytes": memory,
            "append_seconds": append,
            "reopen_seconds": median_seconds(lambda: EventLog.open(path), reps),
            "poll_new_seconds": median_seconds(lambda: log.status(last - 10, 1000), reps),
            "poll_oldest_seconds": median_seconds(lambda: log.status(0, 1000), reps),
            "poll_middle_seconds": median_seconds(lambda: log.status(last // 2, 1000), reps),
            "file_poll_seconds": median_seconds(lambda: EventLog.read(path).status(last - 10, 1000), reps),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="*", default=[1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    print("| steps | file MiB | supervisor memory MiB | append ms | reopen s | poll new ms | poll oldest ms | poll middle ms | poll from file ms |")
    print("|" + "---|" * 9)
    for steps in args.steps:
        row = measure(steps, args.reps)
        rows.append(row)
        print(f"| {steps:,} | {row['file_bytes'] / 2**20:,.1f} | {row['memory_bytes'] / 2**20:,.1f} | {row['append_seconds'] * 1e3:.2f} "
              f"| {row['reopen_seconds']:.3f} | {row['poll_new_seconds'] * 1e3:.2f} | {row['poll_oldest_seconds'] * 1e3:.2f} "
              f"| {row['poll_middle_seconds'] * 1e3:.2f} | {row['file_poll_seconds'] * 1e3:.1f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()} {platform.processor()}, Python {platform.python_version()}",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
