"""Runaway-sized jobs against a real `trainctl serve` process over gRPC on loopback (issue 20).

The service's pool is the shared embedded Ray (`cluster`: 2 nodes x 1 simulated GPU), whose GPUs the
topology map calls H100s (80 GiB each), so the submit-time fit check has a GPU memory to compare with.
Every request below once made the service build the model layer by layer in its RPC thread (or
overflow a byte count); now each must be refused quickly with the field it is about, the server's
memory must stay near its idle size, and SIGTERM afterwards must end the process within 10 s.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serve_process import ServeProcess

from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(300)

CALL_BOUND_SECONDS = 5.0
"""Asserted per call; the issue's bound is 1 s unloaded (the figures are printed), this allows a busy CI machine."""
RSS_GROWTH_BYTES = 100 * 2**20
EXIT_BOUND_SECONDS = 10.0
H100 = "NVIDIA H100 80GB HBM3"

# (what, spec fields laid over a valid one-rank job, the field the refusal must name)
HOSTILE: list[tuple[str, pb.JobSpec, str]] = [
    ("the runaway", pb.JobSpec(model=pb.ModelSpec(dim=10**9, n_layers=10**6)), "spec.model.dim"),
    ("huge dim", pb.JobSpec(model=pb.ModelSpec(dim=10**9)), "spec.model.dim"),
    ("huge layer count", pb.JobSpec(model=pb.ModelSpec(n_layers=10**6)), "spec.model.n_layers"),
    ("huge ffn", pb.JobSpec(model=pb.ModelSpec(ffn_dim=10**12)), "spec.model.ffn_dim"),
    ("huge heads", pb.JobSpec(model=pb.ModelSpec(n_heads=10**9, n_kv_heads=10**9)), "spec.model.n_heads"),
    ("huge vocabulary", pb.JobSpec(model=pb.ModelSpec(vocab_size=10**12)), "spec.model.vocab_size"),
    ("huge expert count", pb.JobSpec(model=pb.ModelSpec(moe=pb.MoESpec(num_experts=10**9, top_k=2))), "spec.model.moe.num_experts"),
    ("huge sequence", pb.JobSpec(data=pb.DataSpec(seq_len=10**12)), "spec.data.seq_len"),
    ("huge batch", pb.JobSpec(training=pb.TrainingSpec(global_batch_size=2**62)), "spec.training.global_batch_size"),
    ("huge step count", pb.JobSpec(training=pb.TrainingSpec(steps=2**63 - 1)), "spec.training.steps"),
    ("huge LoRA rank", pb.JobSpec(lora=pb.LoRASpec(rank=10**9)), "spec.lora.rank"),
    ("huge restart count", pb.JobSpec(scheduling=pb.SchedulingSpec(max_restarts=10**9)), "spec.scheduling.max_restarts"),
    (
        "every size at its bound: valid, but no H100 holds it",
        pb.JobSpec(model=pb.ModelSpec(
            vocab_size=4_194_304, dim=65_536, n_layers=1_024, n_heads=1_024, n_kv_heads=1_024, ffn_dim=262_144,
            moe=pb.MoESpec(num_experts=1_024, top_k=2),
        )),
        "spec.resources.gpus",
    ),
]


@pytest.fixture(scope="module")
def serve(cluster: EmbeddedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("served")
    topology = base / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml().replace("gpu_model: simulated", f"gpu_model: {H100}"))
    with ServeProcess(cluster.address, topology, base / "data") as process:
        process.start()
        yield process


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def job(name: str, spec: pb.JobSpec) -> pb.Job:
    message = pb.Job(metadata=pb.ObjectMeta(name=name))
    message.spec.MergeFrom(spec)
    return message


def test_runaway_sized_jobs_are_refused_quickly_and_sigterm_still_stops_the_service(serve: ServeProcess) -> None:
    assert serve.proc is not None
    pid = serve.proc.pid
    with grpc.insecure_channel(serve.target) as channel:
        client = pb_grpc.TrainingServiceStub(channel)
        warm = client.PlanJob(pb.PlanJobRequest(job=job("warm-up", pb.JobSpec())), timeout=60)
        assert warm.valid, warm.violations
        idle = rss_bytes(pid)
        peak = idle
        for what, spec, field in HOSTILE:
            started = time.monotonic()
            plan = client.PlanJob(pb.PlanJobRequest(job=job("hostile", spec)), timeout=30)
            planned = time.monotonic() - started
            assert not plan.valid, f"{what}: planned as valid"
            assert field in [v.field for v in plan.violations], f"{what}: {list(plan.violations)}"
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.CreateJob(pb.CreateJobRequest(job=job("hostile", spec)), timeout=30)
            created = time.monotonic() - started
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {refused.value.details()}"
            assert field in refused.value.details(), f"{what}: {refused.value.details()}"
            peak = max(peak, rss_bytes(pid))
            print(f"{what}: PlanJob refused in {planned * 1e3:.0f} ms, CreateJob in {created * 1e3:.0f} ms")
            assert planned < CALL_BOUND_SECONDS and created < CALL_BOUND_SECONDS, what
        print(f"server RSS: idle {idle / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
        assert peak - idle < RSS_GROWTH_BYTES

    started = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    status = serve.proc.wait(timeout=EXIT_BOUND_SECONDS)
    print(f"SIGTERM to exit: {time.monotonic() - started:.1f} s, status {status}")
    assert status == 0, serve.log_path.read_text()[-3000:]
