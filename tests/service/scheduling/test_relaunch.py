"""A restarted service and the jobs whose supervisor ended with the Ray cluster it ran on (the embedded
Ray stops with the service): relaunched from the newest checkpoint with a restart that says why, or
CANCELLED when they were being cancelled, or left to their log's end; never relaunched forever.
The same over a real `trainctl serve` with its embedded Ray: tests/reliability/test_embedded_restart.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from control_plane_fakes import ScriptedRuntime, make_scheduler
from small_jobs import restartable_job

from trainctl.parallelism.checkpoint.layout import COMPLETE, step_dir_name
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service import store as st
from trainctl.service.scheduling.relaunch import RELAUNCHES_WITHOUT_PROGRESS, stop_notice
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import EventLog, JobState
from trainctl.workers.relaunch import Relaunch

NOT_COUNTED = "not counted against scheduling.max_restarts"


class FileBackedRuntime(ScriptedRuntime):
    """A scripted runtime whose event logs live in the run directories, as the real runtime's do: a
    re-attached or relaunched job continues its log, and a relaunched supervisor records its restart."""

    def attach(self, job_id: str, run_dir: RunDirectory) -> None:
        self.attached.append(job_id)
        try:
            self.logs[job_id] = EventLog.open(run_dir.events)
        except ValueError:  # a damaged log: the real runtime reads it only when polled
            self.logs[job_id] = EventLog()

    def start_job(
        self, job_id: str, job: TrainingJob, placement: Any, run_dir: RunDirectory, *, node_env: dict,
        file_rule: FileRule, relaunch: Relaunch | None = None,
    ) -> None:
        super().start_job(job_id, job, placement, run_dir, node_env=node_env, file_rule=file_rule, relaunch=relaunch)
        self.logs[job_id] = EventLog.open(run_dir.events)
        if relaunch is not None:
            self.state(job_id, JobState.RESTARTING, relaunch.reason)


def running_job(data_dir: Path, runtime: FileBackedRuntime, steps: int, checkpoint: int | None) -> str:
    """A service that started a job which reported `steps` steps (and saved `checkpoint`), then stopped."""
    first = make_scheduler(data_dir, runtime)
    job_id = first.store.create_job(restartable_job("resumable", steps=100, max_restarts=0))[0].id
    first.tick()
    runtime.state(job_id, JobState.SCHEDULED, "supervisor started")
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    for step in range(1, steps + 1):
        runtime.step(job_id, step, 10.0 / step)
    if checkpoint is not None:
        save(RunDirectory.at(first.store.get_job(job_id).run_dir), checkpoint)  # where the scheduler put it
    first.tick()
    assert first.store.get_job(job_id).state == JobState.RUNNING
    first.store.close()
    return job_id


def save(run: RunDirectory, step: int) -> None:
    """A complete (empty) checkpoint of `step`, as the engine leaves one."""
    path = run.checkpoints / step_dir_name(step)
    path.mkdir(parents=True)
    (path / COMPLETE).write_text(json.dumps({"files": {}}))


def restart_service(data_dir: Path, runtime: FileBackedRuntime, lost: set[str]) -> Scheduler:
    """The service starting again on `data_dir`: no supervisor is alive; those of `lost` ended with the
    Ray cluster they ran on (the others' cluster is the same one)."""
    runtime.alive.clear()
    runtime.lost_clusters = set(lost)
    again = make_scheduler(data_dir, runtime)
    again.recover()
    return again


def test_a_job_whose_supervisor_ended_with_its_cluster_is_relaunched_from_its_newest_checkpoint(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    runtime.started.clear()
    again = restart_service(tmp_path, runtime, lost=set())
    assert runtime.started == [], "not relaunched: its cluster is the same one (Ray gave up on its supervisor)"
    again.store.close()
    again = restart_service(tmp_path, runtime, lost={job_id})
    assert [started for started, _ in runtime.started] == [job_id]
    relaunch = runtime.relaunches[job_id]
    assert relaunch.count == 1
    assert "the service restarted on a new Ray cluster" in relaunch.reason
    assert "resuming from checkpoint step 10" in relaunch.reason and NOT_COUNTED in relaunch.reason

    again.tick()
    record = again.store.get_job(job_id)
    assert record.state == JobState.RESTARTING and record.reason == relaunch.reason and record.restarts == 1
    assert again.pool.free_count == again.pool.total - 2, "the relaunched job holds its GPUs"
    runtime.state(job_id, JobState.RUNNING, "ranks up (generation 1)")
    for step in range(11, 101):
        runtime.step(job_id, step, 10.0 / step)
    runtime.state(job_id, JobState.SUCCEEDED, "all 2 ranks finished")
    again.tick()
    record = again.store.get_job(job_id)
    assert record.state == JobState.SUCCEEDED and record.restarts == 1
    changes = [(e.payload["to"], e.payload["reason"]) for e in again.store.events(job_id) if e.type == st.EVENT_STATE]
    assert (JobState.RESTARTING, relaunch.reason) in changes
    assert again.pool.free_count == again.pool.total


def test_a_job_without_a_checkpoint_starts_again_and_says_so(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=1, checkpoint=None)
    restart_service(tmp_path, runtime, lost={job_id})
    assert "no complete checkpoint yet: starting again from the beginning" in runtime.relaunches[job_id].reason


def test_a_job_being_cancelled_is_cancelled_not_relaunched(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    cancelling = make_scheduler(tmp_path, runtime)
    cancelling.recover()
    cancelling.request_cancel(job_id, "not needed any more")
    cancelling.store.close()
    runtime.started.clear()

    again = restart_service(tmp_path, runtime, lost={job_id})
    record = again.store.get_job(job_id)
    assert record.state == JobState.CANCELLED and record.reason == "not needed any more"
    assert runtime.started == [] and job_id not in runtime.relaunches
    assert again.pool.free_count == again.pool.total


def test_a_job_whose_log_ended_before_the_cluster_went_keeps_its_end(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    runtime.state(job_id, JobState.SUCCEEDED, "all 2 ranks finished")  # written, not yet followed by the service
    runtime.started.clear()
    again = restart_service(tmp_path, runtime, lost={job_id})
    again.tick()
    record = again.store.get_job(job_id)
    assert record.state == JobState.SUCCEEDED and record.reason == "all 2 ranks finished"
    assert runtime.started == []


def test_a_job_whose_log_is_damaged_fails_saying_so_and_the_others_are_relaunched(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    damaged = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    intact = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    with RunDirectory.of_job(tmp_path / "runs", damaged).events.open("a") as log:
        log.write('{"seq": "torn\n{"seq": 99}\n')  # a torn line that is no longer the last
    runtime.started.clear()
    again = restart_service(tmp_path, runtime, lost={damaged, intact})
    record = again.store.get_job(damaged)
    assert record.state == JobState.FAILED and "its event log cannot be read" in record.reason, record.reason
    assert [started for started, _ in runtime.started] == [intact]


def test_a_service_that_keeps_dying_relaunches_a_job_without_progress_only_so_often(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    for count in range(1, RELAUNCHES_WITHOUT_PROGRESS + 1):
        runtime.started.clear()
        again = restart_service(tmp_path, runtime, lost={job_id})
        assert [started for started, _ in runtime.started] == [job_id]
        assert runtime.relaunches[job_id].count == count
        again.tick()
        again.store.close()

    runtime.started.clear()
    again = restart_service(tmp_path, runtime, lost={job_id})
    record = again.store.get_job(job_id)
    assert record.state == JobState.FAILED, record.reason
    assert record.reason.startswith(
        f"the service restarted on a new Ray cluster {RELAUNCHES_WITHOUT_PROGRESS + 1} times in a row without the job "
        "reporting a step after step 12 in between; not relaunched again"
    ), record.reason
    assert runtime.started == []
    assert again.pool.free_count == again.pool.total
    again.store.close()


def test_progress_between_relaunches_lets_a_job_be_relaunched_again(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=12, checkpoint=10)
    for count in range(1, RELAUNCHES_WITHOUT_PROGRESS + 3):
        again = restart_service(tmp_path, runtime, lost={job_id})
        assert runtime.relaunches[job_id].count == count
        runtime.step(job_id, 12 + count, 1.0)  # each generation gets somewhere before the service dies again
        again.tick()
        assert again.store.get_job(job_id).state == JobState.RESTARTING
        again.store.close()


def test_the_stop_notice_says_what_happens_to_the_active_jobs(tmp_path: Path) -> None:
    runtime = FileBackedRuntime()
    job_id = running_job(tmp_path, runtime, steps=3, checkpoint=None)
    store = st.JobStore(tmp_path)
    jobs = store.list_jobs(states=[JobState.RUNNING])
    embedded = stop_notice(jobs, None)
    assert embedded is not None and job_id in embedded
    assert "stop with the service's embedded Ray and resume from their newest complete checkpoint" in embedded
    assert "--data-dir" in embedded
    external = stop_notice(jobs, "10.0.0.1:6379")
    assert external is not None and "keep running on the Ray cluster at 10.0.0.1:6379 and are re-attached" in external
    assert stop_notice([], None) is None
    store.close()


def test_the_relaunch_decision_reads_what_the_supervisors_log_derived_not_every_event(tmp_path: Path, monkeypatch) -> None:
    """A restarted service decides a job's relaunch from the newest step, the relaunches and those since
    that step that the supervisor's log keeps in its snapshot: it parses at most the events after the
    snapshot, however long the job ran (issue 38: a million-step job's log is 583 MiB), and decides as a
    replay of every event would."""
    from trainctl.service.scheduling import relaunch
    from trainctl.workers import events
    from trainctl.workers.events import Event, EventKind
    from trainctl.workers.relaunch import is_relaunch
    from trainctl.workers.supervisor import LOG_TALLIES

    assert LOG_TALLIES[relaunch.RELAUNCHES] is is_relaunch  # the supervisor's tally, under the same name
    monkeypatch.setattr(events, "INDEX_STRIDE", 64)
    store = st.JobStore(tmp_path / "data")
    record = store.create_job(restartable_job("long", steps=5000, max_restarts=0))[0]
    run = RunDirectory.at(tmp_path / "run")
    log = EventLog.open(run.events, tallies=LOG_TALLIES)
    log.append(EventKind.STATE, state=JobState.RUNNING, reason="ranks up")
    for step in range(1, 2001):
        log.append(EventKind.STEP, rank=0, step={"step": step, "loss": 1.0})
        if step == 700:
            log.append(EventKind.STATE, state=JobState.RESTARTING, reason=Relaunch(resume="r", count=1).reason)
    for count in (2, 3):  # two relaunches in a row without a new step
        log.append(EventKind.STATE, state=JobState.RESTARTING, reason=Relaunch(resume="r", count=count).reason)
        log.append(EventKind.STEP, rank=0, step={"step": 1990, "loss": 1.0})  # a re-run step: no progress
    parsed = []
    real = Event.from_json.__func__
    monkeypatch.setattr(Event, "from_json", classmethod(lambda cls, line: parsed.append(line) or real(cls, line)))
    decision = relaunch.after_cluster_loss(record, run)
    assert isinstance(decision, Relaunch) and decision.count == 4, decision
    assert len(parsed) <= 64 + 1, len(parsed)

    log.append(EventKind.STATE, state=JobState.RESTARTING, reason=Relaunch(resume="r", count=4).reason)
    decision = relaunch.after_cluster_loss(record, run)
    assert isinstance(decision, relaunch.Ending) and decision.reason.startswith(
        f"the service restarted on a new Ray cluster {RELAUNCHES_WITHOUT_PROGRESS + 1} times in a row without the "
        "job reporting a step after step 2000 in between"), decision
    store.close()
