"""Answers' Job messages kept serialized: the same message as a fresh conversion, the status always the
store's current one, a page the entries of its jobs, the kept answers bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_jobs import small_job
from test_convert import RICH

from trainctl.service.api.job_messages import JobMessages, fill_status
from trainctl.service.store import JobRecord, JobStore
from trainctl.spec.validate import parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_to_proto
from trainctl.workers.events import JobState


def converted(record: JobRecord) -> pb.Job:
    """The message the whole conversion gives, for comparison."""
    message = job_to_proto(record.job)
    message.id = record.id
    fill_status(message.status, record)
    return message


def test_messages_equal_a_fresh_conversion_and_follow_the_status(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    messages = JobMessages()
    rich, _ = store.create_job(parse_object(RICH), tenant="nlp")
    small, _ = store.create_job(small_job("small"), tenant="vision")
    for record in (rich, small):
        assert messages.message(record) == converted(record)
    placement = [{"rank": 0, "node": "node-0", "gpu": 1, "coords": {"dp": 0}}]
    store.update_status(rich.id, state=JobState.SCHEDULED, reason="placed", placement=placement, schedule_time=5.0)
    store.record_step(rich.id, {"step": 1, "loss": 2.5, "tokens_per_second": 10.0, "breakdown": {"forward_backward": 0.1}})
    updated = store.get_job(rich.id)
    answered = messages.message(updated, store.step_metrics(rich.id))
    assert answered.status.state == pb.SCHEDULED and answered.status.reason == "placed"
    assert [(p.node, p.gpu, dict(p.coords)) for p in answered.status.placement] == [("node-0", 1, {"dp": 0})]
    assert (answered.status.steps_done, answered.status.last_loss) == (1, 2.5)
    assert [(m.step, m.loss, dict(m.breakdown)) for m in answered.metrics] == [(1, 2.5, {"forward_backward": 0.1})]
    assert answered.spec == converted(updated).spec and answered.metadata == converted(updated).metadata


def test_kept_specs_are_bounded_by_the_capacity(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    messages = JobMessages(capacity=3)
    records = [store.create_job(small_job(f"job-{i}"))[0] for i in range(5)]
    for record in records:
        assert messages.message(record).metadata.name == record.name
    assert len(messages) == 3
    assert messages.message(records[0]) == converted(records[0])  # evicted, converted again
    with pytest.raises(ValueError, match="capacity"):
        JobMessages(capacity=0)


def test_a_page_is_its_jobs_answers_and_a_changed_job_is_answered_anew(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    messages = JobMessages()
    for i in range(3):
        store.create_job(small_job(f"job-{i}"))
    records = store.list_jobs()
    page = pb.ListJobsResponse.FromString(messages.page(records))
    assert page == pb.ListJobsResponse(jobs=[converted(r) for r in records])
    kept = messages.listed(records[0])
    assert messages.listed(store.list_jobs()[0]) is kept  # the same version of the job: the same bytes
    store.update_status(records[0].id, state=JobState.CANCELLED, reason="user")
    changed = store.list_jobs()
    page = pb.ListJobsResponse.FromString(messages.page(changed))
    assert page == pb.ListJobsResponse(jobs=[converted(r) for r in changed])
    assert page.jobs[0].status.state == pb.CANCELLED
