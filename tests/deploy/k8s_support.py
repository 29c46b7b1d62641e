"""Building the kustomize overlays and validating what they emit against tests/fixtures/schemas (strict)."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from deploy_support import SCHEMAS
from referencing import Registry, Resource

KUBE_STRICT = SCHEMAS / "kubernetes" / "v1.33.0-standalone-strict"
DEFINITIONS = SCHEMAS / "kubernetes" / "v1.33.0-local-strict" / "_definitions.json"
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): SCHEMAS / "ray.io" / "raycluster_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "monitoring.coreos.com" / "podmonitor_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "monitoring.coreos.com" / "prometheusrule_v1.json",
}
CORE_FILES = {("v1", "ConfigMap"): "configmap-v1.json", ("v1", "Secret"): "secret-v1.json",
              ("v1", "Service"): "service-v1.json"}
# Kinds without a standalone file: their definition in the same strict _definitions.json.
CORE_DEFINITIONS = {("v1", "Namespace"): "io.k8s.api.core.v1.Namespace",
                    ("v1", "ServiceAccount"): "io.k8s.api.core.v1.ServiceAccount",
                    ("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim",
                    ("apps/v1", "Deployment"): "io.k8s.api.apps.v1.Deployment",
                    ("policy/v1", "PodDisruptionBudget"): "io.k8s.api.policy.v1.PodDisruptionBudget"}


def kustomize(kubectl: str, path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def strip_nulls(value: Any) -> Any:
    """The API server drops nulls before validating (SOURCES.md); so do we."""
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value]
    return value


@cache
def _definitions() -> dict[str, Any]:
    return json.loads(DEFINITIONS.read_text())


def _schema_file(path: Path, api_version: str, kind: str) -> dict[str, Any]:
    if not path.is_file():
        raise AssertionError(f"schema for {api_version} {kind} missing: {path} (see {SCHEMAS / 'SOURCES.md'})")
    return json.loads(path.read_text())


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    key = (api_version, kind)
    if key in CRD_SCHEMAS:
        schema = _schema_file(CRD_SCHEMAS[key], api_version, kind)
    elif key in CORE_FILES:
        schema = _schema_file(KUBE_STRICT / CORE_FILES[key], api_version, kind)
    elif key in CORE_DEFINITIONS:
        schema = {"$ref": f"/api/_definitions.json#/$defs/{CORE_DEFINITIONS[key]}"}
    else:
        raise AssertionError(f"no schema in {SCHEMAS} for {api_version} {kind}: copy it in (see its SOURCES.md)")
    registry = Registry().with_resource("/api/_definitions.json", Resource.from_contents(_definitions()))
    return jsonschema.Draft7Validator(schema, registry=registry)


def _root_properties(v: jsonschema.Draft7Validator) -> set[str]:
    schema = v.schema
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = _definitions()["$defs"][name]
    return set(schema["properties"])


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one object, unknown top-level keys included (the schemas leave the
    root open, as kubeconform does)."""
    doc = strip_nulls(doc)
    v = validator(doc["apiVersion"], doc["kind"])
    where = f"{doc['kind']}/{doc['metadata'].get('name')}"
    errors = [f"{where}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]
    errors += [f"{where}: unknown top-level field {k!r}" for k in sorted(set(doc) - _root_properties(v))]
    return errors
