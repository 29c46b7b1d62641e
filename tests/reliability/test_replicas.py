"""Two `trainctl serve` replicas on one PostgreSQL store, joined to an embedded 2-node Ray (1 simulated
GPU per node, so each 2-rank job takes the whole pool): both serve the API, the first leads.

Any replica answers for the cluster (GetCluster on the standby shows the leader's job on its GPUs).
SIGKILL of the leader with one job running and one queued: the standby leads within 10 s (the 6 s
lease, tried every 2 s), re-attaches to the supervisor that kept the job running (same processes,
never restarted) and supervises it to SUCCEEDED, then runs the queued job; the watchers, given both
addresses with the leader's first (the CLI's client in the test, and `trainctl --server A,B logs -f`
in a process of its own), were on the killed replica and resume on the other at their cursor with no
gap and no duplicate; nothing is lost, duplicated or re-run; no Ray actor or placement group is left."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fault_support import (
    assert_nothing_left,
    freeze_once_stepping,
    rank_pids,
    signal_all,
    states_of,
    steps_of,
    supervisor_pid,
    wait_for,
)
from postgres_server import PostgresServer
from serve_process import BIN, ServeProcess
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.scheduling.leadership import SCHEDULER_LEASE
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.events import EventKind, JobState, read_events

pytestmark = pytest.mark.timeout(420)

TAKEOVER_SECONDS = 10.0
"""The issue's bound for a standby to lead after the leader's death (the lease makes it at most 8 s)."""


def lease_holder(url: str) -> str | None:
    """The replica holding the scheduler lease now (None when it lapsed), read from the database."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT holder FROM leases WHERE name = %s AND expires > EXTRACT(EPOCH FROM clock_timestamp())",
            (SCHEDULER_LEASE,),
        ).fetchone()
    return row[0] if row else None


def holder_pid(holder: str | None) -> int | None:
    return int(holder.split("/")[1]) if holder else None  # leadership.replica_id(): host/pid/suffix


@pytest.fixture(scope="module")
def replicas(cluster: EmbeddedRay, postgres: PostgresServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ServeProcess, str]]:
    base = tmp_path_factory.mktemp("replicas")
    topology = base / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml())
    url = postgres.create_database()
    for name in ("a", "b"):
        (base / name).mkdir()
    first = ServeProcess(cluster.address, topology, base / "a" / "data", f"--store={url}")
    second = ServeProcess(cluster.address, topology, base / "b" / "data", f"--store={url}")
    with first, second:
        first.start()
        wait_for(lambda: holder_pid(lease_holder(url)) == first.proc.pid, "the first replica leads", 30)
        second.start()
        yield first, second, url


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Processes the test starts, killed at its end if still running."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def printed_events(out: str) -> tuple[list[int], list[int]]:
    """(the sequences of the state and log lines, the step numbers of the step lines) `trainctl logs -f`
    printed (plain lines: its stdout is a file)."""
    sequences = [int(s) for s in re.findall(r"^\[(\d+)\] ", out, flags=re.MULTILINE)]
    steps = [int(s) for s in re.findall(r"^step (\d+)/", out, flags=re.MULTILINE)]
    return sequences, steps


def runs_of(*replicas: ServeProcess) -> list[Path]:
    return [r.data_dir / "runs" for r in replicas]


def test_sigkilled_leader_replica_hands_over_losing_and_duplicating_nothing(
    replicas: tuple[ServeProcess, ServeProcess, str], cluster: EmbeddedRay, processes: list[subprocess.Popen]
) -> None:
    leader, standby, url = replicas
    on_leader, on_standby = TrainctlClient(leader.target), TrainctlClient(standby.target)
    running = on_standby.create_job(small_job("running", steps=30))  # either replica takes API calls
    queued = on_leader.create_job(small_job("queued", steps=3))
    both = f"{leader.target},{standby.target}"
    cli_out = leader.data_dir.parent.parent / "logs-f.out"
    with cli_out.open("w") as out:  # the CLI as users run it, following the job on the leader
        cli = subprocess.Popen([str(BIN / "trainctl"), "--server", both, "logs", running.id, "-f"],
                               stdout=out, stderr=subprocess.STDOUT)
    processes.append(cli)
    watching = TrainctlClient(both)
    stream = watching.watch(running.id)
    seen: list[pb.JobEvent] = []
    ranks = freeze_once_stepping(cluster, stream, seen, running.id)  # still running when the standby leads
    try:
        wait_for(lambda: "step 2/30" in cli_out.read_text(), "`trainctl logs -f` shows the job stepping", 60)
        assert on_standby.get_job(queued.id).status.state == pb.QUEUED
        wait_for(lambda: on_standby.get_cluster().used_gpus == 2, "the standby's GetCluster shows the leader's job", 10)
        supervisor = supervisor_pid(cluster, running.id)
        assert supervisor is not None

        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: holder_pid(lease_holder(url)) == standby.proc.pid, "the standby leads", TAKEOVER_SECONDS)
        took_over = time.monotonic() - killed
        jobs = {j.id: j.status.state for j in on_standby.list_jobs()}
        assert jobs == {running.id: pb.RUNNING, queued.id: pb.QUEUED}, jobs
        assert supervisor_pid(cluster, running.id) == supervisor, "re-attached to the same, living supervisor"
        assert rank_pids(cluster, running.id) == ranks
    finally:
        signal_all(list(ranks.values()), signal.SIGCONT)

    resumed = list(stream)  # the watcher moves to the standby at its cursor
    assert watching.target == standby.target
    whole = list(on_standby.watch(running.id))
    assert seen + resumed == whole, "the resumed watch has no gap and no duplicate"
    assert cli.wait(timeout=60) == 0, cli_out.read_text()
    assert printed_events(cli_out.read_text()) == (
        [e.sequence for e in whole if e.WhichOneof("payload") != "step"], steps_of(whole)
    ), "`trainctl logs -f` moved to the standby with no gap and no duplicate"
    assert states_of(whole) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED]
    assert steps_of(whole) == list(range(1, 31)), "every step exactly once: nothing re-ran"
    done = on_standby.get_job(running.id, full=True)
    assert done.status.state == pb.SUCCEEDED and done.status.restarts == 0, done.status.reason
    later = list(on_standby.watch(queued.id))
    assert states_of(later) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED], later
    assert len(list(on_standby.list_jobs())) == 2

    for job_id in (running.id, queued.id):  # each supervisor started once: one SCHEDULED, no restart
        candidates = [RunDirectory.of_job(runs, job_id) for runs in runs_of(leader, standby)]
        (log_file,) = [run.events for run in candidates if run.root.exists()]
        states = [e.state for e in read_events(log_file) if e.kind is EventKind.STATE]
        assert states == [JobState.SCHEDULED, JobState.RUNNING, JobState.SUCCEEDED], (job_id, states)
    assert on_standby.get_cluster().used_gpus == 0
    on_leader.close()
    on_standby.close()
    watching.close()
    assert_nothing_left(cluster)
    print(f"standby led {took_over:.1f} s after the leader's SIGKILL")
