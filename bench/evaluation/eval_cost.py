"""What evaluation during training costs, and what the loader and the tracker add to a training step
(issue 37: "the time evaluation adds is recorded as a fraction of the step time, beside what the eval
batches cost alone; the loader and the tracker never add to a training step").

**Engine.** One job (the `debug` preset by default, `--ranks` FSDP ranks under gloo, spawned as the
other bench scripts spawn them, one torch thread each) runs `--repeats` times in each of three modes,
interleaved (the order rotates every repeat) so that load on the machine falls on every mode alike:
`none` (no `spec.evaluation`), and an evaluation every `--interval` steps (and at the end) of 1 and of
4 global batches of a separate copy of the training data read in another order (`eval-1`, `eval-4`).
From rank 0's StepReports, the first `WARMUP_STEPS` steps left out:

- the training step, `step_time_seconds` (it excludes the evaluation), and its data wait
  (`breakdown["data"]`): the evaluation's loader must leave both as they are without evaluation, also
  on the step right after an evaluation;
- an evaluation's time (`breakdown["evaluation"]`), per evaluation and per eval batch, as a fraction of
  the training step, and spread over its interval (the fraction of training time the evaluations add);
- the forward of one eval batch alone (`Evaluator._batch_loss`: the model's forward and the loss, no
  sample reads) against the training step's forward + backward (`breakdown["forward_backward"]`);
- the trainer's set-up (building the evaluation dataset happens there, once).

The training losses of all three modes must be identical (the script fails otherwise).

**Tracker.** `JobTracker.step` (trainctl/service/tracking/tracker.py), what the scheduler's follower
calls for every step a job reports, timed per call with the real tracker and MLflow sink (its thread
started) and a fake MLflow API behind it, in four peers interleaved per repeat: `untracked` (no MLflow
server: the call's floor), `answering` (the fake answers at once), `blocking` (every call to the server
sleeps `--block-seconds`: a hung server) and `down` (every call raises ConnectionError: a server that
is away). The follower's call must cost microseconds in every peer and never wait for the server.

Usage: nice -n 19 .venv/bin/python bench/evaluation/eval_cost.py [--ranks 2] [--repeats 3] [--json PATH]
       nice -n 19 .venv/bin/python bench/evaluation/eval_cost.py --smoke      (seconds: few steps, one repeat)
Results: bench/evaluation/results-eval-cost.json, docs/benchmarks.md ("Evaluation cost").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from trainctl.parallelism.data.corpus import MicroBatch
from trainctl.parallelism.engine.distributed import init_distributed, teardown
from trainctl.parallelism.engine.evaluation import Evaluator
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.service import store as st
from trainctl.service.store import JobStore
from trainctl.service.tracking.mlflow_sink import MlflowSink
from trainctl.service.tracking.policy import TrackingPolicy
from trainctl.service.tracking.run import StepPoint
from trainctl.service.tracking.tracker import JobTracker
from trainctl.spec.job import JobSpecBody, TrainingJob

EVAL_MODES = {"none": 0, "eval-1": 1, "eval-4": 4}
"""Engine modes: eval batches per evaluation (0: no evaluation)."""
TRACKER_PEERS = ("untracked", "answering", "blocking", "down")
WARMUP_STEPS = 2
MLFLOW_URI = "http://mlflow.bench.invalid:5000"
RESULTS = Path(__file__).with_name("results-eval-cost.json")


# ---- the engine ---------------------------------------------------------------------------------------
def job(model: str, steps: int, interval: int, batches: int, ranks: int) -> JobSpecBody:
    """The benchmark's job: `ranks` FSDP ranks of `model` on the standard library's sources, evaluating
    `batches` batches every `interval` steps and at the end (0 batches: no evaluation)."""
    data = {"max_files": 40, "seq_len": 128, "seed": 3}
    spec: dict[str, Any] = {
        "model": {"preset": model},
        "data": data,
        "parallelism": {"dp_shard": ranks, "zero_stage": 3} if ranks > 1 else {},
        "training": {"steps": steps, "global_batch_size": 4 * ranks, "micro_batch_size": 4, "warmup_steps": 2,
                     "lr": 1e-3, "seed": 5, "log_interval": 1},
        "checkpoint": {"interval_steps": 0},
        "resources": {"gpus": ranks, "device": "cpu"},
    }
    if batches:
        spec["evaluation"] = {"data": {**data, "seed": 11}, "interval_steps": interval, "batches": batches}
    return JobSpecBody.model_validate(spec)


class TimedEvaluator(Evaluator):
    """An Evaluator that notes the seconds of each eval batch's forward and loss (no sample reads)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forward_seconds: list[float] = []

    def _batch_loss(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        started = time.perf_counter()
        loss = super()._batch_loss(micro_batches)
        self.forward_seconds.append(time.perf_counter() - started)
        return loss


class TimedTrainer(Trainer):
    """A Trainer whose evaluator times its batches' forwards (on the evaluation dataset it built)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.evaluator is not None:
            self.evaluator = TimedEvaluator(self, self.evaluator.spec, self.evaluator.loader.dataset)


def train_timed(rank: int, world: int, body_json: str) -> dict[str, Any]:
    """Run the job on this rank (one torch thread): its set-up seconds, StepReports (rank 0), losses and
    eval forwards."""
    torch.set_num_threads(1)
    reports: list[dict[str, Any]] = []
    started = time.perf_counter()
    trainer = TimedTrainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world, device="cpu",
                           on_step=lambda report: reports.append(report.to_dict()))
    setup_seconds = time.perf_counter() - started
    result = trainer.run()
    forwards = trainer.evaluator.forward_seconds if isinstance(trainer.evaluator, TimedEvaluator) else []
    return {"setup_seconds": setup_seconds, "reports": reports, "losses": result.losses, "eval_forward_seconds": forwards}


def _rank_main(rank: int, world: int, body_json: str, port: int, out: Any) -> None:
    init_distributed(rank, world, "127.0.0.1", port, device="cpu")
    try:
        timed = train_timed(rank, world, body_json)
        if rank == 0:
            out.put(timed)
    finally:
        teardown()


def run_once(body: JobSpecBody) -> dict[str, Any]:
    """One run of `body` (one rank: in this process; more: spawned processes): rank 0's timings."""
    world = body.parallelism.world_size
    if world == 1:
        return train_timed(0, 1, body.model_dump_json())
    out = mp.get_context("spawn").SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, body.model_dump_json(), port, out), nprocs=world, start_method="spawn")
    return out.get()


def empty_samples() -> dict[str, list[float]]:
    return {name: [] for name in ("step", "step_after_eval", "data", "forward_backward", "evaluation",
                                  "eval_forward", "setup")}


def collect(run: dict[str, Any], samples: dict[str, list[float]]) -> None:
    """Add one run's timings to `samples` (the warm-up steps left out)."""
    evaluated = {r["step"] for r in run["reports"] if r["eval_loss"] is not None}
    for report in run["reports"]:
        if report["step"] <= WARMUP_STEPS:
            continue
        breakdown = report["breakdown"]
        samples["step_after_eval" if report["step"] - 1 in evaluated else "step"].append(report["step_time_seconds"])
        samples["data"].append(breakdown["data"])
        samples["forward_backward"].append(breakdown["forward_backward"])
        if "evaluation" in breakdown:
            samples["evaluation"].append(breakdown["evaluation"])
    samples["eval_forward"].extend(run["eval_forward_seconds"])
    samples["setup"].append(run["setup_seconds"])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_engine(samples: dict[str, dict[str, list[float]]], interval: int) -> dict[str, Any]:
    """Per mode: medians and the ratios the module docstring names."""
    base = samples["none"]
    base_step = statistics.median(base["step"])
    rows: dict[str, Any] = {}
    for mode, batches in EVAL_MODES.items():
        s = samples[mode]
        step = statistics.median(s["step"])
        fwd_bwd = statistics.median(s["forward_backward"])
        row: dict[str, Any] = {
            "step_median_s": step, "steps": len(s["step"]), "step_mean_s": statistics.mean(s["step"]),
            "step_over_none": step / base_step,
            "data_wait_median_s": statistics.median(s["data"]),
            "data_wait_over_none": statistics.median(s["data"]) / statistics.median(base["data"]),
            "forward_backward_median_s": fwd_bwd,
            "setup_median_s": statistics.median(s["setup"]),
            "setup_over_none": statistics.median(s["setup"]) / statistics.median(base["setup"]),
        }
        if batches:
            evaluation = statistics.median(s["evaluation"])
            forward = statistics.median(s["eval_forward"])
            row |= {
                "step_after_eval_median_s": median(s["step_after_eval"]),
                "steps_after_eval": len(s["step_after_eval"]),
                "step_after_eval_over_none": statistics.median(s["step_after_eval"]) / base_step,
                "evaluations": len(s["evaluation"]),
                "eval_batches": batches,
                "evaluation_median_s": evaluation,
                "evaluation_per_batch_s": evaluation / batches,
                "evaluation_over_step": evaluation / step,
                "evaluation_per_batch_over_step": evaluation / batches / step,
                "evaluation_spread_over_interval": evaluation / (interval * step),
                "eval_forward_per_batch_median_s": forward,
                "eval_forward_over_train_forward_backward": forward / fwd_bwd,
                "eval_forward_share_of_evaluation": forward * batches / evaluation,
            }
        rows[mode] = row
    return rows


def engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    samples = {mode: empty_samples() for mode in EVAL_MODES}
    losses: dict[str, list[float]] = {}
    per_repeat: list[dict[str, Any]] = []
    modes = list(EVAL_MODES)
    for repeat in range(args.repeats):
        for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
            run = run_once(job(args.model, args.steps, args.interval, EVAL_MODES[mode], args.ranks))
            one = empty_samples()
            collect(run, one)
            for name, values in one.items():
                samples[mode][name].extend(values)
            losses.setdefault(mode, run["losses"])
            if run["losses"] != losses[mode]:
                raise SystemExit(f"{mode}: repeat {repeat + 1} trained different losses than repeat 1")
            per_repeat.append({"repeat": repeat + 1, "mode": mode, "step_median_s": statistics.median(one["step"]),
                               "evaluation_median_s": median(one["evaluation"])})
            evaluation = median(one["evaluation"])
            print(f"repeat {repeat + 1} {mode:6s}: step {statistics.median(one['step']) * 1e3:.1f} ms"
                  + (f", evaluation {evaluation * 1e3:.1f} ms" if evaluation is not None else ""), flush=True)
    if not all(values == losses["none"] for values in losses.values()):
        raise SystemExit("the modes trained different losses: evaluation changed the training run")
    return {"losses_identical": True, "modes": summarise_engine(samples, args.interval), "per_repeat": per_repeat}


# ---- the tracker --------------------------------------------------------------------------------------
class FakeMlflow:
    """An MLflow server in memory that answers (`answering`), hangs `seconds` on every call (`blocking`)
    or refuses every call (`down`); counts calls and the steps it received."""

    def __init__(self, behaviour: str, seconds: float):
        self.behaviour = behaviour
        self.seconds = seconds
        self.calls = 0
        self.steps_received = 0
        self.in_call = threading.Event()
        """Set while a call is in progress (the sink's thread is waiting on the 'server')."""

    def _call(self) -> None:
        self.calls += 1
        if self.behaviour == "down":
            raise ConnectionError("connection refused")
        if self.behaviour == "blocking":
            self.in_call.set()
            try:
                time.sleep(self.seconds)
            finally:
                self.in_call.clear()

    def experiment_id(self, name: str) -> str:
        self._call()
        return f"exp-{name}"

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        self._call()
        return None

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str], start_time: float) -> str:
        self._call()
        return f"run-{self.calls}"

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        self._call()

    def log_steps(self, run_id: str, points: list[StepPoint]) -> None:
        self._call()
        self.steps_received += len(points)

    def end_run(self, run_id: str, status: str, tags: dict[str, str], artifacts: dict[str, bytes]) -> None:
        self._call()


def step_payload(step: int) -> dict[str, Any]:
    """A step event's payload as the engine reports it (every metric, an eval loss every 10th step)."""
    return StepReport(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=1024, tokens_per_second=5e4, mfu=None,
                      step_time_seconds=0.02, breakdown={"data": 1e-4, "forward_backward": 0.015, "optimizer": 0.004},
                      peak_memory_bytes=2**28, eval_loss=1.9 if step % 10 == 0 else None).to_dict()


def tracker_once(peer: str, calls: int, block_seconds: float, data_dir: Path) -> dict[str, Any]:
    """Time `calls` calls of `JobTracker.step` for one job in one peer (a fresh tracker, store and job)."""
    store = JobStore(data_dir / peer)
    server = FakeMlflow(peer, block_seconds)
    try:
        record, _ = store.create_job(TrainingJob.model_validate({"metadata": {"name": f"bench-{peer}"}, "spec": {}}))
        policy = TrackingPolicy(default_uri=None if peer == "untracked" else MLFLOW_URI)
        sink = None if peer == "untracked" else MlflowSink(
            lambda job_id, level, message, extra: store.append_event(job_id, st.EVENT_LOG, {"level": level, "message": message}),
            lambda _sweep: None, api_for=lambda _uri: server,
        )
        tracker = JobTracker(policy, store, mlflow=sink).start()
        grid = partial(RankGrid.from_spec, record.job.spec.parallelism)
        try:
            tracker.running(record, grid)
            if peer == "blocking" and not server.in_call.wait(5.0):
                raise SystemExit("the blocking fake server was never called")
            seconds, during_server_call = [], 0
            for step in range(1, calls + 1):
                payload = step_payload(step)
                hung = server.in_call.is_set()
                started = time.perf_counter_ns()
                tracker.step(record, grid, payload, time.time())
                seconds.append((time.perf_counter_ns() - started) / 1e9)
                during_server_call += hung and server.in_call.is_set()
            received_by_last_call = server.steps_received
        finally:
            tracker.close()
    finally:
        store.close()
    return {"seconds": seconds, "calls_while_the_server_hung": during_server_call,
            "steps_received_by_last_call": received_by_last_call, "server_calls": server.calls}


def tracker_bench(args: argparse.Namespace) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {peer: [] for peer in TRACKER_PEERS}
    per_run: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="eval-cost-tracker-") as directory:
        for repeat in range(args.repeats):
            for peer in TRACKER_PEERS:
                data_dir = Path(directory) / f"r{repeat}"
                data_dir.mkdir(exist_ok=True)
                run = tracker_once(peer, args.tracker_calls, args.block_seconds, data_dir)
                calls = run.pop("seconds")
                seconds[peer].extend(calls)
                per_run.append({"repeat": repeat + 1, "peer": peer, **run})
                print(f"repeat {repeat + 1} tracker {peer:9s}: median {statistics.median(calls) * 1e6:.1f} us, "
                      f"max {max(calls) * 1e3:.2f} ms, server calls {run['server_calls']}", flush=True)
    floor = statistics.median(seconds["untracked"])
    peers = {}
    for peer, values in seconds.items():
        ordered = sorted(values)
        peers[peer] = {
            "calls": len(values), "median_us": statistics.median(values) * 1e6, "mean_us": statistics.mean(values) * 1e6,
            "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6, "max_ms": ordered[-1] * 1e3,
            "median_over_untracked": statistics.median(values) / floor,
        }
    return {"calls_per_run": args.tracker_calls, "block_seconds": args.block_seconds, "peers": peers, "per_run": per_run}


# ---- the script ---------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few steps and calls, one repeat (seconds)")
    parser.add_argument("--model", default="debug")
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tracker-calls", type=int, default=2000)
    parser.add_argument("--block-seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help=f"write the results here (full mode default: {RESULTS.name})")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.interval, args.repeats, args.tracker_calls = 8, 3, 1, 200
    target = args.json or (None if args.smoke else RESULTS)
    payload: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, torch {torch.__version__}, gloo",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model, "ranks": args.ranks, "steps": args.steps, "interval": args.interval,
        "repeats": args.repeats, "warmup_steps": WARMUP_STEPS,
    }
    started = time.perf_counter()
    payload["tracker"] = tracker = tracker_bench(args)
    write(target, payload)
    payload["engine"] = engine = engine_bench(args)
    payload["seconds"] = time.perf_counter() - started
    write(target, payload)
    for mode, row in engine["modes"].items():
        line = (f"{mode:6s} step {row['step_median_s'] * 1e3:.1f} ms ({row['step_over_none']:.3f} of none), "
                f"data wait {row['data_wait_median_s'] * 1e6:.0f} us, fwd+bwd {row['forward_backward_median_s'] * 1e3:.1f} ms")
        if "evaluation_median_s" in row:
            line += (f"; evaluation {row['evaluation_median_s'] * 1e3:.1f} ms = {row['evaluation_over_step']:.2f} steps "
                     f"({row['evaluation_per_batch_over_step']:.2f} per batch, {row['evaluation_spread_over_interval']:.3f} "
                     f"spread over the interval); eval forward / train fwd+bwd {row['eval_forward_over_train_forward_backward']:.2f}")
        print(line)
    for peer, row in tracker["peers"].items():
        print(f"tracker {peer:9s}: median {row['median_us']:.1f} us, p99 {row['p99_us']:.1f} us, max {row['max_ms']:.2f} ms")


def write(target: Path | None, payload: dict[str, Any]) -> None:
    """Write the results so far (the tracker's first, so a failed engine run keeps them)."""
    if target is not None:
        target.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
