"""Per-step overhead of training through the service vs the same loop under plain torchrun.

One job spec (a small Llama preset, 2 data-parallel ranks on CPU with gloo) runs, in alternating
trials, (1) under ``torchrun --nproc-per-node 2 -m trainctl.parallelism.launch job.yaml
--metrics-jsonl steps.jsonl`` and (2) through the service: CreateJob on a service backed by an
embedded Ray on loopback, watched to SUCCEEDED, its per-step metrics read back with GetJob (the
RankWorkers report every step to the job's supervisor, which records a STEP event; the service
stores it). Both sides run `trainctl.parallelism.engine.trainer.Trainer` with the same spec, both write a
checkpoint at the last step, both use one torch thread per rank, and torchrun runs while the
embedded Ray is up, so the background load of Ray's own processes is the same for both.

Two per-step figures, over the steady-state steps (the first ``--warmup`` steps and the last step,
which saves the final checkpoint, are excluded):

- *step time*: ``StepReport.step_time_seconds``, measured by the Trainer around one step on rank 0
  (data, forward/backward, optimizer). It shows what the rank's environment costs the loop: a Ray
  worker's extra threads, contention with the supervisor or the service.
- *step period*: the time between consecutive step reports (torchrun: the launcher's wall time of
  each report; service: the supervisor's wall time of each STEP event). It also contains what the
  loop does between steps, the step report RPC to the supervisor included.

Per trial pair the ratio service / torchrun of each figure's median; reported: the median of those
ratios (target: the period ratio at most 1.05) and the pooled medians.

    .venv/bin/python bench/engine/service_overhead.py --trials 3 --out bench/engine/results-service-overhead.json
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun and Ray both default to 1 here; make it explicit

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

from trainctl.cli.client import TrainctlClient  # noqa: E402
from trainctl.service.server import Service, ServiceConfig  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.v1 import training_pb2 as pb  # noqa: E402
from trainctl.workers.embedded import start_embedded  # noqa: E402

VENV_BIN = Path(sys.executable).parent
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
ROLES = (  # first match of a process's command line; the script's own process is "service + client"
    ("torchrun agent", ("bin/torchrun",)),
    ("ranks", ("ray::RankWorker", "trainctl.parallelism.launch")),
    ("supervisor", ("ray::JobSupervisor",)),
    ("other ray workers", ("ray::", "default_worker.py")),  # idle workers, or an actor not yet renamed
    ("ray daemons", ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent")),
)


def _role(pid: int, cmdline: str) -> str:
    if pid == os.getpid():
        return "service + client"
    return next((role for role, keys in ROLES if any(k in cmdline for k in keys)), "other")


class CpuSampler:
    """Samples the CPU seconds (user + system) of this process and all its descendants every
    ``interval`` seconds, so the CPU each role used inside a time window can be read afterwards
    (processes that exit later keep their samples)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.time(), self._snapshot()))

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            pid = int(entry.name)
            parents[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICK
        mine, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
            mine.update(children)
            frontier.extend(children)
        out = {}
        for pid in mine:
            if pid not in self._roles or self._roles[pid] == "other ray workers":  # Ray renames actor processes
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                self._roles[pid] = _role(pid, cmdline)
            out[pid] = (self._roles[pid], cpu[pid])
        return out

    def by_role(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per role between the last sample before ``start`` and the first after ``end``."""
        before = [s for t, s in self.samples if t <= start]
        after = [s for t, s in self.samples if t >= end]
        if not before or not after:
            return {}
        first, last = before[-1], after[0]
        used: dict[str, float] = {}
        for pid, (role, seconds) in last.items():
            used[role] = used.get(role, 0.0) + seconds - (first[pid][1] if pid in first else 0.0)
        return used


def job_spec(preset: str, steps: int, seq_len: int) -> dict[str, Any]:
    """The job both sides run: 2 FSDP ranks on CPU, a report every step, a checkpoint at the end only."""
    return {
        "apiVersion": "trainctl/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "service-overhead"},
        "spec": {
            "model": {"preset": preset},
            "data": {"seq_len": seq_len, "max_files": 20},
            "parallelism": {"dp_shard": 2},
            "training": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "warmup_steps": 2},
            "checkpoint": {"interval_steps": 0},
            "resources": {"gpus": 2, "device": "cpu"},
            "scheduling": {"max_restarts": 0},
        },
    }


def steady(steps: list[dict[str, Any]], warmup: int, sampler: CpuSampler) -> dict[str, Any]:
    """Step times and step periods of the steady-state steps (after ``warmup``, before the last), and
    the CPU seconds per step each role used over them."""
    steps = sorted(steps, key=lambda s: s["step"])
    last = steps[-1]["step"]
    keep = [s for s in steps if warmup < s["step"] < last]
    by_step = {s["step"]: s for s in steps}
    periods = [s["time"] - by_step[s["step"] - 1]["time"] for s in keep if s["step"] - 1 in by_step]
    window = (by_step[warmup]["time"], keep[-1]["time"])
    cpu = {role: seconds / len(keep) for role, seconds in sampler.by_role(*window).items()}
    return {"step_time": [s["step_time_seconds"] for s in keep], "period": periods, "cpu_seconds_per_step": cpu}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_trial(spec: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """Run the job under torchrun; rank 0's step reports from --metrics-jsonl."""
    trial = Path(tempfile.mkdtemp(prefix="torchrun-", dir=workdir))
    job_file = trial / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec))
    metrics = trial / "steps.jsonl"
    done = subprocess.run(
        [str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trainctl.parallelism.launch", str(job_file),
         "--checkpoint-dir", str(trial / "checkpoints"), "--metrics-jsonl", str(metrics)],
        capture_output=True, text=True, timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def service_trial(client: TrainctlClient, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the job through the service; its recorded step metrics (time = the supervisor's)."""
    created = client.create_job(TrainingJob.model_validate(spec))
    for _ in client.watch(created.id):
        pass
    job = client.get_job(created.id, full=True)
    if job.status.state != pb.SUCCEEDED:
        raise RuntimeError(f"job {created.id} ended {pb.JobState.Name(job.status.state)}: {job.status.reason}")
    return [
        {"step": m.step, "step_time_seconds": m.step_time_seconds, "time": m.time.ToNanoseconds() / 1e9}
        for m in job.metrics
    ]


def summarise(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_seconds_per_step": {}}
    for side in ("torchrun", "service"):
        roles = sorted({role for p in pairs for role in p[side]["cpu_seconds_per_step"]})
        out["cpu_seconds_per_step"][side] = {
            role: statistics.median(p[side]["cpu_seconds_per_step"].get(role, 0.0) for p in pairs) for role in roles
        }
    for figure in ("step_time", "period"):
        ratios = [
            statistics.median(p["service"][figure]) / statistics.median(p["torchrun"][figure]) for p in pairs
        ]
        pooled = {side: statistics.median(v for p in pairs for v in p[side][figure]) for side in ("torchrun", "service")}
        out[figure] = {
            "torchrun_median_ms": 1000 * pooled["torchrun"],
            "service_median_ms": 1000 * pooled["service"],
            "pooled_ratio": pooled["service"] / pooled["torchrun"],
            "pair_ratios": ratios,
            "median_pair_ratio": statistics.median(ratios),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="trial pairs (torchrun, service), alternating")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the statistics")
    parser.add_argument("--out", type=Path, help="write the raw steps and the summary as JSON here")
    args = parser.parse_args()
    if args.steps < args.warmup + 3:
        parser.error("--steps must leave at least 2 steady-state steps after --warmup (the last is excluded)")
    spec = job_spec(args.preset, args.steps, args.seq_len)
    workdir = Path(tempfile.mkdtemp(prefix="trainctl-bench-overhead-"))
    cluster = start_embedded(1, 2, head_cpus=2)
    pairs: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    started = time.time()
    try:
        config = ServiceConfig(address="127.0.0.1:0", data_dir=workdir / "service", metrics_port=0, ray_address=cluster.address)
        with (
            Service(config, topology=cluster.topology) as service,
            TrainctlClient(service.target) as client,
            CpuSampler() as sampler,
        ):
            for trial in range(args.trials):
                order = ("torchrun", "service") if trial % 2 == 0 else ("service", "torchrun")
                steps: dict[str, list[dict[str, Any]]] = {}
                for side in order:
                    steps[side] = torchrun_trial(spec, workdir) if side == "torchrun" else service_trial(client, spec)
                pair = {side: steady(steps[side], args.warmup, sampler) for side in ("torchrun", "service")}
                pairs.append(pair)
                raw.append({side: [[r["step"], r["step_time_seconds"], r["time"]] for r in rows] for side, rows in steps.items()})
                line = ", ".join(
                    f"{side} step {1000 * statistics.median(pair[side]['step_time']):.1f} ms "
                    f"period {1000 * statistics.median(pair[side]['period']):.1f} ms"
                    for side in ("torchrun", "service")
                )
                print(f"trial {trial} ({' then '.join(order)}): {line}", flush=True)
                for side in ("torchrun", "service"):
                    cpu = ", ".join(f"{r} {1000 * v:.0f}" for r, v in sorted(pair[side]["cpu_seconds_per_step"].items()))
                    print(f"  {side} CPU ms per step: {cpu}", flush=True)
    finally:
        cluster.shutdown()
    load = os.getloadavg()
    result = {
        "job": spec,
        "trials": args.trials,
        "warmup_steps_excluded": args.warmup,
        "wall_seconds": time.time() - started,
        "load_average_at_end": load,
        "summary": summarise(pairs),
        "steps": raw,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "job")}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1)
        steps_json = ",\n  ".join(json.dumps(pair) for pair in raw)
        args.out.write_text(f'{head[:-2]},\n "steps_columns": ["step", "step_time_seconds", "time"],\n "steps": [\n  {steps_json}\n ]\n}}\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
