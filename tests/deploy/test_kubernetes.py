"""The kustomize overlays: they build, every object passes its strict schema from tests/fixtures/schemas,
and the objects agree with each other and with the project (selectors, ports, volumes, images, Ray
version, CLI flags, generated monitoring objects, the topology-labels init container)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import DEPLOY, REPO, require_tool
from k8s_support import kustomize, schema_errors

KUBE = DEPLOY / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
RAY_PIN = re.search(r"^ray\[[^\]]*\]==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)


@pytest.fixture(scope="module")
def kubectl() -> str:
    return require_tool("kubectl", "kubectl (with its built-in kustomize) is part of the machine image")


@pytest.fixture(scope="module")
def built(kubectl) -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(kubectl, KUBE / "overlays" / name) for name in OVERLAYS}


@dataclass
class PodTemplate:
    where: str
    namespace: str
    labels: dict[str, str]
    spec: dict[str, Any]

    def containers(self) -> list[dict[str, Any]]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def port_names(self) -> set[str]:
        return {p["name"] for c in self.spec["containers"] for p in c.get("ports", []) if "name" in p}


def pod_templates(docs: list[dict[str, Any]]) -> list[PodTemplate]:
    """Pod templates with the labels their pods will carry (KubeRay adds ray.io/cluster, node-type, group)."""
    pods = []
    for doc in docs:
        ns = doc["metadata"].get("namespace", "")
        if doc["kind"] == "RayCluster":
            name = doc["metadata"]["name"]
            groups = [("head", "headgroup", doc["spec"]["headGroupSpec"])]
            groups += [("worker", g["groupName"], g) for g in doc["spec"].get("workerGroupSpecs", [])]
            for node_type, group, spec in groups:
                labels = {**spec["template"].get("metadata", {}).get("labels", {}),
                          "ray.io/cluster": name, "ray.io/node-type": node_type, "ray.io/group": group}
                pods.append(PodTemplate(f"RayCluster/{name} {group}", ns, labels, spec["template"]["spec"]))
        elif doc["kind"] == "Deployment":
            tpl = doc["spec"]["template"]
            pods.append(PodTemplate(f"Deployment/{doc['metadata']['name']}", ns, tpl["metadata"]["labels"], tpl["spec"]))
    return pods


def objects(docs, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def control_plane(docs) -> dict[str, Any]:
    """The `trainctl serve` container: the head's sidecar, or the replicas' (components/ha-postgres)."""
    pods = [p for p in pod_templates(docs) if p.where.startswith(("RayCluster/", "Deployment/trainctl"))]
    (container,) = [c for p in pods for c in p.spec["containers"] if c["name"] == "trainctl"]
    return container


def supervisors_on_head(docs) -> bool:
    """Whether the head advertises the control resource, which puts every job supervisor there."""
    from trainctl.workers.resources import CONTROL_RESOURCE

    (cluster,) = objects(docs, "RayCluster").values()
    return CONTROL_RESOURCE in cluster["spec"]["headGroupSpec"].get("resources", {})


def test_every_overlay_is_there() -> None:
    assert {"cpu-dev", "gpu-h100", "gb200-nvl72", "gpu-h100-ha"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_its_strict_schema(built, overlay) -> None:
    errors = [e for doc in built[overlay] for e in schema_errors(doc)]
    assert errors == []
    kinds = {d["kind"] for d in built[overlay]}
    assert {"RayCluster", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim", "ServiceAccount",
            "PodMonitor", "PrometheusRule"} <= kinds


def test_schema_check_rejects_unknown_fields(built) -> None:
    cluster = json.loads(json.dumps(objects(built["cpu-dev"], "RayCluster")["trainctl"]))
    cluster["spec"]["headGroupSpec"]["rayStartparams"] = {}
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "2"
    cluster["extra"] = 1
    found = "\n".join(schema_errors(cluster))
    assert "rayStartparams" in found and "'2' is not of type 'integer'" in found and "'extra'" in found
    monitor = dict(objects(built["cpu-dev"], "PodMonitor")["trainctl"])
    monitor["spec"] = {**monitor["spec"], "podMetricEndpoints": []}
    assert any("podMetricEndpoints" in e for e in schema_errors(monitor))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_overlay_namespace(built, overlay) -> None:
    docs = built[overlay]
    (namespace,) = objects(docs, "Namespace")
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {namespace}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_ports_match_pods(built, overlay) -> None:
    docs, pods = built[overlay], pod_templates(built[overlay])
    for svc in objects(docs, "Service").values():
        selected = [p for p in pods if matches(svc["spec"]["selector"], p.labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            assert all(port["targetPort"] in p.port_names() for p in selected), port
    for mon in objects(docs, "PodMonitor").values():
        selected = [p for p in pods if matches(mon["spec"]["selector"]["matchLabels"], p.labels)]
        assert selected, f"PodMonitor {mon['metadata']['name']} selects no pod"
        for endpoint in mon["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in p.port_names() for p in selected), (mon["metadata"]["name"], endpoint)
        if "jobLabel" in mon["spec"]:
            assert all(mon["spec"]["jobLabel"] in p.labels for p in selected), mon["metadata"]["name"]
    (trainctl_monitor,) = [m for m in objects(docs, "PodMonitor").values() if m["metadata"]["name"] == "trainctl"]
    (service_pod,) = [p for p in pods if matches(trainctl_monitor["spec"]["selector"]["matchLabels"], p.labels)]
    assert service_pod.labels[trainctl_monitor["spec"]["jobLabel"]] == "trainctl"  # the rules' job="trainctl"
    worker_monitor = objects(docs, "PodMonitor")["ray-workers"]
    assert all(matches(worker_monitor["spec"]["selector"]["matchLabels"], p.labels)
               for p in pods if p.labels.get("ray.io/node-type") == "worker")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_referenced_configmaps_secrets_volumes_exist(built, overlay) -> None:
    docs, pods = built[overlay], pod_templates(built[overlay])
    configmaps, secrets = objects(docs, "ConfigMap"), objects(docs, "Secret")
    claims, accounts = objects(docs, "PersistentVolumeClaim"), objects(docs, "ServiceAccount")
    for pod in pods:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (pod.where, v)
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, (pod.where, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (pod.where, v)
        assert pod.spec["serviceAccountName"] in accounts, pod.where
        assert pod.spec.get("automountServiceAccountToken") is False, pod.where
        assert pod.spec["securityContext"]["runAsNonRoot"] is True, pod.where
        pod_claims = {c["name"] for c in pod.spec.get("resourceClaims", [])}
        for c in pod.containers():
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (pod.where, c["name"], m)
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, (pod.where, ref)
            for claim in c.get("resources", {}).get("claims", []):
                assert claim["name"] in pod_claims, (pod.where, claim)
            env = {e["name"] for e in c.get("env", [])}
            env |= {k for ref in c.get("envFrom", []) for k in configmaps[ref["configMapRef"]["name"]]["data"]}
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env, f"{pod.where} {c['name']}: $({var}) is not defined in its env"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_and_ray_versions_agree(built, overlay) -> None:
    (cluster,) = objects(built[overlay], "RayCluster").values()
    assert cluster["spec"]["rayVersion"] == RAY_PIN
    images = {c["image"] for p in pod_templates(built[overlay]) for c in p.containers()}
    assert len(images) == 1, f"one image for the head, the control plane and the workers: {images}"
    (image,) = images
    tag = image.rsplit(":", 1)[1]
    assert f"-ray{RAY_PIN}-" in tag, f"image tag {tag} does not name Ray {RAY_PIN}"
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\S+)$", dockerfile, re.M).group(1)
    assert base.startswith(f"{RAY_PIN}-"), f"Dockerfile base rayproject/ray:{base} is not Ray {RAY_PIN}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_gpu_slots_match_gpus_and_topology(built, overlay) -> None:
    from trainctl.workers.topology.model import TopologyMap

    (cluster,) = objects(built[overlay], "RayCluster").values()
    topology = TopologyMap.model_validate(yaml.safe_load(objects(built[overlay], "ConfigMap")["trainctl-topology"]
                                                         ["data"]["topology.yaml"]))
    gpus_per_node = {len(n.gpus) for n in topology.spec.nodes}
    replicas = 0
    for group in cluster["spec"]["workerGroupSpecs"]:
        slots = sorted(int(k.removeprefix("trainctl_gpu_")) for k in group["resources"])
        (worker,) = group["template"]["spec"]["containers"]
        limit = worker["resources"]["limits"].get("nvidia.com/gpu")
        gpus = int(limit) if limit is not None else int(group["labels"]["trainctl.io/gpus"])
        assert slots == list(range(gpus)), (group["groupName"], slots, gpus)
        assert gpus_per_node == {gpus}, f"topology has {gpus_per_node} GPUs per node, pods have {gpus}"
        if "labels" in group:
            assert group["labels"]["trainctl.io/node"] in {n.name for n in topology.spec.nodes}
        replicas += group["replicas"]
    assert replicas <= len(topology.spec.nodes), "more worker pods than nodes in the topology map"


@pytest.fixture(scope="module")
def serve_help() -> str:
    """`trainctl serve --help` as the CLI prints it (once for every overlay)."""
    return subprocess.run([sys.executable, "-m", "trainctl.cli.main", "serve", "--help"], capture_output=True,
                          text=True, check=True, timeout=60).stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_args_are_real_serve_flags(built, serve_help, overlay) -> None:
    sidecar = control_plane(built[overlay])
    assert sidecar["command"] == ["trainctl"] and sidecar["args"][0] == "serve"
    for arg in sidecar["args"][1:]:
        flag = arg.split("=", 1)[0]
        assert re.search(rf"(^|\s){re.escape(flag)}[\s=,]", serve_help), f"`trainctl serve` has no flag {flag}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_objects_are_the_generated_ones(built, overlay) -> None:
    docs = built[overlay]
    (rule,) = objects(docs, "PrometheusRule").values()
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())["groups"]
    dashboards = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    shipped = {}
    for cm in objects(docs, "ConfigMap").values():
        if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
            ((name, text),) = cm["data"].items()
            shipped[name] = json.loads(text)
    assert shipped == dashboards, "one ConfigMap labelled grafana_dashboard=1 per dashboard, same JSON"


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "cpu-dev"])
def test_topology_labels_init_container_runs(built, overlay, tmp_path) -> None:
    """Run the init container's own script on the overlay's topology ConfigMap for one of its nodes."""
    (cluster,) = objects(built[overlay], "RayCluster").values()
    topology = objects(built[overlay], "ConfigMap")["trainctl-topology"]["data"]["topology.yaml"]
    (tmp_path / "topology.yaml").write_text(topology)
    node = yaml.safe_load(topology)["spec"]["nodes"][-1]["name"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        (init,) = group["template"]["spec"]["initContainers"]
        env = {e["name"]: e.get("value") for e in init["env"]}
        labels_file = group["rayStartParams"]["labels-file"]
        assert labels_file == env["RAY_LABELS_FILE"]
        overrides = {"K8S_NODE_NAME": node, "TOPOLOGY_FILE": str(tmp_path / "topology.yaml"),
                     "RAY_LABELS_FILE": str(tmp_path / "labels.yaml")}
        cmd = [sys.executable if init["command"][0] == "python" else init["command"][0], *init["command"][1:],
               *init["args"]]
        subprocess.run(cmd, env={**os.environ, **overrides}, check=True, timeout=60)
        labels = yaml.safe_load((tmp_path / "labels.yaml").read_text())
        assert labels["trainctl.io/node"] == node
        assert labels["trainctl.io/nvlink-domain"] != "none"


def test_gcs_fault_tolerance_component(kubectl, tmp_path) -> None:
    overlay = tmp_path / "ha"
    overlay.mkdir()
    rel = Path(os.path.relpath(KUBE, overlay))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(rel / "overlays" / "gpu-h100")], "components": [str(rel / "components" / "gcs-ft")]}))
    docs = kustomize(kubectl, overlay)
    assert [e for d in docs for e in schema_errors(d)] == []
    (cluster,) = objects(docs, "RayCluster").values()
    ft = cluster["spec"]["gcsFaultToleranceOptions"]
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in objects(docs, "Secret")[ref["name"]]["stringData"]
    assert re.fullmatch(r"[\w.-]+:\d+", ft["redisAddress"])
    assert cluster["spec"]["workerGroupSpecs"], "the component must keep the overlay's workers"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_shares_the_run_directories(built, overlay) -> None:
    """Supervisor, ranks and service exchange events and checkpoints under <data dir>/runs (Ray's head
    container too where the supervisors are placed on the head)."""
    docs = built[overlay]
    data_dir = objects(docs, "ConfigMap")["trainctl-settings"]["data"]["TRAINCTL_DATA_DIR"]
    claims = objects(docs, "PersistentVolumeClaim")
    writers = {"trainctl", "ray-worker", *(["ray-head"] if supervisors_on_head(docs) else [])}
    for pod in pod_templates(docs):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        containers = [c for c in pod.spec["containers"] if c["name"] in writers]
        assert containers, pod.where
        for container in containers:
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            claim = mounts[f"{data_dir}/runs"]["persistentVolumeClaim"]["claimName"]
            assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"], (pod.where, claim)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_path_a_job_names_is_confined_to_the_read_only_datasets_volume(built, overlay) -> None:
    """The service runs with --data-root (not the opt-out), and every container that reads job data (the
    service, which validates the files, the Ray head and every worker, where the ranks read them) mounts
    the datasets PVC read-only at that root."""
    docs = built[overlay]
    data_root = objects(docs, "ConfigMap")["trainctl-settings"]["data"]["TRAINCTL_DATA_ROOT"]
    sidecar = control_plane(docs)
    assert "--data-root=$(TRAINCTL_DATA_ROOT)" in sidecar["args"]
    assert not any(a.startswith("--allow-any-data-path") for a in sidecar["args"])
    claims = objects(docs, "PersistentVolumeClaim")
    for pod in pod_templates(docs):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for container in pod.spec["containers"]:
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data_root]
            claim = volumes[mount["name"]]["persistentVolumeClaim"]
            assert mount.get("readOnly") is True and claim.get("readOnly") is True, (pod.where, container["name"])
            assert "ReadWriteMany" in claims[claim["claimName"]]["spec"]["accessModes"], (pod.where, claim)


HA_OVERLAYS = [o for o in OVERLAYS if o.endswith("-ha")]


@pytest.mark.parametrize("overlay", HA_OVERLAYS)
def test_two_replicas_on_postgresql_replace_the_head_sidecar(built, overlay) -> None:
    """components/ha-postgres: 2 replicas, one per node, a PodDisruptionBudget over exactly them, the
    database URL from a Secret only, readiness from gRPC health on a plaintext port, liveness that a
    database outage does not fail, the Service on the replicas, and Ray's head alone in its pod."""
    from trainctl.workers.resources import CONTROL_CAPACITY, CONTROL_RESOURCE

    docs, pods = built[overlay], pod_templates(built[overlay])
    (deployment,) = objects(docs, "Deployment").values()
    assert deployment["spec"]["replicas"] == 2
    (replica,) = [p for p in pods if p.where.startswith("Deployment/")]
    assert matches(deployment["spec"]["selector"]["matchLabels"], replica.labels)
    (pdb,) = objects(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] == 1
    assert [p.where for p in pods if matches(pdb["spec"]["selector"]["matchLabels"], p.labels)] == [replica.where]
    service = objects(docs, "Service")["trainctl"]
    assert [p.where for p in pods if matches(service["spec"]["selector"], p.labels)] == [replica.where]
    (anti,) = replica.spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname" and matches(anti["labelSelector"]["matchLabels"], replica.labels)

    serve = control_plane(docs)
    env = {e["name"]: e for e in serve["env"]}
    assert env["TRAINCTL_STORE"]["valueFrom"]["secretKeyRef"] == {"name": "trainctl-store", "key": "url"}
    assert "trainctl-store" not in objects(docs, "Secret"), "the URL's Secret is the operator's, not a placeholder"
    rendered = yaml.safe_dump_all(docs)
    assert "postgresql://" not in rendered and "postgres://" not in rendered
    assert not any(a.startswith("--store") for a in serve["args"])
    (health_arg,) = [a for a in serve["args"] if a.startswith("--health-address=")]
    health_port = int(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)]["value"], health_arg).rsplit(":", 1)[1])
    assert serve["readinessProbe"]["grpc"]["port"] == health_port
    assert health_port in {p["containerPort"] for p in serve["ports"]}
    grpc_port = next(p for p in serve["ports"] if p["name"] == "grpc")
    assert serve["livenessProbe"]["tcpSocket"]["port"] in (grpc_port["name"], grpc_port["containerPort"])
    assert "--warm-pool" not in serve["args"]

    (cluster,) = objects(docs, "RayCluster").values()
    assert any(a == f"--ray-address={cluster['metadata']['name']}-head-svc:$(TRAINCTL_RAY_GCS_PORT)" for a in serve["args"])
    (ray_node,) = replica.spec["initContainers"]
    assert ray_node["restartPolicy"] == "Always" and ray_node["command"] == ["ray"]
    assert {"--num-cpus=0", "--num-gpus=0", "--block"} <= set(ray_node["args"])
    head = cluster["spec"]["headGroupSpec"]
    assert [c["name"] for c in head["template"]["spec"]["containers"]] == ["ray-head"]
    assert "trainctl.io/component" not in head["template"]["metadata"].get("labels", {})
    assert float(head["resources"][CONTROL_RESOURCE]) == CONTROL_CAPACITY
    assert "trainctl-store" not in objects(docs, "PersistentVolumeClaim"), "no SQLite volume"
