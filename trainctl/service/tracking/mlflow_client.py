"""The few MLflow calls the tracker makes, over the `mlflow` package's `MlflowClient` (imported here
only: the package is optional). `MlflowApi` is what the sink needs; tests hand it a fake."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from trainctl.service.tracking.flatten import batches
from trainctl.service.tracking.run import StepPoint

METRICS_PER_BATCH = 1000
"""MLflow's most metrics in one log_batch call."""
REQUEST_TIMEOUT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""The MLflow client's own retries (7, with backoff: minutes) and timeout (120 s) made short unless the
service's environment sets them: the sink retries with its own backoff and must notice an outage soon."""


class MlflowApi(Protocol):
    """The MLflow calls the sink makes on one tracking server."""

    def experiment_id(self, name: str) -> str: ...

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None: ...

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str], start_time: float) -> str: ...

    def log_params(self, run_id: str, params: dict[str, str]) -> None: ...

    def log_steps(self, run_id: str, points: list[StepPoint]) -> None: ...

    def end_run(self, run_id: str, status: str, tags: dict[str, str], artifacts: dict[str, bytes]) -> None: ...


class MlflowClientApi:
    """`MlflowApi` over `mlflow.tracking.MlflowClient` for the server at `uri`; credentials come from
    the service's environment (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD), as MLflow reads them."""

    def __init__(self, uri: str):
        for name, value in REQUEST_TIMEOUT_ENV.items():
            os.environ.setdefault(name, value)
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str) -> str:
        """The id of experiment `name`, created when missing."""
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self._client.create_experiment(name)

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        runs = self._client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str], start_time: float) -> str:
        run = self._client.create_run(experiment_id, start_time=int(start_time * 1000), tags=tags, run_name=name)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        for batch in batches(params):
            self._client.log_batch(run_id, params=[Param(key, value) for key, value in batch.items()])

    def log_steps(self, run_id: str, points: list[StepPoint]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(name, value, int(p.time * 1000), p.step) for p in points for name, value in p.values.items()]
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=metrics[start : start + METRICS_PER_BATCH])

    def end_run(self, run_id: str, status: str, tags: dict[str, str], artifacts: dict[str, bytes]) -> None:
        """Log the final tags and the artifacts (file name -> content, at the run's artifact root), then
        the status."""
        from mlflow.entities import RunTag

        if tags:
            self._client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        if artifacts:
            with tempfile.TemporaryDirectory(prefix="trainctl-artifacts-") as folder:
                for name, content in artifacts.items():
                    (Path(folder) / name).write_bytes(content)
                self._client.log_artifacts(run_id, folder)
        self._client.set_terminated(run_id, status=status)
