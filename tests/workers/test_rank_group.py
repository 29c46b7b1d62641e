"""RankGroup on the embedded cluster: ranks land exactly where the plan says, even with part of the
pool taken and a plan whose rank order differs from node order; taken slots are never double-booked."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.state import list_actors, list_placement_groups

from trainctl.workers.placement import RankAssignment
from trainctl.workers.rank_group import (
    PlacementUnavailable,
    RankGroup,
    check_slots,
    group_name,
    owned_by,
    rank_name,
)
from trainctl.workers.rank_worker import RankWorker
from trainctl.workers.resources import NODE_LABEL, gpu_slot, slot_index, slot_resources, slots_of


@pytest.fixture
def blocker(embedded_ray):
    """Another tenant holds node-0 GPUs 0 and 1 and node-1 GPU 2."""
    taken = [("node-0", 0), ("node-0", 1), ("node-1", 2)]
    pg = placement_group(
        [{gpu_slot(gpu): 1} for _, gpu in taken],
        bundle_label_selector=[{NODE_LABEL: node} for node, _ in taken],
        name="someone-else",
    )
    ray.get(pg.ready(), timeout=30)
    yield taken
    remove_placement_group(pg)
    deadline = time.monotonic() + 30  # the next test sees the pool whole again
    while any(gpu not in _free_slots()[node] for node, gpu in taken) and time.monotonic() < deadline:
        time.sleep(0.1)


def _free_slots() -> dict[str, list[int]]:
    available = ray._private.state.available_resources_per_node()
    return {
        info["Labels"][NODE_LABEL]: slots_of(available.get(info["NodeID"], {}))
        for info in ray.nodes()
        if info["Alive"] and NODE_LABEL in info["Labels"]
    }


def _job_leftovers(job_id: str) -> tuple[list, list]:
    actors = [a for a in list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")]) if owned_by(a.name or "", job_id)]
    groups = [
        g for g in list_placement_groups(address=ray.get_runtime_context().gcs_address, filters=[("state", "!=", "REMOVED")]) if owned_by(g.name or "", job_id)
    ]
    return actors, groups


def test_every_rank_runs_on_its_planned_node_and_gpu(embedded_ray, blocker, monkeypatch):
    # Rank order deliberately differs from node order; the taken GPUs are avoided by the plan.
    plan = [RankAssignment(rank=r, node=n, gpu=g) for r, (n, g) in enumerate(
        [("node-2", 3), ("node-0", 2), ("node-1", 0), ("node-2", 1)])]
    remote, classes = ray.remote, []
    monkeypatch.setattr(ray, "remote", lambda *args, **kwargs: classes.append(args) or remote(*args, **kwargs))
    group = RankGroup.create("pin-test", 0, plan, use_gpu=False, ready_timeout=30)
    # Ray exports a remote class at its first actor (~35 ms of CPU): one class for the group, not one per
    # rank (a 4,096-rank group spent over two minutes of its supervisor's CPU on it).
    assert [args for args in classes if args and args[0] is RankWorker] == [(RankWorker,)]
    try:
        locations = group.locations(timeout=60)
        assert [(loc.rank, loc.node, loc.gpu) for loc in locations] == [(s.rank, s.node, s.gpu) for s in plan]
        assert all(loc.cuda_visible_devices == "" for loc in locations)
        assert len({loc.pid for loc in locations}) == 4
        free = _free_slots()
        for slot in plan:
            assert slot.gpu not in free[slot.node], f"{slot.node} GPU {slot.gpu} should be reserved"
        for node, gpu in blocker:
            assert gpu not in free[node]
        assert free["node-0"] == [3] and free["node-1"] == [1, 3] and free["node-2"] == [0, 2]
    finally:
        group.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_job_leftovers("pin-test")):
        time.sleep(0.2)
    assert _job_leftovers("pin-test") == ([], [])


def test_a_taken_gpu_is_not_double_booked(embedded_ray, blocker):
    plan = [RankAssignment(rank=0, node="node-0", gpu=1), RankAssignment(rank=1, node="node-2", gpu=2)]  # node-0 GPU 1 is taken
    with pytest.raises(PlacementUnavailable, match=r"rank 0 -> node-0 GPU 1.*not within 2s"):
        RankGroup.create("taken-test", 0, plan, use_gpu=False, ready_timeout=2)
    time.sleep(0.5)
    assert _job_leftovers("taken-test") == ([], [])


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([], "no ranks"),
        ([RankAssignment(rank=0, node="a", gpu=0), RankAssignment(rank=2, node="a", gpu=1)], r"ranks 0..1 exactly once"),
        ([RankAssignment(rank=0, node="a", gpu=0), RankAssignment(rank=0, node="a", gpu=1)], r"ranks 0..1 exactly once"),
        ([RankAssignment(rank=0, node="a", gpu=0), RankAssignment(rank=1, node="a", gpu=0)], "ranks 0 and 1 are both placed on a GPU 0"),
        ([RankAssignment.model_construct(rank=0, node="a", gpu=-1)], "rank 0: GPU index must be >= 0"),
    ],
)
def test_bad_plans_are_rejected(slots, message):
    with pytest.raises(ValueError, match=message):
        check_slots(slots)


def test_names_belong_to_exactly_one_job():
    assert owned_by(group_name("abc", 0), "abc")
    assert owned_by(rank_name("abc", 2, 7), "abc")
    assert not owned_by(group_name("abc-g1", 0), "abc")  # a job whose id extends another's
    assert owned_by(group_name("abc-g1", 0), "abc-g1")
    assert not owned_by("trainctl-job-abc", "abc")
    assert slot_index(gpu_slot(12)) == 12 and slot_index("GPU") is None
    assert slot_resources(2) == {"trainctl_gpu_0": 1.0, "trainctl_gpu_1": 1.0}
