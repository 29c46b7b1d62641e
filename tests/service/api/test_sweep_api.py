"""The sweep RPCs over real gRPC (scripted runtime, no Ray): bad input answers INVALID_ARGUMENT naming
the field, a sweep's trials are jobs visible by label, get/list/watch show trials and the best one,
cancel stops the trials."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from control_plane_fakes import SWEEP_DOCUMENT, ApiServer, ScriptedRuntime, start_api_server

from trainctl.cli.client import TrainctlClient
from trainctl.service.api.sweep_rpcs import quota_violations
from trainctl.service.security.tenancy import Quota
from trainctl.spec.sweep import SWEEP_LABEL, parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.wire.errors import field_violations
from trainctl.wire.sweep_convert import sweep_from_proto, sweep_to_proto, value_to_proto
from trainctl.workers.events import JobState


def changed(path: str, value: Any) -> dict[str, Any]:
    """SWEEP_DOCUMENT with the value at a dotted path (list indices as numbers) replaced."""
    document = copy.deepcopy(SWEEP_DOCUMENT)
    *parents, last = path.split(".")
    node: Any = document
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value
    return document


def sent(document: dict[str, Any]) -> pb.Sweep:
    """The document as a proto Sweep built without schema validation (as another client could send it)."""
    valid = parse_sweep_object(SWEEP_DOCUMENT)
    message = sweep_to_proto(valid)
    spec = document["spec"]
    del message.spec.parameters[:]
    for parameter in spec["parameters"]:
        item = message.spec.parameters.add(path=parameter["path"])
        item.type = pb.ParameterType.Value("PARAMETER_TYPE_" + parameter["type"].upper())
        for bound in ("low", "high"):
            if bound in parameter:
                value = parameter[bound]
                if isinstance(value, int):
                    getattr(item, bound).int_value = value
                else:
                    getattr(item, bound).float_value = value
        if "log" in parameter:
            item.log = parameter["log"]
        for value in parameter.get("values", ()):
            item.values.add(int_value=value)
    message.spec.parallel_trials = spec["parallel_trials"]
    if "objective" in spec:
        message.spec.objective.metric = spec["objective"]["metric"]
    return message


BAD = [
    ("spec.parameters.0.path", "spec.training.learning_rate", "spec.parameters[0].path", "not a field"),
    ("spec.parameters.0.path", "spec.data.paths", "spec.parameters[0].path", "not searchable"),
    ("spec.parameters.0.low", 0.5, "spec.parameters[0].high", "inverted range"),
    ("spec.parameters.2.high", 0, "spec.parameters[2].high", "empty range"),
    ("spec.parameters.0.low", 0.0, "spec.parameters[0].low", "log range must lie above 0"),
    ("spec.parameters.1.values", [1, 3], "spec.parameters[1].values[1]", "global_batch_size"),
    ("spec.objective", {"metric": "accuracy"}, "spec.objective.metric", "not reported"),
    ("spec.parallel_trials", 5, "spec.parallel_trials", "more than spec.trials"),
]


@pytest.mark.parametrize(("path", "value", "field", "words"), BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_sweeps_are_invalid_argument_naming_the_field(
    api_client: TrainctlClient, api: ApiServer, path: str, value: Any, field: str, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        api_client.create_sweep(sent(changed(path, value)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(caught.value)
    assert any(v.field == field and words in v.description for v in violations), violations
    assert api.scheduler.store.list_sweeps() == []


def test_a_retried_create_sweep_is_answered_its_sweep_and_another_sweep_needs_another_id(
    api_client: TrainctlClient, api: ApiServer
) -> None:
    first = api_client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT), request_id="sweep-once")
    assert api_client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT), request_id="sweep-once").id == first.id
    with pytest.raises(grpc.RpcError) as caught:  # the same id with another sweep: a client's mistake
        api_client.create_sweep(sent(changed("spec.trials", 4)), request_id="sweep-once")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = field_violations(caught.value)
    assert violation.field == "request_id" and f"sweep {first.id}" in violation.description
    assert [s.id for s in api.scheduler.store.list_sweeps()] == [first.id]


def test_a_watch_of_a_running_sweep_ends_unavailable_when_the_service_stops(api_client: TrainctlClient, api: ApiServer) -> None:
    created = api_client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT))
    with grpc.insecure_channel(api.target) as channel:
        stream = pb_grpc.TrainingServiceStub(channel).WatchSweep(pb.WatchSweepRequest(id=created.id), timeout=30)
        assert next(stream).status.state == pb.SWEEP_STATE_RUNNING
        api.servicer.stopping.set()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "the service is stopping" in info.value.details()


def test_parallel_trials_beyond_the_tenant_quota_is_refused() -> None:
    sweep = parse_sweep_object(changed("spec.trials", 8))
    sweep = sweep.model_copy(update={"spec": sweep.spec.model_copy(update={"parallel_trials": 3})})
    assert quota_violations(sweep, "vision", Quota(running_gpus=3, queued_jobs=3)) == []
    gpus = quota_violations(sweep, "vision", Quota(running_gpus=2))
    queued = quota_violations(sweep, "vision", Quota(queued_jobs=2))
    assert [v.field for v in gpus + queued] == ["spec.parallel_trials"] * 2
    assert "quota running_gpus of tenant 'vision' is 2" in gpus[0].description
    assert "quota queued_jobs of tenant 'vision' is 2" in queued[0].description


def test_sweep_round_trips_the_wire_losslessly() -> None:
    sweep = parse_sweep_object(changed("spec.parameters.1.values", [1, 2.5, "auto", True]))
    assert sweep_from_proto(sweep_to_proto(sweep)) == sweep
    assert [type(v) for v in sweep_from_proto(sweep_to_proto(sweep)).spec.parameters[1].values] == [int, float, str, bool]


def test_sweep_trials_are_labelled_jobs_and_cancel_stops_them(api_client: TrainctlClient, runtime: ScriptedRuntime) -> None:
    created = api_client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT))
    assert created.status.state == pb.SWEEP_STATE_RUNNING and created.id.startswith("api-sweep-")
    deadline = time.monotonic() + 10
    while len(api_client.get_sweep(created.id).status.trials) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sweep = api_client.get_sweep(created.id)
    jobs = list(api_client.list_jobs(labels={SWEEP_LABEL: created.id}))
    assert sorted(j.id for j in jobs) == sorted(t.job_id for t in sweep.status.trials)
    first = sweep.status.trials[0]
    job = api_client.get_job(first.job_id)
    assert job.spec.training.lr == first.params["spec.training.lr"].float_value
    assert job.spec.training.micro_batch_size == first.params["spec.training.micro_batch_size"].int_value
    assert [s.id for s in api_client.list_sweeps()] == [created.id]

    runtime.wait_started(first.job_id)
    runtime.state(first.job_id, JobState.RUNNING, "ranks up")
    cancelled = api_client.cancel_sweep(created.id, "enough")
    assert cancelled.status.state == pb.SWEEP_STATE_CANCELLED
    assert {t.state for t in cancelled.status.trials} == {pb.TRIAL_STATE_CANCELLED}
    while {api_client.get_job(t.job_id).status.state for t in cancelled.status.trials} != {pb.CANCELLED}:
        assert time.monotonic() < deadline + 10
        time.sleep(0.05)
    assert api_client.get_job(first.job_id).status.reason == "enough"
    assert [s.status.state for s in api_client.watch_sweep(created.id)] == [pb.SWEEP_STATE_CANCELLED]
    assert len(api_client.get_sweep(created.id).status.trials) == 2  # no trial after the cancel
    with pytest.raises(grpc.RpcError) as caught:
        api_client.get_sweep("nope")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_nul_character_in_a_sweep_request_is_refused_or_not_found_on_both_stores(
    tmp_path: Path, runtime: ScriptedRuntime, store_location: str
) -> None:
    """As for jobs (test_api): PostgreSQL's text refuses NUL, so it is checked before the store."""
    api = start_api_server(tmp_path, runtime, store=store_location)
    stub = pb_grpc.TrainingServiceStub(grpc.insecure_channel(api.target))
    sweep = sweep_to_proto(parse_sweep_object(SWEEP_DOCUMENT))
    labelled = sweep_to_proto(parse_sweep_object(SWEEP_DOCUMENT))
    labelled.metadata.labels["team"] = "a\x00b"
    try:
        created = stub.CreateSweep(pb.CreateSweepRequest(sweep=sweep))
        invalid = {
            "request_id": lambda: stub.CreateSweep(pb.CreateSweepRequest(sweep=sweep, request_id="r\x00")),
            "metadata.labels.team": lambda: stub.CreateSweep(pb.CreateSweepRequest(sweep=labelled)),
            "reason": lambda: stub.CancelSweep(pb.CancelSweepRequest(id=created.id, reason="no\x00")),
        }
        for field, call in invalid.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in [v.field for v in field_violations(info.value)]
        for call in (
            lambda: stub.GetSweep(pb.GetSweepRequest(id="x\x00y")),
            lambda: stub.CancelSweep(pb.CancelSweepRequest(id="x\x00y")),
            lambda: list(stub.WatchSweep(pb.WatchSweepRequest(id="x\x00y"))),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        api.stop()


def test_cli_sweep_commands(api: ApiServer, runtime: ScriptedRuntime, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainctl.cli.main import main

    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"apiVersion": "trainctl/v1", "kind": "Sweep", **SWEEP_DOCUMENT}))
    assert main(["--server", api.target, "sweep", "create", str(spec)]) == 0
    sweep_id = capsys.readouterr().out.split()[1]
    deadline = time.monotonic() + 10
    while len(api.scheduler.store.get_sweep(sweep_id).trials) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = api.scheduler.store.get_sweep(sweep_id).trials[0]
    runtime.wait_started(first.job_id)
    runtime.run(first.job_id, [3.0, 2.0, 1.5, 1.25])
    while api.scheduler.store.get_sweep(sweep_id).trials[0].objective is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert main(["--server", api.target, "sweep", "get", sweep_id]) == 0
    out = capsys.readouterr().out
    assert f"best: trial 0 ({first.job_id}) objective 1.25" in out and "COMPLETE" in out
    assert main(["--server", api.target, "sweep", "get", sweep_id, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["status"]["trials"][0]["params"] == first.params and document["kind"] == "Sweep"
    assert main(["--server", api.target, "list", "--label", f"{SWEEP_LABEL}={sweep_id}"]) == 0
    assert first.job_id in capsys.readouterr().out
    assert main(["--server", api.target, "sweep", "list"]) == 0
    assert sweep_id in capsys.readouterr().out
    assert main(["--server", api.target, "sweep", "cancel", sweep_id]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    assert main(["--server", api.target, "sweep", "watch", sweep_id]) == 1  # ended, not SUCCEEDED
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"kind": "Sweep", **changed("spec.parameters.0.low", 0.0)}))
    assert main(["--server", api.target, "sweep", "create", str(bad)]) == 2
    assert "spec.parameters[0].low: a log range must lie above 0" in capsys.readouterr().err


def test_sweep_report(api: ApiServer, runtime: ScriptedRuntime, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainctl.cli.main import main
    from trainctl.cli.sweep_report import PANELS, build_sweep_figure

    with TrainctlClient(api.target, token="") as client:
        created = client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT))
        assert main(["--server", api.target, "report", created.id]) == 1  # no objective yet
        assert "has no trial with an objective yet" in capsys.readouterr().err
        deadline = time.monotonic() + 10
        while len(client.get_sweep(created.id).status.trials) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first, second = client.get_sweep(created.id).status.trials
        for trial, losses in ((first, [3.0, 2.0, 1.5, 1.0]), (second, [3.0, 2.5])):
            runtime.wait_started(trial.job_id)
            runtime.run(trial.job_id, losses)
        while sum(t.HasField("objective") for t in client.get_sweep(created.id).status.trials) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sweep = client.get_sweep(created.id)
        curves = {t.job_id: list(client.get_job(t.job_id, full=True).metrics) for t in sweep.status.trials}
    fig = build_sweep_figure(sweep, curves)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(PANELS) <= set(axes)
    lines = {tuple(line.get_ydata()): line.get_linewidth() for line in axes["Curves"].get_lines() if line.get_label() != "objective"}
    assert lines == {(3.0, 2.0, 1.5, 1.0): 2.5, (3.0, 2.5): 1.0}  # the best trial (first) drawn bold
    (marks,) = [line for line in axes["Curves"].get_lines() if line.get_label() == "objective"]
    assert list(marks.get_xdata()) == [4, 2] and list(marks.get_ydata()) == [1.0, 2.5]  # each read at its last step
    assert len(axes["Parameters"].get_lines()) == 2 + 3  # one line per trial, one axis line per parameter
    out = tmp_path / "sweep.png"
    assert main(["--server", api.target, "report", created.id, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and first.job_id in out.with_suffix(".html").read_text()
    assert main(["--server", api.target, "sweep", "report", created.id, "--out", str(tmp_path / "b.png"), "--no-html"]) == 0
    assert (tmp_path / "b.png").exists() and not (tmp_path / "b.html").exists()


def eval_loss_sweep() -> tuple[pb.Sweep, dict[str, list[pb.StepMetrics]]]:
    """A sweep on eval_loss whose trials evaluate every 2nd step: trial 0 and 2 ran 4 steps, trial 1 was
    pruned at step 3 with one evaluation; trial 2 trains to the lowest loss but evaluates worse than trial 0."""
    document = copy.deepcopy(SWEEP_DOCUMENT)
    document["spec"]["template"]["evaluation"] = {"holdout_fraction": 0.2, "interval_steps": 2}
    document["spec"]["objective"] = {"metric": "eval_loss"}
    sweep = sweep_to_proto(parse_sweep_object(document))
    sweep.id, sweep.status.state = "sweep-1", pb.SWEEP_STATE_SUCCEEDED
    runs = [  # (state, losses of steps 1.., eval losses by step, objective step)
        (pb.TRIAL_STATE_COMPLETE, [3.0, 2.5, 2.0, 1.5], {2: 1.8, 4: 1.6}, 4),
        (pb.TRIAL_STATE_PRUNED, [3.0, 2.9, 2.8], {2: 2.4}, 2),
        (pb.TRIAL_STATE_COMPLETE, [2.0, 1.5, 1.0, 0.5], {2: 1.9, 4: 1.7}, 4),
    ]
    curves = {}
    for number, (state, losses, evals, at) in enumerate(runs):
        trial = sweep.status.trials.add(number=number, job_id=f"job-{number}", state=state, objective=evals[at], objective_step=at)
        for path, value in (("spec.training.lr", 1e-3), ("spec.training.micro_batch_size", 2), ("spec.training.warmup_steps", 1)):
            value_to_proto(value, trial.params[path])
        curves[trial.job_id] = [pb.StepMetrics(step=step, loss=loss, **({"eval_loss": evals[step]} if step in evals else {}))
                                for step, loss in enumerate(losses, start=1)]
    sweep.status.best_trial, sweep.status.best_objective = 0, 1.6
    return sweep, curves


def test_a_sweep_on_eval_loss_shows_its_eval_curves_and_where_each_objective_was_read(tmp_path: Path) -> None:
    """Issue 37: the curves are the eval losses of the steps that evaluated (a pruned trial's single
    evaluation visible as a point), each trial's objective is marked at its objective step, the best
    (by eval loss, not by training loss) is drawn bold, and the table names the metric and the step."""
    from trainctl.cli.sweep_report import build_sweep_figure, write_sweep_report

    sweep, curves = eval_loss_sweep()
    axes = {ax.get_title(): ax for ax in build_sweep_figure(sweep, curves).axes}
    drawn = [line for line in axes["Curves"].get_lines() if line.get_label() != "objective"]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in drawn] == [
        ([2, 4], [1.8, 1.6]), ([2], [2.4]), ([2, 4], [1.9, 1.7])]
    assert [line.get_linewidth() for line in drawn] == [2.5, 1.0, 1.0]  # trial 0: the best eval loss
    assert all(line.get_marker() not in (None, "None", "") for line in drawn)  # one evaluation is still seen
    (marks,) = [line for line in axes["Curves"].get_lines() if line.get_label() == "objective"]
    assert list(marks.get_xdata()) == [4, 2, 4] and list(marks.get_ydata()) == [1.6, 2.4, 1.7]
    assert axes["Curves"].get_ylabel() == "eval_loss"
    assert axes["Objective per trial"].get_ylabel() == "eval_loss (at each trial's objective step)"
    page = write_sweep_report(sweep, curves, tmp_path / "s.png").html.read_text()
    assert "<th>eval_loss</th><th>at step</th>" in page
    assert "<td>PRUNED</td><td>0.001</td><td>2</td><td>1</td><td>2.4</td><td>2</td>" in page
