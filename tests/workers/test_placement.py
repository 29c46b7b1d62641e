"""The placement solver: contract, never splitting TP when it need not, rails, leaf sets, determinism."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.job import TrainingJob
from trainctl.spec.presets import PRESETS
from trainctl.workers.placement import PlacementError, capacity, place, place_job
from trainctl.workers.placement.fabric import FabricIndex
from trainctl.workers.topology import simulated_topology
from trainctl.workers.topology.builders import mixed_pcie_fleet, pcie_servers, rail_optimized_fleet
from trainctl.workers.topology.model import parse_topology

TINY = PRESETS["tiny"]


def all_free(topology) -> dict[str, set[int]]:
    return {n.name: set(n.gpus) for n in topology.nodes}


def test_contract_shape_and_table() -> None:
    topo = simulated_topology(3, 4)
    plan = place(RankGrid(tp=2, dp_shard=2, pp=2), topo, all_free(topo), model=TINY)
    assert plan is not None
    assert [a.rank for a in plan.assignments] == list(range(8))
    assert len({(a.node, a.gpu) for a in plan.assignments}) == 8
    assert set(plan.comm_seconds_by_dim) == {"tp", "pp", "dp"} and plan.comm_seconds > 0
    table = plan.to_table()
    assert "placement of pp2 x dp_shard2 x tp2 (8 ranks)" in table and "split groups: none" in table
    assert all(f"{a.rank:>6}  {a.node:<24} {a.gpu}" in table for a in plan.assignments)
    assert sum(len(g) for g in plan.gpus_by_node().values()) == 8
    assert capacity(topo) == 12


def test_none_when_the_free_gpus_cannot_hold_the_job() -> None:
    topo = simulated_topology(2, 4)
    assert place(RankGrid(dp_shard=8), topo, {"node-0": {0, 1, 2, 3}, "node-1": {0, 1, 2}}) is None


def test_bad_free_maps_are_named() -> None:
    topo = simulated_topology(2, 4)
    with pytest.raises(PlacementError, match="node 'node-9'"):
        place(RankGrid(), topo, {"node-9": {0}})
    with pytest.raises(PlacementError, match=r"node 'node-1': free GPUs \[7\] do not exist"):
        place(RankGrid(), topo, {"node-1": {7}})


def test_unhealthy_nodes_and_failed_gpus_get_no_ranks() -> None:
    data = simulated_topology(3, 4).model_dump(mode="json")
    data["spec"]["nodes"][0]["health"] = "unhealthy"
    data["spec"]["nodes"][1]["failed_gpus"] = [1]
    topo = parse_topology(data)
    assert capacity(topo) == 7
    plan = place(RankGrid(dp_shard=7), topo, all_free(topo), model=TINY)
    assert plan is not None
    used = {(a.node, a.gpu) for a in plan.assignments}
    assert not any(node == "node-0" for node, _ in used) and ("node-1", 1) not in used
    assert place(RankGrid(dp_shard=8), topo, all_free(topo)) is None


def test_tp_is_not_split_when_whole_nodes_exist_elsewhere() -> None:
    topo = simulated_topology(4, 4)
    free = {"node-0": {0, 1, 2}, "node-1": {0, 1, 2, 3}, "node-2": {1, 2, 3}, "node-3": {0, 1, 2, 3}}
    plan = place(RankGrid(tp=4, dp_shard=2), topo, free, model=TINY)
    assert plan.split_groups == []
    assert plan.gpus_by_node() == {"node-1": [0, 1, 2, 3], "node-3": [0, 1, 2, 3]}


def test_split_is_reported_when_unavoidable() -> None:
    topo = simulated_topology(3, 4)
    free = {"node-0": {1, 2, 3}, "node-1": {0, 1, 2, 3}, "node-2": {0}}
    plan = place(RankGrid(tp=4, dp_shard=2), topo, free, model=TINY)
    assert [g.dim for g in plan.split_groups] == ["tp"], "one TP group fits whole on node-1; only the other splits"
    [split] = plan.split_groups
    assert sorted(split.nodes) == ["node-0", "node-2"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(0, 7)), min_size=4, max_size=4), st.sampled_from([2, 4, 8]), st.integers(1, 4))
def test_never_splits_tp_if_an_unsplit_placement_exists(free_sets, tp, dp) -> None:
    topo = simulated_topology(4, 8)
    free = {f"node-{i}": s for i, s in enumerate(free_sets)}
    grid = RankGrid(tp=tp, dp_shard=dp)
    plan = place(grid, topo, free, model=TINY)
    if sum(len(s) for s in free_sets) < grid.world_size:
        assert plan is None
        return
    unsplit_exists = sum(len(s) // tp for s in free_sets) >= dp
    assert plan is not None
    assert bool(plan.split_groups) == (not unsplit_exists)
    assert all(a.gpu in free[a.node] for a in plan.assignments)
    assert len({(a.node, a.gpu) for a in plan.assignments}) == grid.world_size


def test_ep_and_cp_groups_stay_in_a_domain_when_they_can() -> None:
    topo = simulated_topology(4, 8)
    free = {"node-0": {0, 1, 2, 3, 4, 5}, "node-1": set(range(8)), "node-2": set(range(8)), "node-3": {0, 1}}
    moe = PRESETS["debug-moe"]
    plan = place(RankGrid(tp=2, ep=4, dp_shard=4), topo, free, model=moe)
    assert plan.split_groups == [], "EP blocks of tp x ep = 8 ranks go to whole nodes"
    plan = place(RankGrid(tp=2, cp=4, dp_shard=2), topo, free, model=TINY)
    assert plan.split_groups == []


def rail_su(nodes: int = 8, oversubscription: float = 1.0):
    return rail_optimized_fleet(nodes, gpus_per_node=8, su_nodes=4, sus_per_pod=2, oversubscription=oversubscription, name="t")


def test_dp_peers_are_rail_aligned_when_possible() -> None:
    topo = rail_su()
    names = [n.name for n in topo.nodes]
    free = {names[0]: {6, 7}, names[1]: {0, 1}, names[2]: {6, 7}}
    plan = place(RankGrid(tp=2, dp_shard=2), topo, free, model=TINY)
    assert plan.split_groups == []
    gpus = {a.rank: a.gpu for a in plan.assignments}
    assert gpus[0] == gpus[2] and gpus[1] == gpus[3], "DP peers on the same local GPU, i.e. the same rail"
    assert plan.level_by_dim["dp"] == "leaf"


def test_dp_groups_under_one_leaf_set_and_pp_across() -> None:
    topo = rail_su()
    index = FabricIndex.build(topo)
    plan = place(RankGrid(tp=8, pp=2, dp_shard=4), topo, all_free(topo), model=PRESETS["llama3-8b"], index=index)
    leafset = {a.rank: index.node_leafset[index.node_id[a.node]] for a in plan.assignments}
    stage0 = {leafset[r] for r in range(32)}
    stage1 = {leafset[r] for r in range(32, 64)}
    assert len(stage0) == 1 and len(stage1) == 1 and stage0 != stage1
    assert plan.level_by_dim == {"tp": "nvlink", "pp": "spine", "dp": "leaf"}


def test_small_jobs_take_a_whole_free_node_over_scattered_gpus() -> None:
    topo = rail_su()
    names = [n.name for n in topo.nodes]
    free = {names[0]: {0, 1, 2}, names[1]: {3, 4, 5}, names[2]: {6, 7}, names[5]: set(range(8))}
    plan = place(RankGrid(dp_shard=8), topo, free, model=TINY)
    assert plan.gpus_by_node() == {names[5]: list(range(8))}


def test_deterministic_and_independent_of_dict_order() -> None:
    topo = rail_su()
    rng = random.Random(3)
    free = {n.name: set(rng.sample(range(8), rng.randint(0, 8))) for n in topo.nodes}
    grid = RankGrid(tp=2, dp_shard=6)
    first = place(grid, topo, free, model=TINY)
    again = place(grid, topo, dict(reversed(list(free.items()))), model=TINY)
    assert first is not None and first.assignments == again.assignments


def test_pcie_servers_keep_tp_inside_a_server() -> None:
    topo = pcie_servers(servers=3, gpus_per_node=8)
    free = {"pcie-l40s-0": {0, 1}, "pcie-l40s-1": set(range(8)), "pcie-l40s-2": {0, 1, 2, 3}}
    plan = place(RankGrid(tp=4, dp_shard=3), topo, free, model=TINY)
    assert plan.split_groups == [] and plan.level_by_dim["tp"] == "host"


def test_job_spec_sets_the_workload() -> None:
    topo = simulated_topology(2, 4)
    spec = {
        "apiVersion": "trainctl/v1", "kind": "TrainingJob", "metadata": {"name": "j"},
        "spec": {
            "model": {"preset": "tiny"}, "data": {"seq_len": 64},
            "parallelism": {"tp": 2, "dp_shard": 4}, "training": {"global_batch_size": 8},
            "resources": {"gpus": 8},
        },
    }
    job = TrainingJob.model_validate(spec)
    short = place_job(ResolvedJob.resolve(job.spec), topo, all_free(topo))
    spec["spec"]["data"]["seq_len"] = 128
    longer = place_job(ResolvedJob.resolve(TrainingJob.model_validate(spec).spec), topo, all_free(topo))
    assert longer.comm_bytes_by_dim["tp"] == pytest.approx(2 * short.comm_bytes_by_dim["tp"])
    assert longer.comm_bytes_by_dim["dp"] == pytest.approx(short.comm_bytes_by_dim["dp"])


def test_nccl_hints_from_the_map() -> None:
    from trainctl.workers.topology.builders import example_maps
    from trainctl.workers.topology.nccl import nccl_env

    maps = example_maps()
    su = maps["dgx-h100-superpod-su.yaml"]
    env = nccl_env(su, su.nodes[3].name)
    assert env == {"NCCL_IB_HCA": "=" + ",".join(f"mlx5_{i}:1" for i in range(8)), "NCCL_CROSS_NIC": "0"}
    nvl = maps["gb200-nvl72-2racks.yaml"]
    assert nccl_env(nvl, nvl.nodes[0].name)["NCCL_MNNVL_ENABLE"] == "1"
    pcie = maps["pcie-servers.yaml"]
    assert nccl_env(pcie, "pcie-l40s-1") == {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1"}
    with pytest.raises(KeyError, match="node 'ghost' is not in topology map"):
        nccl_env(pcie, "ghost")


def test_topology_and_placement_import_without_torch_or_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trainctl.workers.placement, trainctl.workers.topology.discovery_node, "
        "trainctl.workers.topology.merge, trainctl.workers.topology.nccl, trainctl.cli.topology_cmd; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_nvlink_partitions_bound_the_nvlink_level() -> None:
    from trainctl.workers.topology.builders import nvl72_fleet

    data = nvl72_fleet(1, racks_per_su=1, name="p").model_dump(mode="json")
    trays = data["spec"]["nvlink_domains"][0]["nodes"]
    data["spec"]["nvlink_domains"][0]["partitions"] = [{"name": "a", "nodes": trays[:9]}, {"name": "b", "nodes": trays[9:]}]
    topo = parse_topology(data)
    index = FabricIndex.build(topo)
    assert index.level([(0, 0), (8, 3)]) == "nvlink" and index.level([(0, 0), (9, 0)]) == "leaf"
    free = {trays[8]: {0, 1, 2, 3}, trays[9]: {0, 1, 2, 3}, trays[10]: {0, 1, 2, 3}}
    plan = place(RankGrid(tp=8), topo, free, model=TINY)
    assert plan.split_groups == [] and plan.gpus_by_node() == {trays[9]: [0, 1, 2, 3], trays[10]: [0, 1, 2, 3]}


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([
        dict(pp=2, dp_replicate=2, dp_shard=2, tp=2),
        dict(dp_shard=4, cp=2, tp=2),
        dict(dp_shard=4, ep=4, tp=2),
        dict(pp=4, dp_shard=3),
        dict(dp_replicate=3, tp=4),
        dict(pp=2, dp_shard=2, cp=2, ep=2, tp=2),
    ]),
    st.sampled_from(["rail", "mixed-pcie"]),
)
def test_any_layout_on_any_free_set_is_a_valid_plan(seed: int, layout: dict, fabric: str) -> None:
    """On an HGX-like rail fabric, and on PCIe nodes with per-pair links (bridged pairs, none, an NVLink quad)."""
    topo = rail_su(oversubscription=2.0) if fabric == "rail" else mixed_pcie_fleet(6, su_nodes=2, oversubscription=2.0, name="m")
    rng = random.Random(seed)
    free = {n.name: set(rng.sample(range(8), rng.randint(0, 8))) for n in topo.nodes}
    grid = RankGrid(**layout)
    plan = place(grid, topo, free, model=PRESETS["debug-moe"] if grid.ep > 1 else TINY)
    if sum(map(len, free.values())) < grid.world_size:
        assert plan is None
        return
    assert [a.rank for a in plan.assignments] == list(range(grid.world_size))
    assert all(a.gpu in free[a.node] for a in plan.assignments)
    assert len({(a.node, a.gpu) for a in plan.assignments}) == grid.world_size
    for dim, seconds in plan.comm_seconds_by_dim.items():
        assert seconds >= plan.lower_bound_seconds_by_dim[dim] * (1 - 1e-12), dim
