"""KubeRay's autoscaler in the built overlays: enabled with its options, the worker groups' bounds within
the topology map, the control plane asking for nodes (`--autoscaling`), and the Kubernetes API token
mounted into the autoscaler's container alone. Every object also passes its strict schema
(tests/deploy/test_kubernetes.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from deploy_support import DEPLOY, require_tool
from k8s_support import kustomize, schema_errors

from trainctl.workers.topology.model import TopologyMap

OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "kubernetes" / "overlays").glob("*/kustomization.yaml"))
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    kubectl = require_tool("kubectl", "kubectl (with its built-in kustomize) is part of the machine image")
    return {name: kustomize(kubectl, DEPLOY / "kubernetes" / "overlays" / name) for name in OVERLAYS}


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscaler_is_on_with_bounds_the_map_can_fill(built, overlay) -> None:
    docs = built[overlay]
    cluster = only(docs, "RayCluster")
    assert schema_errors(cluster) == []
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["version"] == "v1", "v1 sizes by shape; the name label is the init container's, unseen by v2"
    assert options["idleTimeoutSeconds"] > 0 and options["upscalingMode"] == "Default"
    topology = TopologyMap.model_validate(yaml.safe_load(only(docs, "ConfigMap", "trainctl-topology")["data"]["topology.yaml"]))
    most = 0
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        most += group["maxReplicas"]
    assert most <= len(topology.spec.nodes), "the autoscaler could add pods for hosts the map does not name"


def test_the_h100_group_scales_between_zero_and_the_maps_nodes(built) -> None:
    (group,) = only(built["gpu-h100"], "RayCluster")["spec"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == (0, 32)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_control_plane_asks_for_nodes(built, overlay) -> None:
    containers = [c for d in built[overlay] if d["kind"] in ("RayCluster", "Deployment")
                  for c in _pod(d)["containers"] if c["name"] == "trainctl"]
    assert containers and all("--autoscaling" in c["args"] for c in containers)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_autoscaler_mounts_the_api_token(built, overlay) -> None:
    cluster = only(built[overlay], "RayCluster")
    head = _pod(cluster)
    assert head["automountServiceAccountToken"] is False
    mounts = cluster["spec"]["autoscalerOptions"]["volumeMounts"]
    assert [(m["name"], m["mountPath"], m["readOnly"]) for m in mounts] == [("autoscaler-token", TOKEN_DIR, True)]
    (volume,) = [v for v in head["volumes"] if v["name"] == "autoscaler-token"]
    sources = volume["projected"]["sources"]
    assert [next(iter(s)) for s in sources] == ["serviceAccountToken", "configMap", "downwardAPI"]
    for container in head.get("initContainers", []) + head["containers"]:
        assert all(m["name"] != "autoscaler-token" for m in container.get("volumeMounts", [])), container["name"]


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment, or of a RayCluster's head."""
    if doc["kind"] == "RayCluster":
        return doc["spec"]["headGroupSpec"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]
