"""Node loss through the service: a real `trainctl serve` process over gRPC on loopback, on an embedded
Ray whose head offers no GPU of the topology map and whose two GPU nodes (node-1, node-2, 2 simulated
GPUs each) are the whole pool, so a 2-rank job fills one node.

- The job's node is removed mid-run with the other node free: the scheduler re-places the job there,
  it resumes from its checkpoint and SUCCEEDS; its events and GetJob say where the ranks run now.
- The job's node is removed with no other node alive: the job waits, its reason and an event say for
  what, and it is re-placed and SUCCEEDS once a node joins.

Ray declares a removed node dead once its health checks fail (about 3 s with
`FAST_NODE_FAILURE_DETECTION`, 15 s with Ray's defaults); a rank on it dies at once.

Every test ends by proving that no Ray actor or placement group is left and no GPU is held."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fault_support import assert_nothing_left, kind, read_until, states_of, steps_of, wait_for
from serve_process import ServeProcess
from small_jobs import restartable_job

from trainctl.cli.client import TrainctlClient
from trainctl.cli.progress import TERMINAL
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay, topology_labels
from trainctl.workers.topology.model import TopologyMap, parse_topology, simulated_topology

pytestmark = [pytest.mark.timeout(420), pytest.mark.cluster(nodes=1, gpus_per_node=1, fast_node_failure=True)]

POOL = ("node-1", "node-2")


def pool_map() -> TopologyMap:
    """node-1 and node-2 of a simulated 3 x 2 map (node-0, the head, is not in the pool)."""
    data = simulated_topology(3, 2).model_dump(mode="json")
    data["spec"]["nodes"] = [n for n in data["spec"]["nodes"] if n["name"] in POOL]
    data["spec"]["nvlink_domains"] = [d for d in data["spec"]["nvlink_domains"] if set(d["nodes"]) <= set(POOL)]
    return parse_topology(data)


def add_pool_node(cluster: EmbeddedRay, name: str) -> None:
    cluster.add_node(name, gpus=2, labels=topology_labels(pool_map(), name))


@pytest.fixture(scope="module")
def cluster(cluster: EmbeddedRay) -> EmbeddedRay:
    """The head alone (its lost nodes declared dead in ~3 s instead of ~15 s), then the two pool nodes."""
    for name in POOL:
        add_pool_node(cluster, name)
    return cluster


@pytest.fixture(scope="module")
def serve(cluster: EmbeddedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """`trainctl serve` on the pool map (its own module fixture: test_service_faults serves another map)."""
    topology = tmp_path_factory.mktemp("serve") / "pool.yaml"
    topology.write_text(pool_map().to_yaml())
    with ServeProcess(cluster.address, topology, topology.parent / "data") as process:
        process.start()
        yield process
    assert process.proc is not None and process.proc.returncode == 0, process.log_path.read_text()[-3000:]


def job(name: str, steps: int) -> TrainingJob:
    return restartable_job(name, steps, labels={"suite": "node-loss"})


def nodes_of(client: TrainctlClient, job_id: str) -> set[str]:
    return {p.node for p in client.get_job(job_id).status.placement}


def alive(client: TrainctlClient, node: str) -> bool:
    return {n.name: n.alive for n in client.get_cluster().nodes}[node]


def logs_of(events: list[pb.JobEvent]) -> list[str]:
    return [e.log.message for e in events if kind(e) == "log"]


def test_a_lost_node_restarts_the_job_on_the_free_node(serve: ServeProcess, cluster: EmbeddedRay) -> None:
    client = TrainctlClient(serve.target)
    moved = client.create_job(job("moved", steps=30))  # room after step 3 for the node's removal to land
    stream = client.watch(moved.id)
    seen: list[pb.JobEvent] = []
    read_until(stream, seen, lambda e: kind(e) == "step" and e.step.step >= 3)
    [lost] = nodes_of(client, moved.id)  # two ranks fill one node; the other node is free
    [spare] = set(POOL) - {lost}
    cluster.remove_node(lost)
    seen += list(stream)
    assert states_of(seen) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.RESTARTING, pb.RUNNING, pb.SUCCEEDED]
    logs = logs_of(seen)
    assert f"node(s) {lost} left the Ray cluster; waiting for a new placement of rank(s) 0,1 from the scheduler" in logs
    assert any(line.startswith(f"node {lost} lost; re-placed ranks 0,1 on {spare}") for line in logs), logs
    placed = [line for line in logs if line.startswith("ranks placed: ")][-1]
    assert f"0->{spare}:" in placed and f"1->{spare}:" in placed, placed
    done = client.get_job(moved.id, full=True)
    assert done.status.state == pb.SUCCEEDED and done.status.restarts == 1, done.status.reason
    assert nodes_of(client, moved.id) == {spare}, "GetJob shows where the ranks run now"
    steps = steps_of(seen)
    assert steps[-1] == 30 and steps.count(1) == 1, "resumed from a checkpoint, not from scratch"
    assert client.get_cluster().used_gpus == 0
    add_pool_node(cluster, lost)  # the pool is whole again for the next test
    client.close()
    assert_nothing_left(cluster)


def test_a_lost_node_without_room_waits_then_resumes_when_a_node_joins(serve: ServeProcess, cluster: EmbeddedRay) -> None:
    client = TrainctlClient(serve.target)
    lost, other = POOL
    cluster.remove_node(other)  # idle; Ray declares it dead after its health checks fail
    wait_for(lambda: not alive(client, other), f"Ray to declare {other} dead", timeout=90)
    stranded = client.create_job(job("stranded", steps=60))  # ~6 s after step 1 for the removal to land (6 steps took 0.7 s)
    stream = client.watch(stranded.id)
    seen: list[pb.JobEvent] = []
    read_until(stream, seen, lambda e: kind(e) == "step")
    assert nodes_of(client, stranded.id) == {lost}
    cluster.remove_node(lost)
    waiting = f"node(s) {lost} lost; waiting for 2 GPUs to re-place the job: 0 of 4 free"

    def waits_for_gpus() -> bool:
        status = client.get_job(stranded.id).status
        assert status.state not in TERMINAL, f"the job ended {pb.JobState.Name(status.state)}: {status.reason}"
        return status.reason == waiting

    wait_for(waits_for_gpus, "the job to wait for GPUs")
    assert client.get_job(stranded.id).status.state == pb.RESTARTING
    add_pool_node(cluster, other)
    seen += list(stream)
    assert states_of(seen) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.RESTARTING, pb.RUNNING, pb.SUCCEEDED]
    warnings = [e.log.message for e in seen if kind(e) == "log" and e.log.level == "WARNING"]
    assert warnings[-1] == waiting, warnings
    assert any(line.startswith(f"node {lost} lost; re-placed ranks 0,1 on {other}") for line in logs_of(seen))
    assert nodes_of(client, stranded.id) == {other}
    assert client.get_cluster().used_gpus == 0
    client.close()
    assert_nothing_left(cluster)
