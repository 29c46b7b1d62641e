"""Two tenants, authentication and data roots on: tenant B (bob, nlp) can start from, read, plan with,
export or list nothing of tenant A's (alice, vision) through any path field or RPC; A names its own
earlier job as `init_from: job:<id>`; misconfigured jobs (seq_len beyond the corpus, init_from naming no
checkpoint) are refused at submit."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from secure_service import (
    SecureService,
    Tokens,
    bearer,
    job_message,
    refused,
    start_service,
    stub,
    write_access_file,
)

from trainctl.cli.export_cmd import resolve_source
from trainctl.parallelism.checkpoint.dcp import save_checkpoint
from trainctl.parallelism.checkpoint.pretrained import CheckpointNotFoundError, write_run_spec
from trainctl.v1 import training_pb2 as pb

UNKNOWN_ID = "job-000000000000"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return write_access_file(tmp_path_factory.mktemp("access"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("datasets")
    (data / "corpus.txt").write_text("tenant-shared text " * 50)  # 950 bytes
    (data / "empty-run").mkdir()
    return data


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tokens: Tokens, root: Path):
    svc = start_service(tmp_path_factory.mktemp("svc"), tokens.path, data_roots=[root])
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def alices_job(service: SecureService, tokens: Tokens) -> pb.Job:
    """A job of tenant vision whose run directory holds a complete checkpoint and its job record."""
    with service.channel() as ch:
        job = stub(ch).CreateJob(pb.CreateJobRequest(job=job_message("alice-base")), metadata=bearer(tokens.alice), timeout=10)
    checkpoints = service.data_dir / "runs" / job.id / "checkpoints"
    save_checkpoint(checkpoints, 2, {"model": {"tok_embeddings.weight": torch.ones(4)}}, keep_last=1)
    write_run_spec(checkpoints, service.store.get_job(job.id).job.spec)
    service.store.update_status(job.id, run_dir=str(checkpoints.parent))  # as the scheduler records it
    return job


def hostile_jobs(run_dir: Path, job_id: str) -> dict[str, pb.Job]:
    """Jobs of bob that point a path field into alice's run directory, or name her job by id."""
    jobs = {}
    for name, field, value in (
        ("init-path", "init_from", str(run_dir)),
        ("init-ckpt", "init_from", str(run_dir / "checkpoints")),
        ("init-ref", "init_from", f"job:{job_id}"),
        ("tokenizer", "tokenizer", str(run_dir / "checkpoints" / "job.json")),
        ("paths", "paths", f"{run_dir}/checkpoints/*/*"),
        ("paths-span", "paths", f"{run_dir.parent}/*/checkpoints/**"),
    ):
        job = job_message(f"bob-{name}")
        if field == "init_from":
            job.spec.init_from = value
        elif field == "tokenizer":
            job.spec.data.tokenizer = value
        else:
            job.spec.data.paths.values[:] = [value]
        jobs[name] = job
    return jobs


def test_b_cannot_start_from_read_or_plan_with_anything_of_a(service: SecureService, tokens: Tokens, alices_job: pb.Job) -> None:
    run_dir = service.data_dir / "runs" / alices_job.id
    with service.channel() as ch:
        client = stub(ch)
        for name, job in hostile_jobs(run_dir, alices_job.id).items():
            fields = refused(client, pb.CreateJobRequest(job=job), tokens.bob)
            assert len(fields) == 1 and fields[0].startswith(("spec.init_from", "spec.data")), (name, fields)
            plan = client.PlanJob(pb.PlanJobRequest(job=job), metadata=bearer(tokens.bob), timeout=10)
            assert not plan.valid and [f"{v.field}: {v.description}" for v in plan.violations] == fields, name
        # A's id looks exactly like an unknown one
        unknown = job_message("bob-unknown")
        unknown.spec.init_from = f"job:{UNKNOWN_ID}"
        [theirs] = refused(client, pb.CreateJobRequest(job=hostile_jobs(run_dir, alices_job.id)["init-ref"]), tokens.bob)
        [nobody] = refused(client, pb.CreateJobRequest(job=unknown), tokens.bob)
        assert theirs.replace(alices_job.id, "X") == nobody.replace(UNKNOWN_ID, "X")
        # nothing of A's by id either
        for call, request in (
            (client.GetJob, pb.GetJobRequest(id=alices_job.id)),
            (client.CancelJob, pb.CancelJobRequest(id=alices_job.id)),
            (client.WatchJob, pb.WatchJobRequest(id=alices_job.id)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                list(call(request, metadata=bearer(tokens.bob), timeout=10)) if call is client.WatchJob else call(request, metadata=bearer(tokens.bob), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        listed = client.ListJobs(pb.ListJobsRequest(page_size=1000), metadata=bearer(tokens.bob), timeout=10)
        assert alices_job.id not in {j.id for j in listed.jobs}
    assert not [r for r in service.store.list_jobs() if r.name.startswith("bob-")]


def test_b_cannot_export_as_job_id(service: SecureService, tokens: Tokens, alices_job: pb.Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINCTL_TOKEN", tokens.bob)
    with pytest.raises(CheckpointNotFoundError, match="NOT_FOUND"):
        resolve_source(alices_job.id, f"127.0.0.1:{service.port}")
    monkeypatch.setenv("TRAINCTL_TOKEN", tokens.alice)
    assert resolve_source(alices_job.id, f"127.0.0.1:{service.port}").path.name == "step_00000002"


def test_a_starts_from_its_own_job_by_id(service: SecureService, tokens: Tokens, alices_job: pb.Job) -> None:
    job = job_message("alice-tuned")
    job.spec.init_from = f"job:{alices_job.id}"
    with service.channel() as ch:
        created = stub(ch).CreateJob(pb.CreateJobRequest(job=job), metadata=bearer(tokens.alice), timeout=10)
        # by path, A's run directory is outside the data roots: the id is the way to name it
        job.spec.init_from = str(service.data_dir / "runs" / alices_job.id)
        [by_path] = refused(stub(ch), pb.CreateJobRequest(job=job), tokens.alice)
    assert created.spec.init_from == str((service.data_dir / "runs" / alices_job.id).resolve())
    assert by_path.startswith("spec.init_from") and "outside the data roots" in by_path


def test_misconfigured_jobs_are_refused_at_submit(service: SecureService, tokens: Tokens, root: Path, alices_job: pb.Job) -> None:
    too_long = job_message("seq-too-long", paths=[str(root / "corpus.txt")])
    too_long.spec.data.seq_len = 4096
    no_checkpoint = job_message("no-checkpoint")
    no_checkpoint.spec.init_from = str(root / "empty-run")
    other_shape = job_message("other-shape")
    other_shape.spec.init_from = f"job:{alices_job.id}"
    other_shape.spec.model.dim = 128
    with service.channel() as ch:
        client = stub(ch)
        [seq] = refused(client, pb.CreateJobRequest(job=too_long), tokens.alice)
        [ckpt] = refused(client, pb.CreateJobRequest(job=no_checkpoint), tokens.alice)
        [shape] = refused(client, pb.CreateJobRequest(job=other_shape), tokens.alice)
        too_long.spec.data.seq_len = 512  # 950 bytes hold one sample of 513
        assert client.CreateJob(pb.CreateJobRequest(job=too_long), metadata=bearer(tokens.alice), timeout=10).status.state == pb.QUEUED
    assert seq.startswith("spec.data.seq_len: a sample needs seq_len + 1 = 4097 tokens") and "950 bytes" in seq
    assert ckpt.startswith("spec.init_from") and "no complete checkpoint" in ckpt
    assert shape.startswith("spec.init_from") and "dim" in shape
