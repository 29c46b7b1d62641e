"""The service's tracking policy (which MLflow servers a job may name, TensorBoard only with its
package) and the spec flattened into MLflow parameters within MLflow's limits."""

from __future__ import annotations

import pytest

from trainctl.service.tracking import policy as policy_module
from trainctl.service.tracking.flatten import PARAM_VALUE_MAX, PARAMS_PER_BATCH, batches, flatten
from trainctl.service.tracking.policy import TrackingPolicy, TrackingUnavailable
from trainctl.spec.job import TrackingSpec


def test_a_job_names_only_servers_the_service_allows() -> None:
    policy = TrackingPolicy.of_service("http://default:5000", ["http://team:5000"])
    assert policy.violations(TrackingSpec(mlflow_tracking_uri="http://team:5000")) == []
    assert policy.mlflow_uri(TrackingSpec()) == "http://default:5000"
    assert policy.mlflow_uri(TrackingSpec(mlflow_tracking_uri="http://team:5000")) == "http://team:5000"
    assert policy.mlflow_uri(TrackingSpec(mlflow=False)) is None
    (violation,) = policy.violations(TrackingSpec(mlflow_tracking_uri="http://evil:5000"))
    assert violation.field == "spec.tracking.mlflow_tracking_uri"
    assert "http://default:5000, http://team:5000" in violation.description
    assert TrackingPolicy.of_service(None, []).mlflow_uri(TrackingSpec()) is None


def test_tensorboard_and_mlflow_need_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_module, "installed", lambda package: False)
    (violation,) = TrackingPolicy.of_service(None, []).violations(TrackingSpec(tensorboard=True))
    assert violation.field == "spec.tracking.tensorboard" and "tensorboard package" in violation.description
    with pytest.raises(TrackingUnavailable, match="need the mlflow package"):
        TrackingPolicy.of_service("http://default:5000", [])


def test_the_spec_flattens_to_dotted_params_within_mlflows_limits() -> None:
    params = flatten({"training": {"lr": 0.01, "steps": 4}, "data": {"paths": ["a", "b"], "text": "x" * 7000},
                      "empty": {}, "none": None, "layers": [{"n": 1}]}, "spec")
    assert params["spec.training.lr"] == "0.01" and params["spec.training.steps"] == "4"
    assert params["spec.data.paths"] == '["a", "b"]' and params["spec.layers.0.n"] == "1"
    assert len(params["spec.data.text"]) == PARAM_VALUE_MAX and params["spec.data.text"].endswith("(truncated)")
    assert not any(key.startswith(("spec.empty", "spec.none")) for key in params)
    many = {f"k{i:03}": "v" for i in range(250)}
    sizes = [len(batch) for batch in batches(many)]
    assert sizes == [PARAMS_PER_BATCH, PARAMS_PER_BATCH, 50]
