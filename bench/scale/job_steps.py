"""A job of 1,000 to 1,000,000 steps in the service (issue 38): what GetJob, ListJobs, WatchJob from a
cursor and a service restart cost, and how big the store and the job's event log grow.

    .venv/bin/python bench/scale/job_steps.py --out bench/scale/results-job-steps.json
    .venv/bin/python bench/scale/job_steps.py --quick      # 1,000 and 100,000 steps, a couple of minutes

Per size, in a fresh directory: a real SQLite `JobStore` with one RUNNING job placed on a simulated node
(and 49 other jobs, so ListJobs answers a page), filled the way the scheduler's following fills it: every
step through the store's `record_step` code (`EventLog.write_step`, the same statements, 10,000 steps a
transaction so a million steps take minutes, not the hours of a synced commit each), with the fields a
step event carries (every StepReport field, the straggler statistics, the time), an eval loss every
`EVAL_EVERY` steps and a checkpoint every `CHECKPOINT_EVERY`; and the job's `events.jsonl` as its
supervisor leaves it (`EventLog` with the supervisor's tallies: the log's lines written directly, then
taken in by `EventLog.open` and a stride of appends, as bench/scale/event_log.py does), holding one
earlier relaunch after a cluster loss half-way. Then, in process, on the product's code:

- GetJob (basic and JOB_VIEW_FULL, answer serialised) and a ListJobs page of 50, through the
  `TrainingServicer` the service builds;
- WatchJob (no follow) from a cursor near the start, the middle and the end of the job's events: the
  time to the first event and to a page of 1,000;
- a service restart: opening the store again, and `Scheduler.recover()` for the job, whose supervisor
  ended with the Ray cluster it ran on (the runtime is replaced by `LostRuntime`, which says so and
  records the relaunch), which decides the relaunch (trainctl.service.scheduling.relaunch) from the
  job's event log; and that decision alone (`after_cluster_loss`);
- the store's size on disk (database and WAL) and the event log's (with its snapshot).

Times are medians of `--reps` (wall; the CPU column is this process's CPU time, all threads, which the
other users of a shared machine disturb least). Results: docs/benchmarks.md, "A job of a million steps in
the service (issue 38)".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.scheduling.relaunch import Ending, after_cluster_loss
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.tenancy import ANONYMOUS
from trainctl.service.store import JobStore
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers import events
from trainctl.workers.events import Event, EventKind, EventLog, JobState
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.relaunch import Relaunch
from trainctl.workers.supervisor import LOG_TALLIES
from trainctl.workers.topology import simulated_topology

SIZES = (1_000, 10_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 100_000)
EVAL_EVERY = 100
CHECKPOINT_EVERY = 1_000
STEPS_PER_TRANSACTION = 10_000
PAGE = 1_000
"""Events a WatchJob page is timed over (the store's read size)."""
OTHER_JOBS = 49
RANKS = 8
REPORT = {
    "loss": 2.5, "grad_norm": 1.0, "lr": 3e-4, "tokens": 8192, "tokens_per_second": 6e4, "mfu": 0.47,
    "mfu_full_attention": 0.49, "step_time_seconds": 0.137,
    "breakdown": {"data": 1e-4, "forward_backward": 0.118, "optimizer": 0.023},
    "peak_memory_bytes": 36742647296, "checkpoint_bytes": None, "eval_loss": None,
    "straggler": {"step": 0, "ranks": RANKS, "slowest_rank": 3, "slowest_seconds": 0.14, "fastest_rank": 1,
                  "fastest_seconds": 0.13, "median_seconds": 0.135, "ratio": 1.07},
}
RELAUNCH_REASON = Relaunch(resume="resuming from checkpoint step 1000", count=1).reason


def report(step: int) -> dict[str, Any]:
    """The step event's `step` of step `step`: every StepReport field and the straggler statistics."""
    out = {**REPORT, "step": step, "loss": 2.5 + 1.0 / step}
    if step % EVAL_EVERY == 0:
        out["eval_loss"] = 2.6 + 1.0 / step
    if step % CHECKPOINT_EVERY == 0:
        out["checkpoint_bytes"] = 16 << 30
        out["breakdown"] = {**out["breakdown"], "checkpoint": 4.2}
    out["straggler"] = {**REPORT["straggler"], "step": step - 1}
    return out


@dataclass
class LostRuntime:
    """The part of trainctl.workers.runtime.RayRuntime a restarted scheduler calls for its jobs: no
    supervisor runs, each job's ended with the Ray cluster it ran on; a start is only recorded."""

    started: list[tuple[str, Relaunch | None]] = field(default_factory=list)

    def attach(self, job_id: str, run_dir: RunDirectory) -> None:
        pass

    def lost_with_cluster(self, job_id: str) -> bool:
        return True

    def running_jobs(self) -> list[str]:
        return []

    def live_nodes(self) -> set[str]:
        return {"node-0"}

    def start_job(self, job_id: str, *_args: Any, relaunch: Relaunch | None = None, **_kwargs: Any) -> None:
        self.started.append((job_id, relaunch))


def job_spec(name: str, steps: int) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": name},
        "spec": {"model": {"preset": "llama-1b"}, "parallelism": {"dp_shard": RANKS}, "training": {"steps": steps}},
    })


def placement() -> PlannedPlacement:
    return PlannedPlacement(assignments=tuple(RankAssignment(rank=r, node="node-0", gpu=r) for r in range(RANKS)))


def write_log(path: Path, steps: int) -> None:
    """The job's events.jsonl as its supervisor leaves it after `steps` steps: started, placed, relaunched
    once half-way (a service restart on a new Ray cluster), running; the newest stride appended through
    `EventLog.append` (which writes the snapshot)."""
    lines: list[Event] = []
    seq = 0

    def add(kind: EventKind, **fields: Any) -> None:
        nonlocal seq
        seq += 1
        lines.append(Event(seq=seq, time=time.time(), kind=kind, **fields))

    add(EventKind.STATE, state=JobState.SCHEDULED, reason="supervisor started")
    add(EventKind.PLACEMENT, placement=[{"rank": r, "node": "node-0", "gpu": r} for r in range(RANKS)])
    add(EventKind.STATE, state=JobState.RUNNING, reason="ranks up")
    appended = events.INDEX_STRIDE + 1
    direct_steps = max(steps - appended, 0)
    half = steps // 2
    generation = 0
    with path.open("w", encoding="utf-8") as out:
        for event in lines:
            out.write(event.to_json() + "\n")
        lines.clear()
        for step in range(1, direct_steps + 1):
            if step == half:
                generation = 1
                add(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH_REASON, generation=1)
                add(EventKind.STATE, state=JobState.RUNNING, reason="ranks up", generation=1)
            add(EventKind.STEP, rank=0, generation=generation, step=report(step))
            for event in lines:
                out.write(event.to_json() + "\n")
            lines.clear()
    log = EventLog.open(path, tallies=LOG_TALLIES)
    for step in range(direct_steps + 1, steps + 1):
        if step == half:
            generation = 1
            log.append(EventKind.STATE, state=JobState.RESTARTING, reason=RELAUNCH_REASON, generation=1)
            log.append(EventKind.STATE, state=JobState.RUNNING, reason="ranks up", generation=1)
        log.append(EventKind.STEP, rank=0, generation=generation, step=report(step))


def fill_store(store: JobStore, job_id: str, steps: int) -> None:
    """The job's steps recorded as the scheduler's following records them (`record_step`'s statements),
    `STEPS_PER_TRANSACTION` a transaction; its relaunch half-way; its runtime cursor."""
    core, log = store._core, store._events
    start = time.time() - steps * 0.137
    for first in range(1, steps + 1, STEPS_PER_TRANSACTION):
        with core.tx() as db:
            for step in range(first, min(first + STEPS_PER_TRANSACTION, steps + 1)):
                at = start + step * 0.137
                log.write_step(db, job_id, {**report(step), "time": at}, at)
        if first <= steps // 2 < first + STEPS_PER_TRANSACTION:
            store.update_status(job_id, state=JobState.RESTARTING, reason=RELAUNCH_REASON, restarts=1)
            store.update_status(job_id, state=JobState.RUNNING, reason="ranks up")
    store.update_status(job_id, runtime_cursor=str(steps + 5))


CPU_SECONDS: dict[str, float] = {}
"""The median CPU seconds of this process (all its threads) of the last `median` call, by figure: the
figure the other users of a shared machine disturb least."""


def median(call: Callable[[], Any], reps: int, figure: str = "") -> float:
    """The median wall seconds of `reps` calls (the median CPU seconds go to `CPU_SECONDS[figure]`)."""
    times, cpu = [], []
    for _ in range(reps):
        started, cpu_started = time.perf_counter(), time.process_time()
        call()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    CPU_SECONDS[figure] = statistics.median(cpu)
    return statistics.median(times)


def watch_times(loop: asyncio.AbstractEventLoop, servicer: TrainingServicer, job_id: str, after: int) -> tuple[float, float]:
    """WatchJob (no follow) from `after`: seconds to the first event and to a page of `PAGE` events."""

    async def watch() -> tuple[float, float]:
        started = time.perf_counter()
        stream = servicer.WatchJob(pb.WatchJobRequest(id=job_id, after_sequence=after), ANONYMOUS)
        first = None
        count = 0
        async for event in stream:
            event.SerializeToString()
            count += 1
            if first is None:
                first = time.perf_counter() - started
            if count == PAGE:
                break
        await stream.aclose()
        return first or 0.0, time.perf_counter() - started

    return loop.run_until_complete(watch())


def size_of(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def measure(steps: int, reps: int, work: Path) -> dict[str, Any]:
    data, runs = work / "data", work / "runs"
    topology = simulated_topology(1, RANKS)
    store = JobStore(data)
    for i in range(OTHER_JOBS):
        store.create_job(job_spec(f"other-{i}", 100))
    record, _ = store.create_job(job_spec("long-run", steps))
    run = RunDirectory.of_job(runs, record.id)
    run.root.mkdir(parents=True)
    store.update_status(record.id, state=JobState.SCHEDULED, reason="admitted", placement=placement().records(),
                        run_dir=str(run.root), schedule_time=time.time())
    store.update_status(record.id, state=JobState.RUNNING, reason="ranks up", start_time=time.time())
    started = time.perf_counter()
    write_log(run.events, steps)
    log_seconds = time.perf_counter() - started
    started = time.perf_counter()
    fill_store(store, record.id, steps)
    fill_seconds = time.perf_counter() - started
    store.close()

    store = JobStore(data)
    pool = GpuPool(topology, "simulated")
    runtime = LostRuntime()
    scheduler = Scheduler(store, pool, runtime, runs)
    servicer = TrainingServicer(store, scheduler, pool, Authenticator.from_file(None), ray_nodes=lambda: {"node-0"})
    loop = asyncio.new_event_loop()
    job_id = record.id
    with store._core.reading() as db:
        bounds = db.execute("SELECT MIN(sequence) AS first, MAX(sequence) AS last FROM events WHERE job_id = ?", (job_id,)).fetchone()
    first_seq, last_seq = int(bounds["first"]), int(bounds["last"])
    basic = lambda: loop.run_until_complete(servicer.GetJob(pb.GetJobRequest(id=job_id), ANONYMOUS)).SerializeToString()  # noqa: E731
    full = lambda: loop.run_until_complete(  # noqa: E731
        servicer.GetJob(pb.GetJobRequest(id=job_id, view=pb.JOB_VIEW_FULL), ANONYMOUS)).SerializeToString()
    full_answer = full()
    listing = lambda: servicer.ListJobs(pb.ListJobsRequest(page_size=50), ANONYMOUS)  # noqa: E731
    row: dict[str, Any] = {
        "steps": steps,
        "events": last_seq - first_seq + 1,
        "log_build_seconds": log_seconds,
        "store_fill_seconds": fill_seconds,
        "store_bytes": size_of([data / name for name in os.listdir(data)]),
        "log_bytes": size_of([run.events, EventLog.snapshot_path(run.events)]),
        "get_job_seconds": median(basic, reps, "get_job_seconds"),
        "get_job_full_seconds": median(full, reps, "get_job_full_seconds"),
        "get_job_full_bytes": len(full_answer),
        "get_job_full_steps": len(pb.Job.FromString(full_answer).metrics),
        "list_jobs_seconds": median(listing, reps, "list_jobs_seconds"),
    }
    for name, cursor in (("start", first_seq + 10), ("middle", (first_seq + last_seq) // 2), ("end", last_seq - PAGE)):
        samples = [watch_times(loop, servicer, job_id, cursor) for _ in range(reps)]
        row[f"watch_{name}_first_seconds"] = statistics.median(s[0] for s in samples)
        row[f"watch_{name}_page_seconds"] = statistics.median(s[1] for s in samples)
    loop.close()
    job = store.get_job(job_id)
    row["decide_relaunch_seconds"] = median(lambda: after_cluster_loss(job, run), reps, "decide_relaunch_seconds")
    decision = after_cluster_loss(job, run)
    assert not isinstance(decision, Ending) and decision is not None and decision.count == 2, decision
    store.close()

    def restart() -> None:
        again = JobStore(data)
        runtime = LostRuntime()
        Scheduler(again, GpuPool(topology, "simulated"), runtime, runs).recover()
        assert [(started, relaunch.count) for started, relaunch in runtime.started] == [(job_id, 2)], runtime.started
        again.close()

    row["restart_seconds"] = median(restart, reps, "restart_seconds")
    row["cpu_seconds"] = dict(CPU_SECONDS)
    return row


COLUMNS = (
    ("steps", "steps", lambda r: f"{r['steps']:,}"),
    ("store MiB", "store_bytes", lambda r: f"{r['store_bytes'] / 2**20:,.1f}"),
    ("log MiB", "log_bytes", lambda r: f"{r['log_bytes'] / 2**20:,.1f}"),
    ("GetJob ms", "get_job_seconds", lambda r: f"{r['get_job_seconds'] * 1e3:.2f}"),
    ("GetJob full ms", "get_job_full_seconds", lambda r: f"{r['get_job_full_seconds'] * 1e3:,.1f}"),
    ("full steps / KiB", "get_job_full_steps", lambda r: f"{r['get_job_full_steps']:,} / {r['get_job_full_bytes'] / 1024:,.0f}"),
    ("ListJobs ms", "list_jobs_seconds", lambda r: f"{r['list_jobs_seconds'] * 1e3:.2f}"),
    ("watch first ms (start/mid/end)", "watch", lambda r: "/".join(
        f"{r[f'watch_{n}_first_seconds'] * 1e3:.2f}" for n in ("start", "middle", "end"))),
    ("watch page ms (start/mid/end)", "watch", lambda r: "/".join(
        f"{r[f'watch_{n}_page_seconds'] * 1e3:.1f}" for n in ("start", "middle", "end"))),
    ("relaunch decision ms", "decide_relaunch_seconds", lambda r: f"{r['decide_relaunch_seconds'] * 1e3:,.1f}"),
    ("restart ms", "restart_seconds", lambda r: f"{r['restart_seconds'] * 1e3:,.1f}"),
    ("CPU ms: full / decision / restart", "cpu_seconds", lambda r: "/".join(
        f"{r.get('cpu_seconds', {}).get(f, float('nan')) * 1e3:,.0f}"
        for f in ("get_job_full_seconds", "decide_relaunch_seconds", "restart_seconds"))),
    ("fill s", "store_fill_seconds", lambda r: f"{r['store_fill_seconds']:,.1f}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(c[2](r) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="*")
    parser.add_argument("--quick", action="store_true", help="1,000 and 100,000 steps, 3 repetitions")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarise", type=Path, help="reprint the table of a results file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the relaunch each restart logs, and the servicer's auth notice
    if args.summarise:
        print(table(json.loads(args.summarise.read_text())["rows"]))
        return
    sizes = args.steps or (QUICK_SIZES if args.quick else SIZES)
    reps = args.reps or (3 if args.quick else 5)
    rows = []
    loads = [os.getloadavg()[0]]
    for steps in sizes:
        with tempfile.TemporaryDirectory(prefix="trainctl-job-steps-") as tmp:
            rows.append(measure(steps, reps, Path(tmp)))
        loads.append(os.getloadavg()[0])
        print(table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else table(rows), flush=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min": loads,
        "argv": sys.argv[1:],
        "rows": rows,
    }
    print(f"load average (1 min) before and after each size: {', '.join(f'{x:.1f}' for x in loads)}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
