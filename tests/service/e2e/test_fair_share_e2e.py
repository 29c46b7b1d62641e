"""Guaranteed shares between tenants on the embedded Ray, end to end through an authenticated service: the
pool is 2 GPUs and each of two tenants is guaranteed one. Tenant vision borrows nlp's idle GPU for a
2-rank job of higher priority; nlp's 1-GPU job arrives and reclaims it: vision's job checkpoints at its
next step, is queued again, nlp's job runs and SUCCEEDS, and vision's job resumes and SUCCEEDS with every
step trained once and each step's loss equal to an uninterrupted run's. The policy's cases are unit-tested
in tests/service/capacity/test_preemption.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from secure_service import Tokens, write_access_file
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.service.server import Service, ServiceConfig
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(300)

STEPS = 12


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    """alice (tenant vision) and bob (tenant nlp), each tenant guaranteed one of the pool's two GPUs."""
    quotas = {"vision": {"guaranteed_gpus": 1}, "nlp": {"guaranteed_gpus": 1}}
    return write_access_file(tmp_path_factory.mktemp("access"), quotas=quotas)


@pytest.fixture(scope="module")
def service(cluster: EmbeddedRay, tokens: Tokens, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The real service on the module's cluster with the access file (jobs read only the built-in corpus)."""
    config = ServiceConfig(address="127.0.0.1:0", data_dir=tmp_path_factory.mktemp("service"), metrics_port=0,
                           ray_address=cluster.address, tokens_file=tokens.path, allow_any_data_path=True)
    with Service(config, topology=cluster.topology) as running:
        yield running


def job(name: str, gpus: int, priority: int) -> TrainingJob:
    return small_job(name, gpus=gpus, steps=STEPS if gpus == 2 else 3, labels={"suite": "fair-share"},
                     training={"lr": 0.005}, checkpoint={"interval_steps": 50}, scheduling={"priority": priority})


def payload(event: pb.JobEvent) -> str | None:
    return event.WhichOneof("payload")


def test_a_tenant_within_its_share_reclaims_a_borrowed_gpu_and_the_borrower_loses_nothing(
    service: Service, tokens: Tokens,
) -> None:
    with TrainctlClient(service.target, token=tokens.alice) as alice, TrainctlClient(service.target, token=tokens.bob) as bob:
        borrower = alice.create_job(job("borrower", gpus=2, priority=5))
        stream, seen = alice.watch(borrower.id), []
        for event in stream:
            seen.append(event)
            if payload(event) == "step" and event.step.step >= 3:
                break
        shares = {t.tenant: (t.used_gpus, t.guaranteed_gpus, t.borrowed_gpus) for t in alice.get_cluster().tenants}
        assert shares == {"vision": (2, 1, 1)}, "a user sees its own tenant's share only"
        reclaimer = bob.create_job(job("reclaimer", gpus=1, priority=0))
        seen += list(stream)
        done = bob.get_job(reclaimer.id)
        assert done.status.state == pb.SUCCEEDED, done.status.reason

        states = [e.state_change.to_state for e in seen if payload(e) == "state_change"]
        assert states == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.PREEMPTED, pb.QUEUED, pb.SCHEDULED, pb.RESTARTING,
                          pb.RUNNING, pb.SUCCEEDED]
        reasons = [e.state_change.reason for e in seen if payload(e) == "state_change"]
        assert reasons[3] == (f"preempted by job {reclaimer.id}, whose tenant 'nlp' reclaims GPUs within its guaranteed "
                              "share: checkpointing at its next step boundary")
        assert [e.step.step for e in seen if payload(e) == "step"] == list(range(1, STEPS + 1))
        resumed = alice.get_job(borrower.id, full=True)
        assert resumed.status.preemptions == 1
        assert done.status.end_time.ToNanoseconds() <= resumed.status.end_time.ToNanoseconds()

        reference = alice.create_job(job("reference", gpus=2, priority=5))
        for _ in alice.watch(reference.id):
            pass
        uninterrupted = alice.get_job(reference.id, full=True)
        assert uninterrupted.status.state == pb.SUCCEEDED, uninterrupted.status.reason
        for step, expected in zip(resumed.metrics, uninterrupted.metrics, strict=True):
            assert step.step == expected.step and step.loss == pytest.approx(expected.loss, rel=1e-5), step.step
