"""RunDirectory: the one place that names the parts of a job's run directory.

The service's scheduler builds it once per job at admission (`RunDirectory.of_job`, recorded in the job's
``run_dir``) and hands it down: to the runtime, which creates it, and, as a string across Ray, to the
job's supervisor, which builds it again from that string (`RunDirectory.at`) and hands its ranks their
parts. Readers take its parts from here and never compose them. The layout::

    <runs_dir>/<job id>/
        events.jsonl        the job's event log (trainctl.workers.events), kept by its supervisor
        ray_session         the Ray session its supervisor was last started in (trainctl.workers.runtime)
        checkpoints/        the checkpoint root its ranks save to and resume from (checkpoint.layout)
            job.json        the job the checkpoints were written for (checkpoint.source.write_run_spec)
            step_<N>/       one checkpoint
        logs/               a command job's rank output, rank-<R>.log (trainctl.workers.command.output)
        tensorboard/        TensorBoard event files the service writes (trainctl.service.tracking)

A checkpoint root outside a run directory (``Trainer(checkpoint_dir=...)``,
``python -m trainctl.parallelism.launch --checkpoint-dir``) records its job the same way:
`RunDirectory.run_spec_in`. Standard library only: the control plane imports it without the engine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_EVENTS = "events.jsonl"
_RAY_SESSION = "ray_session"
_CHECKPOINTS = "checkpoints"
_RUN_SPEC = "job.json"
_LOGS = "logs"
_TENSORBOARD = "tensorboard"

JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""A job id: one path component under the runs directory (and part of its supervisor's Ray actor name)."""


def check_job_id(job_id: str) -> None:
    """Raise ValueError naming `job_id` unless it matches `JOB_ID_PATTERN`."""
    if not JOB_ID_PATTERN.match(job_id):
        raise ValueError(
            f"job id {job_id!r} must be 1-128 characters of letters, digits, '_', '.' and '-', starting alphanumeric"
        )


@dataclass(frozen=True)
class RunDirectory:
    """A job's run directory (`root`) and its parts (the module docstring draws the layout)."""

    root: Path

    @classmethod
    def of_job(cls, runs_dir: str | os.PathLike[str], job_id: str) -> RunDirectory:
        """The run directory of job `job_id` under `runs_dir` (ValueError for an id that is not one safe
        path component)."""
        check_job_id(job_id)
        return cls(Path(runs_dir) / job_id)

    @classmethod
    def at(cls, where: RunDirectory | str | os.PathLike[str]) -> RunDirectory:
        """The run directory `where` names (a path handed down as a string), its root made absolute with
        symlinks resolved; ValueError for an empty string, which names none."""
        if isinstance(where, RunDirectory):
            where = where.root
        if not os.fspath(where):
            raise ValueError("no run directory: the path is empty")
        return cls(Path(where).resolve())

    @classmethod
    def laid_out_at(cls, path: str | os.PathLike[str]) -> RunDirectory | None:
        """`path` as a run directory when it is laid out as one (it holds a `checkpoints/` directory or an
        `events.jsonl` file), else None."""
        run = cls(Path(path))
        return run if run.checkpoints.is_dir() or run.events.is_file() else None

    @staticmethod
    def run_spec_in(checkpoint_root: str | os.PathLike[str]) -> Path:
        """The file a checkpoint root records its job in (a run directory's is `run_spec`)."""
        return Path(checkpoint_root) / _RUN_SPEC

    def create(self) -> RunDirectory:
        """Make the directory and its `checkpoints/` (where they exist already, nothing changes)."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def events(self) -> Path:
        """The job's event log, one JSON object per line."""
        return self.root / _EVENTS

    @property
    def ray_session(self) -> Path:
        """The name of the Ray session the job's supervisor was last started in."""
        return self.root / _RAY_SESSION

    @property
    def checkpoints(self) -> Path:
        """The checkpoint root: `step_<N>/` checkpoints and `job.json`."""
        return self.root / _CHECKPOINTS

    @property
    def run_spec(self) -> Path:
        """The job the checkpoints were written for, as JSON."""
        return self.run_spec_in(self.checkpoints)

    @property
    def logs(self) -> Path:
        """A command job's per-rank output files."""
        return self.root / _LOGS

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of the job's steps, written by the service (`spec.tracking.tensorboard`)."""
        return self.root / _TENSORBOARD
