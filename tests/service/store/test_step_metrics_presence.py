"""Issue 34, point 5: a step metric a job does not report (a command job's program passes what it
chooses) stays absent all the way to the user, never 0: the store keeps NULL (and migrates its older
NOT NULL table, rows kept), the API leaves the field unset, `get -o json` leaves the key out, Prometheus
exports no sample, the progress line keeps the last known rate. The engine's full reports keep every
field."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.store.old_stores import ADDED_COLUMNS
from trainctl.cli.job_cmd import STEP_METRICS, metrics_dict
from trainctl.cli.progress import Tracker
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.service.api.job_messages import step_to_proto
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.store import MIGRATIONS, JobStore
from trainctl.service.store.db import open_database, run_script
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb

ENGINE_STEP = {"step": 3, "loss": 2.0, "grad_norm": 0.5, "lr": 1e-3, "tokens": 4096, "tokens_per_second": 900.0,
               "mfu": 0.3, "step_time_seconds": 4.5, "peak_memory_bytes": 1 << 30, "eval_loss": 2.25,
               "mfu_full_attention": 0.32}


def job() -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "j"}, "spec": {}})


def test_the_store_keeps_unreported_metrics_absent_and_the_jobs_last_known_rate(store_location: str) -> None:
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    store.record_step(record.id, {"step": 5, "loss": 2.0, "tokens": 256})  # a run's first report: no rate
    store.record_step(record.id, {"step": 10, "loss": 1.5, "tokens": 256, "tokens_per_second": 2560.0,
                                  "step_time_seconds": 0.1})
    store.record_step(record.id, {"step": 15, "loss": 1.2, "tokens": 256})  # the first after a restart
    first, second, _ = store.step_metrics(record.id)
    assert {k: first[k] for k in STEP_METRICS} == dict.fromkeys(STEP_METRICS) | {"tokens": 256}
    assert (second["tokens_per_second"], second["step_time_seconds"], second["lr"]) == (2560.0, 0.1, None)
    assert store.get_job(record.id).tokens_per_second == 2560.0


def test_a_store_from_before_absent_metrics_is_migrated_with_its_rows(store_location: str) -> None:
    """Schema 8's step_metrics had NOT NULL DEFAULT 0 columns: the rebuilt table keeps the rows' values
    and takes NULLs."""
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    store.close()
    db = open_database(store_location)
    db.begin_write()
    db.execute("DROP TABLE step_metrics")
    for version in sorted(v for v in ADDED_COLUMNS if v > 9):  # the jobs columns of the schemas after 9
        for column in ADDED_COLUMNS[version].get("jobs", []):
            db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    run_script(db, next(s for s in MIGRATIONS[0].split(";") if "CREATE TABLE step_metrics" in s))
    db.execute("INSERT INTO step_metrics (job_id, step, time, loss, grad_norm, lr, tokens, tokens_per_second,"
               " step_time_seconds, peak_memory_bytes) VALUES (?, 1, 10.0, 2.0, 0.5, 0.001, 64, 8.0, 8.0, 1024)",
               (record.id,))
    db.set_schema_version(8)
    db.commit()
    db.close()
    store = JobStore(store_location)
    store.record_step(record.id, {"step": 2, "loss": 1.0})
    old, new = store.step_metrics(record.id)
    assert {k: old[k] for k in STEP_METRICS} == {"grad_norm": 0.5, "lr": 0.001, "tokens": 64, "tokens_per_second": 8.0,
                                                 "mfu": None, "step_time_seconds": 8.0, "peak_memory_bytes": 1024,
                                                 "eval_loss": None, "mfu_full_attention": None}
    assert {k: new[k] for k in STEP_METRICS} == dict.fromkeys(STEP_METRICS)


def test_the_api_and_get_json_leave_out_what_was_not_reported_and_keep_what_was() -> None:
    reported = metrics_dict(step_to_proto({"step": 10, "loss": 1.5, "tokens": 256, "tokens_per_second": 2560.0,
                                           "step_time_seconds": 0.1, "lr": None, "grad_norm": None}, pb.StepMetrics()))
    assert set(reported) == {"step", "loss", "tokens", "tokens_per_second", "step_time_seconds", "breakdown", "time"}
    engine = metrics_dict(step_to_proto(ENGINE_STEP, pb.StepMetrics()))
    assert {k: engine[k] for k in STEP_METRICS} == {k: ENGINE_STEP[k] for k in STEP_METRICS}
    zero = metrics_dict(step_to_proto({**ENGINE_STEP, "lr": 0.0, "grad_norm": 0.0}, pb.StepMetrics()))
    assert (zero["lr"], zero["grad_norm"]) == (0.0, 0.0)  # a reported 0 is a value, not an absence


def exported(registry: CollectorRegistry) -> set[str]:
    """Names of the samples ``registry`` exports for job ``j``."""
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("job_id") == "j"}


def test_prometheus_exports_no_sample_of_an_unreported_metric() -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    bare = StepReport(step=5, loss=2.0, grad_norm=None, lr=None, tokens=None, tokens_per_second=None, mfu=None,
                      step_time_seconds=None)
    metrics.record_step("j", "t", bare)
    names = exported(registry)
    assert {"trainctl_job_step", "trainctl_job_loss"} <= names
    assert not names & {"trainctl_job_grad_norm", "trainctl_job_learning_rate", "trainctl_job_tokens_per_second",
                        "trainctl_job_peak_memory_bytes", "trainctl_job_mfu_ratio",
                        "trainctl_job_mfu_full_attention_ratio", "trainctl_job_step_duration_seconds_count"}
    metrics.record_step("j", "t", StepReport.from_dict({**ENGINE_STEP, "step": 6}))
    assert {"trainctl_job_grad_norm", "trainctl_job_learning_rate", "trainctl_job_tokens_per_second",
            "trainctl_job_peak_memory_bytes", "trainctl_job_mfu_ratio", "trainctl_job_mfu_full_attention_ratio",
            "trainctl_job_step_duration_seconds_count"} <= (
        exported(registry))


def test_the_progress_line_keeps_the_last_known_rate() -> None:
    tracker = Tracker(total_steps=0)
    tracker.on_step(pb.StepMetrics(step=5, loss=2.0, tokens_per_second=2560.0), now=1.0)
    tracker.on_step(pb.StepMetrics(step=10, loss=1.5), now=2.0)
    assert "2,560 tok/s" in tracker.line()
