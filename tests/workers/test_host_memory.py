"""Host memory is a resource (trainctl.workers.host_memory): each rank runs under a host-memory limit the
kernel enforces (RLIMIT_DATA), from ``spec.resources.host_memory_gib`` or the node's memory divided among
its GPU slots; torch and a Ray worker run under it, an allocation past it fails at once in the process
that made it, and the job FAILS without a restart with a reason that names the limit. On the embedded
Ray: a command program that allocates twice its limit, and an engine rank whose model does not fit its
limit; a program runs under the node's default when the spec sets none."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray.exceptions import RayActorError, RayTaskError
from small_jobs import small_job
from test_command_jobs import command_job, rank_lines
from test_runtime import assert_nothing_left, finished, follow, plan, states_of

import trainctl
from trainctl.parallelism.errors import ConfigurationError
from trainctl.workers.command.output import RankOutput
from trainctl.workers.command.program import ProgramExited, ProgramProcess
from trainctl.workers.events import JobState
from trainctl.workers.host_memory import (
    GIB,
    HostMemoryExceeded,
    node_memory_bytes,
    node_share,
    ran_out_of_memory,
    rank_limit,
    says_out_of_memory,
    spec_limit,
)
from trainctl.workers.outcomes import Outcome, failure_class
from trainctl.workers.runtime import RayRuntime

ALLOCATE = "import sys; block = bytearray(int(float(sys.argv[1]) * 2**30)); print('allocated', flush=True)"
"""``python -c ALLOCATE GIB``: allocate GIB GiB at once."""


def test_the_limit_is_the_specs_or_the_nodes_memory_over_its_gpu_slots() -> None:
    assert spec_limit(2.0).bytes == 2 * GIB
    assert str(spec_limit(2.0)) == "2.0 GiB (spec.resources.host_memory_gib)"
    share = node_share(64 * GIB, 8)
    assert share.bytes == 8 * GIB
    assert str(share) == (
        "8.0 GiB (the node's 64.0 GiB over its 8 GPU slot(s); spec.resources.host_memory_gib sets another)"
    )
    assert node_share(10 * GIB, 0).bytes == 10 * GIB  # a node without slots: all of it
    assert rank_limit(None, 64 * GIB, 8) == share and rank_limit(2.0, 64 * GIB, 8) == spec_limit(2.0)
    with pytest.raises(ConfigurationError, match=(
        r"^spec\.resources\.host_memory_gib: 9 GiB per rank is more than a GPU slot's share of this node's host "
        r"memory, 8\.0 GiB \(the node's 64\.0 GiB over its 8 GPU slot\(s\);"
    )):
        rank_limit(9.0, 64 * GIB, 8)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < node_memory_bytes() <= physical


def test_torch_runs_under_the_data_limit_and_an_allocation_past_it_fails_at_once() -> None:
    """RLIMIT_DATA (not RLIMIT_AS, which Ray's and torch's address-space reservations exceed at once):
    torch imports and trains a step under 2 GiB; a 4 GiB tensor and a 4 GiB bytes object fail at
    once; the limit cannot be raised again, and the processes the rank starts inherit it."""
    code = (
        "import resource, subprocess, sys\n"
        "from trainctl.workers.host_memory import limit_this_process, spec_limit\n"
        "limit_this_process(spec_limit(2.0))\n"
        "import torch\n"
        "model = torch.nn.Linear(256, 256); model(torch.randn(8, 256)).sum().backward()\n"
        "try:\n    torch.empty(2**30, dtype=torch.float32)\nexcept RuntimeError as exc:\n    print('torch:', exc)\n"
        "try:\n    bytes(4 * 2**30)\nexcept MemoryError:\n    print('python: MemoryError')\n"
        "try:\n    resource.setrlimit(resource.RLIMIT_DATA, (2**40, 2**40))\nexcept (ValueError, OSError):\n    print('raise refused')\n"
        "child = 'import resource; print(\"child:\", resource.getrlimit(resource.RLIMIT_DATA)[0])'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(trainctl.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    lines = out.splitlines()
    assert any(line.startswith("torch:") and "can't allocate memory" in line for line in lines), out
    assert "python: MemoryError" in lines and "raise refused" in lines
    assert f"child: {2 * GIB}" in lines


def test_a_program_runs_under_its_limit_and_says_so_when_it_runs_out(tmp_path: Path) -> None:
    lines: list[str] = []
    limits = "print([l for l in open('/proc/self/limits') if l.startswith('Max data size')][0].split()[3])"
    program = ProgramProcess([sys.executable, "-c", limits], str(tmp_path), dict(os.environ),
                             RankOutput(tmp_path, 0, lines.append), data_limit=GIB)
    assert program.wait() == 0 and lines == [str(GIB)]
    lines.clear()
    program = ProgramProcess([sys.executable, "-c", ALLOCATE, "2"], str(tmp_path), dict(os.environ),
                             RankOutput(tmp_path, 0, lines.append), data_limit=GIB)
    assert program.wait() == 1
    assert lines[-1] == "stderr: MemoryError" and says_out_of_memory(lines)


def test_out_of_memory_is_told_from_other_errors() -> None:
    torch_error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried")
    assert ran_out_of_memory(MemoryError()) and ran_out_of_memory(torch_error)
    try:
        try:
            raise MemoryError()
        except MemoryError as exc:
            raise ValueError("spec.data.paths: could not read a record") from exc
    except ValueError as wrapped:
        assert ran_out_of_memory(wrapped)
    assert not ran_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not ran_out_of_memory(ValueError("bad"))
    assert says_out_of_memory(["Traceback (most recent call last):", "MemoryError"])
    assert says_out_of_memory(["OSError: [Errno 12] Cannot allocate memory"])
    assert says_out_of_memory(["terminate called after throwing an instance of 'std::bad_alloc'"])
    assert not says_out_of_memory(["torch.OutOfMemoryError: CUDA out of memory", "exit 1"])


def _task_error(cause: Exception) -> RayTaskError:
    return RayTaskError("RankWorker.train", f"Traceback ...\n{type(cause).__name__}: {cause}", cause).as_instanceof_cause()


def test_a_rank_past_its_limit_fails_the_job_without_a_restart_naming_the_limit() -> None:
    engine = HostMemoryExceeded(0, "2.0 GiB (spec.resources.host_memory_gib)", "MemoryError")
    engine = pickle.loads(pickle.dumps(engine))  # as Ray sends it
    broken = (1, _task_error(RuntimeError("Connection closed by peer")))
    outcome, reason = failure_class([broken, (0, _task_error(engine))])
    assert outcome is Outcome.MISCONFIGURED
    assert reason == (
        "rank 0 exceeded its host-memory limit of 2.0 GiB (spec.resources.host_memory_gib): MemoryError; "
        "not restarted (the same allocation would fail again)"
    )
    program = pickle.loads(pickle.dumps(ProgramExited(1, 1, ["Traceback ...", "MemoryError"], 2.0, "1.0 GiB (x)")))
    other = ProgramExited(0, 1, ["RuntimeError: peer gone"], 3.0)
    outcome, reason = failure_class([(0, _task_error(other)), (1, _task_error(program))])
    assert outcome is Outcome.MISCONFIGURED
    assert reason.startswith("rank 1 exceeded its host-memory limit of 1.0 GiB (x): its program exited with code 1;")
    outcome, _ = failure_class([(0, _task_error(engine)), (2, RayActorError())])
    assert outcome is Outcome.FAILED, "a dead rank still comes first"


# ---- on the embedded Ray ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(embedded_ray) -> RayRuntime:
    return RayRuntime(embedded_ray.address, placement_timeout=30)


def test_a_program_that_allocates_twice_its_limit_fails_its_job_at_once_naming_the_limit(runtime, tmp_path: Path) -> None:
    job = command_job("greedy", sys.executable, "-c", ALLOCATE, "2", gpus=1,
                      resources={"host_memory_gib": 1.0}, scheduling={"max_restarts": 2})
    runtime.start_job("mem-program", job, plan(("node-0", 3)), tmp_path)
    events, status = follow(runtime, "mem-program", finished)
    assert status.state is JobState.FAILED and status.restarts == 0, status.reason
    assert status.reason.startswith(
        "rank 0 exceeded its host-memory limit of 1.0 GiB (spec.resources.host_memory_gib): its program exited with code 1"
    ), status.reason
    assert "MemoryError" in status.reason and status.reason.endswith("not restarted (the same allocation would fail again)")
    assert "allocated" not in rank_lines(events, 0)
    assert states_of(events) == [JobState.SCHEDULED, JobState.RUNNING, JobState.FAILED]
    assert_nothing_left("mem-program")


def test_a_program_gets_the_nodes_memory_over_its_gpu_slots_by_default(runtime, tmp_path: Path) -> None:
    limits = "print([l for l in open('/proc/self/limits') if l.startswith('Max data size')][0].split()[3])"
    job = command_job("default-limit", sys.executable, "-c", limits, gpus=1)
    runtime.start_job("mem-default", job, plan(("node-2", 3)), tmp_path)
    events, status = follow(runtime, "mem-default", finished)
    assert status.state is JobState.SUCCEEDED, status.reason
    expected = node_share(node_memory_bytes(), 4)  # the embedded nodes have 4 simulated GPUs each
    assert str(expected.bytes) in rank_lines(events, 0)
    assert any(line.endswith(f"host-memory limit {expected}") for line in rank_lines(events, 0))
    assert_nothing_left("mem-default")


def test_an_engine_rank_whose_model_does_not_fit_its_limit_fails_at_once_naming_it(runtime, tmp_path: Path) -> None:
    # A 4 GiB embedding (4,194,304 x 256 float32) under a 1 GiB limit: refused at its allocation.
    job = small_job("too-big", gpus=1, model={"vocab_size": 4_194_304, "dim": 256}, resources={"host_memory_gib": 1.0},
                    scheduling={"max_restarts": 2})
    started = time.monotonic()
    runtime.start_job("mem-engine", job, plan(("node-1", 3)), tmp_path)
    events, status = follow(runtime, "mem-engine", finished)
    assert status.state is JobState.FAILED and status.restarts == 0, status.reason
    assert status.reason.startswith(
        "rank 0 exceeded its host-memory limit of 1.0 GiB (spec.resources.host_memory_gib): RuntimeError:"
    ), status.reason
    assert "can't allocate memory" in status.reason
    assert states_of(events) == [JobState.SCHEDULED, JobState.RUNNING, JobState.FAILED]
    assert time.monotonic() - started < 120
    assert_nothing_left("mem-engine")
