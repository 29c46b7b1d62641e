"""Start-up of a command job: from CreateJob to the script's first line of output, trainctl vs Ray
Train's TorchTrainer running the same script body (`first_line_body.py`: import torch, join the gloo
process group, print), 2 ranks on CPU, one per node of the same embedded 2-node Ray.

- trainctl: `TrainctlClient.create_job` of a command job (`python first_line_body.py MARKER`) -> rank 0's
  first line, by the wall time the program writes beside it, and -> that line's LOG event at the client
  (WatchJob), which adds its way back through the supervisor, the service's poll and the store;
- Ray Train: `TorchTrainer.fit()` called -> the same line in rank 0's train loop, with
  `ScalingConfig(num_workers=2)` pinned one worker per node by the same GPU-slot resources.

Trials alternate between the two; medians and their ratio are printed (and written with --out).

    .venv/bin/python bench/api/bench_command_first_line.py --trials 3 --out bench/api/results-command-first-line.json
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

BODY = Path(__file__).resolve().parent / "first_line_body.py"
FIRST_LINE = "first line"


def trainctl_trial(client: TrainctlClient, workdir: Path) -> tuple[float, float]:
    """(seconds to the first line's print, seconds to its LOG event at the client)."""
    marker = Path(tempfile.mkdtemp(dir=workdir)) / "first-line"
    job = TrainingJob.model_validate({
        "metadata": {"name": "first-line"},
        "spec": {
            "command": {"program": "python", "args": [str(BODY), str(marker)]},
            "resources": {"gpus": 2, "device": "cpu"},
            "scheduling": {"max_restarts": 0},
        },
    })
    started_wall = time.time()
    started = time.perf_counter()
    created = client.create_job(job)
    seen = None
    for event in client.watch(created.id):
        if seen is None and event.WhichOneof("payload") == "log" and FIRST_LINE in event.log.message:
            seen = time.perf_counter() - started
    final = client.get_job(created.id)
    if seen is None or final.status.state != 6:  # SUCCEEDED
        raise RuntimeError(f"job {created.id}: {final.status.reason}")
    return float(marker.read_text()) - started_wall, seen


def _ray_train_loop(config: dict) -> None:
    sys.path.insert(0, str(Path(config["body"]).parent))
    import first_line_body

    first_line_body.main(config["marker"])


def ray_train_trial(workdir: Path) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trial = Path(tempfile.mkdtemp(dir=workdir))
    marker = trial / "first-line"
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"body": str(BODY), "marker": str(marker)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0, "trainctl_gpu_0": 1}),
        run_config=RunConfig(storage_path=str(trial / "ray-train"), name="first-line"),
    )
    started = time.time()
    trainer.fit()
    return float(marker.read_text()) - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-command-"))
    cluster = start_embedded(2, 1, head_cpus=2)
    seconds: dict[str, list[float]] = {"trainctl_print": [], "trainctl_client": [], "ray_train_print": []}
    try:
        config = ServiceConfig(address="127.0.0.1:0", data_dir=workdir / "svc", metrics_port=0, ray_address=cluster.address)
        with Service(config, topology=cluster.topology) as service, TrainctlClient(service.target) as client:
            for trial in range(args.trials):
                printed, seen = trainctl_trial(client, workdir)
                seconds["trainctl_print"].append(printed)
                seconds["trainctl_client"].append(seen)
                seconds["ray_train_print"].append(ray_train_trial(workdir))
                print(f"trial {trial}: trainctl {printed:.2f} s (at the client {seen:.2f} s), "
                      f"Ray Train {seconds['ray_train_print'][-1]:.2f} s", flush=True)
    finally:
        cluster.shutdown()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "trials": args.trials,
        "seconds": seconds,
        "median_seconds": median,
        "ray_train_over_trainctl": median["ray_train_print"] / median["trainctl_print"],
        "ray_train_over_trainctl_at_client": median["ray_train_print"] / median["trainctl_client"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
