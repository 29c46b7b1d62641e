"""The MLflow sink against a fake server: runs found or created with their tags and parameters, steps
buffered while the server is down (the oldest dropped and counted when full) and sent once it is back,
one event each way, the run ended only after its last step, and a sweep's run ended with the sweep. The
tracker over a real store: the layout tag from the grid the scheduler hands it, and the run report
(`report.png`, `report.html`, `report.json`) drawn from the job as GetJob(JOB_VIEW_FULL) answers it."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from trainctl.observability.run_report import report_page
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.service.api.job_messages import JobMessages, full_view
from trainctl.service.store import JobStore
from trainctl.service.tracking.mlflow_sink import PARENT_TAG, MlflowSink
from trainctl.service.tracking.policy import TrackingPolicy
from trainctl.service.tracking.run import RunEnd, StepPoint, TrackedRun
from trainctl.service.tracking.tracker import JobTracker
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState


class FakeMlflow:
    """An MLflow server in memory that fails every call while `down` is set."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.runs: dict[str, dict[str, Any]] = {}
        self.calls = 0
        self.call_times: list[float] = []

    def _call(self) -> None:
        self.calls += 1
        self.call_times.append(time.monotonic())
        if self.down.is_set():
            raise ConnectionError("connection refused")

    def experiment_id(self, name: str) -> str:
        self._call()
        return f"exp-{name}"

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        self._call()
        return next((rid for rid, r in self.runs.items() if r["experiment"] == experiment_id and r["tags"].get(tag) == value), None)

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str], start_time: float) -> str:
        self._call()
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = {"experiment": experiment_id, "name": name, "tags": dict(tags), "params": {}, "steps": [], "status": "RUNNING"}
        return run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        self._call()
        self.runs[run_id]["params"].update(params)

    def log_steps(self, run_id: str, points: list[StepPoint]) -> None:
        self._call()
        self.runs[run_id]["steps"] += [p.step for p in points]

    def end_run(self, run_id: str, status: str, tags: dict[str, str], artifacts: dict[str, bytes]) -> None:
        self._call()
        self.runs[run_id].update(status=status, artifacts=artifacts)
        self.runs[run_id]["tags"].update(tags)


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def server() -> FakeMlflow:
    return FakeMlflow()


def tracked(job_id: str = "j1", sweep_id: str | None = None) -> TrackedRun:
    return TrackedRun(
        job_id=job_id, name=f"job ({job_id})", tenant="t", run_dir="", mlflow_uri="http://mlflow", experiment="trainctl/t",
        tensorboard=False, tags={"trainctl.job_id": job_id}, params={"spec.training.lr": "0.01"}, sweep_id=sweep_id,
    )


def point(step: int) -> StepPoint:
    return StepPoint(step, 1000.0 + step, {"loss": 1.0 / step})


def sink_of(server: FakeMlflow, events: list[tuple[str, str, str]], **kwargs: Any) -> MlflowSink:
    sink = MlflowSink(lambda job, level, message, extra: events.append((job, level, message)),
                      kwargs.pop("sweep_state", lambda _sweep: None), api_for=lambda _uri: server, **kwargs)
    return sink.start()


def test_a_run_is_created_with_its_params_steps_and_end(server: FakeMlflow) -> None:
    events: list[tuple[str, str, str]] = []
    sink = sink_of(server, events)
    try:
        sink.open(tracked())
        for step in (1, 2, 3):
            sink.step("j1", point(step))
        sink.end("j1", RunEnd("SUCCEEDED", "done", lambda: {"report.json": b"[1, 2, 3]"}))
        wait_for(lambda: sink.pending() == 0)
    finally:
        sink.close()
    (run,) = server.runs.values()
    assert run["steps"] == [1, 2, 3] and run["status"] == "FINISHED" and run["artifacts"] == {"report.json": b"[1, 2, 3]"}
    assert run["params"] == {"spec.training.lr": "0.01"} and run["tags"]["trainctl.reason"] == "done"
    assert [e[2].split(" ")[:2] for e in events] == [["MLflow", "run"]]


def test_a_restarted_service_continues_the_run_it_logged(server: FakeMlflow) -> None:
    def logged() -> list[int]:
        return [step for run in server.runs.values() for step in run["steps"]]

    for steps in ([1, 2], [3]):  # two services, one after the other
        sink = sink_of(server, [])
        try:
            sink.open(tracked())
            for step in steps:
                sink.step("j1", point(step))
            wait_for(lambda steps=steps: logged()[-1:] == steps[-1:])
        finally:
            sink.close()
    assert len(server.runs) == 1 and logged() == [1, 2, 3]


def test_steps_wait_while_the_server_is_down_and_the_oldest_are_dropped(server: FakeMlflow) -> None:
    events: list[tuple[str, str, str]] = []
    server.down.set()
    sink = sink_of(server, events, capacity=3)
    try:
        sink.open(tracked())
        wait_for(lambda: events)
        for step in range(1, 6):
            started = time.monotonic()
            sink.step("j1", point(step))
            assert time.monotonic() - started < 0.5  # the caller never waits on the server
        sink.end("j1", RunEnd("FAILED", "a rank failed", lambda: {}))
        assert events == [("j1", "WARNING", events[0][2])] and "unreachable" in events[0][2]
        server.down.clear()
        wait_for(lambda: sink.pending() == 0, timeout=15)  # the first retry comes after BACKOFF_FIRST
    finally:
        sink.close()
    (run,) = server.runs.values()
    assert run["steps"] == [3, 4, 5] and run["status"] == "FAILED"
    assert events[-1][1] == "INFO" and "is back; 2 older steps were dropped" in events[-1][2]


def test_retries_back_off(server: FakeMlflow, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainctl.service.tracking.mlflow_sink.BACKOFF_FIRST", 0.05)
    monkeypatch.setattr("trainctl.service.tracking.mlflow_sink.BACKOFF_MOST", 0.2)
    server.down.set()
    sink = sink_of(server, [])
    try:
        sink.open(tracked())
        wait_for(lambda: server.calls >= 6)
    finally:
        sink.close()
    gaps = [later - earlier for earlier, later in itertools.pairwise(server.call_times)][:5]
    assert [round(g, 2) >= wait for g, wait in zip(gaps, (0.05, 0.1, 0.2, 0.2, 0.2), strict=True)] == [True] * 5, gaps
    assert max(gaps[3:]) < 2.0, f"the delay stops doubling at BACKOFF_MOST: {gaps}"


def test_trials_are_children_of_their_sweep_run_which_ends_with_the_sweep(server: FakeMlflow, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainctl.service.tracking.mlflow_sink.SWEEP_CHECK_SECONDS", 0.05)
    ended: dict[str, str] = {}
    sink = sink_of(server, [], sweep_state=ended.get)
    try:
        for job in ("t0", "t1"):
            sink.open(tracked(job, sweep_id="s1"))
            sink.end(job, RunEnd("SUCCEEDED", "", lambda: {}))
        wait_for(lambda: sink.pending() == 0)
        parent = next(rid for rid, r in server.runs.items() if r["name"] == "s1")
        children = [r for r in server.runs.values() if r["tags"].get(PARENT_TAG) == parent]
        assert len(children) == 2 and server.runs[parent]["status"] == "RUNNING"
        ended["s1"] = "CANCELLED"
        wait_for(lambda: server.runs[parent]["status"] == "KILLED")
    finally:
        sink.close()


def test_the_report_is_drawn_once_on_the_sinks_thread_and_one_that_fails_ends_the_run_without_it(server: FakeMlflow) -> None:
    events: list[tuple[str, str, str]] = []
    drawn: list[str] = []

    def report() -> dict[str, bytes]:
        drawn.append(threading.current_thread().name)
        return {"report.png": b"\x89PNG..."}

    def broken() -> dict[str, bytes]:
        raise RuntimeError("no font")

    sink = sink_of(server, events)
    try:
        sink.open(tracked("j1"))
        wait_for(lambda: sink.pending() == 1 and server.runs)
        server.down.set()
        sink.end("j1", RunEnd("SUCCEEDED", "", report))
        wait_for(lambda: any("unreachable" in e[2] for e in events))  # ending the run failed once
        server.down.clear()
        wait_for(lambda: sink.pending() == 0, timeout=15)
        sink.open(tracked("j2"))
        sink.end("j2", RunEnd("SUCCEEDED", "", broken))
        wait_for(lambda: sink.pending() == 0)
    finally:
        sink.close()
    assert drawn == ["trainctl-mlflow"]  # once, though the end was sent twice; never on the caller's thread
    first, second = (next(r for r in server.runs.values() if r["tags"]["trainctl.job_id"] == job) for job in ("j1", "j2"))
    assert first["status"] == "FINISHED" and first["artifacts"] == {"report.png": b"\x89PNG..."}
    assert second["status"] == "FINISHED" and second["artifacts"] == {}
    assert ("j2", "WARNING", "the run report could not be drawn (RuntimeError: no font); the MLflow run ends without it") in events


def test_the_tracker_tags_the_grid_it_is_handed_and_logs_the_run_report(server: FakeMlflow, tmp_path: Path) -> None:
    store = JobStore(tmp_path / "data")
    asked: list[int] = []

    def grid() -> RankGrid:
        asked.append(1)
        return RankGrid(dp_shard=2, tp=2)

    sink = sink_of(server, [])
    tracker = JobTracker(TrackingPolicy(default_uri="http://mlflow"), store, mlflow=sink)
    try:
        record, _ = store.create_job(TrainingJob.model_validate({"metadata": {"name": "reported"}, "spec": {}}))
        placement = [{"rank": r, "node": f"node-{r // 2}", "gpu": r % 2, "coords": {"dp_shard": r // 2, "tp": r % 2}} for r in range(4)]
        record = store.update_status(record.id, state=JobState.RUNNING, reason="", start_time=100.0, placement=placement)
        tracker.running(record, grid)
        for step in (1, 2, 3):
            payload = {"step": step, "loss": 3.0 / step, "tokens_per_second": 1000.0, **({"eval_loss": 1.25} if step == 2 else {})}
            store.record_step(record.id, {**payload, "time": 100.0 + step})
            tracker.step(record, grid, payload, 100.0 + step)
        record = store.update_status(record.id, state=JobState.SUCCEEDED, reason="finished 3 steps")
        tracker.ended(record, grid)
        wait_for(lambda: sink.pending() == 0, timeout=60)
        expected = full_view(JobMessages(), record, store.step_metrics(record.id))  # what GetJob(JOB_VIEW_FULL) answers
    finally:
        tracker.close()
        store.close()
    (run,) = server.runs.values()
    assert run["tags"]["trainctl.layout"] == "dp_shard2 x tp2 (4 ranks)" and asked == [1]  # asked once, when the run opened
    assert run["steps"] == [1, 2, 3] and run["status"] == "FINISHED"
    artifacts = run["artifacts"]
    assert sorted(artifacts) == ["report.html", "report.json", "report.png"]
    png = artifacts["report.png"]
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[16:24] == (1500).to_bytes(4, "big") + (900).to_bytes(4, "big")
    assert artifacts["report.html"].decode() == report_page(expected, png)  # drawn from the API's full view
    page = artifacts["report.html"].decode()
    assert "SUCCEEDED finished 3 steps" in page and "<td>node-1</td><td>1</td>" in page
    assert "<tr><td>2</td><td>1.25</td><td>3.49</td></tr>" in page
    steps = json.loads(artifacts["report.json"])
    assert steps["job_id"] == record.id and [s["step"] for s in steps["steps"]] == [1, 2, 3]


def test_a_job_that_recorded_no_step_logs_only_its_json(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "data")
    try:
        record, _ = store.create_job(TrainingJob.model_validate({"metadata": {"name": "early"}, "spec": {}}))
        record = store.update_status(record.id, state=JobState.FAILED, reason="a rank failed at start")
        artifacts = JobTracker(TrackingPolicy(), store).artifacts(record)
    finally:
        store.close()
    assert list(artifacts) == ["report.json"] and json.loads(artifacts["report.json"])["steps"] == []
