"""Goodput under a fault schedule (issue 35): a job whose random rank is SIGKILLed every `--kill-every`
seconds, against the same job undisturbed, on the same embedded Ray, once per recovery path (`--paths`):
``cold`` (every restart starts fresh rank processes, the path before warm restarts) and ``warm`` (the
surviving ranks run the next generation in their processes, a dead rank's slot takes its node's spare:
`SupervisorConfig.warm_restarts`).

The job: 4 ranks of the debug model on 2 nodes (2 simulated GPUs each, `dp_replicate` 2 x `dp_shard` 2),
CPU and gloo, a checkpoint every `--interval` steps, every step reported, `--steps` steps. It is run by
`RayRuntime` (the supervisor restarts the group from the newest complete checkpoint after each death, as
under the service). Reported per run:

- ETTR (effective training time ratio, "goodput"): the time of the steps that count over the wall time
  from `start_job` to the job's end. A step counts once, in the run of it that survives: a step trained
  again after a restart counts only the second time, the first is lost work;
- per failure: detection (the kill to the RESTARTING event), restart (RESTARTING to the new generation's
  RUNNING), first step (RUNNING to its first STEP), recovery (the kill to that first step) and the steps
  recomputed (the newest step reported before the kill minus the step the new generation resumed from);
- the time from `start_job` to the first step (fresh rank processes: the cold start a restart pays
  again today);
- whether the faulted run's loss at every step equals the undisturbed run's (rel 1e-5).

    .venv/bin/python bench/goodput/fault_schedule.py --out bench/goodput/results-fault-schedule.json
    .venv/bin/python bench/goodput/fault_schedule.py --smoke       (one kill, a short job)
    .venv/bin/python bench/goodput/fault_schedule.py --paths warm --async-save --interval 5
    .venv/bin/python bench/goodput/fault_schedule.py --paths warm --async-save --interval 5 --memory-interval 1
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.workers.embedded import start_embedded  # noqa: E402
from trainctl.workers.events import Event, EventKind, JobState  # noqa: E402
from trainctl.workers.placement import Placement, RankAssignment  # noqa: E402
from trainctl.workers.runtime import RayRuntime  # noqa: E402
from trainctl.workers.supervisor import SPARE_AFTER  # noqa: E402

SLOTS = [("node-0", 0), ("node-0", 1), ("node-1", 0), ("node-1", 1)]


def job(steps: int, interval: int, max_restarts: int, async_save: bool, memory_interval: int = 0) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "goodput"},
        "spec": {
            "model": {"preset": "debug"},
            "data": {"seq_len": 64, "max_files": 20},
            "parallelism": {"dp_replicate": 2, "dp_shard": 2},
            "training": {"steps": steps, "global_batch_size": 8, "warmup_steps": 1, "log_interval": 1},
            "checkpoint": {"interval_steps": interval, "async_save": async_save, "memory_interval_steps": memory_interval},
            "resources": {"gpus": 4, "device": "cpu"},
            "scheduling": {"max_restarts": max_restarts},
        },
    })


@dataclass
class Failure:
    killed_at: float
    rank: int
    detection_s: float | None = None
    restart_s: float | None = None
    first_step_s: float | None = None
    recovery_s: float | None = None
    steps_recomputed: int | None = None


def run(runtime: RayRuntime, job_id: str, spec: TrainingJob, root: Path, kill_every: float | None,
        rng: random.Random) -> dict[str, Any]:
    """Run the job, SIGKILLing a random rank every `kill_every` seconds while it trains (None: never); a
    kill waits until the generation started after the previous one has reported a step, so the job always
    progresses."""
    placement = Placement(grid="dp_replicate2-dp_shard2",
                          assignments=[RankAssignment(rank=r, node=n, gpu=g) for r, (n, g) in enumerate(SLOTS)])
    started = time.time()
    runtime.start_job(job_id, spec, placement, root)
    events: list[Event] = []
    cursor, failures, last_step_at = 0, [], 0.0
    next_kill = started + kill_every if kill_every else math.inf
    while True:
        status = runtime.poll(job_id, cursor)
        events += status.events
        cursor = status.cursor
        if status.state.terminal and status.drained:
            break
        last_step_at = max((e.time for e in status.events if e.kind is EventKind.STEP), default=last_step_at)
        now = time.time()
        stepped = not failures or last_step_at > failures[-1].killed_at
        if now >= next_kill and status.state is JobState.RUNNING and stepped:
            pids = [e.placement for e in events if e.kind is EventKind.PLACEMENT][-1]
            victim = rng.randrange(len(pids))
            os.kill(pids[victim]["pid"], signal.SIGKILL)
            failures.append(Failure(killed_at=time.time(), rank=victim))
            next_kill = now + kill_every
        time.sleep(0.05)
    ended = events[-1].time
    return {"status": status.state.value, "reason": status.reason, "wall_s": ended - started,
            **account(events, failures, started)}


def account(events: list[Event], failures: list[Failure], started: float) -> dict[str, Any]:
    """ETTR, the surviving steps' losses and each failure's timeline, from the job's events."""
    surviving: dict[int, tuple[float, float]] = {}  # step -> (loss, step time) of its last run
    for event in events:
        if event.kind is EventKind.STEP and event.step is not None:
            surviving[int(event.step["step"])] = (float(event.step["loss"]), float(event.step["step_time_seconds"]))
    for failure in failures:
        before = [e for e in events if e.time <= failure.killed_at]
        after = [e for e in events if e.time > failure.killed_at]
        restarting = next((e for e in after if e.state is JobState.RESTARTING), None)
        running = next((e for e in after if e.state is JobState.RUNNING), None)
        first = next((e for e in after if e.kind is EventKind.STEP and running is not None and e.time >= running.time), None)
        newest = max((int(e.step["step"]) for e in before if e.kind is EventKind.STEP), default=0)
        if restarting is not None:
            failure.detection_s = restarting.time - failure.killed_at
        if restarting is not None and running is not None:
            failure.restart_s = running.time - restarting.time
        if running is not None and first is not None:
            failure.first_step_s = first.time - running.time
            failure.recovery_s = first.time - failure.killed_at
            failure.steps_recomputed = newest - (int(first.step["step"]) - 1)
    productive = sum(seconds for _, seconds in surviving.values())
    wall = events[-1].time - started
    first_step = next(e.time for e in events if e.kind is EventKind.STEP)
    return {
        "ettr": productive / wall,
        "first_step_s": first_step - started,
        "productive_s": productive,
        "losses": {step: loss for step, (loss, _) in sorted(surviving.items())},
        "failures": [asdict(f) for f in failures],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default="cold,warm", help="recovery paths to run, comma-separated: cold, warm")
    parser.add_argument("--async-save", action="store_true", help="checkpoints saved in the background")
    parser.add_argument("--memory-interval", type=int, default=0,
                        help="an in-memory snapshot every N steps (checkpoint.memory_interval_steps; 0: none)")
    parser.add_argument("--spare-after", type=float, default=SPARE_AFTER,
                        help="seconds a job trains before its supervisor starts spares (warm path)")
    parser.add_argument("--smoke", action="store_true", help="a short job, one kill")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.interval, args.kill_every = 100, 10, 30.0
    paths = [path for path in args.paths.split(",") if path]
    if not paths or set(paths) - {"cold", "warm"}:
        parser.error(f"--paths: expected cold and/or warm, got {args.paths!r}")
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-goodput-"))
    cluster = start_embedded(2, 2, head_cpus=2)
    rng = random.Random(args.seed)
    spec = job(args.steps, args.interval, max_restarts=1000, async_save=args.async_save, memory_interval=args.memory_interval)
    faulted: dict[str, dict[str, Any]] = {}
    try:
        undisturbed = run(RayRuntime(cluster.address, placement_timeout=60), "undisturbed", spec,
                          workdir / "undisturbed", None, rng)
        for path in paths:
            runtime = RayRuntime(cluster.address, placement_timeout=60, warm_restarts=path == "warm",
                                 spare_after=args.spare_after)
            faulted[path] = run(runtime, f"faulted-{path}", spec, workdir / f"faulted-{path}", args.kill_every, rng)
    finally:
        cluster.shutdown()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_end": os.getloadavg(),
        "steps": args.steps, "checkpoint_interval": args.interval, "async_save": args.async_save,
        "memory_interval": args.memory_interval,
        "kill_every_s": args.kill_every, "spare_after_s": args.spare_after,
        "undisturbed": {k: v for k, v in undisturbed.items() if k != "losses"},
        "faulted": {path: summary(undisturbed, run_) for path, run_ in faulted.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    ok = undisturbed["status"] == JobState.SUCCEEDED.value and all(
        run_["status"] == JobState.SUCCEEDED.value and run_["losses_equal"] and run_["median"]["recovery_s"] is not None
        for run_ in result["faulted"].values()
    )
    return 0 if ok else 1


def summary(undisturbed: dict[str, Any], faulted: dict[str, Any]) -> dict[str, Any]:
    """A faulted run's figures: whether each step's loss equals the undisturbed run's, and per-failure medians."""
    same = undisturbed["losses"].keys() == faulted["losses"].keys() and all(
        math.isclose(faulted["losses"][s], loss, rel_tol=1e-5) for s, loss in undisturbed["losses"].items()
    )
    recovered = [f for f in faulted["failures"] if f["recovery_s"] is not None]

    def median(key: str) -> float | None:
        values = [f[key] for f in recovered]
        return statistics.median(values) if values else None

    keys = ("detection_s", "restart_s", "first_step_s", "recovery_s", "steps_recomputed")
    return {**{k: v for k, v in faulted.items() if k != "losses"}, "losses_equal": same,
            "median": {key: median(key) for key in keys}}


if __name__ == "__main__":
    sys.exit(main())
