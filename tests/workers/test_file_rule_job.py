"""A job's `FileRule` reaches its ranks: a job started through the runtime with a rule whose
`model.safetensors` is a symlink out of the data roots (a file swapped after the submit-time check)
FAILS on its rank at once, before the file is read, with a reason naming the field and the rule, and
without spending a restart."""

from __future__ import annotations

import os
import time

import pytest
from small_jobs import small_job

from trainctl.spec.files import FileRule
from trainctl.workers.events import EventKind, JobState, JobStatus
from trainctl.workers.placement import Placement, RankAssignment
from trainctl.workers.runtime import RayRuntime

SECRET = "SECRET-CONTENT-OF-A-FILE-OUTSIDE-THE-ROOTS"


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


def finished(runtime: RayRuntime, job_id: str, timeout: float = 240.0) -> tuple[list, JobStatus]:
    """Poll the job until it is over and every event is read; (events, last status)."""
    events, cursor = [], 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = runtime.poll(job_id, cursor)
        events += status.events
        cursor = status.cursor
        if status.state.terminal and status.drained:
            return events, status
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {status.state} ({status.reason}) after {timeout:g}s")


def test_weights_swapped_for_a_link_out_of_the_roots_fail_the_job_on_its_rank_without_restarts(runtime, tmp_path) -> None:
    from transformers import LlamaConfig

    root, outside = tmp_path / "data", tmp_path / "outside"
    model = root / "model"
    model.mkdir(parents=True)
    outside.mkdir()
    LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    ).save_pretrained(str(model))
    (outside / "weights").write_text(SECRET * 64)  # read, it would be a corrupt safetensors file (a restart)
    (model / "model.safetensors").symlink_to(outside / "weights")
    (root / "doc.txt").write_text("one small document for the byte tokenizer\n" * 40)
    job = small_job(
        "swapped", gpus=1, steps=1, model={"from_pretrained": str(model)},
        data={"paths": [str(root / "doc.txt")], "tokenizer": "byte"}, scheduling={"max_restarts": 2},
    )
    rule = FileRule((os.path.realpath(root),), os.path.realpath(tmp_path / "runs"), frozenset({"swapped-1"}))
    placement = Placement(grid="dp_shard1", assignments=[RankAssignment(rank=0, node="node-0", gpu=3)])
    runtime.start_job("swapped-1", job, placement, tmp_path / "runs" / "swapped-1", file_rule=rule)

    events, status = finished(runtime, "swapped-1")
    assert status.state is JobState.FAILED and status.restarts == 0, status.reason
    assert status.reason.startswith(
        f"configuration error on rank 0: spec.model.from_pretrained: '{model / 'model.safetensors'}' resolves "
        "through a symlink outside the data roots"
    ), status.reason
    assert "not restarted" in status.reason and SECRET not in status.reason
    assert [e.state for e in events if e.kind is EventKind.STATE] == [JobState.SCHEDULED, JobState.RUNNING, JobState.FAILED]
    assert not any(e.kind is EventKind.STEP for e in events)
