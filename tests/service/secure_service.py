"""A Ray-free TrainingService on loopback for the security tests: the real servicer, store, pool and
gRPC server (`build_grpc_server`, the same call chain `trainctl serve` runs), with the scheduler
loop not started, so jobs stay where the API puts them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from trainctl.planning.pool import GpuPool
from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.hardening import MessageLimits
from trainctl.service.security.paths import JobPathPolicy
from trainctl.service.server import build_grpc_server
from trainctl.service.store import JobStore
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.errors import field_violations
from trainctl.wire.tls import TlsConfig, bind
from trainctl.wire.tokens import generate_token, hash_token
from trainctl.workers.topology import simulated_topology

POOL_NODES, POOL_GPUS_PER_NODE = 2, 4


class NoRuntime:
    """The scheduler loop never runs in these tests, so nothing may reach the runtime."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the security tests must not reach the runtime ({name})")


@dataclass
class Tokens:
    """One token per principal the tests use, and the access file holding their hashes."""

    alice: str  # user, tenant vision
    bob: str  # user, tenant nlp
    root: str  # admin, tenant ops
    path: Path


def write_access_file(
    directory: Path, quotas: dict[str, dict[str, int]] | None = None, command_tenants: list[str] | None = None,
) -> Tokens:
    tokens = Tokens(generate_token(), generate_token(), generate_token(), directory / "access.yaml")
    document = {
        "tokens": [
            {"name": "alice", "tenant": "vision", "role": "user", "sha256": hash_token(tokens.alice)},
            {"name": "bob", "tenant": "nlp", "role": "user", "sha256": hash_token(tokens.bob)},
            {"name": "root", "tenant": "ops", "role": "admin", "sha256": hash_token(tokens.root)},
        ],
        "tenants": quotas or {},
        "command_tenants": command_tenants or [],
    }
    tokens.path.write_text(yaml.safe_dump(document))
    return tokens


@dataclass
class SecureService:
    store: JobStore
    server: RpcServer
    port: int
    data_dir: Path

    def channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        target = f"127.0.0.1:{self.port}"
        return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)

    def stop(self) -> None:
        self.server.stop(grace=2).wait()  # let handlers (a WatchJob noticing its deadline) finish before the store closes
        self.store.close()


def start_service(
    data_dir: Path,
    access_file: Path | None,
    *,
    data_roots: list[Path] | None = None,
    tls: TlsConfig | None = None,
    limits: MessageLimits | None = None,
    metrics: ServiceMetrics | None = None,
    streams_per_tenant: int | None = None,
    store_location: str | None = None,
) -> SecureService:
    """`store_location`: a PostgreSQL URL for the store (default: SQLite in `data_dir`)."""
    authenticator = Authenticator.from_file(access_file)
    store = JobStore(store_location or data_dir)
    pool = GpuPool(simulated_topology(POOL_NODES, POOL_GPUS_PER_NODE), "simulated")
    scheduler = Scheduler(store, pool, NoRuntime(), data_dir / "runs", quota_of=authenticator.quota)
    servicer = TrainingServicer(
        store, scheduler, pool, authenticator, paths=JobPathPolicy(data_roots or [], scheduler.runs_dir)
    )
    extra = {} if streams_per_tenant is None else {"streams_per_tenant": streams_per_tenant}
    server, _health = build_grpc_server(servicer, authenticator, metrics, workers=8, limits=limits, **extra)
    port = bind(server, "127.0.0.1:0", tls)
    server.start()
    return SecureService(store, server, port, data_dir)


def job_message(name: str, *, gpus: int = 2, paths: list[str] | None = None, labels: dict[str, str] | None = None) -> pb.Job:
    """A small valid job: debug model, `gpus` data-parallel ranks on CPU."""
    job = pb.Job(api_version="trainctl/v1", kind="TrainingJob")
    job.metadata.name = name
    job.metadata.labels.update(labels or {})
    job.spec.data.paths.values.extend(paths or ["@stdlib"])
    job.spec.data.seq_len = 64
    job.spec.parallelism.dp_shard = gpus
    job.spec.training.steps = 2
    job.spec.training.global_batch_size = 2 * gpus
    job.spec.resources.gpus = gpus
    job.spec.resources.device = pb.DEVICE_CPU
    return job


def stub(channel: grpc.Channel) -> pb_grpc.TrainingServiceStub:
    return pb_grpc.TrainingServiceStub(channel)


def bearer(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def refused(client: pb_grpc.TrainingServiceStub, request: pb.CreateJobRequest, token: str) -> list[str]:
    """The fields a refused CreateJob names (INVALID_ARGUMENT)."""
    with pytest.raises(grpc.RpcError) as info:
        client.CreateJob(request, metadata=bearer(token), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return [f"{v.field}: {v.description}" for v in field_violations(info.value)]
