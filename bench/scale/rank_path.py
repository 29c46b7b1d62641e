"""The rank-side control path at 512 to 4,096 ranks (issue 38): what a job's supervisor pays per step for its
ranks' reports, how long a rank's step report takes to become a STEP event a watching client sees, what
detecting a dead rank and starting the next generation cost trainctl, and the supervisor's memory per rank.

    .venv/bin/python bench/scale/rank_path.py                   # 512, 1,024, 2,048, 4,096 ranks, 1 s steps (~17 min)
    .venv/bin/python bench/scale/rank_path.py --quick           # 512 and 1,024 ranks, a 20 s interval (~3 min)
    .venv/bin/python bench/scale/rank_path.py --mode batched    # step times batched per rank, not relayed per node
    .venv/bin/python bench/scale/rank_path.py --mode per-rank   # step times sent as before issue 38's fix
    .venv/bin/python bench/scale/rank_path.py --mode rank0-only # the supervisor without the other ranks' calls

What runs is the product's: the real `JobSupervisor` class as a Ray actor created the way
`RayRuntime.start_job` creates it (its ``control`` and ``reports`` concurrency groups, num_cpus=0), with its
event log in a real run directory, its ``_supervise`` loop, ``_watch`` (a `ray.wait` over one result ref per
rank), root cause and restart decision, and its ``record_step`` / ``record_step_times`` / ``record_log``.
Only the rank group is simulated (`BenchSupervisor._run_generation`, the rest of the generation as the
product runs it): a few `RankSimulator` actors (plain Python, no torch) each host the ranks of up to 128
simulated 8-GPU nodes. Each simulated rank answers its ``location`` and ``run_rank`` (a `RankWorker.train`
stand-in that returns when its generation ends) calls as a RankWorker does and, at every step boundary (all
ranks in lockstep on the machine's clock), sends what `RankWorker.train`'s callbacks send: rank 0 a full
StepReport (``record_step``) and a log line every ``--log-every`` steps, every other rank its step time
through the product's `StepTimeBatcher` to its node's relay rank, whose `StepTimeRelay` sends the node's
batches in one ``record_step_times`` call (``--mode per-node``, the product's path; the relay is an in-process
call where the product makes a Ray call between two processes of a node, a cost of the ranks, not the
supervisor's), or each rank's batches in calls of their own (``--mode batched``, the path before per-node
relays), or one call per rank per step (``--mode per-rank``, the path before batching). One rank (the last) runs alone
in its own simulator; killing that process is the dead rank (the next generation runs it in another).

Per size: the supervisor's CPU (utime + stime of its process from /proc over ``--window`` steps, by default
one batching ``--interval`` so every rank's batch falls in it once, divided by the steps; also per thread;
the figure load disturbs least), the CPU of one `ray.wait` of `_watch`, its RSS, the delay from rank 0's ``record_step`` call to the
STEP event at a client polling the supervisor every 0.2 s (the service's scheduler tick, `Following`), and,
after the kill, the times from the kill to ``_watch`` returning (Ray's death notice plus trainctl's wait),
to the RESTARTING event (trainctl's root cause and decision) and to the next generation's RUNNING event
(trainctl's part of a new generation: plan check, N location calls, the PLACEMENT event, N run calls;
Ray's placement group and actor creation are measured apart, below). Also in-process: tracemalloc of the
supervisor's `StepStats` holding its 16 steps of N ranks' times.

Ray's own part of a new generation (`ray_part`): one placement group of k bundles and k light actors (no
torch) in it, created, pinged and removed, at the largest k this 2-core machine allows; fitted linearly; and
(`placement_group_part`) a placement group of up to thousands of tiny bundles alone, reserved and removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray: bind 127.0.0.1 only

import ray  # noqa: E402

from trainctl.parallelism.run_directory import RunDirectory  # noqa: E402
from trainctl.spec.job import TrainingJob  # noqa: E402
from trainctl.workers import step_stats, step_time_sending  # noqa: E402
from trainctl.workers.events import EventKind, JobState  # noqa: E402
from trainctl.workers.placement.plan import RankAssignment  # noqa: E402
from trainctl.workers.rank_group import check_slots  # noqa: E402
from trainctl.workers.rank_worker import RankLocation  # noqa: E402
from trainctl.workers.supervisor import JobSupervisor, SupervisorConfig  # noqa: E402

SIZES = (512, 1024, 2048, 4096)
GPUS_PER_NODE = 8
NODES_PER_SIMULATOR = 128
"""Simulated 8-GPU nodes per simulator process (1,024 ranks)."""
POLL_SECONDS = 0.2
"""The client's poll interval: the service's scheduler tick (`Scheduler.interval`)."""
EXTRAPOLATE_RANKS = 16384
GOALS = {"supervisor_cpu_share": 0.05, "report_to_event_p99_s": 1.0}
OUT = Path(__file__).resolve().parent / "results-rank-path.json"
ROOT = Path(__file__).resolve().parents[2]
REPORT = {
    "loss": 2.5, "grad_norm": 1.0, "lr": 3e-4, "tokens": 4194304, "tokens_per_second": 4.1e6, "mfu": 0.47,
    "mfu_full_attention": 0.49, "step_time_seconds": 1.0,
    "breakdown": {"data": 1e-3, "forward_backward": 0.82, "optimizer": 0.17},
    "peak_memory_bytes": 61742647296, "checkpoint_bytes": None, "eval_loss": None,
}
"""Every StepReport field (trainctl/parallelism/engine/step_report.py), as rank 0 sends them."""


def job_spec(ranks: int) -> TrainingJob:
    """A job of ``ranks`` GPUs: tp8 pp4 dp* llama3-8b (ranks a multiple of 32), else dp_shard llama-1b."""
    layout = {"tp": 8, "pp": 4, "dp_shard": ranks // 32} if ranks % 32 == 0 else {"dp_shard": ranks}
    model = "llama3-8b" if ranks % 32 == 0 else "llama-1b"
    return TrainingJob.model_validate({
        "metadata": {"name": f"rank-path-{ranks}"},
        "spec": {"model": {"preset": model}, "parallelism": layout, "resources": {"gpus": ranks},
                 "scheduling": {"max_restarts": 3, "step_timeout_seconds": 120}},
    })


def slots_of(ranks: int) -> list[RankAssignment]:
    return [RankAssignment(rank=r, node=f"node-{r // GPUS_PER_NODE:04d}", gpu=r % GPUS_PER_NODE) for r in range(ranks)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name (Ray's C++ threads are named; Python's
    threads carry the process's name)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, rest = task.joinpath("stat").read_text().split("(", 1)[1].rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = rest.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RankSimulator:
    """Simulated ranks of some nodes, in one process (an async Ray actor with one sending thread)."""

    def __init__(self, ranks: list[int], step_seconds: float, mode: str, log_every: int, slow_rank: int,
                 interval: float) -> None:
        self._ranks = sorted(ranks)
        self._routes: dict[int, Any] = {}
        self._relays: dict[int, step_time_sending.StepTimeRelay] = {}
        self._interval = interval
        self._step = step_seconds
        self._mode = mode
        self._log_every = log_every
        self._slow_rank = slow_rank
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._supervisor: Any = None
        self._epoch = 0.0
        self._running: list[int] = []
        self._ended: dict[int, asyncio.Future] = {}
        self._batchers: dict[int, Any] = {}
        self._sent: dict[str, float] = {}
        self._calls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._send_steps, name="ranks", daemon=True).start()

    def pid(self) -> int:
        return os.getpid()

    def location(self, rank: int, node: str, gpu: int) -> RankLocation:
        """What `RankWorker.location` answers."""
        return RankLocation(planned=RankAssignment(rank=rank, node=node, gpu=gpu), node=node, gpu=gpu,
                            node_id="0" * 56, ip="127.0.0.1", pid=os.getpid(), cuda_visible_devices=str(gpu),
                            actor=f"trainctl-rank-bench-{rank}")

    async def run_rank(self, rank: int, supervisor: Any, generation: int, epoch: float, job_json: str,
                       route: Any) -> dict[str, Any]:
        """`RankWorker.train`'s stand-in: the rank steps from ``epoch`` until its generation ends."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            if generation != self._generation:
                for future in self._ended.values():  # the previous generation's calls return
                    if not future.done():
                        future.set_result(None)
                self._generation, self._supervisor, self._epoch = generation, supervisor, epoch
                self._running, self._ended, self._batchers, self._routes, self._relays = [], {}, {}, {}, {}
            self._routes[rank] = route
            if route is not None and route.relay == rank:
                self._relays[rank] = step_time_sending.StepTimeRelay(
                    lambda batches: self._call(supervisor.record_step_times, generation, batches), route.node_ranks, generation)
            future = self._loop.create_future()
            self._ended[rank] = future
            self._running.append(rank)
        await future
        return {"steps": 0, "rank": rank}

    def sent(self) -> dict[str, float]:
        """Rank 0's send time per ``"generation:step"``."""
        with self._lock:
            return dict(self._sent)

    def calls(self) -> int:
        return self._calls

    def relay_step_times(self, generation: int, rank: int, times: dict[int, float]) -> None:
        """`RankWorker.relay_step_times`: a batch of another simulator's rank for a relay rank of this one (the
        lowest rank but 0 of the rank's node, `slots_of`)."""
        relay = self._relays.get(max(1, rank // GPUS_PER_NODE * GPUS_PER_NODE))
        if relay is not None and relay.generation == generation:
            relay.add(rank, times)

    def _call(self, method: Any, *args: Any) -> None:
        method.remote(*args)
        self._calls += 1

    def _send_steps(self) -> None:
        done: tuple[int | None, int] = (None, 0)  # the generation and the last step sent for it
        while True:
            with self._lock:
                supervisor, generation, epoch = self._supervisor, self._generation, self._epoch
            if supervisor is None:
                time.sleep(0.05)
                continue
            step = math.floor((time.time() - epoch) / self._step) + 1
            if done[0] == generation:
                step = max(step, done[1] + 1)
            time.sleep(max(0.0, epoch + step * self._step - time.time()))
            with self._lock:
                if self._generation != generation:
                    continue
                ranks = sorted(self._running)
            done = (generation, step)
            for rank in ranks:
                seconds = self._step * (1.0 + 0.01 * ((rank * 7919 + step * 104729) % 97) / 97)
                if rank == self._slow_rank and step % 20 >= 10:
                    seconds *= 1.4  # a straggler half the time: the log line names it
                self._send(supervisor, generation, rank, step, seconds)

    def _send(self, supervisor: Any, generation: int, rank: int, step: int, seconds: float) -> None:
        """What `RankWorker.train`'s callbacks send for one step of one rank."""
        if rank == 0:
            with self._lock:
                self._sent[f"{generation}:{step}"] = time.time()
            supervisor.record_step.remote(generation, 0, {**REPORT, "step": step, "step_time_seconds": seconds})
            self._calls += 1
            if self._log_every and step % self._log_every == 0:
                supervisor.record_log.remote(generation, 0, f"step {step}: data shard {step // self._log_every} opened")
                self._calls += 1
            return
        if self._mode == "rank0-only":  # the supervisor's cost without the other ranks' calls
            return
        if self._mode == "per-rank":
            self._call(supervisor.record_step_times, generation, {rank: {step: seconds}})
            return
        batcher = self._batchers.get(rank)
        if batcher is None:
            if self._mode == "batched":
                batcher = step_time_sending.StepTimeBatcher(
                    lambda times, rank=rank: times and self._call(supervisor.record_step_times, generation, {rank: times}),
                    rank % step_time_sending.SPREAD_STEPS, self._interval)
            else:
                route = self._routes[rank]
                batcher = step_time_sending.StepTimeBatcher(
                    lambda times, rank=rank, route=route: self._hand_over(route, generation, rank, times),
                    route.stagger, self._interval)
            self._batchers[rank] = batcher
        batcher(step, seconds)

    def _hand_over(self, route: Any, generation: int, rank: int, times: dict[int, float]) -> None:
        """A rank's batch to its node's relay: in this process, or in the simulator that runs the relay rank."""
        relay = self._relays.get(route.relay)
        if relay is not None:
            relay.add(rank, times)
        else:
            route.worker.relay_step_times.remote(generation, rank, times)


class BenchSupervisor(JobSupervisor):
    """The product's supervisor with its rank group replaced by simulated ranks (`_run_generation`); every
    other method is JobSupervisor's. ``simulators``: (actor, ranks) per simulator; ``victims``: per
    generation, the simulator of the last rank (the first, alone in its process, is killed; the next, a
    regular simulator, runs it in the restarted generation)."""

    def __init__(self, config: SupervisorConfig, simulators: list[tuple[Any, list[int]]], victims: list[Any]) -> None:
        self._simulators = simulators
        self._victims = victims
        self._refs: list[Any] = []
        self._marks: list[dict[str, float]] = []
        """Per generation run: when it started, its ranks were running, and `_watch` returned."""
        super().__init__(config)

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def wait_cost(self, reps: int) -> float:
        """CPU seconds of one `ray.wait` over the running generation's result refs, as `_watch` calls it
        (``num_returns=1``; here with no timeout, so only its own work is timed)."""
        refs = list(self._refs)
        started = time.thread_time()
        for _ in range(reps):
            ray.wait(refs, num_returns=1, timeout=0)
        return (time.thread_time() - started) / reps

    @ray.method(concurrency_group="control")
    def marks(self) -> list[dict[str, float]]:
        return [dict(m) for m in self._marks]

    def _run_generation(self):  # noqa: ANN202  (JobSupervisor._run_generation, the rank group simulated)
        generation = self._generation
        marks = {"started": time.time()}
        victim = self._victims[min(len(self._marks), len(self._victims) - 1)]
        self._marks.append(marks)
        check_slots(self._plan.slots)  # RankGroup.create's check of the plan
        ordered = sorted(self._plan.slots, key=lambda slot: slot.rank)
        owner = {rank: sim for sim, ranks in self._simulators for rank in ranks}
        owner[len(ordered) - 1] = victim
        routes = step_time_sending.step_time_routes(ordered, [owner[s.rank] for s in ordered])  # RankGroup.start's
        locations = ray.get([owner[s.rank].location.remote(s.rank, s.node, s.gpu) for s in ordered],
                            timeout=self._cfg.call_timeout)  # RankGroup.locations: one call per rank
        marks["located"] = time.time()
        self._log.append(EventKind.PLACEMENT, generation=generation, placement=[loc.to_dict() for loc in locations])
        marks["placement_recorded"] = time.time()
        self._watchdog.started()
        self._stats = step_stats.StepStats()
        reporter = ray.get_runtime_context().current_actor
        epoch = time.time()
        job_json = self._job.spec.model_dump_json()
        refs = [owner[s.rank].run_rank.remote(s.rank, reporter, generation, epoch, job_json, routes.get(s.rank))
                for s in ordered]
        marks["submitted"] = time.time()
        self._refs = refs
        nodes = sorted({loc.node or "?" for loc in locations})
        self._state(JobState.RUNNING, f"{len(refs)} ranks running on {len(nodes)} nodes (generation {generation})")
        marks["running"] = time.time()
        outcome = self._watch(refs)
        marks["watch_returned"] = time.time()
        return outcome


class Client:
    """Polls the supervisor every POLL_SECONDS from its cursor, as the service's `Following` does; notes
    when each event was first seen."""

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor
        self.cursor = 0
        self.seen: list[tuple[float, Any]] = []
        self.poll_seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.time()
            try:
                status = ray.get(self.supervisor.poll.remote(self.cursor, 1000), timeout=30)
            except Exception:  # noqa: BLE001  (the supervisor is gone at the end)
                return
            now = time.time()
            self.poll_seconds.append(now - started)
            self.seen.extend((now, event) for event in status.events)
            self.cursor = status.cursor
            self._stop.wait(max(0.0, POLL_SECONDS - (time.time() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait_for(self, predicate, timeout: float) -> tuple[float, Any] | None:  # noqa: ANN001
        deadline = time.time() + timeout
        while time.time() < deadline:
            for seen, event in list(self.seen):
                if predicate(event):
                    return seen, event
            time.sleep(0.05)
        return None


def stats_bytes(ranks: int) -> int:
    """tracemalloc bytes of a StepStats holding STEP_HISTORY steps of ``ranks`` ranks' times."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    stats = step_stats.StepStats()
    for step in range(1, step_stats.STEP_HISTORY + 1):
        for rank in range(ranks):
            stats.add(rank, step, 1.0 + rank * 1e-6 + step * 1e-3)
    stats.latest_complete(before=step_stats.STEP_HISTORY + 1)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del stats
    return held


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def measure(ranks: int, *, step: float = 1.0, window: int | None = None, warmup: int = 10, mode: str = "per-node",
            log_every: int = 10, interval: float = step_time_sending.STEP_TIME_INTERVAL, work: Path) -> dict[str, Any]:
    """Run one job of ``ranks`` simulated ranks and measure it (see the module docstring). ``window``: steps
    measured (default: one ``interval``, the batcher's, so each rank's call falls in it once)."""
    window = window or math.ceil(interval / step)
    job_id = f"rank-path-{ranks}-{mode}-{int(time.time())}"
    run = RunDirectory.at(work / job_id).create()
    job = job_spec(ranks)
    sim_cls = ray.remote(RankSimulator)
    regular = list(range(ranks - 1))
    per_sim = NODES_PER_SIMULATOR * GPUS_PER_NODE
    groups = [regular[i:i + per_sim] for i in range(0, len(regular), per_sim)]
    slow = ranks // 3
    simulators = [(sim_cls.options(num_cpus=0, max_concurrency=len(g) + 16).remote(g, step, mode, log_every, slow, interval), g)
                  for g in groups]
    # the last rank alone, to be killed; the next generation runs it in the last simulator (no new process)
    victims = [sim_cls.options(num_cpus=0, max_concurrency=16).remote([ranks - 1], step, mode, log_every, slow, interval),
               simulators[-1][0]]
    sim_pids = ray.get([sim.pid.remote() for sim, _ in simulators] + [victims[0].pid.remote()])
    # The supervisor starts one spare per node once the job has trained `spare_after` seconds: a one-off
    # (nodes x ~1.4 ms of its CPU), made to fall in the warm-up so the window measures the steady state.
    config = SupervisorConfig(job_id=job_id, job_json=job.model_dump_json(), slots=slots_of(ranks),
                              run_dir=str(run.root), use_gpu=False, call_timeout=120.0, spare_after=warmup * step / 2)
    actor_cls = ray.remote(concurrency_groups={"control": 4, "reports": 1})(BenchSupervisor)
    created = time.time()
    supervisor = actor_cls.options(name=f"bench-supervisor-{job_id}", num_cpus=0, max_restarts=0).remote(
        config, simulators, victims)
    pid = ray.get(supervisor.pid.remote())
    client = Client(supervisor)
    row: dict[str, Any] = {"ranks": ranks, "nodes": math.ceil(ranks / GPUS_PER_NODE), "mode": mode,
                           "step_seconds": step, "interval_s": interval if mode in ("batched", "per-node") else None, "window_steps": window, "simulators": len(simulators) + 1}
    try:
        first = client.wait_for(lambda e: e.kind is EventKind.STEP, timeout=120 + ranks / 20)
        if first is None:
            raise RuntimeError(f"{ranks} ranks: no STEP event")
        row["first_step_after_s"] = round(first[0] - created, 2)
        time.sleep(warmup * step)
        cpu0, t0, load0, threads0 = cpu_seconds(pid), time.time(), os.getloadavg()[0], thread_cpu(pid)
        sims0 = sum(cpu_seconds(p) for p in sim_pids)
        calls0 = sum(ray.get([sim.calls.remote() for sim, _ in simulators]))
        time.sleep(window * step)
        cpu1, t1, threads1 = cpu_seconds(pid), time.time(), thread_cpu(pid)
        sims1 = sum(cpu_seconds(p) for p in sim_pids)
        calls1 = sum(ray.get([sim.calls.remote() for sim, _ in simulators]))
        steps = (t1 - t0) / step
        row["supervisor_cpu_per_step_s"] = (cpu1 - cpu0) / steps
        row["supervisor_cpu_share"] = (cpu1 - cpu0) / (t1 - t0)
        by_thread = {name: (cpu - threads0.get(name, 0.0)) / steps for name, cpu in threads1.items()}
        row["supervisor_cpu_per_step_by_thread_s"] = {k: round(v, 5) for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v > 0}
        row["rank_calls_per_step"] = (calls1 - calls0) / steps
        row["simulators_cpu_per_step_s"] = (sims1 - sims0) / steps
        row["supervisor_rss_bytes"] = rss_bytes(pid)
        # one `ray.wait` of `_watch`'s loop, which runs it at least every watch_interval (0.5 s)
        row["watch_wait_cpu_s"] = ray.get(supervisor.wait_cost.remote(20))
        row["load_average"] = [load0, os.getloadavg()[0]]
        sent = ray.get(simulators[0][0].sent.remote())
        delays = [seen - sent[f"{e.generation}:{e.step['step']}"] for seen, e in list(client.seen)
                  if e.kind is EventKind.STEP and t0 <= seen <= t1 and f"{e.generation}:{e.step['step']}" in sent]
        row["report_to_event_s"] = {"n": len(delays), "p50": statistics.median(delays) if delays else None,
                                    "p90": pct(delays, 0.9), "p99": pct(delays, 0.99), "max": max(delays, default=None),
                                    "all": [round(d, 3) for d in delays]}
        stepped = [e for seen, e in client.seen if e.kind is EventKind.STEP]
        row["straggler_in_last_step"] = stepped[-1].step.get("straggler") if stepped else None
        row["straggler_lines"] = sum(1 for _, e in client.seen if e.kind is EventKind.LOG and e.message.startswith("straggler"))
        row["poll_p50_s"] = statistics.median(client.poll_seconds[-50:]) if client.poll_seconds else None
        # The dead rank: its simulator's process is killed.
        killed = time.time()
        ray.kill(victims[0], no_restart=True)
        first_generation = first[1].generation
        running = client.wait_for(
            lambda e: e.kind is EventKind.STATE and e.state is JobState.RUNNING and e.generation > first_generation,
            timeout=120 + ranks / 20)
        restarting = client.wait_for(lambda e: e.kind is EventKind.STATE and e.state is JobState.RESTARTING, timeout=1)
        marks = ray.get(supervisor.marks.remote())
        if running is None or restarting is None:
            raise RuntimeError(f"{ranks} ranks: no restart seen after the kill ({marks})")
        row["restart"] = {
            "kill_to_watch_returned_s": marks[0]["watch_returned"] - killed,
            "watch_returned_to_restarting_s": restarting[1].time - marks[0]["watch_returned"],
            "restarting_to_running_s": running[1].time - restarting[1].time,
            "kill_to_running_s": running[1].time - killed,
            # the next generation's parts: N location calls, the PLACEMENT event, N run calls submitted
            "locations_s": marks[1]["located"] - marks[1]["started"],
            "placement_event_s": marks[1]["placement_recorded"] - marks[1]["located"],
            "run_calls_s": marks[1]["submitted"] - marks[1]["placement_recorded"],
            "reason": restarting[1].reason[:200],
        }
        row["placement_event_bytes"] = len(next(e for _, e in client.seen if e.kind is EventKind.PLACEMENT).to_json())
    finally:
        client.stop()
        for handle in [supervisor, *(sim for sim, _ in simulators), victims[0]]:
            ray.kill(handle, no_restart=True)
    row["stats_tracemalloc_bytes"] = stats_bytes(ranks)
    return row


class Light:
    """A rank's actor without the engine: what Ray's own part of a new generation costs per actor."""

    def ping(self) -> int:
        return os.getpid()


def ray_part(count: int) -> dict[str, float]:
    """Placement group of ``count`` bundles, ``count`` light actors in it (pinged), then removed."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = time.time()
    pg = placement_group([{"CPU": 0.01}] * count, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    reserved = time.time()
    light = ray.remote(Light)
    actors = [light.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
              for i in range(count)]
    ray.get([a.ping.remote() for a in actors], timeout=600)
    ready = time.time()
    for actor in actors:
        ray.kill(actor, no_restart=True)
    remove_placement_group(pg)
    return {"actors": count, "placement_group_s": reserved - started, "actors_ready_s": ready - reserved,
            "removed_s": time.time() - ready}


def placement_group_part(count: int) -> dict[str, float]:
    """A placement group of ``count`` tiny bundles alone (no actors): Ray's GCS reserving and removing it."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    started = time.time()
    pg = placement_group([{"CPU": 0.0001}] * count, strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    reserved = time.time()
    remove_placement_group(pg)
    while placement_group_table(pg).get("state") != "REMOVED" and time.time() - reserved < 120:
        time.sleep(0.01)
    return {"bundles": count, "reserved_s": reserved - started, "removed_s": time.time() - reserved}


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Slope of log y on log x (the growth exponent) and y extrapolated to EXTRAPOLATE_RANKS by it."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y and y > 0]
    if len(pairs) < 2:
        return {"exponent": float("nan"), "at_16384": float("nan")}
    mx = statistics.fmean(p[0] for p in pairs)
    my = statistics.fmean(p[1] for p in pairs)
    slope = sum((a - mx) * (b - my) for a, b in pairs) / sum((a - mx) ** 2 for a, _ in pairs)
    last_x, last_y = pairs[-1]
    return {"exponent": round(slope, 2), "at_16384": math.exp(last_y + slope * (math.log(EXTRAPOLATE_RANKS) - last_x))}


def law(exponent: float) -> str:
    if math.isnan(exponent):
        return "?"
    if exponent < 0.2:
        return "constant"
    if exponent < 0.8:
        return "sub-linear"
    if exponent < 1.2:
        return "linear"
    return "super-linear"


def linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y on x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True)) / sum((a - mx) ** 2 for a in xs)
    return my - slope * mx, slope


FIGURES = {
    "supervisor CPU per step (s)": lambda r: r["supervisor_cpu_per_step_s"],
    "report to STEP event p99 (s)": lambda r: r["report_to_event_s"]["p99"],
    "kill to _watch returned (s)": lambda r: r["restart"]["kill_to_watch_returned_s"],
    "_watch returned to RESTARTING (s)": lambda r: r["restart"]["watch_returned_to_restarting_s"],
    "RESTARTING to RUNNING, trainctl's part (s)": lambda r: r["restart"]["restarting_to_running_s"],
    "StepStats bytes": lambda r: r["stats_tracemalloc_bytes"],
}


def laws(rows: list[dict[str, Any]], ray_rows: list[dict[str, float]], pg_rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    xs = [r["ranks"] for r in rows]
    for name, get in FIGURES.items():
        got = fit(xs, [get(r) for r in rows])
        out[name] = {**got, "law": law(got["exponent"])}
    if len(rows) >= 2:
        base, per_rank = linear(xs, [r["supervisor_rss_bytes"] for r in rows])
        out["supervisor RSS"] = {"base_bytes": base, "bytes_per_rank": per_rank,
                                 "at_16384": base + per_rank * EXTRAPOLATE_RANKS}
    if len(pg_rows) >= 2:
        got = fit([r["bundles"] for r in pg_rows], [r["reserved_s"] for r in pg_rows])
        out["ray placement group alone"] = {**got, "law": law(got["exponent"])}
    if len(ray_rows) >= 2:
        counts = [r["actors"] for r in ray_rows]
        for key in ("placement_group_s", "actors_ready_s", "removed_s"):
            base, per = linear(counts, [r[key] for r in ray_rows])
            out[f"ray {key}"] = {"base_s": base, "per_actor_s": per, "at_4096_serial_s": base + per * 4096,
                                 "at_16384_serial_s": base + per * EXTRAPOLATE_RANKS}
    return out


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "trainctl"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "git_commit": commit, "trainctl_tree_dirty": dirty,
            "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "ray": ray.__version__, "load_average": os.getloadavg()}


def start_ray() -> Any:
    """An embedded one-node Ray on 127.0.0.1 for the bench (its own, never another's), connected; returns it."""
    from trainctl.workers.embedded import start_embedded

    cluster = start_embedded(1, GPUS_PER_NODE, head_cpus=2)
    ray.init(address=cluster.address, namespace="trainctl-bench", log_to_driver=False)
    by_value()
    return cluster


def by_value() -> None:
    """Pickle this module's classes by value: Ray's workers cannot import bench/scale."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| ranks | mode | calls/step | supervisor CPU/step ms (share) | report→event p50 / p99 s | kill→_watch s | "
             "→RESTARTING s | →RUNNING (trainctl) s | RSS MiB | StepStats KiB | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, rs = r["report_to_event_s"], r["restart"]
        lines.append(
            f"| {r['ranks']:,} | {r['mode']} | {r['rank_calls_per_step']:.0f} | {r['supervisor_cpu_per_step_s'] * 1e3:.1f} "
            f"({r['supervisor_cpu_share'] * 100:.1f} %) | {d['p50']:.3f} / {d['p99']:.3f} | "
            f"{rs['kill_to_watch_returned_s']:.2f} | {rs['watch_returned_to_restarting_s']:.3f} | "
            f"{rs['restarting_to_running_s']:.2f} | {r['supervisor_rss_bytes'] / 2**20:.0f} | "
            f"{r['stats_tracemalloc_bytes'] / 1024:.0f} | {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} |")
    return "\n".join(lines)


def report(result: dict[str, Any]) -> None:
    print(table(result["rows"]))
    for r in result.get("placement_group_part", []):
        print(f"ray: placement group of {r['bundles']} bundles alone: reserved {r['reserved_s']:.2f} s, "
              f"removed {r['removed_s']:.2f} s")
    for r in result.get("ray_part", []):
        print(f"ray: {r['actors']} actors: placement group {r['placement_group_s']:.2f} s, actors ready "
              f"{r['actors_ready_s']:.2f} s, removed {r['removed_s']:.2f} s")
    for name, got in result["laws"].items():
        print(f"{name}: {json.dumps(got)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 1,024 ranks, 20 s intervals, 4 and 8 Ray actors")
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    parser.add_argument("--mode", choices=("per-node", "batched", "per-rank", "rank0-only"), default="per-node",
                        help="how the ranks other than 0 send step times (rank0-only: not at all)")
    parser.add_argument("--step", type=float, default=1.0, help="seconds per step")
    parser.add_argument("--window", type=int, default=None, help="steps measured per size (default: one --interval)")
    parser.add_argument("--interval", type=float, default=None,
                        help=f"seconds between a rank's batched step times (default {step_time_sending.STEP_TIME_INTERVAL:g}; 20 with --quick)")
    parser.add_argument("--ray-actors", type=int, nargs="*", default=None, help="actor counts of Ray's part")
    parser.add_argument("--pg-bundles", type=int, nargs="*", default=None,
                        help="bundle counts of a placement group alone (default 256 to 4,096; 64 and 256 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help=f"results file (default {OUT.name}; none with --quick)")
    parser.add_argument("--summarise", type=Path, default=None, help="only print a results file's table and laws")
    args = parser.parse_args()
    if args.summarise:
        report(json.loads(args.summarise.read_text()))
        return 0
    cluster = start_ray()
    try:
        return run(args)
    finally:
        ray.shutdown()
        cluster.shutdown()


def run(args: argparse.Namespace) -> int:
    sizes = args.sizes or ([512, 1024] if args.quick else list(SIZES))
    interval = args.interval or (20.0 if args.quick else step_time_sending.STEP_TIME_INTERVAL)
    counts = args.ray_actors if args.ray_actors is not None else ([4, 8] if args.quick else [8, 16, 32])
    out = args.out or (None if args.quick else OUT)
    started_at = machine()
    rows: list[dict[str, Any]] = []
    ray_rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tc-rank-path-") as tmp:
        for ranks in sizes:
            rows.append(measure(ranks, step=args.step, window=args.window, mode=args.mode, interval=interval,
                                work=Path(tmp)))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    for count in counts:
        ray_rows.append(ray_part(count))
        print(f"ray part: {ray_rows[-1]}", file=sys.stderr, flush=True)
    bundles = args.pg_bundles if args.pg_bundles is not None else ([64, 256] if args.quick else [256, 512, 1024, 2048, 4096])
    pg_rows = []
    for count in bundles:
        pg_rows.append(placement_group_part(count))
        print(f"placement group alone: {pg_rows[-1]}", file=sys.stderr, flush=True)
    result = {**started_at, "load_average_after": os.getloadavg(), "interval_s": interval, "goals": GOALS,
              "rows": rows, "ray_part": ray_rows, "placement_group_part": pg_rows,
              "laws": laws(rows, ray_rows, pg_rows)}
    if out is not None:
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
