"""The CLI given two replicas' addresses (`--server A,B`) on one PostgreSQL store: when the replica it is
connected to stops mid-watch, `submit --watch` re-opens the stream on the other after the last event it
showed, so the job's progress is printed whole, with no gap and no duplicate; a sweep's watch moves the
same way; a unary command whose first address refuses the connection is answered by the next
(trainctl.cli.client)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from control_plane_fakes import (
    SWEEP_DOCUMENT,
    ApiServer,
    ScriptedRuntime,
    eventually,
    free_port,
    start_api_server,
)
from postgres_server import PostgresServer
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import EXIT_INVALID, main
from trainctl.spec.sweep import parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.events import JobState

TTL = 1.0
"""Short leases: the standby leads a second or two after the leader stops."""
STEPS = 6


@dataclass
class Replicas:
    """One scripted cluster and two API replicas on one database; `first` leads."""

    runtime: ScriptedRuntime
    first: ApiServer
    second: ApiServer
    stopped: set[str] = field(default_factory=set)
    """Targets of the replicas a test stopped."""

    def stop(self, replica: ApiServer) -> None:
        replica.stop()
        self.stopped.add(replica.target)


@pytest.fixture
def replicas(postgres: PostgresServer, tmp_path: Path) -> Iterator[Replicas]:
    url = postgres.create_database()
    runtime = ScriptedRuntime()
    first = start_api_server(tmp_path / "data", runtime, store=url, lease_ttl=TTL)
    running = [first]
    try:
        eventually(lambda: first.scheduler.leading, "the first replica leads")
        running.append(start_api_server(tmp_path / "data", runtime, store=url, lease_ttl=TTL))
        both = Replicas(runtime, first, running[1])
        yield both
    finally:
        for replica in running:
            if replica.target not in both.stopped:
                replica.stop()


def test_submit_watch_moves_to_the_other_replica_at_its_cursor(
    tmp_path: Path, replicas: Replicas, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime, first, second = replicas.runtime, replicas.first, replicas.second
    spec = tmp_path / "failover.yaml"
    spec.write_text(yaml.safe_dump(small_job("failover", steps=STEPS).model_dump(mode="json", exclude_unset=True)))
    exit_status: list[int] = []
    watcher = threading.Thread(
        target=lambda: exit_status.append(main(["--server", f"{first.target},{second.target}", "submit", str(spec), "--watch"])),
        daemon=True,
    )
    watcher.start()
    job_id = eventually(lambda: next(iter(runtime.logs), None), "the leader starts the job")
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    for step in range(1, 4):
        runtime.step(job_id, step, 5.0 - step)
    out = ""

    def printed(text: str) -> bool:
        nonlocal out
        out += capsys.readouterr().out
        return text in out

    eventually(lambda: printed(f"step 3/{STEPS}"), "the watcher shows step 3 from the first replica")
    replicas.stop(first)  # the replica the CLI is connected to goes away mid-watch
    # the supervisor (the scripted runtime) goes on once the standby follows it: a job that ended
    # unseen would look, to the scripted runtime's missing event file, like one never started
    eventually(lambda: second.scheduler.leading, "the second replica leads")
    for step in range(4, STEPS + 1):
        runtime.step(job_id, step, 5.0 - step)
    runtime.state(job_id, JobState.SUCCEEDED, "done")
    watcher.join(20)
    assert not watcher.is_alive(), "the watch ended"
    out += capsys.readouterr().out
    assert exit_status == [0], out

    steps = [int(m) for m in re.findall(rf"^step (\d+)/{STEPS}\b", out, flags=re.MULTILINE)]
    assert steps == list(range(1, STEPS + 1)), out
    changes = re.findall(r"^\[(\d+)\] ([\w-]+) -> (\w+)", out, flags=re.MULTILINE)
    assert [(a, b) for _, a, b in changes] == [("-", "QUEUED"), ("QUEUED", "SCHEDULED"), ("SCHEDULED", "RUNNING"), ("RUNNING", "SUCCEEDED")], out
    with TrainctlClient(second.target) as client:  # what the CLI printed is the job's whole event log
        whole = list(client.watch(job_id))
    assert [int(seq) for seq, _, _ in changes] == [e.sequence for e in whole if e.WhichOneof("payload") == "state_change"]
    assert [e.step.step for e in whole if e.WhichOneof("payload") == "step"] == list(range(1, STEPS + 1))

    assert main(["--server", f"{first.target},{second.target}", "get", job_id, "-o", "json"]) == 0
    assert '"state": "SUCCEEDED"' in capsys.readouterr().out


def test_unary_calls_skip_an_address_that_refuses(replicas: Replicas) -> None:
    second = replicas.second
    nobody = f"127.0.0.1:{free_port()}"
    with TrainctlClient(f"{nobody}, {second.target}") as client:
        assert client.addresses == [nobody, second.target]
        job = client.create_job(small_job("elsewhere"))
        assert client.target == second.target
        assert [j.id for j in client.list_jobs()] == [job.id]


def test_an_empty_server_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--server", " , ", "list"]) == EXIT_INVALID
    assert capsys.readouterr().err == "error: no service address in ' , ' (expected HOST:PORT[,HOST:PORT...])\n"


def test_a_sweep_watch_moves_to_the_other_replica_and_sees_the_end(replicas: Replicas) -> None:
    first, second = replicas.first, replicas.second
    nobody = f"127.0.0.1:{free_port()}"
    with TrainctlClient(f"{nobody},{first.target},{second.target}") as client:
        created = client.create_sweep(parse_sweep_object(SWEEP_DOCUMENT))
        stream = client.watch_sweep(created.id)
        opened = next(stream)  # answered by the first replica: the refusing address was skipped
        assert opened.id == created.id and client.target == first.target
        replicas.stop(first)  # the replica the watch is connected to goes away mid-stream
        with TrainctlClient(second.target) as other:
            other.cancel_sweep(created.id, "enough")
        rest = list(stream)
    assert client.target == second.target
    assert rest and rest[-1].status.state == pb.SWEEP_STATE_CANCELLED, rest
    serialized = [opened.SerializeToString(deterministic=True), *(s.SerializeToString(deterministic=True) for s in rest)]
    assert len(set(serialized)) == len(serialized), "a re-opened stream repeats no sweep already shown"
