"""The rank grid: coordinates, groups, expert groups, errors, and agreement with the DeviceMesh."""

from __future__ import annotations

import pytest
from harness import tiny_job

from trainctl.parallelism.layouts.grid import DIMS, LayoutError, RankGrid


def test_coordinates_round_trip_and_tp_is_innermost():
    grid = RankGrid(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert grid.world_size == 32 and grid.dp == 4
    for rank in range(grid.world_size):
        coords = grid.coords(rank)
        assert grid.rank_of(**{d: coords[d] for d in DIMS}) == rank
    assert grid.group("tp", 6) == [6, 7]
    assert grid.group("cp", 5) == [5, 7]
    assert grid.group("pp", 3) == [3, 19]
    assert grid.coords(31) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 0, "ep_dp": 3}


@pytest.mark.parametrize("dims", ["pp", "tp", ("dp_replicate", "dp_shard"), ("dp_shard", "cp"), "ep", "ep_dp"])
def test_groups_partition_the_world(dims):
    grid = RankGrid(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=2)
    groups = grid.groups(dims)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(grid.world_size))
    assert len({len(g) for g in groups}) == 1
    for g in groups:
        for rank in g:
            assert grid.group(dims, rank) == g


def test_expert_groups_are_carved_from_dp_shard_times_cp():
    grid = RankGrid(dp_shard=2, cp=2, ep=2)
    assert grid.groups("ep") == [[0, 1], [2, 3]]
    assert grid.groups("ep_dp") == [[0, 2], [1, 3]]
    assert RankGrid(dp_shard=4, ep=4).groups("ep") == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"tp": 0}, "tp must be a positive integer"), ({"dp_shard": 3, "ep": 2}, "ep=2 must divide"), ({"pp": 1.5}, "pp must")],
)
def test_impossible_layouts_are_rejected(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        RankGrid(**kwargs)


def test_bad_queries_name_the_problem():
    grid = RankGrid(tp=2)
    with pytest.raises(LayoutError, match="rank 2 out of range"):
        grid.coords(2)
    with pytest.raises(LayoutError, match="unknown grid dimensions"):
        grid.groups("zz")
    with pytest.raises(LayoutError, match="tp coordinate 2 out of range"):
        grid.rank_of(tp=2)


def test_from_spec_reads_the_parallelism_block(corpus):
    body = tiny_job(corpus, pp=2, dp_shard=2, tp=2)
    grid = RankGrid.from_spec(body.parallelism)
    assert grid.shape == (2, 1, 2, 1, 2) and grid.describe() == "pp2 x dp_shard2 x tp2 (8 ranks)"


def mesh_groups(rank: int, world_size: int, shape: dict) -> dict[str, list[int]]:
    """Worker: the ranks of this rank's group along every mesh dimension and flattened view."""
    import torch.distributed as dist

    from trainctl.parallelism.layouts.mesh import FLATTENED, build_mesh

    pmesh = build_mesh(RankGrid(**shape), "cpu")
    return {name: dist.get_process_group_ranks(pmesh.group(name)) for name in (*DIMS, *FLATTENED)}


@pytest.mark.parametrize("shape", [{"pp": 2, "dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "cp": 2, "tp": 2}])
def test_device_mesh_groups_match_the_grid(pool, shape):
    from trainctl.parallelism.layouts.mesh import FLATTENED

    grid = RankGrid(**shape)
    per_rank = pool.run(mesh_groups, grid.world_size, shape)
    for rank, groups in enumerate(per_rank):
        for name in DIMS:
            assert groups[name] == grid.group(name, rank), (rank, name)
        for name, dims in FLATTENED.items():
            assert groups[name] == grid.group(dims, rank), (rank, name)
