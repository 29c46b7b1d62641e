"""Fuzzing, fast tier (issue 20): proto jobs through the servicer's CreateJob and PlanJob, and YAML text
through `trainctl validate`, in-process. Nothing may escape but a refusal: no exception other than
ApiError (which the server's call chain would answer INTERNAL), no INTERNAL or UNKNOWN code, no traceback
from the CLI, whose exit status is 0 or 2.

The servicer runs over a real store and a pool of two 4-GPU nodes that the map calls H100s, so the
submit-time fit check is fuzzed too; the scheduler loop is not started. Examples are derandomized, so
CI sees the same ones every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from control_plane_fakes import ScriptedRuntime
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from proto_strategies import messages
from spec_strategies import BASE, mutated_documents, values

from trainctl.cli.main import EXIT_INVALID, EXIT_OK, main
from trainctl.planning.pool import GpuPool
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.tenancy import ANONYMOUS
from trainctl.service.store import JobStore
from trainctl.spec.validate import parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_to_proto
from trainctl.wire.errors import ApiError
from trainctl.workers.topology import simulated_topology
from trainctl.workers.topology.model import parse_topology

EXAMPLES = 300
"""Per test: 600 in all, the same derandomized ones every run, 3x hypothesis's default (1000 per test took
100 s, a third of the service tests' fast tier, on an idle 2-core machine)."""
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STRINGS = st.one_of(st.sampled_from(["", "..", "@stdlib", "debug", "\x00", "é" * 70]), st.text(max_size=20))


@pytest.fixture(scope="module")
def servicer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainingServicer]:
    base = tmp_path_factory.mktemp("fuzz")
    h100s = simulated_topology(2, 4).to_yaml().replace("gpu_model: simulated", "gpu_model: NVIDIA H100 80GB HBM3")
    pool = GpuPool(parse_topology(yaml.safe_load(h100s)), "simulated H100s")
    store = JobStore(base / "data")
    yield TrainingServicer(store, Scheduler(store, pool, ScriptedRuntime(), base / "runs"), pool, Authenticator(None))
    store.close()


@st.composite
def near_valid_jobs(draw: st.DrawFn) -> pb.Job:
    """The base spec (device left to the pool, so the fit check runs) with random spec fields laid over it."""
    document = parse_object({**BASE, "spec": {**BASE["spec"], "resources": {"gpus": 2}}})
    message = job_to_proto(document)
    message.spec.MergeFrom(draw(messages(pb.JobSpec.DESCRIPTOR, STRINGS, depth=1)))
    return message


def answer(call: Any, request: Any) -> Any:
    """The servicer's answer, or None when it refused with a well-formed, non-internal error."""
    try:
        answered = call(request, ANONYMOUS)
        return asyncio.run(answered) if inspect.iscoroutine(answered) else answered
    except ApiError as exc:
        assert exc.code not in BAD_CODES, exc.message
        exc.to_status()  # the refusal must serialise (details trailer included)
        return None


@FUZZ
@given(job=st.one_of(messages(pb.Job.DESCRIPTOR, STRINGS), near_valid_jobs()))
def test_fuzzed_proto_jobs_are_planned_created_or_refused(servicer: TrainingServicer, job: pb.Job) -> None:
    plan = answer(servicer.PlanJob, pb.PlanJobRequest(job=job))
    assert plan is not None, "PlanJob refuses a bad job in its answer, not with an error"
    if not plan.valid:
        assert plan.violations and all(v.field and v.description for v in plan.violations), plan
    created = answer(servicer.CreateJob, pb.CreateJobRequest(job=job))
    assert (created is not None) == plan.valid, f"CreateJob and PlanJob disagree: {list(plan.violations)}"
    if created is not None:
        servicer.scheduler.request_cancel(created.id, "fuzz")  # keep the queue (and the quota) empty


def run_validate(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["validate", str(path)])
    return status, err.getvalue()


def yaml_payloads() -> st.SearchStrategy[bytes]:
    as_text = st.one_of(
        st.text(max_size=300),
        values.map(yaml.safe_dump),
        mutated_documents().map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
        st.integers(min_value=1, max_value=200).map(lambda depth: "a: " + "[" * depth + "]" * depth),
    )
    return st.one_of(as_text.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=300))


@FUZZ
@given(payload=yaml_payloads())
@example(payload=b"' ':")  # a blank key: its field must still be printed visibly
def test_validate_cli_answers_any_file_with_a_status_and_error_lines(tmp_path_factory: pytest.TempPathFactory, payload: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzzed.yaml"
    path.write_bytes(payload)
    status, err = run_validate(path)
    assert status in (EXIT_OK, EXIT_INVALID), err
    if status == EXIT_INVALID:
        first, *violations = err.splitlines()
        assert first.startswith("error: ") and violations, err
        for line in violations:  # one line per problem: "  field: description"
            field, _, description = line.strip().partition(": ")
            assert line.startswith("  ") and field and description.strip(), err
    assert "Traceback" not in err
