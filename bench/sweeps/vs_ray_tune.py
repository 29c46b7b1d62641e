"""A trainctl sweep vs the same search run with Ray Tune, on the same embedded Ray and machine.

The search is examples/sweeps/lr-warmup.yaml: 12 trials of the debug model (1 CPU rank each, 30 steps)
over the learning rate (log-uniform) and the warm-up steps, 2 trials at a time, Optuna's TPE after 4
random trials, median early stopping after 10 steps once 3 trials finished. trainctl: CreateSweep on a
service backed by an embedded 1-node Ray, watched until the sweep ends (every trial a job through the
queue). Ray Tune: `tune.Tuner` over a function trainable running the same `Trainer` in-process and
`tune.report`ing each step's loss, with `OptunaSearch` (the same TPE sampler and seed) and
`MedianStoppingRule` (grace 10 iterations, 3 samples) at 2 concurrent trials (1 CPU each, of the head's 2).
Both run the same trainctl engine, so the time difference is what each adds around it. Sides alternate.

    .venv/bin/python bench/sweeps/vs_ray_tune.py --rounds 1 --out bench/sweeps/results-vs-ray-tune.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.sweep import Sweep, load_sweep_file, trial_job  # noqa: E402
from trainctl.v1 import training_pb2 as pb  # noqa: E402
from trainctl.workers.embedded import start_embedded  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweeps" / "lr-warmup.yaml"


def trainctl_side(client: TrainctlClient, sweep: Sweep) -> dict[str, Any]:
    started = time.perf_counter()
    created = client.create_sweep(sweep)
    for _ in client.watch_sweep(created.id):
        pass
    seconds = time.perf_counter() - started
    final = client.get_sweep(created.id)
    states = [pb.TrialState.Name(t.state).removeprefix("TRIAL_STATE_") for t in final.status.trials]
    return {
        "seconds": seconds, "state": pb.SweepState.Name(final.status.state),
        "complete": states.count("COMPLETE"), "pruned": states.count("PRUNED"),
        "best_loss": final.status.best_objective if final.status.HasField("best_objective") else None,
    }


def tune_trial(config: dict[str, Any]) -> None:
    """One Tune trial: the template with the sampled lr and warm-up, trained in-process, each step reported."""
    import torch
    from ray import tune

    from trainctl.parallelism.engine.trainer import Trainer

    torch.set_num_threads(1)
    job = trial_job(config["sweep"], "tune", 0, {"spec.training.lr": config["lr"], "spec.training.warmup_steps": config["warmup"]})
    Trainer(job.spec, device="cpu", on_step=lambda r: tune.report({"loss": r.loss, "step": r.step})).run()


def tune_side(sweep: Sweep, workdir: Path) -> dict[str, Any]:
    import optuna
    from ray import tune
    from ray.tune.schedulers import MedianStoppingRule
    from ray.tune.search.optuna import OptunaSearch

    spec = sweep.spec
    lr, warmup = spec.parameters
    search = OptunaSearch(
        sampler=optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=spec.startup_trials), metric="loss", mode="min",
    )
    stopping = MedianStoppingRule(
        time_attr="training_iteration", metric="loss", mode="min", grace_period=spec.early_stopping.min_steps,
        min_samples_required=spec.early_stopping.startup_trials,
    )
    tuner = tune.Tuner(
        tune.with_resources(tune_trial, {"cpu": 1}),
        param_space={"sweep": sweep, "lr": tune.loguniform(lr.low, lr.high), "warmup": tune.randint(int(warmup.low), int(warmup.high) + 1)},
        tune_config=tune.TuneConfig(num_samples=spec.trials, max_concurrent_trials=spec.parallel_trials, search_alg=search, scheduler=stopping),
        run_config=tune.RunConfig(storage_path=str(workdir / "tune"), name=f"tune-{time.time_ns()}", verbose=0),
    )
    started = time.perf_counter()
    results = tuner.fit()
    seconds = time.perf_counter() - started
    frame = results.get_dataframe()
    steps = frame["step"].tolist()
    best = results.get_best_result(metric="loss", mode="min", scope="last")
    return {
        "seconds": seconds, "trials": len(frame), "complete": sum(s == spec.template.training.steps for s in steps),
        "pruned": sum(s < spec.template.training.steps for s in steps), "best_loss": best.metrics["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs (sides alternate)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    sweep = load_sweep_file(str(EXAMPLE))
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-sweeps-"))
    cluster = start_embedded(1, 2, head_cpus=2)
    rounds = []
    try:
        config = ServiceConfig(address="127.0.0.1:0", data_dir=workdir / "service", metrics_port=0, ray_address=cluster.address)
        with Service(config, topology=cluster.topology) as service, TrainctlClient(service.target) as client:
            for i in range(args.rounds):
                order = ("trainctl", "tune") if i % 2 == 0 else ("tune", "trainctl")
                result = {}
                for side in order:
                    result[side] = trainctl_side(client, sweep) if side == "trainctl" else tune_side(sweep, workdir)
                    print(side, json.dumps(result[side]), flush=True)
                result["ratio"] = result["trainctl"]["seconds"] / result["tune"]["seconds"]
                print(f"round {i + 1}: trainctl / tune = {result['ratio']:.3f}", flush=True)
                rounds.append(result)
    finally:
        cluster.shutdown()
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rounds": rounds}, indent=2) + "\n")


if __name__ == "__main__":
    main()
