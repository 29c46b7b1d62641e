"""The asyncio gRPC server (trainctl.service.api.rpc_server, rpc_calls): reads never wait behind a write that
holds the store, open streams hold no thread, and a stop ends the streams still open."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from secure_service import bearer, job_message, start_service, stub, write_access_file

from trainctl.service.api.rpc_server import RpcServer
from trainctl.v1 import training_pb2 as pb

WORKERS = 8
"""The thread pool of the test service (secure_service.start_service)."""


@pytest.fixture
def service(tmp_path: Path):
    yield from _serving(tmp_path)


@pytest.fixture
def service_on_each_store(tmp_path: Path, store_location: str):
    yield from _serving(tmp_path, store_location)


def _serving(tmp_path: Path, store_location: str | None = None):
    tokens = write_access_file(tmp_path)
    running = start_service(tmp_path / "data", tokens.path, store_location=store_location)
    channel = running.channel()
    yield running, stub(channel), tokens
    channel.close()
    running.stop()


def test_reads_are_answered_while_a_write_holds_the_store(service_on_each_store) -> None:
    running, api, tokens = service_on_each_store
    job = api.CreateJob(pb.CreateJobRequest(job=job_message("first")), metadata=bearer(tokens.alice), timeout=10)
    release = threading.Event()
    held = threading.Event()

    def hold_the_store() -> None:  # what a slow commit looks like to everybody else
        with running.store._core.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_store)
    holder.start()
    held.wait(10)
    try:
        create = api.CreateJob.future(pb.CreateJobRequest(job=job_message("second")), metadata=bearer(tokens.alice), timeout=30)
        started = time.monotonic()
        for _ in range(20):
            assert api.GetJob(pb.GetJobRequest(id=job.id), metadata=bearer(tokens.alice), timeout=5).id == job.id
            listed = api.ListJobs(pb.ListJobsRequest(), metadata=bearer(tokens.alice), timeout=5)
            assert job.id in [j.id for j in listed.jobs]
            events = list(api.WatchJob(pb.WatchJobRequest(id=job.id), metadata=bearer(tokens.alice), timeout=5))
            assert [e.state_change.to_state for e in events] == [pb.QUEUED]
        assert time.monotonic() - started < 5
        assert not create.done()  # the write waits for the store, and only the write
    finally:
        release.set()
        holder.join(10)
    assert create.result(timeout=10).status.state == pb.QUEUED


def test_open_streams_hold_no_thread(service) -> None:
    """Ten times as many following streams as the server has threads, all open, and calls still answered."""
    _running, api, tokens = service
    job = api.CreateJob(pb.CreateJobRequest(job=job_message("followed")), metadata=bearer(tokens.alice), timeout=10)
    streams = [
        api.WatchJob(pb.WatchJobRequest(id=job.id, follow=True), metadata=bearer(tokens.alice), timeout=60)
        for _ in range(10 * WORKERS)
    ]
    try:
        assert all(next(s).state_change.to_state == pb.QUEUED for s in streams)  # each open and served
        created = api.CreateJob(pb.CreateJobRequest(job=job_message("more")), metadata=bearer(tokens.bob), timeout=10)
        assert created.status.state == pb.QUEUED
        cancelled = api.CancelJob(pb.CancelJobRequest(id=job.id), metadata=bearer(tokens.alice), timeout=10)
        assert cancelled.status.state == pb.CANCELLED
        for s in streams:  # every follower sees the end and its stream closes
            assert [e.state_change.to_state for e in s] == [pb.CANCELLED]
    finally:
        for s in streams:
            s.cancel()


def test_stop_ends_open_streams_and_may_be_called_twice(tmp_path: Path) -> None:
    tokens = write_access_file(tmp_path)
    running = start_service(tmp_path / "data", tokens.path)
    channel = running.channel()
    api = stub(channel)
    job = api.CreateJob(pb.CreateJobRequest(job=job_message("followed")), metadata=bearer(tokens.alice), timeout=10)
    stream = api.WatchJob(pb.WatchJobRequest(id=job.id, follow=True), metadata=bearer(tokens.alice), timeout=60)
    next(stream)
    started = time.monotonic()
    running.server.stop(0.5).wait()
    with pytest.raises(grpc.RpcError):
        list(stream)
    assert time.monotonic() - started < 10
    assert running.server.stop(0.5).wait(1)
    channel.close()
    running.store.close()


def test_the_server_needs_a_thread_and_refuses_a_taken_port() -> None:
    with pytest.raises(ValueError, match="workers must be at least 1"):
        RpcServer(workers=0)
    first = RpcServer(workers=1, options=[("grpc.so_reuseport", 0)])
    second = RpcServer(workers=1, options=[("grpc.so_reuseport", 0)])
    try:
        port = first.add_insecure_port("127.0.0.1:0")
        with pytest.raises(RuntimeError):
            second.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        second.stop(0)
        first.stop(0)
