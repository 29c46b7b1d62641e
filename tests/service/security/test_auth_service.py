"""Authentication, tenancy, quotas, path confinement and TLS through the real TrainingService over gRPC."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry
from secure_service import SecureService, Tokens, bearer, job_message, start_service, stub, write_access_file
from throwaway_pki import Authority

from trainctl.service.metrics import ServiceMetrics
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.errors import field_violations
from trainctl.wire.tls import TlsConfig, channel_credentials

QUOTAS = {"vision": {"queued_jobs": 3, "running_gpus": 4}}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return write_access_file(tmp_path_factory.mktemp("access"), QUOTAS)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tokens: Tokens):
    svc = start_service(tmp_path_factory.mktemp("svc"), tokens.path)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def channel(service: SecureService):
    with service.channel() as ch:
        yield ch


def invoke(call, request, **kwargs):
    """Call a unary or server-streaming method; a stream is read to its end."""
    result = call(request, timeout=10, **kwargs)
    return list(result) if isinstance(result, grpc.Call) and hasattr(result, "__next__") else result


def code_of(call, request, **kwargs) -> grpc.StatusCode:
    try:
        invoke(call, request, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def every_method(client) -> list[tuple[str, object, object]]:
    return [
        ("CreateJob", client.CreateJob, pb.CreateJobRequest(job=job_message("x"))),
        ("GetJob", client.GetJob, pb.GetJobRequest(id="job-x")),
        ("ListJobs", client.ListJobs, pb.ListJobsRequest()),
        ("CancelJob", client.CancelJob, pb.CancelJobRequest(id="job-x")),
        ("WatchJob", client.WatchJob, pb.WatchJobRequest(id="job-x")),
        ("PlanJob", client.PlanJob, pb.PlanJobRequest(job=job_message("x"))),
        ("GetCluster", client.GetCluster, pb.GetClusterRequest()),
        ("CreateSweep", client.CreateSweep, pb.CreateSweepRequest(sweep=sweep_message("x"))),
        ("GetSweep", client.GetSweep, pb.GetSweepRequest(id="sweep-x")),
        ("ListSweeps", client.ListSweeps, pb.ListSweepsRequest()),
        ("CancelSweep", client.CancelSweep, pb.CancelSweepRequest(id="sweep-x")),
        ("WatchSweep", client.WatchSweep, pb.WatchSweepRequest(id="sweep-x")),
    ]


def sweep_message(name: str, *, gpus: int = 2, parallel: int = 2) -> pb.Sweep:
    """A small valid sweep over the learning rate of job_message's job."""
    sweep = pb.Sweep(api_version="trainctl/v1", kind="Sweep")
    sweep.metadata.name = name
    sweep.spec.template.CopyFrom(job_message(name, gpus=gpus).spec)
    parameter = sweep.spec.parameters.add(path="spec.training.lr", type=pb.PARAMETER_TYPE_FLOAT, log=True)
    parameter.low.float_value, parameter.high.float_value = 1e-4, 1e-2
    sweep.spec.trials, sweep.spec.parallel_trials = 4, parallel
    return sweep


def test_every_rpc_needs_a_valid_token(service: SecureService, channel: grpc.Channel, tokens: Tokens) -> None:
    client = stub(channel)
    methods = every_method(client)
    assert {m for m, _, _ in methods} == set(pb.DESCRIPTOR.services_by_name["TrainingService"].methods_by_name)
    for name, call, request in methods:
        for metadata in (None, bearer("trainctl_" + "x" * 43), [("authorization", "Basic dXNlcjpwYXNz")]):
            assert code_of(call, request, metadata=metadata) == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
    assert service.store.list_jobs() == []  # nothing refused reached the store
    assert code_of(client.ListJobs, pb.ListJobsRequest(), metadata=bearer(tokens.alice)) == grpc.StatusCode.OK


def test_refused_and_undecodable_calls_are_counted_with_their_codes(tmp_path: Path, tokens: Tokens) -> None:
    registry = CollectorRegistry()
    svc = start_service(tmp_path, tokens.path, metrics=ServiceMetrics(registry))

    def count(method: str, code: str) -> float:
        return registry.get_sample_value("trainctl_grpc_requests_total", {"method": method, "code": code}) or 0.0

    try:
        with svc.channel() as ch:
            client = stub(ch)
            assert code_of(client.GetJob, pb.GetJobRequest(id="job-x")) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(client.WatchJob, pb.WatchJobRequest(id="job-x")) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(client.GetJob, pb.GetJobRequest(id="job-x"), metadata=bearer(tokens.alice)) == grpc.StatusCode.NOT_FOUND
            assert code_of(client.ListJobs, pb.ListJobsRequest(), metadata=bearer(tokens.alice)) == grpc.StatusCode.OK
            undecodable = ch.unary_unary("/trainctl.v1.TrainingService/GetJob")
            with pytest.raises(grpc.RpcError) as bad:
                undecodable(b"\x0a\xff", timeout=10, metadata=bearer(tokens.alice))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        svc.stop()
    assert count("GetJob", "UNAUTHENTICATED") == 1 and count("WatchJob", "UNAUTHENTICATED") == 1
    assert count("GetJob", "NOT_FOUND") == 1 and count("ListJobs", "OK") == 1
    assert count("GetJob", "INVALID_ARGUMENT") == 1
    assert registry.get_sample_value("trainctl_grpc_request_duration_seconds_count", {"method": "GetJob"}) == 3


def test_health_and_reflection_need_no_token(channel: grpc.Channel) -> None:
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "trainctl.v1.TrainingService" in names


def create(channel: grpc.Channel, token: str, name: str, **kwargs) -> pb.Job:
    request_id = kwargs.pop("request_id", "")
    return stub(channel).CreateJob(pb.CreateJobRequest(job=job_message(name, **kwargs), request_id=request_id), metadata=bearer(token), timeout=10)


def rpc_error(call, request, token: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        invoke(call, request, metadata=bearer(token))
    return info.value


def test_a_user_sees_watches_and_cancels_only_its_tenants_jobs(service: SecureService, channel: grpc.Channel, tokens: Tokens) -> None:
    client = stub(channel)
    mine = create(channel, tokens.alice, "alice-job", labels={"owner": "alice"})
    theirs = create(channel, tokens.bob, "bob-job", labels={"owner": "bob"})
    missing = f"job-{uuid.uuid4().hex[:12]}"

    for job_id in (theirs.id, missing):  # another tenant's job looks exactly like no job at all
        for call, request in (
            (client.GetJob, pb.GetJobRequest(id=job_id)),
            (client.CancelJob, pb.CancelJobRequest(id=job_id)),
            (client.WatchJob, pb.WatchJobRequest(id=job_id)),
        ):
            error = rpc_error(call, request, tokens.alice)
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details() == f"job {job_id!r} not found"
    assert client.GetJob(pb.GetJobRequest(id=theirs.id), metadata=bearer(tokens.bob), timeout=10).status.state == pb.QUEUED

    listed = client.ListJobs(pb.ListJobsRequest(), metadata=bearer(tokens.alice), timeout=10)
    assert mine.id in {j.id for j in listed.jobs} and theirs.id not in {j.id for j in listed.jobs}
    by_label = client.ListJobs(pb.ListJobsRequest(labels={"owner": "bob"}), metadata=bearer(tokens.alice), timeout=10)
    assert list(by_label.jobs) == []
    events = list(client.WatchJob(pb.WatchJobRequest(id=mine.id), metadata=bearer(tokens.alice), timeout=10))
    assert events and all(e.job_id == mine.id for e in events)

    cluster = client.GetCluster(pb.GetClusterRequest(), metadata=bearer(tokens.alice), timeout=10)
    assert cluster.queued_jobs == len(listed.jobs)


def test_an_admin_sees_and_cancels_every_tenants_jobs(channel: grpc.Channel, tokens: Tokens) -> None:
    client = stub(channel)
    theirs = create(channel, tokens.bob, "bob-job-2")
    every = client.ListJobs(pb.ListJobsRequest(page_size=1000), metadata=bearer(tokens.root), timeout=10)
    tenants_seen = {j.metadata.labels.get("owner") for j in every.jobs}
    assert theirs.id in {j.id for j in every.jobs} and {"alice", "bob"} <= tenants_seen
    cancelled = client.CancelJob(pb.CancelJobRequest(id=theirs.id), metadata=bearer(tokens.root), timeout=10)
    assert cancelled.status.state == pb.CANCELLED and "root" in cancelled.status.reason


def test_request_ids_are_per_tenant(channel: grpc.Channel, tokens: Tokens) -> None:
    key = str(uuid.uuid4())
    first = create(channel, tokens.bob, "retry-bob", request_id=key)
    assert create(channel, tokens.bob, "retry-bob", request_id=key).id == first.id  # an idempotent retry
    other = create(channel, tokens.root, "retry-root", request_id=key)
    assert other.id != first.id and other.metadata.name == "retry-root"  # never another tenant's job


def test_quotas_refuse_with_resource_exhausted_naming_the_quota(service: SecureService, tmp_path: Path, tokens: Tokens) -> None:
    svc = start_service(tmp_path, tokens.path)
    try:
        with svc.channel() as ch:
            error = rpc_error(stub(ch).CreateJob, pb.CreateJobRequest(job=job_message("too-big", gpus=8)), tokens.alice)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota running_gpus" in error.details()
            for i in range(3):
                create(ch, tokens.alice, f"queued-{i}")
            error = rpc_error(stub(ch).CreateJob, pb.CreateJobRequest(job=job_message("one-more")), tokens.alice)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota queued_jobs" in error.details()
            assert "'vision'" in error.details()
            create(ch, tokens.bob, "other-tenant", gpus=8)  # nlp has no quota: unaffected
            stub(ch).CancelJob(pb.CancelJobRequest(id=svc.store.list_jobs(tenant="vision")[0].id), metadata=bearer(tokens.alice), timeout=10)
            create(ch, tokens.alice, "room-again")  # a cancelled job frees its queue slot
        assert len(svc.store.list_jobs(tenant="vision")) == 4
    finally:
        svc.stop()


def test_a_retry_is_answered_its_job_even_once_the_job_fills_the_quota(tmp_path: Path, tokens: Tokens) -> None:
    svc = start_service(tmp_path, tokens.path)
    try:
        with svc.channel() as ch:
            first = [create(ch, tokens.alice, f"fill-{i}", request_id=f"fill-{i}") for i in range(3)]
            again = create(ch, tokens.alice, "fill-2", request_id="fill-2")  # its first answer was lost
            assert again.id == first[2].id
            error = rpc_error(stub(ch).CreateJob, pb.CreateJobRequest(job=job_message("new"), request_id="new"), tokens.alice)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # a new request is still refused
    finally:
        svc.stop()


def test_concurrent_creates_never_exceed_the_queued_jobs_quota(tmp_path: Path, tokens: Tokens) -> None:
    svc = start_service(tmp_path, tokens.path)
    try:
        with svc.channel() as ch:
            calls = [stub(ch).CreateJob.future(pb.CreateJobRequest(job=job_message(f"race-{i}")), metadata=bearer(tokens.alice),
                                               timeout=30) for i in range(24)]
            codes = []
            for call in calls:
                try:
                    call.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        assert codes.count(grpc.StatusCode.OK) == 3, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 21, codes
        assert svc.store.count_by_state("vision").get("QUEUED", 0) == 3
    finally:
        svc.stop()


def test_only_admins_and_tenants_the_operator_lists_may_run_programs_of_their_own(tmp_path: Path) -> None:
    """A command job's ranks run as the service's user on the workers, able to read what it can (other
    tenants' run directories too): the access file's command_tenants says which tenants may submit one."""
    tokens = write_access_file(tmp_path, command_tenants=["nlp"])
    svc = start_service(tmp_path / "svc", tokens.path)

    def command_job(name: str) -> pb.Job:
        job = pb.Job(api_version="trainctl/v1", kind="TrainingJob")
        job.metadata.name = name
        job.spec.command.program = "python"
        job.spec.command.args.values.append("train.py")
        job.spec.resources.gpus = 2
        job.spec.resources.device = pb.DEVICE_CPU
        return job

    try:
        with svc.channel() as ch:
            error = rpc_error(stub(ch).CreateJob, pb.CreateJobRequest(job=command_job("refused")), tokens.alice)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            [violation] = field_violations(error)
            assert "command_tenants" in violation.description
            plan = stub(ch).PlanJob(pb.PlanJobRequest(job=command_job("planned")), metadata=bearer(tokens.alice), timeout=10)
            assert not plan.valid and [v.field for v in plan.violations] == ["spec.command"]
            for token in (tokens.bob, tokens.root):  # a listed tenant, an admin
                job = stub(ch).CreateJob(pb.CreateJobRequest(job=command_job("allowed")), metadata=bearer(token), timeout=10)
                assert job.status.state == pb.QUEUED
        assert {r.tenant for r in svc.store.list_jobs()} == {"nlp", "ops"}
    finally:
        svc.stop()


def test_sweeps_are_per_tenant_and_parallel_trials_must_fit_the_quota(channel: grpc.Channel, tokens: Tokens) -> None:
    client = stub(channel)
    error = rpc_error(client.CreateSweep, pb.CreateSweepRequest(sweep=sweep_message("wide", parallel=3)), tokens.alice)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = field_violations(error)
    assert violation.field == "spec.parallel_trials" and "quota running_gpus of tenant 'vision' is 4" in violation.description
    mine = client.CreateSweep(pb.CreateSweepRequest(sweep=sweep_message("fits")), metadata=bearer(tokens.alice), timeout=10)
    for call, request in (
        (client.GetSweep, pb.GetSweepRequest(id=mine.id)),
        (client.CancelSweep, pb.CancelSweepRequest(id=mine.id)),
        (client.WatchSweep, pb.WatchSweepRequest(id=mine.id)),
    ):  # another tenant's sweep looks exactly like no sweep at all
        error = rpc_error(call, request, tokens.bob)
        assert error.code() == grpc.StatusCode.NOT_FOUND and error.details() == f"sweep {mine.id!r} not found"
    listed = client.ListSweeps(pb.ListSweepsRequest(), metadata=bearer(tokens.bob), timeout=10)
    assert mine.id not in {s.id for s in listed.sweeps}
    listed = client.ListSweeps(pb.ListSweepsRequest(), metadata=bearer(tokens.root), timeout=10)
    assert mine.id in {s.id for s in listed.sweeps}
    client.CancelSweep(pb.CancelSweepRequest(id=mine.id), metadata=bearer(tokens.alice), timeout=10)


def test_jobs_carrying_another_tenants_sweep_label_cost_its_views_nothing(
    service: SecureService, channel: grpc.Channel, tokens: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = stub(channel)
    sweep = client.CreateSweep(pb.CreateSweepRequest(sweep=sweep_message("labelled")), metadata=bearer(tokens.alice), timeout=10)
    for i in range(3):  # bob's jobs claim to be trials of alice's sweep
        create(channel, tokens.bob, f"claims-{i}", labels={"trainctl.sweep": sweep.id})
    listings: list[dict] = []
    list_jobs = service.store.list_jobs
    monkeypatch.setattr(service.store, "list_jobs", lambda **kw: listings.append(kw) or list_jobs(**kw))
    seen = client.GetSweep(pb.GetSweepRequest(id=sweep.id), metadata=bearer(tokens.alice), timeout=10)
    assert listings == []  # the trials' jobs are read by their ids, not found by the label
    assert {t.job_id for t in seen.status.trials} <= {j.id for j in service.store.list_jobs(tenant="vision")} | {""}
    client.CancelSweep(pb.CancelSweepRequest(id=sweep.id), metadata=bearer(tokens.alice), timeout=10)


@pytest.mark.parametrize("token", ["\u00b2", "\u2460", "12a", "1" * 19])
def test_a_list_sweeps_page_token_not_issued_is_invalid_argument(channel: grpc.Channel, tokens: Tokens, token: str) -> None:
    error = rpc_error(stub(channel).ListSweeps, pb.ListSweepsRequest(page_token=token), tokens.alice)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # '²' passed str.isdigit, then int() raised: INTERNAL
    assert [v.field for v in field_violations(error)] == ["page_token"]


def test_data_paths_outside_the_roots_are_invalid_argument(tmp_path: Path, tokens: Tokens) -> None:
    root = tmp_path / "datasets"
    root.mkdir()
    (root / "ok.txt").write_text("some text " * 20)
    (tmp_path / "secret.txt").write_text("private")
    (root / "escape.txt").symlink_to(tmp_path / "secret.txt")
    svc = start_service(tmp_path / "svc", tokens.path, data_roots=[root])
    try:
        with svc.channel() as ch:
            client = stub(ch)
            assert create(ch, tokens.alice, "inside", paths=[str(root / "ok.txt")]).status.state == pb.QUEUED
            for bad in (str(tmp_path / "secret.txt"), str(root / ".." / "secret.txt"), str(root / "escape.txt"), str(root / "*.txt")):
                error = rpc_error(client.CreateJob, pb.CreateJobRequest(job=job_message("escape", paths=["@stdlib", bad])), tokens.alice)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
                assert [v.field for v in field_violations(error)] == ["spec.data.paths[1]"], bad
            plan = client.PlanJob(pb.PlanJobRequest(job=job_message("plan", paths=[str(tmp_path / "secret.txt")])), metadata=bearer(tokens.alice), timeout=10)
            assert not plan.valid and [v.field for v in plan.violations] == ["spec.data.paths[0]"]
        assert [r.name for r in svc.store.list_jobs()] == ["inside"]
    finally:
        svc.stop()


def test_without_an_access_file_calls_need_no_token(tmp_path: Path) -> None:
    svc = start_service(tmp_path, None)
    try:
        with svc.channel() as ch:
            job = stub(ch).CreateJob(pb.CreateJobRequest(job=job_message("anon")), timeout=10)
        assert svc.store.get_job(job.id).tenant == "default"
    finally:
        svc.stop()


def test_watch_respects_the_client_deadline(channel: grpc.Channel, tokens: Tokens) -> None:
    job = create(channel, tokens.alice, "watched")
    started = time.monotonic()
    stream = stub(channel).WatchJob(pb.WatchJobRequest(id=job.id, follow=True), metadata=bearer(tokens.alice), timeout=1.0)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert stub(channel).GetJob(pb.GetJobRequest(id=job.id), metadata=bearer(tokens.alice), timeout=10).id == job.id


def test_the_service_over_mutual_tls(tmp_path: Path, tokens: Tokens) -> None:
    ca = Authority(tmp_path, "svc-ca")
    server_cert, client_cert = ca.issue("server", server=True), ca.issue("client", server=False)
    svc = start_service(tmp_path / "svc", tokens.path, tls=TlsConfig(server_cert.cert, server_cert.key, ca.cert_file))
    try:
        with svc.channel(channel_credentials(ca.cert_file, client_cert.cert, client_cert.key)) as ch:
            assert create(ch, tokens.alice, "over-tls").status.state == pb.QUEUED
            assert code_of(stub(ch).ListJobs, pb.ListJobsRequest()) == grpc.StatusCode.UNAUTHENTICATED  # TLS is not a token
        with svc.channel() as plain:
            assert code_of(stub(plain).ListJobs, pb.ListJobsRequest(), metadata=bearer(tokens.alice)) == grpc.StatusCode.UNAVAILABLE
        with svc.channel(channel_credentials(ca.cert_file)) as no_cert:
            assert code_of(stub(no_cert).ListJobs, pb.ListJobsRequest(), metadata=bearer(tokens.alice)) == grpc.StatusCode.UNAVAILABLE
    finally:
        svc.stop()
