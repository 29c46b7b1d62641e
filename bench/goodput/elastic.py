"""Elastic data parallel (issue 35): how long a job that loses a node with no spare takes to train again on the
GPUs left, and to grow back when a node joins, against the same job undisturbed, on one embedded Ray.

The job: 4 ranks of the debug model (`dp_shard` 4, FSDP) on node-0 and node-1 (2 simulated GPUs each), CPU and
gloo, a checkpoint every `--interval` steps, `scheduling.elastic.min_gpus` 2, run by `RayRuntime` with the
cluster's topology map (the supervisor re-plans by itself, as the scheduler does under the service). node-1 is
removed after step `--lose-at`: the job shrinks to 2 ranks on node-0 (each accumulating 4 micro-batches instead
of 2). Once the shrunk generation has trained `--grow-after` steps a node (node-2) joins, and the job grows back
to 4 ranks at its next step boundary. Reported:

- shrink: the removal to the RESTARTING event (the rank on node-1 dies), to the REPLAN event (Ray declares the
  node dead: about 15 s with Ray's defaults, 3 s with `--fast-node-failure`), to the shrunk PLAN, to its
  generation's RUNNING and first step (`continue_s`: the removal to that first step; `after_replan_s`: the
  REPLAN to it, what trainctl adds to Ray's detection), and the steps recomputed;
- grow: the node asked to join (`add_node`) to the resize asked (the supervisor's look), to the RESTARTING state, to the new
  generation's first step (`grow_s`), and the steps recomputed (none: it stops at a step boundary with a
  checkpoint);
- the undisturbed run's first step from `start_job` (fresh processes), the reference the issue's 2x bound is
  read against, and whether every step's loss of the elastic run equals the undisturbed run's (rel 1e-5).

    .venv/bin/python bench/goodput/elastic.py --out bench/goodput/results-elastic.json
    .venv/bin/python bench/goodput/elastic.py --fast-node-failure
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.workers.embedded import FAST_NODE_FAILURE_DETECTION, start_embedded  # noqa: E402
from trainctl.workers.events import Event, EventKind, JobState  # noqa: E402
from trainctl.workers.placement import Placement, RankAssignment  # noqa: E402
from trainctl.workers.runtime import RayRuntime  # noqa: E402
from trainctl.workers.topology.model import simulated_topology  # noqa: E402

SLOTS = [("node-0", 0), ("node-0", 1), ("node-1", 0), ("node-1", 1)]


def job(steps: int, interval: int) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "elastic"},
        "spec": {
            "model": {"preset": "debug"},
            "data": {"seq_len": 64, "max_files": 20},
            "parallelism": {"dp_shard": 4},
            "training": {"steps": steps, "global_batch_size": 8, "warmup_steps": 1, "log_interval": 1},
            "checkpoint": {"interval_steps": interval},
            "resources": {"gpus": 4, "device": "cpu"},
            "scheduling": {"max_restarts": 10, "elastic": {"min_gpus": 2}},
        },
    })


class Follower:
    """A job's events as they come (`poll` every 50 ms)."""

    def __init__(self, runtime: RayRuntime, job_id: str) -> None:
        self.runtime, self.job_id, self.events, self.cursor = runtime, job_id, [], 0

    def until(self, done: Callable[[list[Event]], bool], timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            status = self.runtime.poll(self.job_id, self.cursor)
            self.events += status.events
            self.cursor = status.cursor
            if status.state.terminal and status.drained and not done(self.events):
                raise RuntimeError(f"{self.job_id} ended {status.state.value} ({status.reason}) first")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.job_id}: timed out")
            time.sleep(0.05)


def ended(events: list[Event]) -> bool:
    return any(e.kind is EventKind.STATE and e.state is not None and e.state.terminal for e in events)


def steps(events: list[Event], generation: int | None = None) -> dict[int, float]:
    return {int(e.step["step"]): float(e.step["loss"]) for e in events
            if e.kind is EventKind.STEP and (generation is None or e.generation == generation)}


def after(events: list[Event], at: float, match: Callable[[Event], bool]) -> Event:
    return next(e for e in events if e.time >= at and match(e))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--lose-at", type=int, default=12, help="remove node-1 once this step is reported")
    parser.add_argument("--grow-after", type=int, default=5, help="steps the shrunk generation trains before node-2 joins")
    parser.add_argument("--fast-node-failure", action="store_true", help="Ray declares a node dead in ~3 s (else ~15 s)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-elastic-"))
    cluster = start_embedded(2, 2, head_cpus=2, system_config=FAST_NODE_FAILURE_DETECTION if args.fast_node_failure else None)
    spec = job(args.steps, args.interval)
    placement = Placement(grid="dp_shard4", assignments=[RankAssignment(rank=r, node=n, gpu=g) for r, (n, g) in enumerate(SLOTS)])
    try:
        runtime = RayRuntime(cluster.address, placement_timeout=60)
        started = time.time()
        runtime.start_job("undisturbed", spec, placement, workdir / "undisturbed")
        reference = Follower(runtime, "undisturbed")
        reference.until(ended)
        first_step_s = next(e.time for e in reference.events if e.kind is EventKind.STEP) - started

        runtime.start_job("elastic", spec, placement, workdir / "elastic", topology=simulated_topology(3, 2))
        run = Follower(runtime, "elastic")
        run.until(lambda events: max(steps(events), default=0) >= args.lose_at)
        cluster.remove_node("node-1")
        removed_at = time.time()
        newest_before = max(steps(run.events))
        run.until(lambda events: any(len(e.placement or []) == 2 for e in placements(events)))
        shrunk = next(e.generation for e in placements(run.events) if len(e.placement or []) == 2)
        run.until(lambda events: len(steps(events, shrunk)) >= args.grow_after)
        joined_at = time.time()  # the node's raylet is up (and its GPUs free in Ray) before add_node returns
        cluster.add_node("node-2", gpus=2)
        run.until(ended)
    finally:
        cluster.shutdown()
    events = run.events
    for event in events:
        if event.kind is not EventKind.STEP and not event.message.startswith("checkpoint saved"):
            print(f"{event.time - removed_at:8.2f}s  gen {event.generation}  {event.kind.value:9s} "
                  f"{(event.state.value if event.state else '') or ''} {event.reason or event.message}"[:200], file=sys.stderr)
    restarting = after(events, removed_at, lambda e: e.state is JobState.RESTARTING)
    replan = after(events, removed_at, lambda e: e.kind is EventKind.REPLAN)
    shrink_plan = after(events, removed_at, lambda e: e.kind is EventKind.PLAN)
    shrunk_running = after(events, shrink_plan.time, lambda e: e.state is JobState.RUNNING)
    shrunk_first = min((e for e in events if e.kind is EventKind.STEP and e.generation == shrunk), key=lambda e: e.time)
    asked = after(events, joined_at, lambda e: e.kind is EventKind.LOG and e.message.startswith("growing back"))
    resized = after(events, joined_at, lambda e: e.state is JobState.RESTARTING)
    grown = placements(events)[-1].generation
    grown_first = min((e for e in events if e.kind is EventKind.STEP and e.generation == grown), key=lambda e: e.time)
    undisturbed = steps(reference.events)
    trained = [(int(e.step["step"]), float(e.step["loss"])) for e in events if e.kind is EventKind.STEP]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ray_node_failure_detection": "fast (3 s)" if args.fast_node_failure else "Ray's default (about 15 s)",
        "steps": args.steps, "checkpoint_interval": args.interval, "lost_after_step": newest_before,
        "undisturbed_first_step_s": first_step_s,
        "shrink": {
            "to_restarting_s": restarting.time - removed_at, "to_replan_s": replan.time - removed_at,
            "to_plan_s": shrink_plan.time - removed_at, "to_running_s": shrunk_running.time - removed_at,
            "continue_s": shrunk_first.time - removed_at, "after_replan_s": shrunk_first.time - replan.time,
            "plan": shrink_plan.message, "steps_recomputed": newest_before - (int(shrunk_first.step["step"]) - 1),
        },
        "grow": {
            "to_asked_s": asked.time - joined_at, "to_restarting_s": resized.time - joined_at,
            "grow_s": grown_first.time - joined_at, "reason": resized.reason,
            "steps_recomputed": max(steps(events, shrunk)) - (int(grown_first.step["step"]) - 1),
            "ranks": len(placements(events)[-1].placement or []),
        },
        "status": [e.state.value for e in events if e.kind is EventKind.STATE][-1],
        "losses_equal": steps(events).keys() == undisturbed.keys() and all(
            math.isclose(loss, undisturbed[step], rel_tol=1e-5) for step, loss in trained),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["status"] == JobState.SUCCEEDED.value and result["losses_equal"] else 1


def placements(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind is EventKind.PLACEMENT]


if __name__ == "__main__":
    sys.exit(main())
