"""The TrainingService over real gRPC on loopback (scripted runtime, no Ray): errors as google.rpc
statuses naming fields, the server surviving every bad request, the RPCs' contracts."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from control_plane_fakes import ApiServer, ScriptedRuntime, bad_spec_catalogue, eventually, start_api_server
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.planning.plan import plan_on_map
from trainctl.service.api import job_messages
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import load_job_file, parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.convert import job_to_proto
from trainctl.wire.errors import field_violations
from trainctl.wire.plan_convert import plan_to_proto
from trainctl.workers.events import EventKind, JobState
from trainctl.workers.topology.presets import cluster_topology

REMOTE_CASES = [c for c in bad_spec_catalogue() if not c.local_only]


ENUM_PREFIXES = {
    ("training", "optimizer"): "OPTIMIZER_", ("training", "dtype"): "DTYPE_", ("resources", "device"): "DEVICE_",
    ("parallelism", "pp_schedule"): "PIPELINE_SCHEDULE_",
    ("training", "activation_checkpointing"): "ACTIVATION_CHECKPOINTING_",
}


def proto_from_yaml(path: Path) -> pb.Job:
    """The document as a typed proto built field by field, without the pydantic model, as a client in
    another language would send it: schema errors must be caught by the server."""
    document = yaml.safe_load(path.read_text())
    if "apiVersion" in document:
        document["api_version"] = document.pop("apiVersion")
    spec = document.get("spec", {})
    if "paths" in spec.get("data", {}):
        spec["data"]["paths"] = {"values": spec["data"]["paths"]}
    for (section, key), prefix in ENUM_PREFIXES.items():
        if key in spec.get(section, {}):
            spec[section][key] = prefix + str(spec[section][key]).upper()
    return json_format.ParseDict(document, pb.Job())


@pytest.mark.parametrize("case", REMOTE_CASES, ids=lambda c: c.name)
def test_bad_spec_gets_invalid_argument_naming_the_field(case, api_client: TrainctlClient, api: ApiServer) -> None:
    with pytest.raises(grpc.RpcError) as info:
        api_client.create_job(proto_from_yaml(case.path))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = [v.field for v in field_violations(info.value)]
    assert case.field in fields, f"{case.name}: {info.value.details()}"
    assert case.field in info.value.details()
    # and the server keeps serving
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(api.target))
    assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert api_client.get_cluster().total_gpus == 8


def test_at_least_fifteen_kinds_reach_the_server() -> None:
    assert len(REMOTE_CASES) >= 15


def test_unknown_enum_number_names_the_field(api_client: TrainctlClient) -> None:
    message = job_to_proto(small_job("enum"))
    message.spec.training.optimizer = 99
    with pytest.raises(grpc.RpcError) as info:
        api_client.create_job(message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(info.value)] == ["spec.training.optimizer"]


def test_nothing_recorded_for_rejected_jobs(api_client: TrainctlClient) -> None:
    names = {j.metadata.name for j in api_client.list_jobs()}
    assert not names & {c.path.stem for c in REMOTE_CASES}


def test_request_field_errors(api_client: TrainctlClient, api: ApiServer) -> None:
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    cases = [
        (lambda: stub.CreateJob(pb.CreateJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "job"),
        (lambda: stub.GetJob(pb.GetJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "id"),
        (lambda: stub.GetJob(pb.GetJobRequest(id="nope")), grpc.StatusCode.NOT_FOUND, None),
        (lambda: stub.CancelJob(pb.CancelJobRequest(id="nope")), grpc.StatusCode.NOT_FOUND, None),
        (lambda: stub.ListJobs(pb.ListJobsRequest(page_size=-1)), grpc.StatusCode.INVALID_ARGUMENT, "page_size"),
        (lambda: stub.ListJobs(pb.ListJobsRequest(page_token="garbage!")), grpc.StatusCode.INVALID_ARGUMENT, "page_token"),
        (lambda: stub.ListJobs(pb.ListJobsRequest(states=[42])), grpc.StatusCode.INVALID_ARGUMENT, "states[0]"),
        (lambda: stub.ListJobs(pb.ListJobsRequest(labels={str(i): "x" for i in range(100)})),
         grpc.StatusCode.INVALID_ARGUMENT, "labels"),
        (lambda: list(stub.WatchJob(pb.WatchJobRequest(id="nope"))), grpc.StatusCode.NOT_FOUND, None),
        (lambda: stub.PlanJob(pb.PlanJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "job"),
    ]
    for call, code, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
        if field is not None:
            assert [v.field for v in field_violations(info.value)] == [field]
    job = api_client.create_job(small_job("watch-bad"))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.WatchJob(pb.WatchJobRequest(id=job.id, after_sequence=-1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("before", [2**63, 2**64 + 5, True, -1, 1.5, "7"])
def test_a_forged_page_token_is_a_bad_page_token(api_client: TrainctlClient, api: ApiServer, before: object) -> None:
    """A token's seq must be an int64 that is not negative: SQLite cannot bind a larger integer."""
    api_client.create_job(small_job("paged"))
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    token = base64.urlsafe_b64encode(json.dumps({"before": before}).encode()).decode()
    assert answer(lambda: stub.ListJobs(pb.ListJobsRequest(page_token=token))) == (grpc.StatusCode.INVALID_ARGUMENT, ["page_token"])


def test_a_page_token_of_deeply_nested_json_is_a_bad_page_token(api_client: TrainctlClient, api: ApiServer) -> None:
    """Decoding it raised RecursionError, answered INTERNAL: a token longer than any issued one is refused unread."""
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    token = base64.urlsafe_b64encode(b"[" * 100_000).decode()
    assert answer(lambda: stub.ListJobs(pb.ListJobsRequest(page_token=token))) == (grpc.StatusCode.INVALID_ARGUMENT, ["page_token"])


def test_a_request_id_sent_again_with_another_job_is_refused_naming_it(api_client: TrainctlClient, api: ApiServer) -> None:
    first = api_client.create_job(small_job("first"), request_id="once")
    assert api_client.create_job(small_job("first"), request_id="once").id == first.id  # a retry: the same request
    with pytest.raises(grpc.RpcError) as info:
        api_client.create_job(small_job("second"), request_id="once")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = field_violations(info.value)
    assert violation.field == "request_id" and f"job {first.id}" in violation.description
    assert [j.id for j in api.scheduler.store.list_jobs()] == [first.id]


def test_create_get_list_and_idempotent_retry(api_client: TrainctlClient) -> None:
    first = api_client.create_job(small_job("listed", labels={"team": "a"}), request_id="retry-1")
    again = api_client.create_job(small_job("listed", labels={"team": "a"}), request_id="retry-1")
    assert first.id == again.id
    assert first.status.state == pb.QUEUED and first.status.create_time.seconds > 0
    got = api_client.get_job(first.id)
    assert got.metadata.labels["team"] == "a" and got.spec.parallelism.dp_shard == 2
    other = api_client.create_job(small_job("listed-b", labels={"team": "b"}))
    assert [j.id for j in api_client.list_jobs(labels={"team": "a"})] == [first.id]
    assert {j.id for j in api_client.list_jobs(labels={"team": "b"})} == {other.id}
    everything = [j.id for j in api_client.list_jobs(page_size=1)]  # pages of one
    assert everything == [j.id for j in api_client.list_jobs(page_size=1000)] and len(everything) >= 2
    assert first.id not in [j.id for j in api_client.list_jobs(states=["SUCCEEDED"])]
    assert first.id in [j.id for j in api_client.list_jobs(states=["QUEUED", "SCHEDULED"] * 2000)]  # duplicates are fine


def test_watch_resumes_from_a_cursor_and_ends_at_a_terminal_state(api_client: TrainctlClient, runtime: ScriptedRuntime) -> None:
    job = api_client.create_job(small_job("watched"))
    events = api_client.watch(job.id, follow=True)
    first = next(events)
    assert first.state_change.to_state == pb.QUEUED
    second = next(events)
    assert second.state_change.to_state == pb.SCHEDULED and second.sequence > first.sequence
    runtime.wait_started(job.id)
    runtime.run(job.id, [4.0, 3.0, 2.0])
    rest = list(events)
    assert [e.WhichOneof("payload") for e in rest] == ["state_change", "step", "step", "step", "state_change"]
    assert rest[-1].state_change.to_state == pb.SUCCEEDED
    # resume from the middle: exactly the events after the cursor
    resumed = list(api_client.watch(job.id, after_sequence=rest[1].sequence, follow=False))
    assert [e.sequence for e in resumed] == [e.sequence for e in rest[2:]]
    full = api_client.get_job(job.id, full=True)
    assert [m.step for m in full.metrics] == [1, 2, 3] and full.metrics[0].breakdown["forward_backward"] == 0.2
    assert full.status.steps_done == 3 and full.status.last_loss == 2.0 and full.status.first_loss == 4.0
    assert not api_client.get_job(job.id).metrics  # basic view


def test_a_diverged_job_shows_nan_in_get_job_and_watch_job(tmp_path: Path, store_location: str) -> None:
    """A step whose loss and grad_norm are NaN is recorded on either store and answered as NaN: the full
    view's metrics, the step events, and the job's first and last loss."""
    runtime = ScriptedRuntime()
    api = start_api_server(tmp_path, runtime, store=store_location)
    try:
        with TrainctlClient(api.target, token="") as client:
            job = client.create_job(small_job("diverged"))
            runtime.wait_started(job.id)
            runtime.state(job.id, JobState.RUNNING, "ranks up")
            runtime.logs[job.id].append(EventKind.STEP, step={"step": 1, "loss": math.nan, "grad_norm": math.nan})
            runtime.step(job.id, 2, 3.0)
            runtime.state(job.id, JobState.SUCCEEDED, "done")
            eventually(lambda: client.get_job(job.id).status.state == pb.SUCCEEDED, "the job ended")
            steps = [e.step for e in client.watch(job.id, follow=True) if e.WhichOneof("payload") == "step"]
            full = client.get_job(job.id, full=True)
    finally:
        api.stop()
    assert [m.step for m in steps] == [m.step for m in full.metrics] == [1, 2]
    for metrics in (steps, full.metrics):
        assert math.isnan(metrics[0].loss) and math.isnan(metrics[0].grad_norm) and metrics[1].loss == 3.0
    assert full.status.state == pb.SUCCEEDED and math.isnan(full.status.first_loss) and full.status.last_loss == 3.0


def answer(call: Callable[[], object]) -> tuple[grpc.StatusCode, list[str]]:
    """The status code of a call that must fail, and the fields its BadRequest names."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), [v.field for v in field_violations(info.value)]


def test_a_nul_character_is_refused_or_not_found_alike_on_both_stores(tmp_path: Path, store_location: str) -> None:
    """PostgreSQL's text refuses NUL (an internal error) where SQLite keeps it: every string of a request
    that reaches the store is checked first, and an id holding NUL is unknown, as any other."""
    api = start_api_server(tmp_path, ScriptedRuntime(), store=store_location)
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    job = small_job("nul")
    try:
        created = stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(job)))
        labelled = job_to_proto(job)
        labelled.metadata.labels["team"] = "a\x00b"
        referring = job_to_proto(job.model_copy(update={"spec": job.spec.model_copy(update={"init_from": "job:x\x00y"})}))
        invalid = {
            "metadata.labels.team": lambda: stub.CreateJob(pb.CreateJobRequest(job=labelled)),
            "request_id": lambda: stub.CreateJob(pb.CreateJobRequest(job=job_to_proto(job), request_id="r\x00")),
            "spec.init_from": lambda: stub.CreateJob(pb.CreateJobRequest(job=referring)),
            "reason": lambda: stub.CancelJob(pb.CancelJobRequest(id=created.id, reason="no\x00")),
            "labels": lambda: stub.ListJobs(pb.ListJobsRequest(labels={"team": "a\x00b"})),
        }
        for field, call in invalid.items():
            assert answer(call) == (grpc.StatusCode.INVALID_ARGUMENT, [field])
        unknown = [
            lambda: stub.GetJob(pb.GetJobRequest(id="x\x00y")),
            lambda: stub.CancelJob(pb.CancelJobRequest(id="x\x00y")),
            lambda: list(stub.WatchJob(pb.WatchJobRequest(id="x\x00y"))),
        ]
        for call in unknown:
            assert answer(call) == (grpc.StatusCode.NOT_FOUND, [])
        assert [j.id for j in stub.ListJobs(pb.ListJobsRequest()).jobs] == [created.id]
    finally:
        api.stop()


def test_cancel_contract(api_client: TrainctlClient, runtime: ScriptedRuntime) -> None:
    job = api_client.create_job(small_job("to-cancel", gpus=8))
    blocked = api_client.create_job(small_job("blocked", gpus=8))
    assert api_client.cancel_job(blocked.id, reason="changed my mind").status.state == pb.CANCELLED
    assert api_client.get_job(blocked.id).status.reason == "changed my mind"
    states = []
    for event in api_client.watch(job.id):
        if event.WhichOneof("payload") == "state_change":
            states.append(event.state_change.to_state)
            if event.state_change.to_state == pb.SCHEDULED:
                runtime.wait_started(job.id)
                runtime.state(job.id, JobState.RUNNING, "ranks up")
            elif event.state_change.to_state == pb.RUNNING:
                assert api_client.cancel_job(job.id).status.state == pb.CANCELLING
    assert states == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.CANCELLING, pb.CANCELLED]
    assert runtime.cancelled == [job.id]
    assert api_client.get_job(job.id).status.reason == "cancelled by anonymous"  # the caller's reason is kept
    done = api_client.create_job(small_job("done"))
    for event in api_client.watch(done.id):
        if event.state_change.to_state == pb.SCHEDULED:
            runtime.wait_started(done.id)
            runtime.run(done.id, [1.0])
    with pytest.raises(grpc.RpcError) as info:
        api_client.cancel_job(done.id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_plan(api_client: TrainctlClient) -> None:
    hybrid = TrainingJob.model_validate({
        "metadata": {"name": "plan"},
        "spec": {"parallelism": {"pp": 2, "dp_shard": 2, "tp": 2}, "training": {"global_batch_size": 8, "micro_batch_size": 2},
                 "resources": {"gpus": 8, "device": "cpu"}},
    })
    plan = api_client.plan_job(hybrid)
    assert plan.valid and plan.world_size == 8 and plan.pool_gpus == 8
    assert dict(plan.grid) == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    assert sorted((p.node, p.gpu) for p in plan.placement) == [(f"node-{n}", g) for n in (0, 1) for g in range(4)]
    by_rank = {p.rank: p for p in plan.placement}
    assert by_rank[0].node == by_rank[1].node  # tp peers (adjacent ranks) share a node
    assert plan.HasField("placement_cost_seconds")
    bad = api_client.plan_job(load_job_file(Path(__file__).parents[2] / "spec" / "bad" / "heads-tp.yaml"))
    assert not bad.valid and "spec.model.n_heads" in [v.field for v in bad.violations]


def test_the_service_plan_is_the_offline_plan_on_the_same_map(tmp_path: Path) -> None:
    """PlanJob and `trainctl plan --cluster` answer one plan (trainctl.planning), converted by the wire alike."""
    topology = cluster_topology("hgx-h100:2")
    too_big = load_job_file(Path(__file__).parents[3] / "examples" / "hybrid-3d.yaml")  # 32 ranks on 16 GPUs
    document = too_big.model_dump(mode="json")
    document["spec"]["parallelism"]["dp_shard"] = 2
    document["spec"]["resources"]["gpus"] = 16
    fits = parse_object(document)
    api = start_api_server(tmp_path, ScriptedRuntime(), topology=topology)
    try:
        with TrainctlClient(api.target, token="") as client:
            for job in (fits, too_big):
                assert plan_to_proto(plan_on_map(job, topology, "--cluster hgx-h100:2")) == client.plan_job(job)
    finally:
        api.stop()


def test_a_data_glob_repeating_the_recursive_wildcard_is_refused_without_walking(api_client: TrainctlClient, tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "doc.txt").write_text("a document " * 50)
    message = job_to_proto(small_job("globs"))
    del message.spec.data.paths.values[:]
    message.spec.data.paths.values.extend([str(tmp_path / "**" / "*.txt"), str(tmp_path / "**" / "**" / "*.txt")])
    plan = api_client.plan_job(message)
    assert not plan.valid
    assert [(v.field, "'**'" in v.description) for v in plan.violations] == [("spec.data.paths[1]", True)], plan.violations
    with pytest.raises(grpc.RpcError) as info:
        api_client.create_job(message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(info.value)] == ["spec.data.paths[1]"]


def test_a_full_view_of_a_long_run_answers_its_steps_evenly_thinned(
    api_client: TrainctlClient, api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_messages, "FULL_VIEW_STEPS", 5)  # stands for 10,000 of a run of millions
    job = api_client.create_job(small_job("long-run"))
    for step in range(1, 14):
        api.scheduler.store.record_step(job.id, {"step": step, "loss": 10.0 / step})
    full = api_client.get_job(job.id, full=True)
    assert [m.step for m in full.metrics] == [1, 4, 7, 10, 13]  # the first, the last, evenly between
    assert full.metrics[-1].loss == pytest.approx(10.0 / 13)


def test_a_full_view_of_a_long_run_does_not_read_every_step(
    api_client: TrainctlClient, api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: the store picks the steps a full view answers (`thinned_step_metrics`, by index lookups);
    reading every row (`step_metrics`) would cost a million-step job seconds per GetJob."""
    monkeypatch.setattr(job_messages, "FULL_VIEW_STEPS", 5)
    job = api_client.create_job(small_job("long-run"))
    for step in range(1, 14):
        api.scheduler.store.record_step(job.id, {"step": step, "loss": 10.0 / step})

    def every_step(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("GetJob read every step of the job")

    monkeypatch.setattr(api.scheduler.store, "step_metrics", every_step)
    assert [m.step for m in api_client.get_job(job.id, full=True).metrics] == [1, 4, 7, 10, 13]


def test_thinning_a_long_run_keeps_its_eval_steps_beside_the_training_curve() -> None:
    rows = [{"step": step, "loss": 1.0, **({"eval_loss": 2.0} if step % 100 == 0 else {})} for step in range(1, 1001)]
    kept = job_messages.thinned_steps(rows, 20)
    assert len(kept) <= 20 and [r["step"] for r in kept] == sorted(r["step"] for r in kept)
    evals = [r["step"] for r in kept if "eval_loss" in r]
    assert evals == [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]  # evenly thinned alone, 1 in 100 survives
    assert kept[0]["step"] == 1


def test_cluster_health_and_reflection(api_client: TrainctlClient, api: ApiServer) -> None:
    cluster = api_client.get_cluster()
    assert [n.name for n in cluster.nodes] == ["node-0", "node-1"]
    assert cluster.total_gpus == 8 and cluster.free_gpus + cluster.used_gpus == 8
    # One share per tenant holding GPUs; no guarantees without an access file, so all it holds is borrowed.
    assert [t.tenant for t in cluster.tenants] == (["default"] if cluster.used_gpus else []), cluster.tenants
    for share in cluster.tenants:
        assert not share.HasField("guaranteed_gpus") and share.borrowed_gpus == share.used_gpus == cluster.used_gpus
    channel = grpc.insecure_channel(api.target)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert "trainctl.v1.TrainingService" in names and "grpc.health.v1.Health" in names


def test_an_unexpected_exception_is_internal_and_the_server_survives(
    api_client: TrainctlClient, api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(api.scheduler.store, "count_by_state", broken)
    with pytest.raises(grpc.RpcError) as info:
        api_client.get_cluster()
    assert info.value.code() == grpc.StatusCode.INTERNAL and "disk on fire" not in info.value.details()
    monkeypatch.undo()
    assert api_client.get_cluster().total_gpus == 8


def test_a_restarted_service_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """Stop the server abruptly with jobs queued and running, start a new one on the same data dir:
    every job is there in its state, a retried CreateJob returns the first job, the running one is
    re-attached (not started again) and the queued one starts once GPUs free up."""
    runtime = ScriptedRuntime()
    first = start_api_server(tmp_path, runtime, nodes=1, gpus=2)
    with TrainctlClient(first.target) as c:
        running = c.create_job(small_job("running"), request_id="r-1")
        queued = c.create_job(small_job("queued"), request_id="r-2")
        runtime.wait_started(running.id)
        runtime.state(running.id, JobState.RUNNING, "ranks up")
        runtime.step(running.id, 1, 3.0)
        for event in c.watch(running.id):
            if event.WhichOneof("payload") == "step":
                break
    first.server.stop(0).wait()  # no graceful drain, no final writes
    first.scheduler.stop()

    second = start_api_server(tmp_path, runtime, nodes=1, gpus=2)
    try:
        with TrainctlClient(second.target) as c:
            assert {j.id: j.status.state for j in c.list_jobs()} == {running.id: pb.RUNNING, queued.id: pb.QUEUED}
            assert c.create_job(small_job("queued"), request_id="r-2").id == queued.id
            assert len(list(c.list_jobs())) == 2
            assert running.id in runtime.attached and [j for j, _ in runtime.started] == [running.id]
            runtime.step(running.id, 2, 2.0)
            runtime.state(running.id, JobState.SUCCEEDED, "done")
            for _ in c.watch(running.id):
                pass
            status = c.get_job(running.id, full=True)
            assert [m.step for m in status.metrics] == [1, 2] and status.status.state == pb.SUCCEEDED
            runtime.wait_started(queued.id)
            assert [j for j, _ in runtime.started] == [running.id, queued.id]
    finally:
        second.stop()
