"""An exploding chat template fails its own job at once while a job beside it on the same node trains on.

The hostile-tenant review's template (`{{ m.content * 100000000 }}`) grew a rank past 5.8 GB in a minute.
Here two jobs are pinned to the same node, as two tenants' jobs can be: the template's job FAILS on its
first attempt with a reason naming the rendering limit, no restart spent, and the neighbour keeps
reporting steps, never restarted. The neighbour is a command job reporting a step every 0.2 s (a
training job would keep a core busy for the whole test: what is asserted is that it lives on)."""

from __future__ import annotations

import sys
import time

import pytest
from data_sources import build_tokenizer, conversations, write_jsonl
from small_jobs import small_job
from test_command_jobs import command_job
from test_file_rule_job import finished

from trainctl.workers.events import EventKind, JobState
from trainctl.workers.placement import Placement, RankAssignment
from trainctl.workers.runtime import RayRuntime

REPORTER = "import time, trainctl\nfor step in range(1, 100_000):\n    trainctl.report(step=step, loss=1.0)\n    time.sleep(0.2)\n"
"""The neighbour's program: a step reported every 0.2 s until it is cancelled."""


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


def steps_of(runtime: RayRuntime, job_id: str) -> tuple[list[int], int]:
    """(steps reported so far, restarts) of a running job."""
    status = runtime.poll(job_id, 0)
    return [e.step["step"] for e in status.events if e.kind is EventKind.STEP], status.restarts


def test_an_exploding_chat_template_fails_its_job_at_once_and_its_neighbour_trains_on(runtime, tmp_path) -> None:
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    (tokenizer / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}")
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(30)])
    neighbour = command_job("neighbour", sys.executable, "-c", REPORTER, gpus=1, scheduling={"max_restarts": 2})
    exploding = small_job(
        "exploding", gpus=1, steps=4, scheduling={"max_restarts": 2},
        data={"paths": [str(tmp_path / "chat.jsonl")], "format": "jsonl", "messages_field": "messages",
              "tokenizer": str(tokenizer)},
    )
    runtime.start_job("neighbour-1", neighbour, Placement(grid="dp_replicate1", assignments=[RankAssignment(rank=0, node="node-1", gpu=0)]),
                      tmp_path / "runs" / "neighbour-1")
    try:
        deadline = time.monotonic() + 120
        while not steps_of(runtime, "neighbour-1")[0]:
            assert time.monotonic() < deadline, "the neighbour never reported a step"
            time.sleep(0.2)
        runtime.start_job("exploding-1", exploding, Placement(grid="dp_shard1", assignments=[RankAssignment(rank=0, node="node-1", gpu=1)]),
                          tmp_path / "runs" / "exploding-1")
        events, status = finished(runtime, "exploding-1", timeout=120)
        assert status.state is JobState.FAILED and status.restarts == 0, status.reason
        assert status.reason.startswith("configuration error on rank 0: spec.data.tokenizer:"), status.reason
        assert "the chat template's `*` would make" in status.reason and "over its limit of" in status.reason
        assert not any(e.kind is EventKind.STEP for e in events)

        before = max(steps_of(runtime, "neighbour-1")[0])
        deadline = time.monotonic() + 60
        while max(steps_of(runtime, "neighbour-1")[0]) < before + 3:
            assert time.monotonic() < deadline, "the neighbour stopped training"
            time.sleep(0.2)
        steps, restarts = steps_of(runtime, "neighbour-1")
        assert restarts == 0 and runtime.poll("neighbour-1", 0).state is JobState.RUNNING
        assert steps == sorted(set(steps)), "a step was reported twice: the neighbour restarted"
    finally:
        runtime.cancel("neighbour-1")
