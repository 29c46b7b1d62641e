"""What the scheduler's follower tells the trackers (it runs on the leading replica only, so one replica
logs each run): a job runs (`running`), each step (`step`), the job ended (`ended`). Each call only
queues or writes locally; MLflow is reached from its sink's own thread, which also draws the run report
(the run's artifacts: `report.png`, `report.html`, `report.json`) from the job as GetJob(JOB_VIEW_FULL)
answers it.

A job is opened lazily too: the first step the follower applies after a service restart opens it again,
and the MLflow sink then finds the run it logged before (by its `trainctl.job_id` tag) instead of making
a new one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from trainctl.observability.run_report import ReportError, render
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.service import store as st
from trainctl.service.api import job_messages
from trainctl.service.api.job_messages import JobMessages, full_view
from trainctl.service.store import JobRecord, JobStore
from trainctl.service.tracking.flatten import flatten
from trainctl.service.tracking.mlflow_sink import JOB_TAG, MlflowSink
from trainctl.service.tracking.policy import TrackingPolicy
from trainctl.service.tracking.run import RunEnd, StepPoint, TrackedRun
from trainctl.service.tracking.tensorboard_sink import TensorBoardSink
from trainctl.spec.sweep import SWEEP_LABEL, TRIAL_LABEL

log = logging.getLogger(__name__)

GridOf = Callable[[], RankGrid]
"""A job's rank grid, asked for only when its run is opened: the scheduler's resolved job
(`SchedulerState.resolved_job`), so the tracker derives no layout again."""
REPORT_PNG, REPORT_HTML, REPORT_JSON = "report.png", "report.html", "report.json"
"""The run's artifacts: the run report (trainctl.observability.run_report) as `trainctl report` draws
it, and the job's identity, end and every recorded step as JSON (the fields MLflow's metrics leave out
too: tokens, peak memory, the step-time breakdown)."""


def experiment_of(record: JobRecord) -> str:
    """The MLflow experiment of a job: its spec's, else `trainctl/<tenant>`."""
    return record.job.spec.tracking.mlflow_experiment or f"trainctl/{record.tenant}"


def placement_summary(placement: list[dict[str, Any]]) -> str:
    """Ranks per node, e.g. 'node-0:4, node-1:4' (empty before the job is placed)."""
    per_node: dict[str, int] = {}
    for item in placement:
        per_node[str(item.get("node"))] = per_node.get(str(item.get("node")), 0) + 1
    return ", ".join(f"{node}:{ranks}" for node, ranks in sorted(per_node.items()))


def layout_of(grid: GridOf) -> str:
    """The job's rank layout as its grid describes it ('dp2 x tp2 (4 ranks)')."""
    try:
        return grid().describe()
    except Exception as exc:  # the job was admitted with this layout; a tag is no reason to fail following it
        return f"unknown ({exc})"


class JobTracker:
    """Hands each job's run, steps and end to the sinks its spec and the service's policy ask for."""

    def __init__(self, policy: TrackingPolicy, store: JobStore, *, mlflow: MlflowSink | None = None):
        self.policy = policy
        self._store = store
        self._messages = JobMessages(capacity=1)
        """Builds the ended jobs' messages for their reports (one at a time, on the MLflow sink's thread)."""
        self._tensorboard = TensorBoardSink()
        self._mlflow = mlflow
        if mlflow is None and policy.servers:
            self._mlflow = MlflowSink(self._notify, self._sweep_state)

    def start(self) -> JobTracker:
        if self._mlflow is not None:
            self._mlflow.start()
        return self

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.close()
        self._tensorboard.close()

    def tracked(self, record: JobRecord, grid: GridOf) -> TrackedRun | None:
        """The job's run, or None when it is tracked nowhere."""
        tracking = record.job.spec.tracking
        uri = self.policy.mlflow_uri(tracking) if self._mlflow is not None else None
        if uri is None and not tracking.tensorboard:
            return None
        labels = record.job.metadata.labels
        tags = {
            JOB_TAG: record.id, "trainctl.tenant": record.tenant, "trainctl.layout": layout_of(grid),
            "trainctl.placement": placement_summary(record.placement),
        }
        if SWEEP_LABEL in labels:
            tags.update({"trainctl.sweep": labels[SWEEP_LABEL], "trainctl.trial": labels.get(TRIAL_LABEL, "")})
        return TrackedRun(
            job_id=record.id, name=f"{record.name} ({record.id})", tenant=record.tenant, run_dir=record.run_dir,
            mlflow_uri=uri, experiment=experiment_of(record), tensorboard=tracking.tensorboard, tags=tags,
            params=flatten(record.job.spec.model_dump(mode="json", exclude_none=True), "spec"),
            sweep_id=labels.get(SWEEP_LABEL),
        )

    def running(self, record: JobRecord, grid: GridOf) -> None:
        """The job runs: open its run where it is tracked."""
        self._guarded(record, self._running, grid)

    def step(self, record: JobRecord, grid: GridOf, step: dict[str, Any], time: float) -> None:
        """One step the job reported (a step event's payload, at `time`)."""
        self._guarded(record, self._step, grid, step, time)

    def ended(self, record: JobRecord, grid: GridOf) -> None:
        """The job reached its terminal state: end its run (a job that never ran has none)."""
        self._guarded(record, self._ended, grid)

    def _guarded(self, record: JobRecord, call: Callable[..., None], *args: Any) -> None:
        """Run `call`; tracking never fails the following of a job, so an error is only logged."""
        try:
            call(record, *args)
        except Exception:
            log.exception("job %s: tracking failed", record.id)

    def _running(self, record: JobRecord, grid: GridOf) -> None:
        run = self.tracked(record, grid)
        if run is None:
            return
        if self._mlflow is not None and run.mlflow_uri is not None:
            self._mlflow.open(run)
        try:
            self._tensorboard.open(run)
        except OSError as exc:  # the run directory is the service's: a full disk is worth a word, not a failed job
            self._notify(record.id, "WARNING", f"TensorBoard event files could not be opened: {exc}", {})

    def _step(self, record: JobRecord, grid: GridOf, step: dict[str, Any], time: float) -> None:
        if not self._open(record):
            self._running(record, grid)
        point = StepPoint.of(step, time)
        if self._mlflow is not None:
            self._mlflow.step(record.id, point)
        self._tensorboard.step(record.id, point)

    def _ended(self, record: JobRecord, grid: GridOf) -> None:
        if not self._open(record):
            if record.start_time is None:
                return
            self._running(record, grid)
        if self._mlflow is not None:
            self._mlflow.end(record.id, RunEnd(record.state.value, record.reason, lambda: self.artifacts(record)))
        self._tensorboard.end(record.id)

    def _open(self, record: JobRecord) -> bool:
        return (self._mlflow is not None and self._mlflow.is_open(record.id)) or self._tensorboard.is_open(record.id)

    def artifacts(self, record: JobRecord) -> dict[str, bytes]:
        """The ended job's run artifacts (REPORT_PNG, REPORT_HTML, REPORT_JSON; a job that recorded no
        step has nothing to draw: only the JSON). Drawn on the MLflow sink's thread."""
        steps = self._store.step_metrics(record.id)
        artifacts = {REPORT_JSON: json.dumps({
            "job_id": record.id, "name": record.name, "tenant": record.tenant, "state": record.state.value,
            "reason": record.reason, "steps": steps,
        }).encode()}
        try:
            # the steps GetJob(JOB_VIEW_FULL) answers, as the store picks them (`thinned_step_metrics`)
            report = render(full_view(self._messages, record, self._store.thinned_step_metrics(record.id, job_messages.FULL_VIEW_STEPS)))
        except ReportError:
            return artifacts
        return {REPORT_PNG: report.png, REPORT_HTML: report.html.encode(), **artifacts}

    def _notify(self, job_id: str, level: str, message: str, extra: dict[str, Any]) -> None:
        """An event on the job (from the MLflow sink's thread too); a store that is away loses only it."""
        try:
            self._store.append_event(job_id, st.EVENT_LOG, {"level": level, "message": message, **extra})
        except Exception as exc:
            log.warning("job %s: could not record %r: %s", job_id, message, exc)

    def _sweep_state(self, sweep_id: str) -> str | None:
        sweep = self._store.get_sweep(sweep_id)
        return sweep.state.value if sweep.state.terminal else None
