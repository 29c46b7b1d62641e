"""Time from submitting a job to its first completed optimizer step: trainctl vs Ray Train's TorchTrainer.

Both run the same engine loop (`trainctl.parallelism.engine.trainer.Trainer`, same spec: the debug model,
2 data-parallel ranks on CPU with gloo) on the same embedded 2-node Ray on loopback:

- trainctl, twice: a service without the warm pool (every rank a fresh process) and one with it
  (`ServiceConfig(warm_pool=True)`, as `trainctl serve --warm-pool`): `TrainctlClient.create_job` ->
  the first STEP event on `WatchJob`, as the client sees it (the path includes admission, placement,
  the supervisor actor, the rank group, rendezvous and the first step, and the event's way back
  through the supervisor, the service's poll and the store), split into phases from the job's
  recorded times;
- Ray Train: `TorchTrainer.fit()` called -> rank 0's first `on_step` callback (written to a file
  with its wall time), with `ScalingConfig(num_workers=2)` pinned one worker per node by the
  same GPU-slot resources.

Trials alternate between the three; every trial starts once the pool has a loaded worker on every
slot, so no process loads in the background during any trial. Medians are reported with the ratios.

    .venv/bin/python bench/api/bench_first_step.py --trials 3 --out bench/api/results-first-step.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.workers.embedded import start_embedded  # noqa: E402
from trainctl.workers.warm_pool import WarmPool  # noqa: E402

SLOTS = 4
"""GPU slots of the benchmark's cluster (2 nodes x 2)."""

JOB = {
    "metadata": {"name": "first-step"},
    "spec": {
        "model": {"preset": "debug"},
        "data": {"seq_len": 64, "max_files": 20},
        "parallelism": {"dp_shard": 2},
        "training": {"steps": 3, "global_batch_size": 4, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 0},
        "resources": {"gpus": 2, "device": "cpu"},
        "scheduling": {"max_restarts": 0},
    },
}


def trainctl_trial(client: TrainctlClient) -> tuple[float, dict[str, float]]:
    """Seconds from CreateJob to the first step event at the client, and where they went (from the
    job's recorded times: queue + placement, supervisor and rank group up, first step, delivery)."""
    started_wall = time.time()
    started = time.perf_counter()
    created = client.create_job(TrainingJob.model_validate(JOB))
    for event in client.watch(created.id):
        if event.WhichOneof("payload") == "step":
            first = time.perf_counter() - started
            break
    else:
        raise RuntimeError(f"job {created.id} ended without a step: {client.get_job(created.id).status.reason}")
    for _ in client.watch(created.id):  # let it finish before the next trial
        pass
    job = client.get_job(created.id, full=True)
    s = job.status
    seconds = {name: getattr(s, name).ToNanoseconds() / 1e9 for name in ("schedule_time", "start_time")}
    step_at = job.metrics[0].time.ToNanoseconds() / 1e9
    phases = {
        "admission": seconds["schedule_time"] - started_wall,
        "ranks_up": seconds["start_time"] - seconds["schedule_time"],
        "first_step": step_at - seconds["start_time"],
        "delivery": started_wall + first - step_at,
    }
    return first, phases


def _ray_train_loop(config: dict) -> None:
    """One Ray Train worker: the trainctl engine loop under Ray Train's process group."""
    import torch
    from ray import train

    from trainctl.parallelism.engine.trainer import Trainer
    from trainctl.spec.job import JobSpecBody

    context = train.get_context()
    rank = context.get_world_rank()
    marker = Path(config["marker"])

    def on_step(report: object) -> None:
        if rank == 0 and not marker.exists():
            marker.write_text(str(time.time()))

    body = JobSpecBody.model_validate_json(config["job"])
    Trainer(body, rank=rank, world_size=context.get_world_size(), device=torch.device("cpu"),
            checkpoint_dir=config["checkpoints"], on_step=on_step, on_event=lambda _m: None).run()


def ray_train_trial(workdir: Path) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trial = Path(tempfile.mkdtemp(dir=workdir))
    marker = trial / "first-step"
    job = TrainingJob.model_validate(JOB)
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"job": job.spec.model_dump_json(), "marker": str(marker), "checkpoints": str(trial / "ckpt")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0, "trainctl_gpu_0": 1}),
        run_config=RunConfig(storage_path=str(trial / "ray-train"), name="first-step"),
    )
    started = time.time()
    trainer.fit()
    return float(marker.read_text()) - started


def wait_quiet(pool: WarmPool) -> None:
    """Wait until the pool has a loaded worker on every slot, so no process loads during a trial."""
    deadline = time.monotonic() + 180
    while len(pool.idle_slots()) < SLOTS and time.monotonic() < deadline:
        time.sleep(0.25)
    pool.wait_loaded(timeout=max(1.0, deadline - time.monotonic()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-first-step-"))
    cluster = start_embedded(2, 2, head_cpus=2)
    seconds: dict[str, list[float]] = {"cold": [], "warm": [], "ray_train": []}
    phases: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    try:
        def config(name: str, warm: bool) -> ServiceConfig:
            return ServiceConfig(
                address="127.0.0.1:0", data_dir=workdir / name, metrics_port=0, ray_address=cluster.address, warm_pool=warm
            )

        with (
            Service(config("cold", False), topology=cluster.topology) as cold,
            Service(config("warm", True), topology=cluster.topology) as warm,
            TrainctlClient(cold.target) as cold_client,
            TrainctlClient(warm.target) as warm_client,
        ):
            assert warm.warm_pool is not None
            for trial in range(args.trials):
                for name, client in (("cold", cold_client), ("warm", warm_client)):
                    wait_quiet(warm.warm_pool)
                    first, where = trainctl_trial(client)
                    seconds[name].append(first)
                    phases[name].append(where)
                wait_quiet(warm.warm_pool)
                seconds["ray_train"].append(ray_train_trial(workdir))
                print(
                    f"trial {trial}: trainctl {seconds['cold'][-1]:.2f} s, with the warm pool "
                    f"{seconds['warm'][-1]:.2f} s, Ray Train {seconds['ray_train'][-1]:.2f} s",
                    flush=True,
                )
    finally:
        cluster.shutdown()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "trials": args.trials,
        "seconds": seconds,
        "median_seconds": median,
        "speedup_cold": median["ray_train"] / median["cold"],
        "speedup_warm": median["ray_train"] / median["warm"],
        "phase_median_seconds": {
            name: {k: statistics.median(p[k] for p in runs) for k in runs[0]} for name, runs in phases.items()
        },
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
