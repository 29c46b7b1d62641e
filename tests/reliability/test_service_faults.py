"""Control-plane faults, end to end: a real `trainctl serve` process over gRPC on loopback, joined to
an embedded 2-node Ray (1 simulated GPU per node, so each 2-rank job takes the whole pool).

- SIGKILL of the service with one job running and one queued, then a restart on the same data dir:
  both jobs are still there in the right state, the running one is re-attached to the supervisor that
  kept it running (same process, never restarted) and finishes, the queued one is scheduled and runs,
  neither runs twice, and a WatchJob client resumes from its cursor with no gap and no duplicate.
- A rank that keeps dying: restarted once, then FAILED with the reason when `max_restarts` is spent.

Every test ends by proving that no Ray actor or placement group is left (Ray's state API)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest
from fault_support import (
    assert_nothing_left,
    freeze_once_stepping,
    kind,
    rank_pids,
    read_until,
    signal_all,
    states_of,
    steps_of,
    supervisor_pid,
)
from serve_process import ServeProcess
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.events import EventKind, JobState, read_events

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def serve(cluster: EmbeddedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("serve")
    topology = base / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml())
    with ServeProcess(cluster.address, topology, base / "data") as process:
        process.start()
        yield process
    assert process.proc is not None and process.proc.returncode == 0, process.log_path.read_text()[-3000:]


def job(name: str, steps: int, *, max_restarts: int = 0) -> TrainingJob:
    return small_job(name, steps=steps, labels={"suite": "reliability"}, scheduling={"max_restarts": max_restarts})


def test_sigkilled_service_restarts_losing_and_duplicating_nothing(serve: ServeProcess, cluster: EmbeddedRay) -> None:
    client = TrainctlClient(serve.target)
    running = client.create_job(job("running", steps=30))
    queued = client.create_job(job("queued", steps=3))
    channel = grpc.insecure_channel(serve.target)
    stream = pb_grpc.TrainingServiceStub(channel).WatchJob(pb.WatchJobRequest(id=running.id, follow=True))
    seen: list[pb.JobEvent] = []
    # Freeze the ranks while the service is down, so the job is certainly still running when the
    # new service comes up (the step watchdog's 600 s default is far away).
    ranks = freeze_once_stepping(cluster, stream, seen, running.id)
    try:
        before = client.get_job(running.id).status
        assert before.state == pb.RUNNING and before.steps_done < 30, before
        waiting = client.get_job(queued.id).status
        assert waiting.state == pb.QUEUED and waiting.reason == "waiting for 2 GPUs: 0 of 2 free", waiting
        supervisor = supervisor_pid(cluster, running.id)
        assert supervisor is not None

        serve.kill()
        with pytest.raises(grpc.RpcError) as broken:  # the client keeps what reached it before the crash
            for event in stream:
                seen.append(event)
        assert broken.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
        channel.close()
        cursor = seen[-1].sequence
        serve.start()  # same data dir, same port

        jobs = {j.id: j.status for j in client.list_jobs(labels={"suite": "reliability"})}
        assert sorted(jobs) == sorted([running.id, queued.id])
        assert jobs[running.id].state == pb.RUNNING and jobs[queued.id].state == pb.QUEUED, jobs
        assert supervisor_pid(cluster, running.id) == supervisor, "re-attached to the same, living supervisor"
        assert rank_pids(cluster, running.id) == ranks
    finally:
        signal_all(list(ranks.values()), signal.SIGCONT)

    resumed = list(client.watch(running.id, after_sequence=cursor))
    whole = list(client.watch(running.id))
    assert seen + resumed == whole, "the resumed watch has no gap and no duplicate"
    assert [e.sequence for e in whole] == sorted({e.sequence for e in whole})
    assert states_of(whole) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED]
    assert steps_of(whole) == list(range(1, 31)), "every step exactly once: nothing re-ran"
    done = client.get_job(running.id, full=True)
    assert done.status.state == pb.SUCCEEDED and done.status.restarts == 0, done.status.reason
    assert [m.step for m in done.metrics] == list(range(1, 31))

    later = list(client.watch(queued.id))
    assert states_of(later) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED], later
    assert steps_of(later) == [1, 2, 3]
    assert client.get_job(queued.id).status.schedule_time.ToNanoseconds() >= done.status.end_time.ToNanoseconds()

    # Each job's supervisor started exactly once: its own log has one SCHEDULED and no restart.
    for job_id in (running.id, queued.id):
        log = read_events(RunDirectory.of_job(serve.data_dir / "runs", job_id).events)
        supervisor_states = [e.state for e in log if e.kind is EventKind.STATE]
        assert supervisor_states == [JobState.SCHEDULED, JobState.RUNNING, JobState.SUCCEEDED], (job_id, supervisor_states)
    assert "admission was interrupted" not in serve.log_path.read_text()
    assert client.get_cluster().used_gpus == 0
    client.close()
    assert_nothing_left(cluster)


def test_a_rank_that_keeps_dying_fails_the_job_after_max_restarts(serve: ServeProcess, cluster: EmbeddedRay) -> None:
    client = TrainctlClient(serve.target)
    flaky = client.create_job(job("flaky", steps=100_000, max_restarts=1))
    stream = client.watch(flaky.id)
    seen: list[pb.JobEvent] = []
    for generation in (0, 1):
        read_until(stream, seen, lambda e: kind(e) == "state_change" and e.state_change.to_state == pb.RUNNING)
        read_until(stream, seen, lambda e: kind(e) == "step")
        [victim] = [pid for name, pid in rank_pids(cluster, flaky.id).items() if name.endswith(f"-g{generation}-1")]
        os.kill(victim, signal.SIGKILL)
    seen += list(stream)
    assert states_of(seen) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.RESTARTING, pb.RUNNING, pb.FAILED]
    [restart] = [e.state_change for e in seen if kind(e) == "state_change" and e.state_change.to_state == pb.RESTARTING]
    assert restart.reason.startswith("rank 1 died") and "restart 1 of 1" in restart.reason, restart.reason
    status = client.get_job(flaky.id).status
    assert status.state == pb.FAILED and status.restarts == 1
    assert status.reason.startswith("rank 1 died"), status.reason
    assert status.reason.endswith("giving up after 1 restart(s) (scheduling.max_restarts=1)"), status.reason
    assert client.get_cluster().used_gpus == 0
    client.close()
    assert_nothing_left(cluster)
