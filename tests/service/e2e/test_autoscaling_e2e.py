"""Autoscaling end to end on Ray's own autoscaling test cluster (the real autoscaler v2, nodes simulated
by its fake multi-node provider): the topology map names two 4-GPU hosts Ray does not have; a queued
4-GPU job has the service ask the autoscaler for the one the solver would place it on, that node joins
with its map labels, the job is placed on it and SUCCEEDS, the request is withdrawn and the node goes
after the idle timeout; a job no node of the map can hold is refused at CreateJob first. The decisions are
unit-tested in tests/service/capacity/test_autoscaling.py."""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from autoscaling_cluster import LOOPBACK, LoopbackAutoscalingCluster
from prometheus_client.parser import text_string_to_metric_families
from ray.autoscaler.v2 import utils as autoscaler_v2_utils
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.service.server import Service, ServiceConfig
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.autoscaler import node_types
from trainctl.workers.rank_worker import free_port
from trainctl.workers.resources import CONTROL_CAPACITY, CONTROL_RESOURCE
from trainctl.workers.topology import simulated_topology

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

IDLE_TIMEOUT_MINUTES = 0.1
"""The autoscaler's idle timeout: 6 s."""
MAP_NODES = ("node-0", "node-1")


@pytest.fixture
def autoscaled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Service, TrainctlClient]]:
    """An autoscaling Ray with no GPU node up, a service with `--autoscaling` and a map of two 4-GPU
    hosts, and a client; everything the cluster started is gone afterwards."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Ray caches in the process whether the autoscaler is v2, from the first cluster it asked: an embedded
    # cluster of an earlier test (v1) made `request_resources` write the v1 request this cluster's v2
    # autoscaler never reads. A service connects to one cluster; this process has connected to many.
    monkeypatch.setattr(autoscaler_v2_utils, "cached_is_autoscaler_v2", None)
    topology = simulated_topology(len(MAP_NODES), 4)
    (tmp_path / "topology.yaml").write_text(topology.to_yaml())
    workdir = Path(tempfile.mkdtemp(prefix="tc-as-"))  # short: Ray's socket paths must fit in 107 bytes
    cluster = LoopbackAutoscalingCluster(
        {"CPU": 1, CONTROL_RESOURCE: CONTROL_CAPACITY}, node_types(topology, MAP_NODES),
        idle_timeout_minutes=IDLE_TIMEOUT_MINUTES, workdir=workdir,
    )
    service = None
    try:
        cluster.start()
        service = Service(ServiceConfig(
            address=f"{LOOPBACK}:0", data_dir=tmp_path / "data", metrics_port=free_port(LOOPBACK),
            ray_address=cluster.address, topology=tmp_path / "topology.yaml", autoscaling=True,
        )).start()
        with TrainctlClient(service.target) as client:
            yield service, client
    finally:
        if service is not None:
            service.stop()
        cluster.shutdown()
        left = cluster.processes()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"processes of the autoscaling cluster left running: {sorted(left)}"


def wait_for(what: str, check: Callable[[], Any], within: float, seen: Callable[[], Any] = lambda: "") -> Any:
    """`check()`'s first truthy value within `within` seconds (else fail with `seen()`)."""
    deadline = time.monotonic() + within
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}; {seen()}"
        time.sleep(0.2)
    return value


def alive_nodes(client: TrainctlClient) -> set[str]:
    return {node.name for node in client.get_cluster().nodes if node.alive}


def scraped(service: Service, name: str) -> float:
    """The value the service's Prometheus endpoint exports for the unlabelled series `name`."""
    with urllib.request.urlopen(f"http://{LOOPBACK}:{service.metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_queued_job_scales_the_cluster_up_and_the_node_goes_when_idle(autoscaled) -> None:
    service, client = autoscaled
    assert alive_nodes(client) == set(), "no GPU node is up before the job"
    with pytest.raises(grpc.RpcError) as refused:  # more GPUs than every host of the map: refused, not queued
        client.create_job(small_job("too-big", gpus=9, steps=1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "9 GPUs requested but the pool can never hold more than 8" in refused.value.details()
    assert not list(client.list_jobs()) and not client.get_cluster().HasField("scale_up")

    submitted = time.monotonic()
    job = client.create_job(small_job("autoscaled", gpus=4, steps=3))
    scale_up = wait_for("a pending scale-up in GetCluster", lambda: (c := client.get_cluster()).HasField("scale_up") and c.scale_up, 30)
    assert scale_up.job_id == job.id
    assert len(scale_up.nodes) == 1 and scale_up.nodes[0] in MAP_NODES, scale_up
    wanted = scale_up.nodes[0]
    queued = client.get_job(job.id)
    assert queued.status.state == pb.QUEUED
    assert queued.status.reason == f"waiting for the autoscaler to add {wanted} (asked for this job's placement)"
    assert scraped(service, "trainctl_scale_up_pending_nodes") == 1

    wait_for(f"{wanted} joining the Ray cluster", lambda: wanted in alive_nodes(client), 90)
    joined = time.monotonic()
    status = lambda: client.get_job(job.id).status  # noqa: E731
    running = wait_for("the job's first step", lambda: (j := client.get_job(job.id)).status.steps_done >= 1 and j, 150, status)
    first_step = time.monotonic()
    assert {p.node for p in running.status.placement} == {wanted}, "the solver placed every rank on the new node"
    assert alive_nodes(client) == {wanted}, "only the node asked for was added"

    done = wait_for("the job's end", lambda: (j := client.get_job(job.id)).status.state in (pb.SUCCEEDED, pb.FAILED) and j, 90)
    assert done.status.state == pb.SUCCEEDED, done.status.reason
    assert not client.get_cluster().HasField("scale_up"), "nothing is pending once the job is placed"
    assert scraped(service, "trainctl_scale_up_pending_nodes") == 0

    ended = time.monotonic()
    wait_for(f"{wanted} released after the idle timeout", lambda: wanted not in alive_nodes(client), 90)
    released = time.monotonic()
    print(f"\nscale-up: submit -> {wanted} joined {joined - submitted:.1f} s, -> first step {first_step - submitted:.1f} s; "
          f"released {released - ended:.1f} s after the job ended (idle timeout {IDLE_TIMEOUT_MINUTES * 60:g} s)")

