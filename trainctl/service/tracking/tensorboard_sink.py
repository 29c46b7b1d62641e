"""TensorBoard event files in a job's run directory (`RunDirectory.tensorboard`): one scalar per metric
per step, written by the service (never the ranks) through TensorBoard's own event file writer, which
queues to a thread of its own and flushes every FLUSH_SECONDS. The `tensorboard` package is imported
only when a job asks for it (CreateJob refuses `spec.tracking.tensorboard` on a service without it)."""

from __future__ import annotations

import logging
from typing import Any

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.tracking.run import StepPoint, TrackedRun

log = logging.getLogger(__name__)

FLUSH_SECONDS = 10
"""Longest time a written step waits in memory before it is in the event file."""


class TensorBoardSink:
    """One event file writer per open job that asked for TensorBoard."""

    def __init__(self) -> None:
        self._writers: dict[str, Any] = {}

    def open(self, run: TrackedRun) -> None:
        if not run.tensorboard or run.job_id in self._writers or not run.run_dir:
            return
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory = RunDirectory.at(run.run_dir).tensorboard
        directory.mkdir(parents=True, exist_ok=True)
        self._writers[run.job_id] = EventFileWriter(str(directory), flush_secs=FLUSH_SECONDS)

    def is_open(self, job_id: str) -> bool:
        return job_id in self._writers

    def step(self, job_id: str, point: StepPoint) -> None:
        writer = self._writers.get(job_id)
        if writer is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in point.values.items()]
        writer.add_event(Event(wall_time=point.time, step=point.step, summary=Summary(value=values)))

    def end(self, job_id: str) -> None:
        """Flush and close the job's event file."""
        writer = self._writers.pop(job_id, None)
        if writer is not None:
            writer.close()

    def close(self) -> None:
        for job_id in list(self._writers):
            self.end(job_id)
