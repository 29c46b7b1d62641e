"""Command jobs at submit (issue 15): bad command specs get INVALID_ARGUMENT naming the field, a good one
is accepted and round-trips through the proto, and the service keeps serving (Ray-free service with
authentication and a data root)."""

from __future__ import annotations

from pathlib import Path

import pytest
from secure_service import SecureService, Tokens, bearer, refused, start_service, stub, write_access_file

from trainctl.spec.bounds import MAX_ENV_BYTES
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_from_proto, job_to_proto


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return write_access_file(tmp_path_factory.mktemp("access"), command_tenants=["vision"])  # alice may run programs


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("code")
    (data / "project").mkdir()
    (data / "project" / "train.py").write_text("print('hello')\n")
    return data


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tokens: Tokens, root: Path):
    svc = start_service(tmp_path_factory.mktemp("svc"), tokens.path, data_roots=[root])
    yield svc
    svc.stop()


def command_job(name: str, root: Path, **command: object) -> pb.Job:
    """A two-rank CPU command job running train.py in `root/project`, with `command` fields overridden."""
    fields = {"program": "python", "args": ["train.py"], "working_dir": str(root / "project"), **command}
    spec = {"command": fields, "resources": {"gpus": 2, "device": "cpu"}}
    return job_to_proto(TrainingJob.model_validate({"metadata": {"name": name}, "spec": spec}))


def test_a_command_job_is_accepted_and_round_trips(service: SecureService, tokens: Tokens, root: Path) -> None:
    message = command_job("byo", root, env={"MY_FLAG": "1"}, no_progress_timeout_seconds=30.0)
    with service.channel() as ch:
        created = stub(ch).CreateJob(pb.CreateJobRequest(job=message), metadata=bearer(tokens.alice), timeout=10)
    stored = service.store.get_job(created.id).job
    assert stored == job_from_proto(message)
    assert stored.spec.command is not None and stored.spec.command.env == {"MY_FLAG": "1"}
    assert stored.spec.parallelism.dp_replicate == 2  # no parallelism section: gpus data-parallel ranks


def _with(message: pb.Job, edit) -> pb.Job:  # noqa: ANN001 - a proto-editing lambda
    edit(message)
    return message


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("empty-program", "spec.command.program"),
        ("no-program", "spec.command.program"),
        ("outside-roots", "spec.command.working_dir"),
        ("missing-dir", "spec.command.working_dir"),
        ("mixed-model", "spec.model.dim"),
        ("mixed-training", "spec.training.steps"),
        ("oversized-env", "spec.command.env"),
        ("reserved-env", "spec.command.env"),
        ("layout-mismatch", "spec.resources.gpus"),
    ],
)
def test_bad_command_jobs_are_refused_naming_the_field(
    service: SecureService, tokens: Tokens, root: Path, tmp_path: Path, case: str, field: str
) -> None:
    messages = {
        "empty-program": lambda: _with(command_job("bad", root), lambda m: setattr(m.spec.command, "program", " ")),
        "outside-roots": lambda: command_job("bad", root, working_dir=str(tmp_path)),
        "missing-dir": lambda: command_job("bad", root, working_dir=str(root / "nope")),
        "mixed-model": lambda: _with(command_job("bad", root), lambda m: setattr(m.spec.model, "dim", 64)),
        "mixed-training": lambda: _with(command_job("bad", root), lambda m: setattr(m.spec.training, "steps", 7)),
        "oversized-env": lambda: _with(
            command_job("bad", root), lambda m: m.spec.command.env.update({f"V{i}": "x" * 4096 for i in range(17)})
        ),
        "reserved-env": lambda: _with(command_job("bad", root), lambda m: m.spec.command.env.update({"RANK": "3"})),
        "no-program": lambda: _with(command_job("bad", root), lambda m: m.spec.command.ClearField("program")),
        "layout-mismatch": lambda: _with(command_job("bad", root), lambda m: setattr(m.spec.parallelism, "tp", 4)),
    }
    message = messages[case]()
    with service.channel() as ch:
        client = stub(ch)
        named = refused(client, pb.CreateJobRequest(job=message), tokens.alice)
        assert any(v.startswith(f"{field}:") for v in named), named
        if case == "oversized-env":
            assert str(MAX_ENV_BYTES) in " ".join(named)
        # The service keeps serving.
        ok = client.CreateJob(pb.CreateJobRequest(job=command_job("ok", root)), metadata=bearer(tokens.alice), timeout=10)
        assert ok.id


def test_plan_places_a_command_job_without_estimating_its_memory(service: SecureService, tokens: Tokens, root: Path) -> None:
    with service.channel() as ch:
        plan = stub(ch).PlanJob(pb.PlanJobRequest(job=command_job("plan", root)), metadata=bearer(tokens.alice), timeout=10)
    assert plan.valid and plan.world_size == 2 and len(plan.placement) == 2
    assert not plan.memory and any("command job" in note for note in plan.notes)
