"""Dashboards: generated JSON is current and valid (known keys, panel types, datasource references),
and every query reads a metric the service exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from deploy_support import DEPLOY, REPO
from prometheus_client import CollectorRegistry

from trainctl.observability.dashboards import all_dashboards
from trainctl.service.metrics import ServiceMetrics

DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Keys of the Grafana dashboard JSON model (schemaVersion 39, grafana/kinds/dashboard) that we accept.
DASHBOARD_KEYS = {"id", "uid", "title", "description", "tags", "editable", "graphTooltip", "timezone",
                  "fiscalYearStartMonth", "liveNow", "schemaVersion", "version", "refresh", "time", "timepicker",
                  "annotations", "links", "templating", "panels", "weekStart"}
PANEL_KEYS = {"id", "type", "title", "description", "datasource", "gridPos", "targets", "fieldConfig", "options",
              "transformations", "interval", "maxDataPoints", "pluginVersion", "transparent", "links", "repeat",
              "repeatDirection", "timeFrom", "timeShift", "hideTimeOverride"}
ROW_KEYS = {"id", "type", "title", "collapsed", "gridPos", "panels", "datasource", "repeat"}
TARGET_KEYS = {"datasource", "editorMode", "expr", "legendFormat", "range", "instant", "refId", "interval",
               "format", "exemplar", "hide", "intervalFactor"}
VARIABLE_KEYS = {"type", "name", "label", "datasource", "definition", "query", "refresh", "sort", "multi",
                 "includeAll", "current", "options", "hide", "regex", "skipUrlSync", "allValue", "description"}
FIELD_DEFAULT_KEYS = {"unit", "min", "max", "decimals", "custom", "color", "thresholds", "mappings", "displayName"}
GRIDPOS_KEYS = {"h", "w", "x", "y"}
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap", "piechart", "state-timeline",
               "status-history", "barchart", "histogram", "logs", "nodeGraph", "alertlist", "dashlist", "news",
               "row", "xychart", "trend", "canvas", "geomap", "flamegraph", "traces", "candlestick"}


def load(path):
    return json.loads(path.read_text())


def test_generated_files_are_up_to_date() -> None:
    out = subprocess.run([sys.executable, str(DEPLOY / "render.py"), "--check"], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr


def test_one_file_per_dashboard() -> None:
    assert [p.stem for p in DASHBOARDS] == sorted(d.uid for d in all_dashboards())
    assert len({load(p)["title"] for p in DASHBOARDS}) == len(DASHBOARDS)


def unknown(obj: dict, allowed: set[str], where: str) -> list[str]:
    return [f"{where}: unknown key {k!r}" for k in sorted(set(obj) - allowed)]


def problems(dash: dict) -> list[str]:
    found = unknown(dash, DASHBOARD_KEYS, "dashboard")
    if dash["schemaVersion"] < 39:
        found.append(f"schemaVersion {dash['schemaVersion']} < 39")
    variables = dash["templating"]["list"]
    names = {v["name"] for v in variables}
    ds_vars = [v for v in variables if v["type"] == "datasource"]
    if [v["name"] for v in ds_vars] != ["datasource"] or ds_vars[0]["query"] != "prometheus":
        found.append("need exactly one datasource variable named 'datasource' for Prometheus")
    for var in variables:
        found += unknown(var, VARIABLE_KEYS, f"variable {var['name']}")
        if var["type"] == "query" and var["datasource"] != DATASOURCE:
            found.append(f"variable {var['name']}: datasource {var['datasource']} is not {DATASOURCE}")
    ids = [p["id"] for p in dash["panels"]]
    if len(ids) != len(set(ids)):
        found.append(f"duplicate panel ids: {ids}")
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        where = f"panel {panel['id']} {panel.get('title')!r}"
        if panel["type"] not in PANEL_TYPES:
            found.append(f"{where}: unknown panel type {panel['type']!r}")
        found += unknown(panel, ROW_KEYS if panel["type"] == "row" else PANEL_KEYS, where)
        pos = panel["gridPos"]
        found += unknown(pos, GRIDPOS_KEYS, f"{where} gridPos")
        if not (pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0):
            found.append(f"{where}: gridPos {pos} outside the 24-column grid")
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                if (x, y) in cells:
                    found.append(f"{where}: overlaps another panel at {(x, y)}")
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        if panel["datasource"] != DATASOURCE:
            found.append(f"{where}: datasource {panel['datasource']} is not {DATASOURCE}")
        found += unknown(panel["fieldConfig"]["defaults"], FIELD_DEFAULT_KEYS, f"{where} fieldConfig.defaults")
        if not panel["targets"]:
            found.append(f"{where}: no queries")
        for target in panel["targets"]:
            found += unknown(target, TARGET_KEYS, f"{where} target {target['refId']}")
            if target["datasource"] != DATASOURCE:
                found.append(f"{where}: target datasource {target['datasource']} is not {DATASOURCE}")
            for var in re.findall(r"\$(\w+)", target["expr"]):
                if var not in names and not var.startswith("__"):
                    found.append(f"{where}: query uses undefined variable ${var}")
    return found


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_valid(path) -> None:
    assert problems(load(path)) == []


def test_validator_catches_mistakes() -> None:
    dash = load(DASHBOARDS[0])
    panel = next(p for p in dash["panels"] if p["type"] != "row")
    panel["type"] = "graph-old"
    panel["colour"] = "red"
    panel["targets"][0]["datasource"] = {"type": "prometheus", "uid": "other"}
    panel["targets"][0]["expr"] += " + $nope"
    found = "\n".join(problems(dash))
    for needle in ("unknown panel type 'graph-old'", "unknown key 'colour'", "target datasource", "$nope"):
        assert needle in found


def test_queries_read_exported_metrics() -> None:
    registry = CollectorRegistry()
    ServiceMetrics(registry)
    exported = {m.name for m in registry.collect()} | {"up"}
    for path in DASHBOARDS:
        for panel in load(path)["panels"]:
            for target in panel.get("targets", []):
                for name in re.findall(r"\b(trainctl_\w+|up)\b(?=\s*[{\[)]|\s*$| )", target["expr"]):
                    base = re.sub(r"_(bucket|count|sum|total|info)$", "", name)
                    assert base in exported or name in exported, f"{path.stem}: {name} is not exported"
