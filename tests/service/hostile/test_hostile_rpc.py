"""Hostile requests against every TrainingService method, as raw bytes over a generic channel.

Two kinds of payload: arbitrary bytes, and well-formed messages with arbitrary field values (built from
the proto descriptors, so new fields are covered as the API grows: int64 extremes, NaN, unknown enum
numbers, traversal strings, ids of real jobs). Every request must get a well-formed answer (never
UNKNOWN or INTERNAL), the server must keep serving, and the store must stay intact.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import event, given, settings
from hypothesis import strategies as st
from proto_strategies import messages
from secure_service import bearer, job_message, start_service, stub, write_access_file

from trainctl.service.store import DB_NAME, JobStore
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.events import JobState

SERVICE = pb.DESCRIPTOR.services_by_name["TrainingService"]
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SAFE_ID = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

@st.composite
def near_valid_jobs(draw: st.DrawFn, descriptor: Descriptor, strings: st.SearchStrategy[str]) -> Any:
    """A request carrying a valid job with random spec fields laid over it, to reach semantic checks."""
    message = GetMessageClass(descriptor)()
    message.job.CopyFrom(job_message("near-valid"))
    message.job.spec.MergeFrom(draw(messages(pb.JobSpec.DESCRIPTOR, strings, depth=1)))
    return message


def requests(descriptor: Descriptor, strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    if "job" in descriptor.fields_by_name:
        return st.one_of(messages(descriptor, strings), near_valid_jobs(descriptor, strings))
    return messages(descriptor, strings)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory):
    """A secured service with a few real jobs, data confined to a small root, as an admin would see it."""
    base = tmp_path_factory.mktemp("hostile")
    tokens = write_access_file(base)
    root = base / "datasets"
    root.mkdir()
    (root / "text.txt").write_text("hostile input " * 50)
    svc = start_service(base / "svc", tokens.path, data_roots=[root])
    channel = svc.channel()
    client = stub(channel)
    created = [
        client.CreateJob(pb.CreateJobRequest(job=job_message(f"keep-{i}", paths=[str(root / "text.txt")])), metadata=bearer(tokens.root), timeout=10)
        for i in range(3)
    ]
    yield {"svc": svc, "channel": channel, "token": tokens.root, "ids": [j.id for j in created], "root": root}
    channel.close()
    svc.stop()


def strings_for(hostile: dict) -> st.SearchStrategy[str]:
    interesting = [*hostile["ids"], "", "..", "../../etc/passwd", "/**", "/etc/passwd", "@stdlib", "\x00", "é" * 70, str(hostile["root"] / "*")]
    return st.one_of(st.sampled_from(interesting), st.text(max_size=40))


def send(hostile: dict, method: str, payload: bytes) -> grpc.StatusCode:
    """Send raw bytes to a TrainingService method; the status code of the answer."""
    descriptor = SERVICE.methods_by_name[method]
    path = f"/{SERVICE.full_name}/{method}"
    channel: grpc.Channel = hostile["channel"]
    metadata = bearer(hostile["token"])
    try:
        if descriptor.server_streaming:
            for _ in channel.unary_stream(path)(payload, metadata=metadata, timeout=10):
                pass
        else:
            channel.unary_unary(path)(payload, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD_CODES, f"{method} answered {exc.code().name}: {exc.details()}"
        event(exc.code().name)  # the mix of answers shows with --hypothesis-show-statistics
        return exc.code()
    event("OK")
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", sorted(SERVICE.methods_by_name))
def test_arbitrary_bytes_get_well_formed_answers(hostile: dict, method: str) -> None:
    @settings(max_examples=25, deadline=None)
    @given(payload=st.binary(max_size=300))
    def run(payload: bytes) -> None:
        send(hostile, method, payload)

    run()


@pytest.mark.parametrize("method", sorted(SERVICE.methods_by_name))
def test_arbitrary_messages_get_well_formed_answers(hostile: dict, method: str) -> None:
    descriptor = SERVICE.methods_by_name[method].input_type

    @settings(max_examples=40, deadline=None)
    @given(message=requests(descriptor, strings_for(hostile)))
    def run(message: Any) -> None:
        if method == "WatchJob":
            message.follow = False  # following a live job waits for its end; the deadline path is tested elsewhere
        send(hostile, method, message.SerializeToString())

    run()


def test_the_service_and_its_store_survive(hostile: dict) -> None:
    """Runs after the hostile tests (file order): the server answers, the store is intact."""
    channel = hostile["channel"]
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    job = stub(channel).CreateJob(pb.CreateJobRequest(job=job_message("after-the-storm", paths=["@stdlib"])), metadata=bearer(hostile["token"]), timeout=10)
    assert job.status.state == pb.QUEUED

    data_dir: Path = hostile["svc"].data_dir
    with sqlite3.connect(data_dir / DB_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    reopened = JobStore(data_dir)  # a second process-level view, as a restarted service would open it
    try:
        for job_id in [*hostile["ids"], job.id]:
            record = reopened.get_job(job_id)  # parses the stored spec back into a TrainingJob
            assert record.state in set(JobState)
        for record in reopened.list_jobs(limit=10_000):
            # run and checkpoint directories are <data-dir>/runs/<job id>: an id must be a plain name
            assert SAFE_ID.match(record.id), record.id
            sequences = [e.sequence for e in reopened.events(record.id)]
            assert sequences == sorted(set(sequences)) and sequences, record.id
    finally:
        reopened.close()
