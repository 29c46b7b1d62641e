"""Grafana dashboards for the service's metrics, as code: `grafana` (typed builder) and `dashboards` (the
three dashboards). Owned by deployment: `deploy/render.py` writes their JSON; the service never imports
this package (tests/test_layering.py)."""
