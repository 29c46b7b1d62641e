"""A high-priority job's wait for its first step: on an idle pool, and on a pool a low-priority job fills
(which is preempted for it), on the same embedded Ray and service.

The pool is 2 simulated GPUs (an embedded Ray of 2 nodes x 1, the service's simulated map); both jobs
are 2-rank CPU jobs of the debug model, gloo. Per trial, interleaved:

- idle: `CreateJob` of the high job (priority 10) on an empty pool -> its first STEP event at the client;
- preempting: a low job (priority 0, a checkpoint every 50 steps) is created and reaches step 3, then the
  high job is created -> its first STEP event at the client. Also recorded: how long the low job took to
  checkpoint and stop (the high job's CreateJob -> the low job queued again), the step it stopped at,
  the time from the high job's end to the low job's first resumed step, and whether every step of the
  low job was reported once and it SUCCEEDED.

    .venv/bin/python bench/cluster/preemption_latency.py --trials 3 --out bench/cluster/results-preemption.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.v1 import training_pb2 as pb  # noqa: E402
from trainctl.workers.embedded import start_embedded  # noqa: E402

LOW_STEPS = 30


def job(name: str, steps: int, priority: int) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": name},
        "spec": {
            "model": {"preset": "debug"},
            "data": {"seq_len": 64, "max_files": 20},
            "parallelism": {"dp_shard": 2},
            "training": {"steps": steps, "global_batch_size": 4, "warmup_steps": 1},
            "checkpoint": {"interval_steps": 50},
            "resources": {"gpus": 2, "device": "cpu"},
            "scheduling": {"max_restarts": 0, "priority": priority},
        },
    })


def first_step_after(client: TrainctlClient, job_id: str, started: float) -> float:
    """Seconds from `started` (perf_counter) to the job's first STEP event at the client."""
    for event in client.watch(job_id):
        if event.WhichOneof("payload") == "step":
            return time.perf_counter() - started
    raise RuntimeError(f"job {job_id} ended without a step: {client.get_job(job_id).status.reason}")


def wait_ended(client: TrainctlClient, job_id: str) -> pb.Job:
    for _ in client.watch(job_id):
        pass
    return client.get_job(job_id, full=True)


def idle_trial(client: TrainctlClient) -> float:
    started = time.perf_counter()
    high = client.create_job(job("high-idle", 3, priority=10))
    seconds = first_step_after(client, high.id, started)
    wait_ended(client, high.id)
    return seconds


def preempting_trial(client: TrainctlClient) -> dict[str, Any]:
    low = client.create_job(job("low", LOW_STEPS, priority=0))
    stream = client.watch(low.id)
    seen: list[pb.JobEvent] = []
    for event in stream:
        seen.append(event)
        if event.WhichOneof("payload") == "step" and event.step.step >= 3:
            break
    started_wall, started = time.time(), time.perf_counter()
    high = client.create_job(job("high", 3, priority=10))
    first = first_step_after(client, high.id, started)
    seen += list(stream)
    done_high, done_low = client.get_job(high.id, full=True), client.get_job(low.id, full=True)
    requeued = next(e for e in seen if e.WhichOneof("payload") == "state_change" and e.state_change.to_state == pb.QUEUED
                    and e.state_change.reason.startswith("queued again"))
    steps = [e.step.step for e in seen if e.WhichOneof("payload") == "step"]
    stopped_at = max(e.step.step for e in seen[: seen.index(requeued)] if e.WhichOneof("payload") == "step")
    resumed = next(m for m in done_low.metrics if m.step == stopped_at + 1).time.ToNanoseconds() / 1e9
    return {
        "first_step_seconds": first,
        "victim_stop_seconds": requeued.time.ToNanoseconds() / 1e9 - started_wall,
        "victim_stopped_at_step": stopped_at,
        "victim_resume_seconds": resumed - done_high.status.end_time.ToNanoseconds() / 1e9,
        "victim_steps_once": steps == list(range(1, LOW_STEPS + 1)),
        "victim_succeeded": done_low.status.state == pb.SUCCEEDED,
        "high_succeeded": done_high.status.state == pb.SUCCEEDED,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-preemption-"))
    cluster = start_embedded(2, 1, head_cpus=2)
    idle: list[float] = []
    preempting: list[dict[str, Any]] = []
    try:
        config = ServiceConfig(address="127.0.0.1:0", data_dir=workdir / "service", metrics_port=0, ray_address=cluster.address)
        with Service(config, topology=cluster.topology) as service, TrainctlClient(service.target) as client:
            for trial in range(args.trials):
                idle.append(idle_trial(client))
                preempting.append(preempting_trial(client))
                print(f"trial {trial}: idle pool {idle[-1]:.2f} s, preempting {preempting[-1]}", flush=True)
    finally:
        cluster.shutdown()
    if not all(t["victim_steps_once"] and t["victim_succeeded"] and t["high_succeeded"] for t in preempting):
        print("a trial lost or repeated a step, or a job failed", file=sys.stderr)
        return 1
    median = {key: statistics.median(t[key] for t in preempting) for key in
              ("first_step_seconds", "victim_stop_seconds", "victim_resume_seconds")}
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "trials": args.trials,
        "idle_first_step_seconds": idle,
        "preempting": preempting,
        "median_idle_first_step_seconds": statistics.median(idle),
        "median_preempting": median,
        "preempting_over_idle": median["first_step_seconds"] / statistics.median(idle),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
