"""What people look at beside the API: Grafana dashboards for the service's metrics, as code (`grafana`,
a typed builder, and `dashboards`, the three dashboards, whose JSON `deploy/render.py` writes), and the
run report of a job (`run_report`, drawn by `trainctl report` and logged by the service as an MLflow
artifact; `perplexity`). It imports none of the layers, only the generated code (tests/test_layering.py)."""
