"""The snapshot keeper's bookkeeping and the peer each node's copies go to (`trainctl.workers.snapshot_keepers`);
the keepers on Ray under node loss are in test_runtime.py."""

from __future__ import annotations

from trainctl.workers.snapshot_keepers import KEPT_PER_RANK, SnapshotKeeper, peer_nodes


def test_a_keeper_holds_the_newest_snapshots_of_each_rank_and_drops_those_after_a_restart_point():
    keeper = SnapshotKeeper("node-0")
    for step in range(1, 6):
        keeper.put(0, step, f"rank0-{step}".encode())
    keeper.put(1, 3, b"rank1-3")
    assert KEPT_PER_RANK == 2
    assert keeper.steps(0) == [4, 5] and keeper.steps(1) == [3] and keeper.steps(7) == []
    assert keeper.get(0, 5) == b"rank0-5" and keeper.get(0, 3) is None and keeper.get(1, 3) == b"rank1-3"
    keeper.discard_after(0, 4)
    assert keeper.steps(0) == [4] and keeper.steps(1) == [3]
    assert keeper.held_bytes() == len(b"rank0-4") + len(b"rank1-3")


def test_each_node_sends_its_second_copies_to_another_node_of_the_plan():
    assert peer_nodes(["b", "a", "c", "a"]) == {"a": "b", "b": "c", "c": "a"}
    assert peer_nodes(["x", "y"]) == {"x": "y", "y": "x"}
    assert peer_nodes(["solo"]) == {"solo": None}
