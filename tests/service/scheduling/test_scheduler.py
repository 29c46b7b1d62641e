"""Scheduler unit tests over a scripted runtime: priority then age, gang admission, reasons, cancel,
release, recovery, re-placement after a node loss. The same behaviour over real Ray is in
tests/service/e2e/test_e2e.py and tests/reliability/test_node_loss.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from control_plane_fakes import ScriptedRuntime, eventually, make_scheduler
from small_jobs import small_job

from trainctl.planning.pool import GpuPool
from trainctl.service import store as st
from trainctl.service.scheduling import following
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.paths import JobPathPolicy
from trainctl.service.store import JobStore
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState
from trainctl.workers.topology import simulated_topology


def job(name: str, gpus: int, priority: int = 0) -> TrainingJob:
    return small_job(name, gpus=gpus, scheduling={"priority": priority})


def submit(scheduler: Scheduler, name: str, gpus: int, priority: int = 0) -> str:
    return scheduler.store.create_job(job(name, gpus, priority))[0].id


def state(scheduler: Scheduler, job_id: str) -> st.JobRecord:
    return scheduler.store.get_job(job_id)


def test_priority_then_age_and_strict_gang_admission(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 8 GPUs
    a = submit(s, "a", 8)
    s.tick()
    assert state(s, a).state == JobState.SCHEDULED and s.pool.free_count == 0
    b = submit(s, "b", 4, priority=0)
    c = submit(s, "c", 4, priority=5)
    d = submit(s, "d", 4, priority=5)
    small = submit(s, "small", 1, priority=-1)
    s.tick()
    assert [state(s, j).state for j in (b, c, d, small)] == [JobState.QUEUED] * 4
    assert state(s, c).reason == "waiting for 4 GPUs: 0 of 8 free"
    assert state(s, d).reason.startswith(f"waiting behind {c}")
    assert state(s, b).reason.startswith(f"waiting behind {c}")

    runtime.run(a, [3.0, 2.0, 1.0])
    s.tick()  # a ends and frees 8 GPUs; c then d (priority 5, in submission order) take them all
    assert state(s, a).state == JobState.SUCCEEDED
    assert [state(s, j).state for j in (c, d)] == [JobState.SCHEDULED, JobState.SCHEDULED]
    assert [j for j, _ in runtime.started] == [a, c, d]
    assert state(s, b).state == JobState.QUEUED and state(s, b).reason == "waiting for 4 GPUs: 0 of 8 free"
    runtime.run(c, [1.0])
    s.tick()  # c's 4 GPUs go to b (priority 0) before small (priority -1)
    assert state(s, b).state == JobState.SCHEDULED
    assert state(s, small).state == JobState.QUEUED and state(s, small).reason == "waiting for 1 GPUs: 0 of 8 free"
    runtime.run(d, [1.0])
    s.tick()
    assert state(s, small).state == JobState.SCHEDULED and s.pool.free_count == 3


def test_gang_scheduling_never_starts_part_of_a_job(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime, nodes=2, gpus=2)  # 4 GPUs
    first = submit(s, "first", 2)
    big = submit(s, "big", 4)
    small = submit(s, "small", 1)
    s.tick()
    assert state(s, first).state == JobState.SCHEDULED
    assert state(s, big).state == JobState.QUEUED and state(s, big).reason == "waiting for 4 GPUs: 2 of 4 free"
    # strict queue: the 1-GPU job would fit, but does not overtake the job at the head
    assert state(s, small).state == JobState.QUEUED and state(s, small).reason.startswith(f"waiting behind {big}")
    assert [j for j, _ in runtime.started] == [first]
    runtime.run(first, [1.0])
    s.tick()
    assert state(s, big).state == JobState.SCHEDULED and state(s, small).state == JobState.QUEUED
    placement = dict(runtime.started)[big]
    assert sorted((a.node, a.gpu) for a in placement.assignments) == [
        ("node-0", 0), ("node-0", 1), ("node-1", 0), ("node-1", 1),
    ]
    assert [a.rank for a in placement.assignments] == [0, 1, 2, 3]


def test_follows_events_into_the_store(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 2)
    s.tick()
    runtime.state(j, JobState.RUNNING, "ranks up")
    runtime.step(j, 1, 5.0)
    s.tick()
    record = state(s, j)
    assert (record.state, record.steps_done, record.last_loss) == (JobState.RUNNING, 1, 5.0)
    assert record.start_time is not None and record.placement and record.run_dir
    runtime.step(j, 2, 4.0)
    runtime.state(j, JobState.SUCCEEDED, "all ranks finished")
    s.tick()
    record = state(s, j)
    assert (record.state, record.reason, record.steps_done, record.first_loss, record.last_loss) == (
        JobState.SUCCEEDED, "all ranks finished", 2, 5.0, 4.0,
    )
    types = [(e.type, e.payload.get("to") or e.payload.get("step")) for e in s.store.events(j)]
    assert types == [
        ("state", JobState.QUEUED), ("state", JobState.SCHEDULED), ("state", JobState.RUNNING), ("step", 1), ("step", 2),
        ("state", JobState.SUCCEEDED),
    ]
    assert s.pool.free_count == 8


def test_cancel_queued_and_running(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    running = submit(s, "running", 8)
    queued = submit(s, "queued", 8)
    s.tick()
    runtime.state(running, JobState.RUNNING)
    s.tick()
    assert s.request_cancel(queued, "by test").state == JobState.CANCELLED
    assert s.request_cancel(running, "by test").state == JobState.CANCELLING
    for _ in range(50):
        s.tick()
        if state(s, running).terminal:
            break
        s._wake.wait(0.05)
    assert runtime.cancelled == [running]
    assert state(s, running).state == JobState.CANCELLED
    assert [j for j, _ in runtime.started] == [running]
    assert s.pool.free_count == 8


def test_stop_waits_for_a_cancel_in_flight(tmp_path: Path) -> None:
    """A cancel still stopping the job's supervisor when the service stops finishes first: it would
    otherwise use the store and the runtime after the service has closed them (seen on CI: a write on a
    closed SQLite store, and Ray connected again by the late cancel)."""
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    job_id = submit(s, "cancelled", 8)
    s.tick()
    runtime.state(job_id, JobState.RUNNING)
    s.tick()
    inside, release = threading.Event(), threading.Event()
    cancel = runtime.cancel

    def slow_cancel(cancelled: str):  # type: ignore[no-untyped-def]
        inside.set()
        release.wait(10)
        return cancel(cancelled)

    runtime.cancel = slow_cancel  # type: ignore[method-assign]
    s.request_cancel(job_id, "by test")
    s.tick()  # sends the cancel, in a thread of its own
    assert inside.wait(10)
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    stopper.join(0.5)
    assert stopper.is_alive(), "stop returned while the cancel was still running"
    release.set()
    stopper.join(10)
    assert not stopper.is_alive() and runtime.cancelled == [job_id]
    s.store.close()


def test_a_cancel_that_lands_while_the_loop_applies_a_running_event_is_not_undone(tmp_path: Path) -> None:
    """The loop reads a SCHEDULED job, the API moves it to CANCELLING, then the loop applies the
    supervisor's RUNNING event: the job stays CANCELLING and is cancelled (found on CI, where a sweep's
    cancelled trial kept running)."""
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    job_id = submit(s, "raced", 8)
    s.tick()
    assert state(s, job_id).state == JobState.SCHEDULED
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    poll = runtime.poll

    def cancel_during_poll(polled: str, cursor: int):  # type: ignore[no-untyped-def]
        if polled == job_id and state(s, job_id).state == JobState.SCHEDULED:
            assert s.request_cancel(job_id, "by test").state == JobState.CANCELLING
        return poll(polled, cursor)

    runtime.poll = cancel_during_poll  # type: ignore[method-assign]
    s.tick()
    assert state(s, job_id).state == JobState.CANCELLING
    for _ in range(50):
        s.tick()
        if state(s, job_id).terminal:
            break
        s._wake.wait(0.05)
    assert runtime.cancelled == [job_id]
    assert (state(s, job_id).state, state(s, job_id).reason) == (JobState.CANCELLED, "by test")
    assert s.pool.free_count == 8


@pytest.mark.scheduling_errors  # the runtime or the store fails on purpose
def test_a_start_failure_fails_the_job_and_frees_its_gpus(tmp_path: Path) -> None:
    runtime = ScriptedRuntime(fail_start=True)
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 4)
    s.tick()
    record = state(s, j)
    assert record.state == JobState.FAILED and "no Ray today" in record.reason
    assert s.pool.free_count == 8


def test_restart_reattaches_without_duplicates(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 4)
    queued = submit(s, "q", 8)
    s.tick()
    runtime.state(j, JobState.RUNNING)
    runtime.step(j, 1, 2.0)
    s.tick()
    s.store.close()

    again = make_scheduler(tmp_path, runtime)
    again.recover()
    assert runtime.attached == [j]
    assert [x for x, _ in runtime.started] == [j]  # its supervisor is alive: not started twice
    assert again.pool.free_count == 4
    runtime.step(j, 2, 1.5)
    runtime.state(j, JobState.SUCCEEDED)
    again.tick()
    assert state(again, j).state == JobState.SUCCEEDED and state(again, j).steps_done == 2
    assert [e.payload["step"] for e in again.store.events(j) if e.type == "step"] == [1, 2]  # no replay
    assert state(again, queued).state == JobState.SCHEDULED
    assert len(again.store.list_jobs()) == 2


class ReplicaKilled(BaseException):
    """The replica's process dies at this point (nothing in its loops handles it)."""


def test_a_replica_killed_before_it_stored_the_page_cursor_records_no_event_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader applies a page of the supervisor's events and dies before the page's last write: the
    next leader follows the same supervisor from the cursor each applied event moved, so the steps and
    the state change already recorded are not recorded again (seen once: steps 1, 2, 3, 2, 3, ...)."""
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 4)
    s.tick()
    runtime.state(j, JobState.RUNNING)
    runtime.step(j, 1, 2.0)
    s.tick()
    runtime.step(j, 2, 1.8)
    runtime.state(j, JobState.RESTARTING, "rank 1 died")
    runtime.state(j, JobState.RUNNING)
    runtime.step(j, 3, 1.6)
    applied = s.store.update_status

    def dies_at_the_page_end(job_id: str, **changes: Any) -> st.JobRecord | None:
        if "restarts" in changes:  # the write of the page's cursor, after every event of the page
            raise ReplicaKilled
        return applied(job_id, **changes)

    monkeypatch.setattr(s.store, "update_status", dies_at_the_page_end)
    with pytest.raises(ReplicaKilled):
        s.tick()
    s.store.close()

    again = make_scheduler(tmp_path, runtime)
    again.recover()
    runtime.step(j, 4, 1.5)
    runtime.state(j, JobState.SUCCEEDED)
    again.tick()
    events = again.store.events(j)
    assert [e.payload["step"] for e in events if e.type == "step"] == [1, 2, 3, 4]
    assert [e.payload["to"] for e in events if e.type == "state"] == [
        JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.RUNNING, JobState.SUCCEEDED,
    ]


def nodes_of(placement) -> set[str]:
    return {a.node for a in placement.assignments}


def test_a_job_that_lost_a_node_is_re_placed_off_it_and_dead_nodes_take_no_job(tmp_path: Path) -> None:
    runtime = ScriptedRuntime(nodes={"node-0", "node-1", "node-2"})
    s = make_scheduler(tmp_path, runtime, nodes=3, gpus=2)  # 6 GPUs
    a, b = submit(s, "a", 2), submit(s, "b", 2)
    s.tick()
    placed = dict(runtime.started)
    [lost] = nodes_of(placed[a])
    runtime.state(a, JobState.RUNNING)
    runtime.lose_node(a, lost)
    s.tick()
    [(job_id, new)] = runtime.plans
    assert job_id == a and lost not in nodes_of(new) and not nodes_of(new) & nodes_of(placed[b])
    assert {slot: holder for slot, holder in s.pool.holders().items() if holder == a} == dict.fromkeys(new.slots, a)
    record = state(s, a)
    assert record.placement == new.records(), "GetJob shows where the ranks run now"
    assert record.state == JobState.RESTARTING and record.reason.startswith(f"node(s) {lost} lost; re-placed 2 ranks on ")
    s.tick()
    assert len(runtime.plans) == 1, "the plan is handed over once"
    messages = [e.payload.get("message") for e in s.store.events(a) if e.type == st.EVENT_LOG]
    assert messages == [f"node(s) {lost} left the Ray cluster", "re-placed"]
    # The lost node's GPUs are free in the pool, but a dead node takes no job.
    c = submit(s, "c", 2)
    s.tick()
    assert state(s, c).state == JobState.QUEUED and state(s, c).reason == "waiting for 2 GPUs: 0 of 6 free"
    runtime.nodes.add(lost)
    s.tick()
    assert state(s, c).state == JobState.SCHEDULED and nodes_of(dict(runtime.started)[c]) == {lost}


def waiting_to_be_re_placed(tmp_path: Path) -> tuple[Scheduler, ScriptedRuntime, str, str, str]:
    """A scheduler of 2 nodes x 2 GPUs whose job a lost its node and waits to be re-placed, because b
    holds the other node: (scheduler, runtime, a, b, the lost node)."""
    runtime = ScriptedRuntime(nodes={"node-0", "node-1"})
    s = make_scheduler(tmp_path, runtime, nodes=2, gpus=2)
    a, b = submit(s, "a", 2), submit(s, "b", 2)
    s.tick()
    [lost] = nodes_of(dict(runtime.started)[a])
    runtime.lose_node(a, lost)
    s.tick()
    return s, runtime, a, b, lost


def test_a_job_that_lost_a_node_waits_for_gpus_then_is_re_placed(tmp_path: Path) -> None:
    s, runtime, a, b, lost = waiting_to_be_re_placed(tmp_path)
    s.tick()
    assert runtime.plans == []
    waiting = f"node(s) {lost} lost; waiting for 2 GPUs to re-place the job: 0 of 4 free"
    assert state(s, a).reason == waiting
    warnings = [e.payload["message"] for e in s.store.events(a) if e.payload.get("level") == "WARNING"]
    assert warnings == [f"node(s) {lost} left the Ray cluster", waiting], "the wait is an event, once"
    queued = submit(s, "queued", 1)
    s.tick()
    assert state(s, queued).reason == f"waiting behind {a}, which waits for GPUs to re-place it after a node loss"

    runtime.run(b, [1.0])  # b ends: its GPUs go to a before anything queued
    s.tick()
    s.tick()
    [(job_id, new)] = runtime.plans
    assert job_id == a and lost not in nodes_of(new)
    assert state(s, a).placement == new.records()
    assert state(s, queued).state == JobState.QUEUED and state(s, queued).reason == "waiting for 1 GPUs: 0 of 4 free"
    runtime.run(a, [1.0])
    s.tick()
    assert state(s, a).state == JobState.SUCCEEDED and set(s.pool.holders().values()) == {queued}


def test_a_job_waiting_to_be_re_placed_keeps_freed_gpus_from_a_nominated_job(tmp_path: Path) -> None:
    """A job a preemption was made for (nominated: admitted out of queue order) waits behind a job that lost
    a node like the rest of the queue: the GPUs that free up re-place the running job first."""
    s, runtime, a, b, lost = waiting_to_be_re_placed(tmp_path)
    nominated = submit(s, "nominated", 2, priority=10)
    s.state.nominated.add(nominated)
    runtime.run(b, [1.0])  # followed after a in the same tick: its GPUs free up before the admission pass
    s.tick()
    assert state(s, nominated).state == JobState.QUEUED
    assert state(s, nominated).reason == f"waiting behind {a}, which waits for GPUs to re-place it after a node loss"
    s.tick()
    [(job_id, new)] = runtime.plans
    assert job_id == a and lost not in nodes_of(new)


def test_ranks_are_started_with_the_nccl_settings_of_the_map(tmp_path: Path) -> None:
    """The scheduler hands the runtime every node's NCCL settings from its topology map (a rail-optimized
    SuperPOD unit: the node's eight compute NICs in rail order, rings kept on one rail)."""
    from trainctl.workers.topology.builders import example_maps
    from trainctl.workers.topology.nccl import nccl_env

    topology = example_maps()["dgx-h100-superpod-su.yaml"]
    runtime = ScriptedRuntime(nodes={node.name for node in topology.nodes})
    s = Scheduler(JobStore(tmp_path), GpuPool(topology, "example"), runtime, tmp_path / "runs")
    a = submit(s, "a", 16)
    s.tick()
    assert state(s, a).state == JobState.SCHEDULED
    nodes = {node for node, _gpu in runtime.started[0][1].slots}
    assert len(nodes) == 2
    for node in nodes:
        assert runtime.node_envs[a][node] == nccl_env(topology, node)
        assert runtime.node_envs[a][node]["NCCL_CROSS_NIC"] == "0"
        assert runtime.node_envs[a][node]["NCCL_IB_HCA"].startswith("=mlx5_0:1,")


def test_ranks_are_started_with_the_jobs_file_rule(tmp_path: Path) -> None:
    """The scheduler hands the runtime each job's FileRule from the service's path policy: the data roots,
    its own run directory, and those of jobs its spec names only when they are its tenant's."""
    root = tmp_path / "data"
    root.mkdir()
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    s.paths = JobPathPolicy([root], tmp_path / "runs")
    mine = s.store.create_job(job("mine", 1), tenant="alice")[0].id
    theirs = s.store.create_job(job("theirs", 1), tenant="bob")[0].id
    later = {}
    for name, earlier in (("from-mine", mine), ("from-theirs", theirs), ("chained", "from-mine")):
        spec = job(name, 1)
        spec.spec.init_from = str(tmp_path / "runs" / later.get(earlier, earlier))
        later[name] = s.store.create_job(spec, tenant="alice")[0].id
    s.tick()
    rules = runtime.file_rules
    assert set(rules) == {mine, theirs, *later.values()}
    assert all(rule.roots == (str(root),) and rule.runs_dir == str(tmp_path / "runs") for rule in rules.values())
    assert rules[mine].readable_runs == {mine} and rules[theirs].readable_runs == {theirs}
    assert rules[later["from-mine"]].readable_runs == {later["from-mine"], mine}
    assert rules[later["from-theirs"]].readable_runs == {later["from-theirs"]}  # bob's run: not alice's to read
    # A checkpoint of a LoRA run loads its own init_from too: the chain of the tenant's runs is readable.
    assert rules[later["chained"]].readable_runs == {later["chained"], later["from-mine"], mine}

    plain = ScriptedRuntime()
    unconfined = make_scheduler(tmp_path / "other", plain)
    submit(unconfined, "a", 1)
    unconfined.tick()
    assert list(plain.file_rules.values()) == [FileRule()]  # no path policy: the default rule


def test_a_burst_of_wakes_is_served_by_few_ticks_and_a_lone_wake_at_once(tmp_path: Path) -> None:
    scheduler = make_scheduler(tmp_path, ScriptedRuntime())
    scheduler.interval, scheduler.min_tick_gap = 60.0, 1.0  # only wakes start a tick
    ticks: list[float] = []
    tick = scheduler.tick
    scheduler.tick = lambda **kw: (ticks.append(time.monotonic()), tick(**kw))[1]  # type: ignore[method-assign]
    scheduler.start()
    try:
        deadline = time.monotonic() + 10
        while not ticks and time.monotonic() < deadline:  # the first tick runs at start
            time.sleep(0.01)
        time.sleep(1.1)  # a quiet spell longer than the gap
        woken = time.monotonic()
        scheduler.wake()
        while len(ticks) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        # At once, not after a gap: half the gap leaves a loaded 2-core machine's thread scheduling room.
        assert ticks[1] - woken < scheduler.min_tick_gap / 2, "a wake after a quiet spell is served at once"
        scheduler.min_tick_gap = 0.1
        time.sleep(1.1)  # the loop's wait after that tick was for the old gap
        burst_start, before = time.monotonic(), len(ticks)
        while time.monotonic() - burst_start < 0.5:  # 500 wakes in half a second, as busy API calls give
            scheduler.wake()
            time.sleep(0.001)
        assert len(ticks) - before <= 0.5 / scheduler.min_tick_gap + 2
        assert all(b - a >= scheduler.min_tick_gap * 0.9 for a, b in zip(ticks, ticks[1:], strict=False))
    finally:
        scheduler.stop()
        scheduler.store.close()


def test_an_idle_loop_passes_over_the_queue_again_only_when_something_it_reads_changed(tmp_path: Path) -> None:
    """A queue blocked at its head: the loop's ticks skip the admission pass until a write to the store,
    a node's loss or `admission_refresh` makes it due, and then pass at once."""
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)  # 8 GPUs
    scheduler.interval, scheduler.min_tick_gap, scheduler.admission_refresh = 0.02, 0.0, 60.0
    blocked = submit(scheduler, "too-big", 16)
    passes: list[float] = []
    admission = scheduler._admission  # noqa: SLF001
    admit = admission.admit
    admission.admit = lambda: (passes.append(time.monotonic()), admit())[1]  # type: ignore[method-assign]

    def passes_within(seconds: float) -> int:
        before = len(passes)
        time.sleep(seconds)
        return len(passes) - before

    def two_passes_after(change: Callable[[], object]) -> None:
        """`change`, then the pass it makes due and the one after that pass's own write of a waiting reason
        (a loaded machine can put more than a tick between them)."""
        before = len(passes)
        change()
        deadline = time.monotonic() + 10.0
        while len(passes) - before < 2:
            assert time.monotonic() < deadline, f"{len(passes) - before} pass(es) within 10 s"
            time.sleep(0.01)

    try:
        two_passes_after(scheduler.start)  # the first pass, then the one after its own write of the waiting reason
        assert state(scheduler, blocked).reason == "waiting for 16 GPUs: 8 of 8 free"
        assert passes_within(0.5) == 0, "about 25 ticks, nothing changed: no pass"
        two_passes_after(lambda: submit(scheduler, "small", 1))  # a write: a pass, and the job behind the head waits
        assert passes_within(0.5) == 0
        two_passes_after(lambda: runtime.nodes.discard("node-1"))  # a node lost: fewer GPUs, the head's reason changes
        assert state(scheduler, blocked).reason == "waiting for 16 GPUs: 4 of 8 free"
        scheduler.admission_refresh = 0.2
        assert passes_within(0.5) >= 2, "with nothing changed, a pass still comes every admission_refresh"
    finally:
        scheduler.stop()
        scheduler.store.close()




class CommitInAdmissionCheck:
    """A trace of the scheduler's loop thread: at line `at` of its second admission check another
    thread commits a CreateJob and wakes the loop, as the API does; `checks_done` counts ended checks."""

    def __init__(self, scheduler: Scheduler, at: int):
        self.scheduler, self.at = scheduler, at
        self.created: list[str] = []
        self.checks_done = threading.Semaphore(0)
        self._calls = self._lines = 0

    def on_call(self, frame: Any, _event: str, _arg: Any) -> Any:
        if frame.f_code is not Scheduler._admission_due.__code__:  # noqa: SLF001
            return None
        self._calls += 1
        return self.in_check

    def in_check(self, _frame: Any, event: str, _arg: Any) -> Any:
        if event == "line" and self._calls == 2:
            if self._lines == self.at:
                api = threading.Thread(target=self._create)
                api.start()
                api.join()
            self._lines += 1
        elif event == "return":
            self.checks_done.release()
        return self.in_check

    def _create(self) -> None:
        self.created.append(submit(self.scheduler, "j", 1))
        self.scheduler.wake()


def test_a_commit_landing_anywhere_in_the_admission_check_is_seen_by_the_next_tick(tmp_path: Path) -> None:
    """The API's threads commit at any moment: a CreateJob committed at each line of the loop's admission
    check in turn (the first check after an idle pass) is admitted by the next ticks, not
    `admission_refresh` (60 s here) later."""
    line, landed = 0, True
    while landed:
        s = make_scheduler(tmp_path / str(line), ScriptedRuntime())  # 8 GPUs, nothing running
        s.interval, s.min_tick_gap, s.admission_refresh = 60.0, 0.0, 60.0  # only wakes tick
        trace = CommitInAdmissionCheck(s, at=line)
        threading.settrace(trace.on_call)  # the loop thread started next is traced
        try:
            s.start()
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
        try:
            assert trace.checks_done.acquire(timeout=10)  # the first tick's: its pass finds no job
            s.wake()
            assert trace.checks_done.acquire(timeout=10)  # the second: the commit lands at `line` of it
            landed = bool(trace.created)
            if landed:
                eventually(lambda s=s, job=trace.created[0]: state(s, job).state == JobState.SCHEDULED,
                           f"a job committed at line {line} of the admission check admitted", timeout=3)
        finally:
            s.stop()
            s.store.close()
        line += 1
    assert line > 3, "the check was traced line by line"


def test_a_job_that_stops_waiting_for_a_new_plan_no_longer_blocks_the_queue(tmp_path: Path) -> None:
    """A job waiting to be re-placed whose supervisor then goes on without a new plan (the lost node came
    back: Ray restarted the supervisor, which resumed on its old plan) no longer holds the queue back."""
    s, runtime, a, b, lost = waiting_to_be_re_placed(tmp_path)
    queued = submit(s, "queued", 1)
    s.tick()
    assert state(s, queued).reason == f"waiting behind {a}, which waits for GPUs to re-place it after a node loss"

    runtime.nodes.add(lost)
    runtime.state(a, JobState.RESTARTING, "job supervisor restarted")
    runtime.state(a, JobState.RUNNING, "ranks up")  # on its old plan: no PLAN event
    runtime.run(b, [1.0])
    s.tick()
    s.tick()
    assert runtime.plans == []
    assert state(s, queued).state == JobState.SCHEDULED, state(s, queued).reason


@pytest.mark.scheduling_errors  # the runtime or the store fails on purpose
def test_a_job_whose_events_the_store_refuses_stops_no_other_job_and_fails_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One job's step the store refuses on every tick (a poison event) is that job's problem alone: the
    other job is followed and a queued job admitted in the same ticks; after FOLLOW_GRACE_SECONDS the job
    is cancelled in the runtime, then recorded FAILED with the error, its GPUs free. The store being
    away still ends the tick (the loop re-syncs when it returns)."""
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 8 GPUs
    poisoned, healthy = submit(s, "poisoned", 2), submit(s, "healthy", 2)
    s.tick()
    record_step = s.store.record_step

    def refuse_the_poisoned_jobs_steps(job_id: str, metrics: dict[str, Any], **kwargs: Any) -> int:
        if job_id == poisoned:
            raise ValueError("loss is not a finite number")
        return record_step(job_id, metrics, **kwargs)

    s.store.record_step = refuse_the_poisoned_jobs_steps  # type: ignore[method-assign]
    for job_id in (poisoned, healthy):
        runtime.state(job_id, JobState.RUNNING, "ranks up")
        runtime.step(job_id, 1, 2.0)
    queued = submit(s, "queued", 4)
    monkeypatch.setattr(following, "FOLLOW_GRACE_SECONDS", 60.0)
    s.tick()
    s.tick()
    assert state(s, healthy).steps_done == 1 and state(s, queued).state == JobState.SCHEDULED
    assert state(s, poisoned).state == JobState.RUNNING and runtime.cancelled == [], "within the grace it is retried"

    monkeypatch.setattr(following, "FOLLOW_GRACE_SECONDS", 0.0)
    eventually(lambda: (s.tick(), state(s, poisoned).terminal)[1], "the poisoned job ended")
    assert runtime.cancelled == [poisoned], "stopped in the runtime before it is recorded FAILED"
    record = state(s, poisoned)
    assert record.state == JobState.FAILED
    assert record.reason == (
        "the service could not follow the job for 0 s (after event 1): ValueError: loss is not a finite number"
    )
    assert poisoned not in s.pool.holders().values()

    runtime.step(healthy, 2, 1.0)
    s.store.record_step = lambda *_args, **_kwargs: (_ for _ in ()).throw(st.StoreUnavailable("the database is away"))  # type: ignore[method-assign]
    with pytest.raises(st.StoreUnavailable):
        s.tick()


def leading_replica(data: Path, runtime: ScriptedRuntime, holder: str) -> Scheduler:
    """A scheduler on the SQLite store in `data` (3 nodes x 2 GPUs) that works only while it holds the lease."""
    store = JobStore(data)
    return Scheduler(store, GpuPool(simulated_topology(3, 2), "simulated"), runtime, data / "runs",
                     leadership=Leadership(store, holder=holder, ttl=30.0))


def loop_once(s: Scheduler) -> None:
    """One turn of the scheduler's loop, as `Scheduler._run` takes it."""
    try:
        if s._in_charge():  # noqa: SLF001
            with s.store.fenced(s._fence):  # noqa: SLF001
                s.tick(skip_idle_admission=True)
        else:
            s._mirror()  # noqa: SLF001
    except st.LeaseLost:
        s._stand_down()  # noqa: SLF001


def test_a_plan_handed_over_whose_placement_write_was_refused_is_recorded_by_the_next_leader(tmp_path: Path) -> None:
    """The leader hands a re-placed job's new plan to its supervisor and loses its lease before writing
    the placement: the next leader re-syncs the old placement from the store, then follows the
    supervisor's PLAN event and holds (and stores) the GPUs the job really runs on, so no other job is
    started there."""
    runtime = ScriptedRuntime(nodes={"node-0", "node-1", "node-2"})
    first, second = leading_replica(tmp_path, runtime, "first"), leading_replica(tmp_path, runtime, "second")
    assert first.leadership is not None and first.leadership.try_acquire() is not None
    a, b = submit(first, "a", 2), submit(first, "b", 2)
    loop_once(first)
    [lost] = nodes_of(dict(runtime.started)[a])
    runtime.lose_node(a, lost)
    hand_over = runtime.replace_plan

    def hand_over_then_lose_the_lease(job_id: str, job: TrainingJob, placement: Any) -> bool:
        adopted = hand_over(job_id, job, placement)
        first.store.release_lease(first._fence)  # noqa: SLF001  # the leader paused here past its lease
        assert second.leadership is not None and second.leadership.try_acquire() is not None
        return adopted

    runtime.replace_plan = hand_over_then_lose_the_lease  # type: ignore[method-assign]
    loop_once(first)  # the plan goes over; the placement's write is refused and the leader stands down
    runtime.replace_plan = hand_over  # type: ignore[method-assign]
    [(_, plan)] = runtime.plans
    assert state(first, a).placement != plan.records()

    loop_once(second)  # leads: re-syncs from the store, follows a's PLAN event
    assert state(second, a).placement == plan.records()
    assert {slot for slot, holder in second.pool.holders().items() if holder == a} == set(plan.slots)
    c = submit(second, "c", 2)
    loop_once(second)
    assert state(second, c).state == JobState.QUEUED and state(second, c).reason == "waiting for 2 GPUs: 0 of 6 free"
    runtime.nodes.add(lost)
    loop_once(second)
    assert nodes_of(dict(runtime.started)[c]) == {lost}
    assert state(second, b).state == JobState.SCHEDULED


def test_a_leader_with_too_little_lease_left_hands_no_plan_over(tmp_path: Path) -> None:
    """Handing a plan to a supervisor is a launch: with less than the launch margin of its lease left, the
    leader leaves the job waiting for the next tick (or the next leader) rather than hand it over."""
    runtime = ScriptedRuntime(nodes={"node-0", "node-1", "node-2"})
    s = leading_replica(tmp_path, runtime, "only")
    assert s.leadership is not None and s.leadership.try_acquire() is not None
    a = submit(s, "a", 2)
    loop_once(s)
    [lost] = nodes_of(dict(runtime.started)[a])
    runtime.lose_node(a, lost)
    s.leadership.may_launch = lambda: False  # type: ignore[method-assign]
    loop_once(s)
    assert runtime.plans == []
    s.leadership.may_launch = lambda: True  # type: ignore[method-assign]
    loop_once(s)
    [(job_id, plan)] = runtime.plans
    assert job_id == a and state(s, a).placement == plan.records()
