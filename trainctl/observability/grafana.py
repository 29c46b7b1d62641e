"""A typed builder for Grafana dashboards (the JSON model of Grafana 10/11, schemaVersion 39).

Only what trainctl's dashboards use is modelled; every panel and query reads the Prometheus data
source chosen by the dashboard's `datasource` variable, so one import works in any Grafana.
`trainctl.observability.dashboards` defines the dashboards; `deploy/render.py` writes their JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SCHEMA_VERSION = 39
DATASOURCE_VAR = "datasource"
DATASOURCE = {"type": "prometheus", "uid": "${" + DATASOURCE_VAR + "}"}
GRID_WIDTH = 24

PanelType = Literal["timeseries", "stat", "bargauge", "table", "row"]


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; `legend` is Grafana's legendFormat (e.g. "{{phase}}")."""

    expr: str
    legend: str = ""
    instant: bool = False

    def to_json(self, ref_id: str) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "instant": self.instant,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Panel:
    """A panel: its type, queries, unit and size; `stack` stacks timeseries (breakdowns)."""

    type: PanelType
    title: str
    queries: tuple[Query, ...]
    description: str = ""
    unit: str = "short"
    width: int = 12
    height: int = 8
    stack: bool = False
    min: float | None = None
    max: float | None = None
    decimals: int | None = None

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {"unit": self.unit}
        for key in ("min", "max", "decimals"):
            if getattr(self, key) is not None:
                defaults[key] = getattr(self, key)
        if self.type == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 20 if self.stack else 0,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
            }
        body: dict[str, Any] = {
            "id": panel_id,
            "type": self.type,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "targets": [q.to_json(chr(ord("A") + i)) for i, q in enumerate(self.queries)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": _options(self.type),
        }
        if self.type == "table":
            body["transformations"] = [{"id": "merge", "options": {}}]
        return body


def _options(panel_type: PanelType) -> dict[str, Any]:
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel_type == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if panel_type == "stat":
        return {"reduceOptions": reduce, "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                "orientation": "auto", "textMode": "auto"}
    if panel_type == "bargauge":
        return {"reduceOptions": reduce, "displayMode": "gradient", "orientation": "horizontal",
                "showUnfilled": True}
    if panel_type == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "fields": ""}}
    raise ValueError(f"no options for panel type {panel_type!r}")


@dataclass(frozen=True)
class Row:
    """A row header; the panels after it (up to the next row) belong to it."""

    title: str


@dataclass(frozen=True)
class Variable:
    """A query template variable over a label's values, e.g. `label_values(trainctl_job_state, job_id)`."""

    name: str
    label: str
    query: str
    multi: bool = False
    include_all: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "query",
            "name": self.name,
            "label": self.label,
            "datasource": DATASOURCE,
            "definition": self.query,
            "query": {"query": self.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "sort": 1,
            "multi": self.multi,
            "includeAll": self.include_all,
            "current": {},
            "options": [],
            "hide": 0,
            "regex": "",
            "skipUrlSync": False,
        }


def _datasource_variable() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": DATASOURCE_VAR,
        "label": "Data source",
        "query": "prometheus",
        "current": {},
        "options": [],
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "includeAll": False,
        "multi": False,
        "skipUrlSync": False,
    }


@dataclass(frozen=True)
class Dashboard:
    """A dashboard: panels laid out left to right, wrapping at the grid's 24 columns."""

    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = ("trainctl",)
    time_from: str = "now-6h"
    refresh: str = "30s"
    links: tuple[str, ...] = ()
    """Tags of dashboards to link to in the header (a dropdown of every dashboard with that tag)."""

    def to_json(self) -> dict[str, Any]:
        panels: list[dict[str, Any]] = []
        x = y = row_height = 0
        for panel_id, item in enumerate(self.items, start=1):
            if isinstance(item, Row):
                y += row_height
                x = row_height = 0
                panels.append({"id": panel_id, "type": "row", "title": item.title, "collapsed": False,
                               "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
                y += 1
                continue
            if not 0 < item.width <= GRID_WIDTH:
                raise ValueError(f"panel {item.title!r}: width must be 1..{GRID_WIDTH}; got {item.width}")
            if x + item.width > GRID_WIDTH:
                y += row_height
                x = row_height = 0
            panels.append(item.to_json(panel_id, x, y))
            x += item.width
            row_height = max(row_height, item.height)
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,
            "timezone": "browser",
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "annotations": {"list": []},
            "links": [
                {"type": "dashboards", "tags": [tag], "title": "trainctl", "asDropdown": True,
                 "includeVars": False, "keepTime": True, "icon": "external link", "targetBlank": False,
                 "tooltip": "", "url": ""}
                for tag in self.links
            ],
            "templating": {"list": [_datasource_variable(), *(v.to_json() for v in self.variables)]},
            "panels": panels,
        }
