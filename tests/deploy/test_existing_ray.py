"""`trainctl serve --ray-address` joins a Ray cluster that is already running (as on KubeRay, where the
control plane runs beside the head) instead of starting its own, and trains a job on it.

The test starts a real `ray start --head --block` on loopback (auth disabled on both sides), the real
`trainctl serve` CLI, submits a job over gRPC, and stops both by PID (never `ray stop`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from prom_support import free_port

from trainctl.spec.validate import parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto
from trainctl.workers.embedded import topology_labels
from trainctl.workers.resources import slot_resources
from trainctl.workers.topology import simulated_topology

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # the Ray guard is in os.environ (tests/conftest.py)
JOB = {
    "apiVersion": "trainctl/v1", "kind": "TrainingJob", "metadata": {"name": "on-existing-ray"},
    "spec": {"model": {"preset": "debug"}, "data": {"seq_len": 32},
             "training": {"steps": 6, "global_batch_size": 2, "warmup_steps": 1},
             "checkpoint": {"interval_steps": 0}, "resources": {"gpus": 1, "device": "cpu"}},
}


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL of the process group this test started for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def ray_head(tmp_path):
    """A one-node Ray head labelled like a trainctl node (node-0, 2 GPU slots) on loopback."""
    topology = simulated_topology(1, 2)
    (tmp_path / "topology.yaml").write_text(topology.to_yaml())
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="tc-ray-"))  # short: Ray's socket paths must fit in 107 bytes
    args = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            "--num-cpus=4", "--include-dashboard=false", f"--temp-dir={temp}",
            f"--resources={json.dumps(slot_resources(2))}",
            f"--labels={','.join(f'{k}={v}' for k, v in topology_labels(topology, 'node-0').items())}",
            f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}"]
    log = (tmp_path / "ray-head.log").open("w")
    head = subprocess.Popen(args, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "blocks forever" not in (text := (tmp_path / "ray-head.log").read_text()) and \
                "block forever" not in text:
            assert head.poll() is None, f"ray start failed:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"ray head not up after 90 s:\n{text[-3000:]}"
            time.sleep(0.5)
        yield {"address": f"127.0.0.1:{port}", "topology": tmp_path / "topology.yaml", "temp": temp}
    finally:
        stop(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_joins_an_existing_ray_cluster(ray_head, tmp_path) -> None:
    serve_log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen(
        [str(BIN / "trainctl"), "serve", "--address=127.0.0.1:0", f"--data-dir={tmp_path / 'data'}",
         "--metrics-port=0", f"--ray-address={ray_head['address']}", f"--topology={ray_head['topology']}"],
        env=ENV, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"serving on (127\.0\.0\.1:\d+)", (tmp_path / "serve.log").read_text())):
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "trainctl serve did not come up in 90 s"
            time.sleep(0.5)
        with grpc.insecure_channel(found.group(1)) as channel:
            stub = pb_grpc.TrainingServiceStub(channel)
            job = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(parse_object(JOB))), timeout=30)
            deadline = time.monotonic() + 120
            while (got := stub.GetJob(pb.GetJobRequest(id=job.id), timeout=10)).status.state not in (
                    pb.SUCCEEDED, pb.FAILED, pb.CANCELLED):
                assert time.monotonic() < deadline, f"job still {pb.JobState.Name(got.status.state)}"
                time.sleep(1)
        assert got.status.state == pb.SUCCEEDED, got.status.reason
        assert got.status.steps_done == 6
        assert [p.node for p in got.status.placement] == ["node-0"]
        # The service was a driver of *this* cluster: its core-driver log is in the head's session,
        # named with the serve process's PID; it started no Ray of its own.
        logs = list((ray_head["temp"] / "session_latest" / "logs").glob(f"python-core-driver-*_{serve.pid}.log"))
        assert logs, "trainctl serve never connected to the existing Ray head"
    finally:
        stop(serve)
        serve_log.close()
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
