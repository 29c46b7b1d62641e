"""docs/observability.md lists every exported metric with its type and labels, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import Clock, populate

from trainctl.service.metrics import ServiceMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
ROW = re.compile(r"^\| `(trainctl_\w+)` \|\s*([^|]+?)\s*\|\s*([^|]*?)\s*\|", re.M)


def exported() -> dict[str, tuple[str, set[str]]]:
    """Every metric: (type, labels) as a scrape sees it, per-job labels included."""
    registry = CollectorRegistry()
    populate(ServiceMetrics(registry, clock=Clock()))
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamp of each counter / histogram series
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        name = family.name + ("_total" if family.type == "counter" else "")
        found[name] = (family.type, labels)
    return found


def test_every_metric_is_documented_with_type_and_labels() -> None:
    rows = {name: (kind.strip(), {x.strip() for x in labels.split(",") if x.strip()})
            for name, kind, labels in ROW.findall(DOC.read_text())}
    metrics = exported()
    assert sorted(rows) == sorted(metrics), "docs/observability.md and the catalogue list different metrics"
    for name, (kind, labels) in metrics.items():
        doc_kind, doc_labels = rows[name]
        assert doc_kind.split()[0] == kind, f"{name}: documented as {doc_kind}, exported as {kind}"
        if name.startswith("trainctl_job_"):
            doc_labels |= {"job_id", "tenant"}  # the per-job table lists only the extra labels
        assert doc_labels == labels, f"{name}: documented labels {doc_labels}, exported {labels}"
