"""Files whose content would once take a served `trainctl serve`'s memory or crash its checks (issue 32),
against a real process with a data root, over gRPC on loopback: a 1 GiB JSONL file with no newline (sparse:
NUL bytes), a model directory whose config.json is nested 50,000 deep, and a JSONL file whose first record
is. Ten CreateJobs of each at once: every one is INVALID_ARGUMENT naming the field within 5 s, and the
server's peak resident memory (VmHWM, reset once it is warm) stays within 100 MB of its idle size.
The service joins the shared embedded Ray (`cluster`): no job gets as far as the cluster.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from serve_process import ServeProcess

from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.errors import field_violations
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(300)

CALL_BOUND_SECONDS = 5.0
RSS_GROWTH_BYTES = 100 * 2**20
EACH = 10
DEEP = "[" * 50_000 + "]" * 50_000
HUGE_JSONL_BYTES = 1 << 30


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data root: the hostile files."""
    root = tmp_path_factory.mktemp("root")
    with open(root / "huge.jsonl", "wb") as handle:
        handle.truncate(HUGE_JSONL_BYTES)  # sparse: a GiB of NUL bytes, no newline
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(DEEP)
    (root / "deep.jsonl").write_text(DEEP + "\n")
    return root


@pytest.fixture(scope="module")
def serve(cluster: EmbeddedRay, root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("served")
    topology = base / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml())
    with ServeProcess(cluster.address, topology, base / "data", f"--data-root={root}") as process:
        process.start()
        yield process


def memory_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for process {pid}")


def job(name: str, data: pb.DataSpec, model: pb.ModelSpec | None = None) -> pb.Job:
    message = pb.Job(metadata=pb.ObjectMeta(name=name))
    message.spec.data.CopyFrom(data)
    message.spec.resources.gpus = 1
    message.spec.resources.device = pb.DEVICE_CPU
    if model is not None:
        message.spec.model.CopyFrom(model)
    return message


def hostile(root: Path) -> list[tuple[str, pb.Job, str]]:
    """(what, job, the field its refusal must name)."""
    return [
        ("1 GiB JSONL without a newline",
         job("huge-line", pb.DataSpec(paths=pb.StringList(values=[str(root / "huge.jsonl")]), format=pb.DATA_FORMAT_JSONL)),
         "spec.data.paths"),
        ("config.json nested 50,000 deep",
         job("deep-config", pb.DataSpec(tokenizer="byte"), pb.ModelSpec(from_pretrained=str(root / "model"))),
         "spec.model.from_pretrained"),
        ("first JSONL record nested 50,000 deep",
         job("deep-record", pb.DataSpec(paths=pb.StringList(values=[str(root / "deep.jsonl")]), format=pb.DATA_FORMAT_JSONL)),
         "spec.data.paths"),
    ]


def test_hostile_file_content_is_refused_quickly_in_bounded_memory(serve: ServeProcess, root: Path) -> None:
    assert serve.proc is not None
    pid = serve.proc.pid
    cases = hostile(root)
    with grpc.insecure_channel(serve.target) as channel:
        client = pb_grpc.TrainingServiceStub(channel)
        for what, message, field in cases:  # warm: every check's code loaded; PlanJob refuses them too
            plan = client.PlanJob(pb.PlanJobRequest(job=message), timeout=60)
            assert not plan.valid and field in [v.field for v in plan.violations], (what, list(plan.violations))
        idle = memory_kib(pid, "VmRSS") * 1024
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
        start = threading.Barrier(len(cases) * EACH)

        def create(message: pb.Job) -> tuple[grpc.StatusCode, list[str], str, float]:
            start.wait()
            began = time.monotonic()
            try:
                client.CreateJob(pb.CreateJobRequest(job=message), timeout=60)
            except grpc.RpcError as exc:
                return exc.code(), [v.field for v in field_violations(exc)], exc.details() or "", time.monotonic() - began
            return grpc.StatusCode.OK, [], "created", time.monotonic() - began

        with ThreadPoolExecutor(len(cases) * EACH) as pool:
            answers = [(what, field, pool.submit(create, message)) for what, message, field in cases for _ in range(EACH)]
            results = [(what, field, *future.result()) for what, field, future in answers]
        peak = memory_kib(pid, "VmHWM") * 1024
    slowest = max(seconds for *_, seconds in results)
    print(f"{len(results)} CreateJobs answered, slowest in {slowest * 1e3:.0f} ms; server RSS idle "
          f"{idle / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
    for what, field, code, fields, details, seconds in results:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert field in fields, (what, details)
        assert seconds < CALL_BOUND_SECONDS, (what, seconds)
    assert peak - idle < RSS_GROWTH_BYTES, f"peak {peak / 2**20:.0f} MiB, idle {idle / 2**20:.0f} MiB"
    assert serve.proc.poll() is None and os.path.getsize(root / "huge.jsonl") == HUGE_JSONL_BYTES
