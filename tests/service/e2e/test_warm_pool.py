"""The warm pool through the service (`ServiceConfig(warm_pool=True)`) on an embedded 2-node Ray with one
simulated GPU per node: the pool loads one rank process per free slot; a job's ranks run on those
processes (PLACEMENT says pooled, the actors are the pool's), leave with the job (finished or
cancelled) and the pool refills the freed slots with new processes. A pooled worker exits when the
placement group of its rank group is removed behind its back, and one handed over for another slot
is not bound: the rank gets a fresh worker in its bundle and the pooled one is killed. One handed to
a job that never binds it (its supervisor died first) is killed by the keeper after the grace, and an
idle one that dies is replaced."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import ray
from ray.util.placement_group import remove_placement_group
from ray.util.state import list_actors
from test_e2e import job, leftovers, states_of

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.server import Service
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.events import EventKind, read_events
from trainctl.workers.placement import RankAssignment
from trainctl.workers.rank_group import RankGroup
from trainctl.workers.warm_pool import WARM_PREFIX, WarmPool, parse_warm_name

pytestmark = [pytest.mark.timeout(300), pytest.mark.service(warm_pool=True)]

SLOTS = [("node-0", 0), ("node-1", 0)]


def pool_of(service: Service) -> WarmPool:
    assert service.warm_pool is not None
    return service.warm_pool


def warm_actors(cluster: EmbeddedRay) -> dict[str, str]:
    """Pooled workers' actor names -> state, per Ray's state API."""
    return {a.name: a.state for a in list_actors(address=cluster.address, limit=10_000) if (a.name or "").startswith(WARM_PREFIX)}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.25)


def loaded_pool(service: Service, cluster: EmbeddedRay, slots: list[tuple[str, int]] = SLOTS) -> set[str]:
    """Wait until ``slots`` have a loaded idle worker each; the names of the live pooled workers."""
    pool = pool_of(service)
    wait_for(lambda: set(slots) <= set(pool.idle_slots()), f"the pool has a worker on each of {slots}", timeout=90)
    pool.wait_loaded(timeout=120)

    def alive() -> set[str]:
        return {name for name, state in warm_actors(cluster).items() if state == "ALIVE"}

    # Ray's state API lags a worker the keeper has just started (for a slot the previous test freed).
    wait_for(lambda: sorted(parse_warm_name(name) for name in alive()) == pool.idle_slots(),
             "every idle pooled worker is an ALIVE actor", timeout=30)
    return alive()


def placement_of(service: Service, job_id: str) -> list[dict]:
    run = RunDirectory.at(service.store.get_job(job_id).run_dir)
    placements = [e.placement for e in read_events(run.events) if e.kind is EventKind.PLACEMENT]
    assert len(placements) == 1, placements
    return placements[0]


def test_ranks_run_on_loaded_pool_workers_that_leave_with_the_job(
    service: Service, client: TrainctlClient, cluster: EmbeddedRay
) -> None:
    before = loaded_pool(service, cluster)
    created = client.create_job(job("warm", gpus=2, steps=4))
    events = list(client.watch(created.id))
    status = client.get_job(created.id).status
    assert states_of(events) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED], status.reason
    assert status.steps_done == 4

    placement = placement_of(service, created.id)
    assert all(rank["pooled"] for rank in placement), placement
    assert {rank["actor"] for rank in placement} == before
    assert sorted((rank["node"], rank["gpu"]) for rank in placement) == SLOTS

    wait_for(lambda: all(warm_actors(cluster).get(name) == "DEAD" for name in before), "the job's pooled ranks are dead")
    wait_for(lambda: leftovers(cluster, created.id) == ([], []), "nothing of the job is left")
    after = loaded_pool(service, cluster)
    assert not after & before, "the freed slots got new processes"


def test_cancel_ends_pooled_ranks(service: Service, client: TrainctlClient, cluster: EmbeddedRay) -> None:
    before = loaded_pool(service, cluster)
    created = client.create_job(job("warm-cancel", gpus=2, steps=100_000))
    for event in client.watch(created.id):
        if event.WhichOneof("payload") == "step":
            break
    client.cancel_job(created.id)
    wait_for(lambda: client.get_job(created.id).status.state == pb.CANCELLED, "the job is CANCELLED", timeout=30)
    assert {rank["actor"] for rank in placement_of(service, created.id)} == before
    wait_for(lambda: all(warm_actors(cluster).get(name) == "DEAD" for name in before), "the pooled ranks are dead")
    wait_for(lambda: leftovers(cluster, created.id) == ([], []), "nothing of the job is left")


def test_a_bound_pooled_worker_exits_when_its_placement_group_is_removed(
    service: Service, cluster: EmbeddedRay
) -> None:
    loaded_pool(service, cluster)
    slot = RankAssignment(rank=0, node="node-0", gpu=0)
    warm = pool_of(service).take([slot], use_gpu=False)
    group = RankGroup.create("orphan", 1, [slot], use_gpu=False, ready_timeout=30, warm=warm)
    try:
        (location,) = group.locations(timeout=30)
        assert location.pooled and location.matches_plan
        remove_placement_group(group.pg)  # as a restarted supervisor removes its predecessor's groups
        wait_for(lambda: warm_actors(cluster).get(location.actor) == "DEAD", "the orphaned worker exits", timeout=30)
    finally:
        group.shutdown()


def test_a_worker_handed_over_for_another_slot_is_not_bound(service: Service, cluster: EmbeddedRay) -> None:
    loaded_pool(service, cluster, slots=[("node-1", 0)])
    warm = pool_of(service).take([RankAssignment(rank=0, node="node-1", gpu=0)], use_gpu=False)
    (handed,) = [name for name, state in warm_actors(cluster).items() if state == "ALIVE" and "node-1" in name]
    group = RankGroup.create("replanned", 1, [RankAssignment(rank=0, node="node-0", gpu=0)], use_gpu=False, ready_timeout=30, warm=warm)
    try:
        (location,) = group.locations(timeout=60)
        assert not location.pooled and location.matches_plan
        wait_for(lambda: warm_actors(cluster).get(handed) == "DEAD", "the unused pooled worker is killed", timeout=30)
    finally:
        group.shutdown()


def test_a_handed_out_worker_never_bound_is_reaped(service: Service, cluster: EmbeddedRay) -> None:
    pool = pool_of(service)
    loaded_pool(service, cluster, slots=[("node-0", 0)])
    (handed,) = [n for n, state in warm_actors(cluster).items() if state == "ALIVE" and parse_warm_name(n) == ("node-0", 0)]
    grace = pool.handed_out_grace
    pool.handed_out_grace = 1.0
    try:
        assert pool.take([RankAssignment(rank=0, node="node-0", gpu=0)], use_gpu=False)  # and nobody binds it
        wait_for(lambda: warm_actors(cluster).get(handed) == "DEAD", "the keeper kills the unbound worker", timeout=30)
    finally:
        pool.handed_out_grace = grace


def test_an_idle_worker_that_dies_is_replaced(service: Service, cluster: EmbeddedRay) -> None:
    pool = pool_of(service)
    interval, grace = pool.check_interval, pool.taken_grace
    pool.check_interval = pool.taken_grace = 1.0  # the previous tests' hand-outs need not hold node-1 for 30 s
    try:
        loaded_pool(service, cluster, slots=[("node-1", 0)])
        (idle,) = [n for n, s in warm_actors(cluster).items() if s == "ALIVE" and parse_warm_name(n) == ("node-1", 0)]
        ray.kill(ray.get_actor(idle, namespace="trainctl"), no_restart=True)
        wait_for(
            lambda: any(
                state == "ALIVE" and name != idle and parse_warm_name(name) == ("node-1", 0)
                for name, state in warm_actors(cluster).items()
            ),
            "a new worker loads on the dead one's slot", timeout=120,  # its actor imports torch on 2 busy cores
        )
    finally:
        pool.check_interval, pool.taken_grace = interval, grace
