"""The MLflow sink against a fake server: runs found or created with their tags and parameters, steps
buffered while the server is down (the oldest dropped and counted when full) and sent once it is back,
one event each way, the run ended only after its last step, and a sweep's run ended with the sweep."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from trainctl.service.tracking.mlflow_sink import PARENT_TAG, MlflowSink
from trainctl.service.tracking.run import RunEnd, StepPoint, TrackedRun


class FakeMlflow:
    """An MLflow server in memory that fails every call while `down` is set."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.runs: dict[str, dict[str, Any]] = {}
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
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

    def end_run(self, run_id: str, status: str, tags: dict[str, str], report: dict[str, Any] | None) -> None:
        self._call()
        self.runs[run_id].update(status=status, report=report)
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
        sink.end("j1", RunEnd("SUCCEEDED", "done", lambda: {"steps": [1, 2, 3]}))
        wait_for(lambda: sink.pending() == 0)
    finally:
        sink.close()
    (run,) = server.runs.values()
    assert run["steps"] == [1, 2, 3] and run["status"] == "FINISHED" and run["report"] == {"steps": [1, 2, 3]}
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


def test_retries_back_off(server: FakeMlflow) -> None:
    server.down.set()
    sink = sink_of(server, [])
    try:
        sink.open(tracked())
        time.sleep(3.5)  # tries at 0, 1 and 3 s (backoff 1, 2, 4 s)
    finally:
        sink.close()
    assert 2 <= server.calls <= 4


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
