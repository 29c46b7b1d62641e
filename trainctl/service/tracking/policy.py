"""Which MLflow tracking servers the service logs to, and the checks that keep jobs to them.

A job may name `spec.tracking.mlflow_tracking_uri` only when the service allows that server (its
default, `trainctl serve --mlflow-tracking-uri`, or one of `--mlflow-allow`): the service holds the
servers' credentials (MLFLOW_TRACKING_TOKEN and the like, in its own environment), so a job naming any
server it liked would have the service log in there for it. TensorBoard needs the `tensorboard` package
on the service.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from trainctl.spec.job import TrackingSpec
from trainctl.spec.validate import FieldViolation


class TrackingUnavailable(RuntimeError):
    """The service was configured to track with a package it does not have."""


def installed(package: str) -> bool:
    """Whether `package` can be imported here (without importing it)."""
    return importlib.util.find_spec(package) is not None


@dataclass(frozen=True)
class TrackingPolicy:
    """The service's MLflow servers: `default_uri` for jobs that name none, `allowed` besides it."""

    default_uri: str | None = None
    allowed: frozenset[str] = field(default_factory=frozenset)
    tensorboard_installed: bool = False

    @classmethod
    def of_service(cls, default_uri: str | None, allowed: list[str]) -> TrackingPolicy:
        """The policy `trainctl serve` was started with; TrackingUnavailable when it names an MLflow
        server and the `mlflow` package is not installed."""
        if (default_uri or allowed) and not installed("mlflow"):
            raise TrackingUnavailable(
                "--mlflow-tracking-uri/--mlflow-allow need the mlflow package on the service: "
                "pip install 'trainctl[tracking]' (or pip install mlflow)"
            )
        return cls(default_uri, frozenset(allowed), installed("tensorboard"))

    @property
    def servers(self) -> frozenset[str]:
        """Every server a job may name."""
        return self.allowed | ({self.default_uri} if self.default_uri else set())

    def mlflow_uri(self, tracking: TrackingSpec) -> str | None:
        """The server a job's run is logged to (None: not logged to MLflow)."""
        if not tracking.mlflow:
            return None
        return tracking.mlflow_tracking_uri or self.default_uri

    def violations(self, tracking: TrackingSpec) -> list[FieldViolation]:
        """What in `tracking` the service refuses: a server it does not allow, TensorBoard without it."""
        out: list[FieldViolation] = []
        uri = tracking.mlflow_tracking_uri
        if uri is not None and uri not in self.servers:
            allowed = ", ".join(sorted(self.servers)) or "none"
            out.append(FieldViolation(
                "spec.tracking.mlflow_tracking_uri",
                f"the service does not log to this MLflow server; it allows: {allowed} "
                "(the operator adds servers with trainctl serve --mlflow-allow)",
            ))
        if tracking.tensorboard and not self.tensorboard_installed:
            out.append(FieldViolation(
                "spec.tracking.tensorboard",
                "the service has no tensorboard package to write event files with "
                "(the operator installs it: pip install 'trainctl[tracking]')",
            ))
        return out
