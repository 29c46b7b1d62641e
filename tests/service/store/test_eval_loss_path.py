"""Issue 37: the eval loss travels where the training loss does. It is only on the steps that evaluated:
the store keeps it on those rows (NULL on the others, and migrates a database from before it with its
rows), the job's status has the newest one, the API and `get -o json` carry both, the list and get table
shows it, Prometheus has a job-level gauge of it (bounded labels), and the progress line shows it with
its perplexity."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.store.old_stores import downgrade
from trainctl.cli.job_cmd import LIST_HEADER, _row, job_document
from trainctl.cli.progress import Tracker, perplexity
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.service.api.job_messages import JobMessages
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.store import SCHEMA_VERSION, JobStore
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb

STEPS = [  # eval_loss on steps 2 and 4 only, as a job evaluating every 2 steps reports it
    {"step": 1, "loss": 3.0},
    {"step": 2, "loss": 2.5, "eval_loss": 2.75},
    {"step": 3, "loss": 2.0},
    {"step": 4, "loss": 1.5, "eval_loss": 2.25},
    {"step": 5, "loss": 1.25},
]


def job() -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "j"}, "spec": {}})


def test_the_store_keeps_eval_loss_on_the_steps_that_evaluated_and_the_jobs_newest(store_location: str) -> None:
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    store.record_step(record.id, STEPS[0])
    assert store.get_job(record.id).last_eval_loss is None  # no evaluation yet
    for step in STEPS[1:]:
        store.record_step(record.id, step)
    store.close()
    store = JobStore(store_location)  # durable across a reopen
    assert [(r["step"], r["eval_loss"]) for r in store.step_metrics(record.id)] == [
        (1, None), (2, 2.75), (3, None), (4, 2.25), (5, None)]
    got = store.get_job(record.id)
    assert (got.last_loss, got.last_eval_loss) == (1.25, 2.25)  # step 5 did not evaluate: step 4's stays
    store.record_step(record.id, {"step": 6, "loss": 1.0, "eval_loss": math.nan})  # a diverged evaluation
    assert math.isnan(store.get_job(record.id).last_eval_loss)


def test_a_store_from_before_eval_loss_opens_with_its_data(store_location: str) -> None:
    """A schema-9 database (no eval_loss columns) with a job and its steps: migrated in place, rows kept."""
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    store.record_step(record.id, {"step": 1, "loss": 2.0, "grad_norm": 0.5})
    store.close()
    downgrade(store_location, 9)
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION
    old = store.get_job(record.id)
    assert (old.name, old.steps_done, old.last_loss, old.last_eval_loss) == ("j", 1, 2.0, None)
    store.record_step(record.id, {"step": 2, "loss": 1.5, "eval_loss": 1.75})
    rows = store.step_metrics(record.id)
    assert [(r["step"], r["grad_norm"], r["eval_loss"]) for r in rows] == [(1, 0.5, None), (2, None, 1.75)]
    assert store.get_job(record.id).last_eval_loss == 1.75


def test_the_api_get_json_and_table_carry_the_eval_loss(tmp_path) -> None:
    store = JobStore(str(tmp_path / "data"))
    record, _ = store.create_job(job())
    message = JobMessages().message(store.get_job(record.id))
    assert not message.status.HasField("last_eval_loss")
    assert job_document(message)["status"]["last_eval_loss"] is None
    assert _row(message)[LIST_HEADER.index("EVAL")] == "-"
    for step in STEPS:
        store.record_step(record.id, step)
    message = JobMessages().message(store.get_job(record.id), store.step_metrics(record.id))
    assert message.status.last_eval_loss == 2.25
    assert [m.eval_loss for m in message.metrics if m.HasField("eval_loss")] == [2.75, 2.25]
    document = job_document(message)
    assert document["status"]["last_eval_loss"] == 2.25
    assert [m.get("eval_loss") for m in document["metrics"]] == [None, 2.75, None, 2.25, None]
    assert "eval_loss" not in document["metrics"][0]  # a step that did not evaluate leaves the key out
    assert _row(message)[LIST_HEADER.index("EVAL")] == "2.2500"


def samples(registry: CollectorRegistry, name: str) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(registry).decode()
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def report(step: dict) -> StepReport:
    return StepReport.from_dict({"grad_norm": None, "lr": None, "tokens": None, "tokens_per_second": None,
                                 "mfu": None, "step_time_seconds": None, **step})


def test_prometheus_has_the_newest_eval_loss_per_job_without_step_labels() -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    metrics.record_step("j", "t", report(STEPS[0]))
    assert samples(registry, "trainctl_job_eval_loss") == []  # no evaluation yet: no sample, not 0
    for step in STEPS[1:]:
        metrics.record_step("j", "t", report(step))
    assert samples(registry, "trainctl_job_eval_loss") == [({"job_id": "j", "tenant": "t"}, 2.25)]
    metrics.forget_job("j")
    assert samples(registry, "trainctl_job_eval_loss") == []


def test_the_progress_line_shows_the_newest_eval_loss_and_its_perplexity() -> None:
    tracker = Tracker(total_steps=5)
    tracker.on_step(pb.StepMetrics(step=1, loss=3.0), now=1.0)
    assert "eval" not in tracker.line()
    tracker.on_step(pb.StepMetrics(step=2, loss=2.5, eval_loss=math.log(12.5)), now=2.0)
    tracker.on_step(pb.StepMetrics(step=3, loss=2.0), now=3.0)
    line = tracker.line()
    assert "loss 2.0000  eval 2.5257 ppl 12.5  " in line, line
    assert (perplexity(800.0), perplexity(math.nan), perplexity(0.0)) == ("inf", "nan", "1")
