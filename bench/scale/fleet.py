"""Control path at fleet scale (issue 38): admission, placement, GetCluster and a Prometheus scrape on
simulated fleets of 128 to 1,024 nodes x 8 GPUs at 70 % occupancy.

Each fleet is `rail_optimized_fleet(nodes)` (HGX nodes, 32-node scalable units, 8 rails, leaf/spine)
fragmented to 70 % by bench/placement/run.py's `fragment`; the busy GPUs are split among 200 RUNNING
jobs of four tenants, written to a real SQLite `JobStore` with their placements and reserved in the
`GpuPool` the service builds. 1,000 QUEUED jobs follow: 24 at priority 5 that fit (1-16 GPUs; a
quarter from a tenant whose quota holds them), one at priority 4 asking for the whole fleet (it never
fits, so it blocks the rest), 975 mixed at priority 0. Measured with the product's code, in process:

- admission: one `Admission.admit()` pass, built as `Scheduler` builds it (`Admission(state,
  Launcher(state), Preemption(state))` on the scheduler's state); the admitted jobs are re-queued after each pass, so
  every repetition is the same pass;
- placement: `GpuPool.place` (what admission calls: the solver with the admission budget) of one job
  of an eighth of the fleet (tp8 pp4 dp*, llama3-8b): 1,024 GPUs on the 1,024-node fleet;
- GetCluster: `TrainingServicer.GetCluster` (servicer built as trainctl/service/server.py builds it)
  for an admin and for a tenant's user, plus serialising the answer;
- scrape: GET /metrics from the real exporter (`start_metrics_server`) of a `ServiceMetrics` whose
  inventory is `Scheduler`'s export and whose 200 jobs have each reported 10 steps (and then 10 more:
  no family may grow with steps).

Ray is replaced by `FleetRuntime` only where the scheduler calls it: every node alive, `start_job`
recorded. Each figure is the median and p95 of the repetitions; the growth law is the slope of a
least-squares line through (log nodes, log median).

    .venv/bin/python bench/scale/fleet.py            # 128, 256, 512, 1,024 nodes, each run twice
    .venv/bin/python bench/scale/fleet.py --quick    # 128 and 256 nodes once, fewer repetitions (< 1 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "placement"))

from run import fragment  # noqa: E402  (bench/placement/run.py: the fragmented fleets of the placement bench)

from trainctl.parallelism.engine.step_report import StepReport  # noqa: E402
from trainctl.parallelism.resolved_job import ResolvedJob  # noqa: E402
from trainctl.planning.pool import GpuPool, PlannedPlacement  # noqa: E402
from trainctl.service.api.servicer import TrainingServicer  # noqa: E402
from trainctl.service.capacity.preemption import Preemption  # noqa: E402
from trainctl.service.metrics import ServiceMetrics, start_metrics_server  # noqa: E402
from trainctl.service.scheduling.admission import Admission  # noqa: E402
from trainctl.service.scheduling.launching import Launcher  # noqa: E402
from trainctl.service.scheduling.scheduler import Scheduler  # noqa: E402
from trainctl.service.security.auth import Authenticator  # noqa: E402
from trainctl.service.security.tenancy import ANONYMOUS, Principal, Quota  # noqa: E402
from trainctl.service.server import settle_heap_for_serving  # noqa: E402
from trainctl.service.store import JobStore  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.v1 import training_pb2 as pb  # noqa: E402
from trainctl.wire.tokens import Role  # noqa: E402
from trainctl.workers.events import JobState  # noqa: E402
from trainctl.workers.placement.plan import RankAssignment  # noqa: E402
from trainctl.workers.placement.solver import place_job  # noqa: E402
from trainctl.workers.topology.builders import rail_optimized_fleet  # noqa: E402

SIZES = (128, 256, 512, 1024)
OCCUPANCY = 0.7
QUEUED = 1000
RUNNING = 200
TENANTS = ("t0", "t1", "t2", "t3")
HELD_TENANT = "t3"
"""Its quota allows no more GPUs than its running jobs hold: its queued jobs wait for the quota."""
FITTING_SIZES = (1, 2, 4, 8, 16)
MIXED_SIZES = (1, 8, 16, 64, 256, 1024)
STEPS = 10
GOALS_S = {"admission": 1.0, "placement": 2.0, "get_cluster_admin": 0.1, "get_cluster_user": 0.1, "scrape": 1.0}
EXTRAPOLATE_NODES = 2048
"""16,384 GPUs."""
OUT = Path(__file__).resolve().parent / "results-fleet.json"


@dataclass
class FleetRuntime:
    """The part of trainctl.workers.runtime.RayRuntime the admission pass calls, on the simulated fleet:
    every node alive; a started job is only recorded."""

    nodes: frozenset[str]
    started: list[str] = field(default_factory=list)

    def live_nodes(self) -> set[str]:
        return set(self.nodes)

    def start_job(self, job_id: str, *_args: Any, **_kwargs: Any) -> None:
        self.started.append(job_id)


@dataclass
class Fleet:
    """One simulated fleet at 70 %: its pool, store, metrics and the scheduler parts over them."""

    nodes: int
    pool: GpuPool
    store: JobStore
    metrics: ServiceMetrics
    registry: CollectorRegistry
    scheduler: Scheduler
    runtime: FleetRuntime
    running: dict[str, str]
    """Running job id -> tenant."""


def job_spec(name: str, gpus: int, priority: int) -> TrainingJob:
    """A job of `gpus` ranks: tp8 pp4 dp* (llama3-8b) for a multiple of 32 GPUs, else dp_shard (llama-1b)."""
    if gpus % 32 == 0:
        model, layout = "llama3-8b", {"tp": 8, "pp": 4, "dp_shard": gpus // 32}
    else:
        model, layout = "llama-1b", {"dp_shard": gpus}
    return TrainingJob.model_validate({
        "metadata": {"name": name},
        "spec": {"model": {"preset": model}, "parallelism": layout, "resources": {"gpus": gpus},
                 "scheduling": {"priority": priority}},
    })


def build_fleet(nodes: int, work: Path, seed: int) -> Fleet:
    topology = rail_optimized_fleet(nodes)
    pool = GpuPool(topology, f"simulated rail-optimised {nodes} x 8")
    index = pool.index
    free = fragment(index, OCCUPANCY, random.Random(seed))
    busy = [
        (index.node_names[n], g) for n, gpus in enumerate(index.node_gpus) for g in gpus if g not in free.get(n, ())
    ]
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, version="bench")
    store = JobStore(work / f"store-{nodes}-{seed}", metrics=metrics)
    held_gpus = 0
    running: dict[str, str] = {}
    for i in range(RUNNING):
        slots = busy[i * len(busy) // RUNNING:(i + 1) * len(busy) // RUNNING]
        tenant = TENANTS[i % len(TENANTS)]
        record, _ = store.create_job(job_spec(f"running-{i}", len(slots), 0), tenant=tenant)
        placement = PlannedPlacement(assignments=tuple(
            RankAssignment(rank=r, node=node, gpu=gpu) for r, (node, gpu) in enumerate(slots)
        ))
        store.update_status(record.id, state=JobState.RUNNING, reason="running", placement=placement.records())
        pool.reserve(record.id, placement)
        running[record.id] = tenant
        held_gpus += len(slots) if tenant == HELD_TENANT else 0
    for i in range(24):
        tenant = TENANTS[i % len(TENANTS)]
        store.create_job(job_spec(f"fits-{i}", FITTING_SIZES[i % len(FITTING_SIZES)], 5), tenant=tenant)
    store.create_job(job_spec("whole-fleet", pool.total, 4), tenant=TENANTS[0])
    rng = random.Random(seed)
    for i in range(QUEUED - 25):
        store.create_job(job_spec(f"mixed-{i}", rng.choice(MIXED_SIZES), 0), tenant=rng.choice(TENANTS))
    quotas = {HELD_TENANT: Quota(running_gpus=held_gpus)}
    runtime = FleetRuntime(frozenset(index.node_names))
    scheduler = Scheduler(store, pool, runtime, work / "runs", metrics=metrics,
                          quota_of=lambda tenant: quotas.get(tenant, Quota()))
    return Fleet(nodes, pool, store, metrics, registry, scheduler, runtime, running)


Sample = tuple[float, float]
"""(wall seconds, this process's CPU seconds, all its threads) of one call."""


def timed(fn: Callable[[], Any]) -> Sample:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def summary(samples: list[Sample]) -> dict[str, Any]:
    """Median and p95 of the wall times, and the median CPU time (the figure a loaded machine inflates least)."""
    ordered = sorted(wall for wall, _ in samples)
    return {
        "median_s": statistics.median(ordered),
        "p95_s": ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)],
        "cpu_median_s": statistics.median(cpu for _, cpu in samples),
        "samples_s": [round(s, 6) for s in ordered],
    }


def measure_admission(fleet: Fleet, reps: int) -> dict[str, Any]:
    """`reps` identical passes (the admitted jobs go back to QUEUED after each); the first pass (which
    writes every waiting reason and resolves the jobs it meets) is reported apart."""
    state = fleet.scheduler.state
    admission = Admission(state, Launcher(state), Preemption(state))  # as Scheduler.__init__ builds it

    def requeue() -> int:
        admitted = [job_id for job_id in state.active if job_id not in fleet.running]
        for job_id in admitted:
            fleet.pool.release(job_id)
            del state.active[job_id]
            fleet.store.update_status(job_id, expect=[JobState.SCHEDULED], state=JobState.QUEUED, reason="re-queued")
            fleet.metrics.forget_job(job_id)
        return len(admitted)

    first, _ = timed(admission.admit)
    admitted = requeue()
    samples: list[Sample] = []
    solver_s = []
    for _ in range(reps):
        before = solver_sum(fleet.registry)
        samples.append(timed(admission.admit))
        solver_s.append(solver_sum(fleet.registry) - before)
        requeue()
    return {**summary(samples), "first_pass_s": first, "admitted_per_pass": admitted,
            "solver_median_s": statistics.median(solver_s)}


def solver_sum(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("trainctl_placement_solver_duration_seconds_sum") or 0.0


def measure_placement(fleet: Fleet, reps: int) -> dict[str, Any]:
    """`GpuPool.place` of a job of an eighth of the fleet on the fragmented fleet; also the solver alone
    (`place_job` given the free GPUs), so the pool's share shows."""
    gpus = fleet.pool.total // 8
    job = ResolvedJob.resolve(job_spec("big", gpus, 0).spec)
    free: dict[str, set[int]] = {}
    for node, gpu in fleet.pool.free_slots():
        free.setdefault(node, set()).add(gpu)
    placed = fleet.pool.place(job)
    samples = [timed(lambda: fleet.pool.place(job)) for _ in range(reps)]
    solver_only = [
        timed(lambda: place_job(job, fleet.pool.topology, free, fleet.pool.solver_budget_s, index=fleet.pool.index))[0]
        for _ in range(reps)
    ]
    return {**summary(samples), "job_gpus": gpus, "placed": placed is not None,
            "solver_median_s": statistics.median(solver_only), "budget_s": fleet.pool.solver_budget_s}


def measure_get_cluster(fleet: Fleet, reps: int) -> dict[str, Any]:
    """GetCluster in process on the servicer the service builds, answer serialised, as admin and user."""
    pool, store = fleet.pool, fleet.store
    alive = dict.fromkeys(pool.index.node_names, True)
    servicer = TrainingServicer(store, fleet.scheduler, pool, Authenticator.from_file(None), ray_nodes=lambda: alive)
    user = Principal(name="bench", tenant=TENANTS[0], role=Role.USER)
    mine = {job_id for job_id, tenant in fleet.running.items() if tenant == user.tenant}
    expected = {"admin": set(fleet.running), "user": mine | {"(another tenant)"}}
    out: dict[str, Any] = {}
    for who, principal in (("admin", ANONYMOUS), ("user", user)):
        answer = servicer.GetCluster(pb.GetClusterRequest(), principal)
        shown = {gpu.job_id for node in answer.nodes for gpu in node.gpus if gpu.job_id}
        if shown != expected[who]:
            raise AssertionError(f"GetCluster for the {who} shows holders {sorted(shown)[:5]}..., not the expected ones")
        samples = [timed(lambda p=principal: servicer.GetCluster(pb.GetClusterRequest(), p).SerializeToString())
                   for _ in range(reps)]
        out[who] = {**summary(samples), "bytes": answer.ByteSize(), "used_gpus": answer.used_gpus}
    return out


def report_steps(fleet: Fleet, first: int, last: int) -> None:
    for job_id, tenant in fleet.running.items():
        for step in range(first, last + 1):
            fleet.metrics.record_step(job_id, tenant, StepReport(
                step=step, loss=2.0, grad_norm=1.0, lr=3e-4, tokens=8192, tokens_per_second=1e5, mfu=0.4,
                step_time_seconds=0.5, breakdown={"data": 0.01, "forward_backward": 0.4, "optimizer": 0.09},
                peak_memory_bytes=1 << 34,
            ))


def series_by_family(text: str) -> dict[str, int]:
    return {family.name: len(family.samples) for family in text_string_to_metric_families(text)}


def measure_scrape(fleet: Fleet, reps: int) -> dict[str, Any]:
    """The exporter over HTTP with the fleet's inventory (`Scheduler`'s export) and 200 jobs' placements
    and step reports; series per family after STEPS steps and after twice as many must be equal."""
    state = fleet.scheduler.state
    for job_id, tenant in fleet.running.items():
        fleet.metrics.set_job_state(job_id, tenant, JobState.RUNNING)
        placement = PlannedPlacement.from_records(fleet.store.get_job(job_id).placement)
        fleet.metrics.set_job_placement(job_id, tenant, state.by_domain(placement))
    fleet.scheduler._export()  # the gauges a tick refreshes: queue, jobs by state, GPU inventory
    report_steps(fleet, 1, STEPS)
    server = start_metrics_server(fleet.registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        def scrape() -> bytes:
            with urllib.request.urlopen(url, timeout=30) as answer:
                return answer.read()

        body = scrape()
        samples = [timed(scrape) for _ in range(reps)]
        before = series_by_family(body.decode())
        report_steps(fleet, STEPS + 1, 2 * STEPS)
        after = series_by_family(scrape().decode())
    finally:
        server.close()
    grew = {name: (before.get(name, 0), count) for name, count in after.items() if count != before.get(name, 0)}
    return {**summary(samples), "bytes": len(body), "series": sum(after.values()), "series_by_family": after,
            "grew_with_steps": grew, "bounded": not grew}


def growth(sizes: list[int], medians: list[float]) -> dict[str, Any]:
    """Slope of log(median) on log(nodes), its law, and the median extrapolated to EXTRAPOLATE_NODES."""
    xs, ys = [math.log(n) for n in sizes], [math.log(max(m, 1e-9)) for m in medians]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    law = "constant" if slope < 0.25 else "sub-linear (log-like)" if slope < 0.75 else "linear" if slope < 1.3 else f"super-linear (~N^{slope:.1f})"
    largest = max(sizes)
    at = medians[sizes.index(largest)] * (EXTRAPOLATE_NODES / largest) ** max(slope, 0.0)
    return {"exponent": round(slope, 3), "law": law, f"extrapolated_{EXTRAPOLATE_NODES}_nodes_s": at}


DEFAULT_GC_THRESHOLD = gc.get_threshold()
"""The collector's thresholds this process started with (restored after each size)."""


def measure(nodes: int, reps: int, seed: int, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    fleet = build_fleet(nodes, work, seed)
    built = time.perf_counter() - started
    # The garbage collector set as `trainctl serve` sets it once it serves (start-up's objects frozen out of
    # full collections, fewer of them); undone after the size, so the next one starts as a new process would.
    settle_heap_for_serving()
    try:
        row = {
            "nodes": nodes, "gpus": fleet.pool.total, "free_gpus": fleet.pool.free_count, "seed": seed,
            "setup_s": round(built, 2),
            "admission": measure_admission(fleet, reps),
            "placement": measure_placement(fleet, max(3, reps // 2)),
            "get_cluster": measure_get_cluster(fleet, reps),
            "scrape": measure_scrape(fleet, reps),
        }
    finally:
        gc.unfreeze()
        gc.set_threshold(*DEFAULT_GC_THRESHOLD)
    fleet.store.close()
    return row


FIGURES: dict[str, tuple[str, ...]] = {
    "admission": ("admission",),
    "placement": ("placement",),
    "get_cluster_admin": ("get_cluster", "admin"),
    "get_cluster_user": ("get_cluster", "user"),
    "scrape": ("scrape",),
}
"""Figure -> where its summary sits in a row."""


def stat(row: dict[str, Any], figure: str, key: str = "median_s") -> float:
    for part in FIGURES[figure]:
        row = row[part]
    return row[key]


def laws(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the growth law over the sizes, of the wall and of the CPU medians (the lowest of each
    size's runs: the one the machine's load disturbed least)."""
    sizes = sorted({r["nodes"] for r in rows})
    if len(sizes) < 2:
        return {}
    out = {}
    for figure in FIGURES:
        wall = [min(stat(r, figure) for r in rows if r["nodes"] == n) for n in sizes]
        cpu = [min(stat(r, figure, "cpu_median_s") for r in rows if r["nodes"] == n) for n in sizes]
        out[figure] = {"wall": growth(sizes, wall), "cpu": growth(sizes, cpu), "goal_s": GOALS_S[figure]}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size and run, each figure's wall median / p95 / CPU median in ms."""
    lines = [
        "| nodes x 8 | run | admission pass | placement (GPUs) | GetCluster admin | GetCluster user | scrape (series) |",
        "|---|---|---|---|---|---|---|",
    ]
    runs: Counter[int] = Counter()
    for r in rows:
        runs[r["nodes"]] += 1
        cells = [
            " / ".join(f"{stat(r, f, key) * 1e3:.1f}" for key in ("median_s", "p95_s", "cpu_median_s")) for f in FIGURES
        ]
        cells[1] += f" ({r['placement']['job_gpus']})"
        cells[4] += f" ({r['scrape']['series']})"
        lines.append(f"| {r['nodes']} | {runs[r['nodes']]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "trainctl"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "git_commit": commit, "trainctl_tree_dirty": dirty,
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 and 256 nodes, one run each, 3 repetitions")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="override the node counts")
    parser.add_argument("--runs", type=int, default=None, help="runs per size (default 2; 1 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 7; 3 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help=f"results file (default {OUT.name}; none with --quick)")
    parser.add_argument("--summarise", type=Path, default=None, help="only print the table and laws of a results file")
    args = parser.parse_args()
    if args.summarise:
        return report(json.loads(args.summarise.read_text()))
    sizes = args.sizes or ([128, 256] if args.quick else list(SIZES))
    runs = args.runs or (1 if args.quick else 2)
    reps = args.reps or (3 if args.quick else 7)
    out = args.out or (None if args.quick else OUT)
    started_at = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tc-fleet-") as tmp:
        for run in range(runs):
            for nodes in sizes:
                rows.append(measure(nodes, reps, seed=run, work=Path(tmp)))
                r = rows[-1]
                print(f"{nodes} nodes run {run + 1}: " + ", ".join(f"{f} {stat(r, f) * 1e3:.1f} ms" for f in FIGURES),
                      file=sys.stderr, flush=True)
    result = {**started_at, "load_average_after": os.getloadavg(), "occupancy": OCCUPANCY, "queued_jobs": QUEUED,
              "running_jobs": RUNNING, "repetitions": reps, "goals_s": GOALS_S, "rows": rows, "laws": laws(rows)}
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return report(result)


def report(result: dict[str, Any]) -> int:
    """Print the table and the laws; 1 when a metric family grew with steps."""
    rows = result["rows"]
    print(table(rows))
    at = f"extrapolated_{EXTRAPOLATE_NODES}_nodes_s"
    for figure, law in result["laws"].items():
        print(f"{figure}: wall exponent {law['wall']['exponent']} ({law['wall']['law']}), {law['wall'][at] * 1e3:.1f} ms "
              f"at {EXTRAPOLATE_NODES} nodes; CPU exponent {law['cpu']['exponent']} ({law['cpu']['law']}), "
              f"{law['cpu'][at] * 1e3:.1f} ms; goal {law['goal_s']} s")
    unbounded = [r["nodes"] for r in rows if not r["scrape"]["bounded"]]
    print(f"series growing with steps: {unbounded or 'none'}")
    return 1 if unbounded else 0

if __name__ == "__main__":
    raise SystemExit(main())
