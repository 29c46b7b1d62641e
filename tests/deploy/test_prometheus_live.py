"""A real Prometheus scrapes the real service while a real job trains; every dashboard query and every
alert expression is evaluated through Prometheus's HTTP API, and the exposition passes promtool."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.request

import grpc
import pytest
import yaml
from deploy_support import DEPLOY, require_tool
from prom_support import Prometheus, free_port

from trainctl.service.server import Service, ServiceConfig
from trainctl.spec.validate import parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto

RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape interval, rounded up
JOB_SPEC = {
    "apiVersion": "trainctl/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "prom-live"},
    "spec": {
        "model": {"preset": "debug"},
        "data": {"seq_len": 32},
        "parallelism": {"dp_shard": 2, "zero_stage": 1},
        "training": {"steps": 20, "global_batch_size": 4, "micro_batch_size": 1, "log_interval": 1,
                     "warmup_steps": 2},
        "checkpoint": {"interval_steps": 8},
        "evaluation": {"holdout_fraction": 0.1, "interval_steps": 10},  # eval loss at steps 10 and 20
        "resources": {"gpus": 2, "device": "cpu"},
    },
}
TERMINAL = {pb.SUCCEEDED, pb.FAILED, pb.CANCELLED}
MFU = "trainctl_job_mfu_"  # both conventions: trainctl_job_mfu_ratio, trainctl_job_mfu_full_attention_ratio


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The service with its metrics endpoint, Prometheus scraping it, and one finished training job."""
    prometheus_bin = require_tool("prometheus", "`make promtool` installs Debian's prometheus package")
    base = tmp_path_factory.mktemp("live")
    metrics_port = free_port()
    service = Service(ServiceConfig(address="127.0.0.1:0", data_dir=base / "data", metrics_port=metrics_port,
                                    embedded_nodes=1, embedded_gpus_per_node=2))  # the job's 2 ranks: one raylet
    service.start()
    prom = None
    try:
        prom = Prometheus(prometheus_bin, base, [f"127.0.0.1:{metrics_port}"], [DEPLOY / "prometheus" / "rules.yaml"])
        # Prometheus has the service's state before the job, as a long-running one would: increases
        # (the first scheduling decision, the first solver run) are then visible to rate().
        assert prom.wait_for('up{job="trainctl"} == 1'), "Prometheus never scraped the service"
        start = time.time()
        with grpc.insecure_channel(service.target) as channel:
            stub = pb_grpc.TrainingServiceStub(channel)
            job = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(parse_object(JOB_SPEC))), timeout=30)
            with pytest.raises(grpc.RpcError) as missing:  # one failing call, so error-ratio panels have data
                stub.GetJob(pb.GetJobRequest(id="no-such-job"), timeout=10)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            deadline = time.monotonic() + 300  # beside make test's engine group on 2 cores
            while (record := stub.GetJob(pb.GetJobRequest(id=job.id, view=pb.JOB_VIEW_FULL), timeout=10)).status.state \
                    not in TERMINAL:
                assert time.monotonic() < deadline, f"job still {pb.JobState.Name(record.status.state)} after 300 s"
                time.sleep(1)
        assert record.status.state == pb.SUCCEEDED, record.status.reason
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            exposition = resp.read()
        time.sleep(3)  # a few scrapes after the end, so the final state is in Prometheus too
        yield {"prom": prom, "job": record, "start": start, "end": time.time(), "exposition": exposition}
    finally:
        if prom is not None:
            prom.stop()
        service.stop()


def dashboard_queries(job_id: str) -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every query, template variables substituted as Grafana would."""
    found = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$job", job_id)
                assert "$" not in expr, f"unsubstituted variable in {expr}"
                found.append((dash["uid"], panel["title"], expr))
    return found


def test_exposition_of_the_real_service_passes_promtool(run, promtool) -> None:
    out = subprocess.run([promtool, "check", "metrics"], input=run["exposition"], capture_output=True, check=False)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert f'job_id="{run["job"].id}"'.encode() in run["exposition"]


def test_every_dashboard_query_returns_data(run) -> None:
    prom, job = run["prom"], run["job"]
    mfu_known = any(m.HasField("mfu") for m in job.metrics)
    empty, checked = [], 0
    for uid, title, expr in dashboard_queries(job.id):
        data = prom.api("query_range", query=expr, start=run["start"], end=run["end"], step="1s")
        has_data = any(math.isfinite(float(v)) for series in data["result"] for _, v in series["values"])
        checked += 1
        if MFU in expr and not mfu_known:
            # On CPU the engine reports MFU as None (unknown peak FLOPS), so MFU panels must stay empty.
            assert not has_data, f"{uid} / {title}: MFU data although every step reported mfu=None"
        elif not has_data:
            empty.append(f"{uid} / {title}: {expr}")
    assert checked > 40
    assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)


def test_every_alert_expression_evaluates(run) -> None:
    prom = run["prom"]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    for expr in exprs.values():
        prom.api("query", query=expr, time=run["end"])  # raises on any evaluation error
    loaded = prom.api("rules")
    states = {r["name"]: r["health"] for g in loaded["groups"] for r in g["rules"]}
    assert set(states) == set(exprs)
    assert all(h == "ok" for h in states.values()), states
    # The service was up the whole time and the job finished cleanly: nothing may be firing.
    firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == [], firing


def test_job_series_in_prometheus_match_the_job(run) -> None:
    prom, job = run["prom"], run["job"]
    sel = f'{{job_id="{job.id}", job="trainctl"}}'
    step = prom.api("query", query=f"max_over_time(trainctl_job_step{sel}[5m])", time=run["end"])["result"]
    assert float(step[0]["value"][1]) == job.metrics[-1].step
    state = prom.api("query", query=f'trainctl_job_state{{job_id="{job.id}", state="SUCCEEDED"}}',
                     time=run["end"])["result"]
    assert float(state[0]["value"][1]) == 1
    evaluated = [m.step for m in job.metrics if m.HasField("eval_loss")]
    assert evaluated == [10, 20] and job.status.last_eval_loss == job.metrics[-1].eval_loss
    eval_loss = prom.api("query", query=f"last_over_time(trainctl_job_eval_loss{sel}[5m])", time=run["end"])["result"]
    assert float(eval_loss[0]["value"][1]) == pytest.approx(job.status.last_eval_loss)
    gpus = prom.api("query", query=f"sum(max_over_time(trainctl_job_gpus{sel}[5m]))", time=run["end"])["result"]
    assert float(gpus[0]["value"][1]) == 2
    assert re.fullmatch(r"[\w.-]+", job.id)


def test_report_of_the_finished_job(run, tmp_path) -> None:
    import matplotlib.image

    from trainctl.cli.report import write_report
    from trainctl.observability.run_report import PANELS, build_figure

    job = run["job"]
    files = write_report(job, tmp_path / "report.png")
    assert matplotlib.image.imread(files.png).shape[:2] == (900, 1500)
    axes = {ax.get_title(): ax for ax in build_figure(job).axes if ax.get_title()}
    assert list(axes) == list(PANELS)
    assert list(axes["Loss"].get_lines()[0].get_ydata()) == [m.loss for m in job.metrics]
    phases = {t.get_text() for t in axes["Step-time breakdown"].get_legend().get_texts()}
    assert phases == {p for m in job.metrics for p in m.breakdown}
    assert len(axes["Placement"].texts) == len(job.status.placement) == 2
