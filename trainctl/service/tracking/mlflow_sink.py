"""Logging jobs' runs to MLflow from one background thread, so the scheduler (and so every job) never
waits on a tracking server.

The follower hands the sink a job's run (`open`), its steps (`step`) and its end (`end`); each only
queues (trainctl.service.tracking.outbox). The thread finds the run (tag `trainctl.job_id`, so a
restarted service continues the run it logged before) or creates it with the job's tags and parameters
(a sweep's trial as a child of the sweep's run), sends the steps in batches and, once a job's steps are
all sent, its final status, reason and artifacts (the run report, built here once; one that cannot
be built is said in an event and the run ends without it). A server that fails a call is retried with backoff
(BACKOFF_FIRST doubling to BACKOFF_MOST seconds) while its jobs' steps wait in their bounded outboxes;
each job is told (`notify`) when its server becomes unreachable and when it is back. A sweep's run ends
when the sweep does (`sweep_state`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from trainctl.service.tracking.mlflow_client import MlflowApi, MlflowClientApi
from trainctl.service.tracking.outbox import STEP_BUFFER, Outbox
from trainctl.service.tracking.run import RunEnd, StepPoint, TrackedRun

log = logging.getLogger(__name__)

BACKOFF_FIRST = 1.0
BACKOFF_MOST = 30.0
STEPS_PER_SEND = 500
"""Steps sent in one pass for one job (up to 7 metrics each: a few log_batch calls)."""
SWEEP_CHECK_SECONDS = 5.0
"""How often the sweeps with an open run are checked for their end."""
STATUS = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
"""MLflow's run status for each terminal state of a job or sweep."""
REASON_MAX = 5000
"""Longest reason tag logged (MLflow's tag values hold 8,000 characters)."""
JOB_TAG, SWEEP_TAG, PARENT_TAG = "trainctl.job_id", "trainctl.sweep_id", "mlflow.parentRunId"

Notify = Callable[[str, str, str, dict[str, Any]], None]
"""(job id, level, message, extra payload): an event on the job."""


def shown(uri: str) -> str:
    """`uri` without any user name or password it carries, for messages and events."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


@dataclass
class _Server:
    """One tracking server: its client, and when it may be tried again after a failure."""

    api: MlflowApi
    retry_at: float = 0.0
    delay: float = 0.0
    parents: dict[str, str] = field(default_factory=dict)
    """Open sweep runs: sweep id -> run id."""


class MlflowSink:
    """Logs runs to MLflow servers on a thread of its own (`start`, `close`)."""

    def __init__(
        self, notify: Notify, sweep_state: Callable[[str], str | None], *,
        api_for: Callable[[str], MlflowApi] = MlflowClientApi, capacity: int = STEP_BUFFER,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._notify = notify
        self._sweep_state = sweep_state
        """The state of a sweep once it has ended (None while it runs or is unknown)."""
        self._api_for = api_for
        self._capacity = capacity
        self._clock = clock
        self._boxes: dict[str, Outbox] = {}
        self._servers: dict[str, _Server] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._sweeps_checked = 0.0

    # ---- the follower's side (never blocks on the network) -----------------------------------------
    def open(self, run: TrackedRun) -> None:
        """Start logging `run` (nothing changes for a job already open)."""
        with self._cond:
            if run.job_id not in self._boxes:
                self._boxes[run.job_id] = Outbox(run, self._capacity)
                self._cond.notify()

    def is_open(self, job_id: str) -> bool:
        with self._cond:
            return job_id in self._boxes

    def step(self, job_id: str, point: StepPoint) -> None:
        with self._cond:
            box = self._boxes.get(job_id)
            if box is not None and box.end is None:
                box.add(point)
                self._cond.notify()

    def end(self, job_id: str, end: RunEnd) -> None:
        with self._cond:
            box = self._boxes.get(job_id)
            if box is not None:
                box.end = end
                self._cond.notify()

    # ---- the thread ----------------------------------------------------------------------------------
    def start(self) -> MlflowSink:
        self._thread = threading.Thread(target=self._run, name="trainctl-mlflow", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after one last pass (within `timeout`); what is still queued is dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def pending(self) -> int:
        """Jobs with anything left to log."""
        with self._cond:
            return len(self._boxes)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(self._wait_seconds())
                stopping = self._stop
                boxes = list(self._boxes.values())
            for box in boxes:
                self._pass(box)
            self._check_sweeps()
            if stopping:
                return

    def _wait_seconds(self) -> float:
        """How long the thread may sleep: until a server may be retried, at most SWEEP_CHECK_SECONDS;
        not at all while a reachable server has work."""
        now = self._clock()
        waits = [SWEEP_CHECK_SECONDS]
        for box in self._boxes.values():
            server = self._servers.get(box.run.mlflow_uri or "")
            ready = server is None or server.retry_at <= now
            if ready and (box.run_id is None or box.steps or box.done):
                return 0.0
            if not ready:
                waits.append(server.retry_at - now)
        return max(0.0, min(waits))

    def _server(self, uri: str) -> _Server:
        if uri not in self._servers:
            self._servers[uri] = _Server(self._api_for(uri))
        return self._servers[uri]

    def _pass(self, box: Outbox) -> None:
        """Send what one job has waiting, if its server may be tried now."""
        uri = box.run.mlflow_uri
        if uri is None:
            return
        try:
            server = self._server(uri)
        except Exception as exc:  # the client could not even be built (a bad URI): nothing to retry
            log.warning("job %s: no MLflow client for %s: %s", box.run.job_id, shown(uri), exc)
            with self._cond:
                self._boxes.pop(box.run.job_id, None)
            return
        with self._cond:
            idle = box.run_id is not None and not box.steps and not box.done
        if idle or server.retry_at > self._clock():
            return
        points: list[StepPoint] = []
        try:
            if box.run_id is None:
                box.run_id = self._run_of(server, box.run)
            with self._cond:
                points = box.take(STEPS_PER_SEND)
            if points:
                server.api.log_steps(box.run_id, points)
            points = []
            with self._cond:
                done = box.done
            if done and box.end is not None:
                end = box.end
                if box.artifacts is None:
                    box.artifacts = self._artifacts(box.run.job_id, end)
                server.api.end_run(box.run_id, STATUS.get(end.state, "FAILED"), {"trainctl.reason": end.reason[:REASON_MAX]},
                                   box.artifacts)
        except Exception as exc:
            with self._cond:
                box.give_back(points)
            self._failed(server, box, exc)
            return
        server.delay = 0.0
        self._reached(box)
        if done:
            with self._cond:
                self._boxes.pop(box.run.job_id, None)

    def _artifacts(self, job_id: str, end: RunEnd) -> dict[str, bytes]:
        """The run's artifacts; none when they cannot be built (retrying the server would not change that)."""
        try:
            return end.artifacts()
        except Exception as exc:
            log.exception("job %s: the run's artifacts could not be built", job_id)
            self._notify(job_id, "WARNING", f"the run report could not be drawn ({type(exc).__name__}: {exc}); "
                         "the MLflow run ends without it", {})
            return {}

    def _run_of(self, server: _Server, run: TrackedRun) -> str:
        """The run already logged for the job (a restarted service), or a new one with its parameters."""
        experiment = server.api.experiment_id(run.experiment)
        found = server.api.find_run(experiment, JOB_TAG, run.job_id)
        if found is not None:
            return found
        tags = dict(run.tags)
        if run.sweep_id is not None:
            tags[PARENT_TAG] = self._parent_of(server, experiment, run.sweep_id)
        run_id = server.api.create_run(experiment, run.name, tags, time.time())
        server.api.log_params(run_id, run.params)
        self._notify(run.job_id, "INFO", f"MLflow run {run_id} on {shown(run.mlflow_uri or '')} "
                     f"(experiment {run.experiment!r})", {"mlflow_run_id": run_id})
        return run_id

    def _parent_of(self, server: _Server, experiment: str, sweep_id: str) -> str:
        """The run of sweep `sweep_id`, found or created."""
        if sweep_id not in server.parents:
            found = server.api.find_run(experiment, SWEEP_TAG, sweep_id)
            server.parents[sweep_id] = found or server.api.create_run(experiment, sweep_id, {SWEEP_TAG: sweep_id}, time.time())
        return server.parents[sweep_id]

    def _failed(self, server: _Server, box: Outbox, exc: Exception) -> None:
        server.delay = min(BACKOFF_MOST, max(BACKOFF_FIRST, server.delay * 2))
        server.retry_at = self._clock() + server.delay
        log.debug("job %s: MLflow call failed (%r); retrying in %.0f s", box.run.job_id, exc, server.delay)
        if not box.unreachable:
            box.unreachable = True
            self._notify(box.run.job_id, "WARNING", (
                f"MLflow server {shown(box.run.mlflow_uri or '')} is unreachable ({type(exc).__name__}); the job goes on, "
                f"its steps wait (up to {box.capacity}) and are retried"), {})

    def _reached(self, box: Outbox) -> None:
        if not box.unreachable:
            return
        box.unreachable = False
        with self._cond:
            dropped, box.dropped = box.dropped, 0
        lost = f"; {dropped} older steps were dropped meanwhile" if dropped else "; no step was lost"
        self._notify(box.run.job_id, "INFO", f"MLflow server {shown(box.run.mlflow_uri or '')} is back{lost}", {})

    def _check_sweeps(self) -> None:
        """End the runs of sweeps that have ended."""
        now = self._clock()
        if now - self._sweeps_checked < SWEEP_CHECK_SECONDS:
            return
        self._sweeps_checked = now
        for server in list(self._servers.values()):
            if server.retry_at > now:
                continue
            for sweep_id, run_id in list(server.parents.items()):
                try:
                    state = self._sweep_state(sweep_id)
                    if state is not None:
                        server.api.end_run(run_id, STATUS.get(state, "FAILED"), {}, {})
                        del server.parents[sweep_id]
                except Exception as exc:
                    log.debug("sweep %s: ending its MLflow run failed (%r); retrying", sweep_id, exc)
