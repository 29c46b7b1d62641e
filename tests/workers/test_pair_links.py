"""Per-pair GPU links inside a node (NVLink bridges and meshes, PCIe path classes): the map's rules,
discovery on `nvidia-smi topo -m` fixtures, the modelled all-reduce of GPU sets, and the solver's choice."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.presets import PRESETS
from trainctl.workers.placement import place
from trainctl.workers.placement.cost import (
    Collective,
    DimTraffic,
    Workload,
    build_traffic,
    evaluate,
    lower_bound,
)
from trainctl.workers.placement.fabric import FabricIndex
from trainctl.workers.placement.pair_links import Link, PairLinks
from trainctl.workers.topology.builders import (
    NVLINK_LINK_GBS,
    bridged_pcie_fleet,
    mixed_pcie_fleet,
    pcie_levels,
)
from trainctl.workers.topology.discovery import parse_topo_matrix
from trainctl.workers.topology.discovery_node import build_node
from trainctl.workers.topology.model import (
    Fabric,
    LinkLevel,
    Metadata,
    Node,
    NvlinkDomain,
    TopologyError,
    TopologyMap,
    TopologySpec,
    parse_topology,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
V100_CUBE_MESH = FIXTURES / "v100-sxm2-x8-cubemesh_vast-unattributed.topo.txt"
H100_NVL_BRIDGED = FIXTURES / "h100-nvl-x8-bridged_constructed.topo.txt"
A100_PCIE_BRIDGED = FIXTURES / "a100-pcie-x4-bridged_unattributed.topo.txt"
H200_NVSWITCH = FIXTURES / "h200-hgx-x8_distributedai.topo.txt"
ALL_REDUCE = DimTraffic("dp", [[0]], [Collective("all_reduce", 1e9, 1)])


def discovered(path: Path, x16_gbs: float) -> TopologyMap:
    """A one-node map of the node discovery builds from `path`, with PCIe of `x16_gbs` GB/s."""
    node = build_node("n0", parse_topo_matrix(path.read_text(), path.name))
    fabric = Fabric(
        nvlink=LinkLevel(bandwidth_gbytes_per_s=450.0, latency_us=2.0),
        nvlink_pair=LinkLevel(bandwidth_gbytes_per_s=NVLINK_LINK_GBS, latency_us=2.0),
        host=LinkLevel(bandwidth_gbytes_per_s=x16_gbs, latency_us=3.0),
        pcie=pcie_levels(x16_gbs),
    )
    domains = [NvlinkDomain(name=node.nvlink_domain, nodes=["n0"])] if node.nvlink_domain else []
    return TopologyMap(metadata=Metadata(name=path.stem), spec=TopologySpec(fabric=fabric, nvlink_domains=domains, nodes=[node]))


def all_reduce_seconds(index: FabricIndex, gpus: tuple[int, ...]) -> float:
    """Modelled time of a 1 GB all-reduce over GPUs `gpus` of node 0."""
    link = index.link([(0, g) for g in gpus])
    entry = DimTraffic("dp", [list(range(len(gpus)))], ALL_REDUCE.collectives)
    return entry.seconds(link.bandwidth, link.latency)


def assert_ordered(index: FabricIndex, best_to_worst: list[tuple[int, ...]]) -> None:
    times = [all_reduce_seconds(index, gpus) for gpus in best_to_worst]
    assert times == sorted(times) and len(set(times)) == len(times), list(zip(best_to_worst, times, strict=True))


def test_v100_cube_mesh_orders_sets_by_their_nvlinks() -> None:
    """DGX-1 hybrid cube-mesh (SOURCES.md): each GPU has 6 NVLinks, NV2 to two peers and NV1 to two,
    SYS to the other three; GPUs 0-3 and 4-7 are fully NVLinked quads, bridged by 0-4, 1-5, 2-6, 3-7."""
    topo = discovered(V100_CUBE_MESH, 12.0)
    node = topo.nodes[0]
    assert node.nvlink_domain is None, "not every pair has NVLink: no NVLink domain"
    assert len(node.nvlink_pairs) == 16 and {links for _, _, links in node.nvlink_pairs} == {1, 2}
    assert sorted(p for _, _, p in node.pcie_paths) == ["SYS"] * 12
    index = FabricIndex.build(topo)
    assert_ordered(index, [(0, 3), (0, 1), (0, 5)])  # NV2, NV1, SYS
    assert_ordered(index, [(0, 1, 2, 3), (0, 1, 4, 5), (0, 1, 2, 5)])  # 4 links per GPU, 3, a ring needing SYS
    assert index.link([(0, g) for g in range(8)]).level == "nvlink_pair", "NVLink alone closes a ring through all 8"
    assert index.link([(0, 0), (0, 1), (0, 2), (0, 5)]).level == "SYS"


def test_pcie_bridged_box_orders_sets_by_bridge_switch_and_socket() -> None:
    topo = discovered(H100_NVL_BRIDGED, 50.0)
    node = topo.nodes[0]
    assert node.nvlink_domain is None and [(a, b) for a, b, _ in node.nvlink_pairs] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [node.nic_of(g).name for g in node.gpus] == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3"]
    index = FabricIndex.build(topo)
    assert_ordered(index, [(0, 1), (0, 2), (0, 4)])  # NV12 bridge, NODE, SYS
    assert_ordered(index, [(0, 1, 2, 3), (0, 1, 4, 5)])  # one socket, across sockets
    real = FabricIndex.build(discovered(A100_PCIE_BRIDGED, 25.0))
    assert_ordered(real, [(0, 1), (1, 2)])
    assert real.link([(0, g) for g in range(4)]).level == "SYS"


def test_nvswitch_node_is_one_domain_and_every_set_of_a_size_is_equal() -> None:
    topo = discovered(H200_NVSWITCH, 50.0)
    assert topo.nodes[0].nvlink_domain == "nvl-n0" and topo.nodes[0].pcie_paths == []
    index = FabricIndex.build(topo)
    for size in (2, 4):
        times = {all_reduce_seconds(index, gpus) for gpus in itertools.combinations(range(8), size)}
        assert len(times) == 1, size
    assert all_reduce_seconds(index, (0, 1)) < all_reduce_seconds(FabricIndex.build(discovered(H100_NVL_BRIDGED, 50.0)), (0, 1))


def test_tp2_on_a_discovered_bridged_box_takes_a_free_bridge() -> None:
    topo = discovered(H100_NVL_BRIDGED, 50.0)
    for free in ({1, 2, 3, 4, 6}, {0, 2, 4, 6, 7}, set(range(8))):
        plan = place(RankGrid(tp=2), topo, {"n0": free}, model=PRESETS["tiny"])
        assert tuple(plan.gpus_by_node()["n0"]) in {(0, 1), (2, 3), (4, 5), (6, 7)} and plan.level_by_dim["tp"] == "nvlink_pair"
    plan = place(RankGrid(tp=2, dp_shard=2), topo, {"n0": set(range(8))}, model=PRESETS["tiny"])
    assert plan.level_by_dim == {"tp": "nvlink_pair", "dp": "NODE"}, "both pairs on one socket: the data-parallel ring avoids SYS"


def _brute_force_ring(table: PairLinks, gpus: tuple[int, ...]) -> float:
    """Best bottleneck over every ring through `gpus`, or the NVLink per-GPU sum when NVLink closes one."""
    first, rest = gpus[0], gpus[1:]
    rings = [(first, *order) for order in itertools.permutations(rest)]
    def edges(ring):
        return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    nv = [r for r in rings if all((min(a, b), max(a, b)) in table.nvlink for a, b in edges(r))]
    if nv:
        return min(sum(table.nvlink.get((min(v, u), max(v, u)), 0.0) for u in gpus if u != v) for v in gpus)
    return max(min(table.link(a, b).bandwidth for a, b in edges(r)) for r in rings)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6), st.sampled_from([6, 12]))
def test_ring_matches_brute_force_on_random_nodes(seed: int, size: int, node_gpus: int) -> None:
    """On 6-GPU nodes the bound is exact, on 12-GPU ones (more than EXACT_GPUS) the summed-NVLink rule."""
    rng = random.Random(seed)
    gpus = tuple(range(node_gpus))
    links = {}
    nvlink = {}
    for a, b in itertools.combinations(gpus, 2):
        if rng.random() < 0.4:
            nvlink[(a, b)] = rng.choice([1, 2, 4]) * 25e9
            links[(a, b)] = Link("nvlink_pair", nvlink[(a, b)], 2e-6)
        else:
            level = rng.choice(["PIX", "NODE", "SYS"])
            links[(a, b)] = Link(level, {"PIX": 50e9, "NODE": 35e9, "SYS": 20e9}[level], 3e-6)
    table = PairLinks(gpus, links, nvlink)
    chosen = tuple(sorted(rng.sample(gpus, size)))
    assert table.ring(chosen).bandwidth == pytest.approx(_brute_force_ring(table, chosen))
    bound_bw, bound_latency = table.bound(size)
    assert table.ring(chosen).bandwidth <= bound_bw and table.ring(chosen).latency >= bound_latency


def test_lower_bound_holds_exhaustively_on_a_mixed_pcie_map() -> None:
    """Every placement of small jobs on a bridged-pair node, a PCIe-only one whose GPUs 2-3 reach their
    NIC across the sockets (SYS) and one with an NVLink quad (4 GPUs each)."""
    data = mixed_pcie_fleet(3, su_nodes=1, name="m").model_dump(mode="json")
    for node in data["spec"]["nodes"]:  # keep GPUs 0-3 of each node: the exhaustive search stays small
        node["gpus"] = [0, 1, 2, 3]
        node["numa"] = {g: 0 if g < 2 else 1 for g in range(4)}
        node["nvlink_pairs"] = [p for p in node["nvlink_pairs"] if p[1] < 4]
        node["pcie_paths"] = [p for p in node["pcie_paths"] if p[1] < 4]
        node["nics"] = [n for n in node["nics"] if n["name"] in ("mlx5_0", "mlx5_1")]
        node["nic_paths"] = [p for p in node["nic_paths"] if p[0] < 4]
    far = data["spec"]["nodes"][1]
    far["nics"][1]["gpus"] = []
    far["nic_paths"] = [[g, nic, "SYS" if g >= 2 else path] for g, nic, path in far["nic_paths"]]
    topo = parse_topology(data)
    assert FabricIndex.build(topo).gpu_nic[(1, 2)] == (0.4 * 50e9, 3e-6)
    index = FabricIndex.build(topo)
    slots = [(n, g) for n in range(3) for g in range(4)]
    for grid in (RankGrid(tp=2, dp_shard=2), RankGrid(pp=2, tp=2), RankGrid(dp_shard=4)):
        traffic = build_traffic(grid, PRESETS["tiny"], Workload())
        bound = sum(lower_bound(traffic, index).values())
        best = min(evaluate(traffic, list(p), index).total_seconds for p in itertools.permutations(slots, grid.world_size))
        assert best >= bound * (1 - 1e-12), grid.describe()
        free = {n.name: set(n.gpus) for n in topo.nodes}
        assert place(grid, topo, free, model=PRESETS["tiny"]).comm_seconds <= best * 1.05, grid.describe()


def test_bridged_preset_bound_is_below_every_placement() -> None:
    topo = bridged_pcie_fleet(2, name="b")
    index = FabricIndex.build(topo)
    traffic = build_traffic(RankGrid(tp=2, dp_shard=4), PRESETS["tiny"], Workload())
    bound = lower_bound(traffic, index)
    rng = random.Random(0)
    slots = [(n, g) for n in range(2) for g in range(8)]
    for _ in range(200):
        rng.shuffle(slots)
        cost = evaluate(traffic, slots[:8], index)
        assert all(cost.seconds_by_dim[d] >= bound[d] * (1 - 1e-12) for d in bound)


def _node_map(node: dict, domain: bool, fabric: dict | None = None) -> dict:
    return {
        "apiVersion": "trainctl/v1", "kind": "TopologyMap", "metadata": {"name": "m"},
        "spec": {
            "fabric": fabric or {"nvlink": {"bandwidth_gbytes_per_s": 450}, "host": {"bandwidth_gbytes_per_s": 25},
                                 "nvlink_pair": {"bandwidth_gbytes_per_s": 25}},
            "nvlink_domains": [{"name": "d", "nodes": ["n0"]}] if domain else [],
            "nodes": [{"name": "n0", "gpus": [0, 1, 2, 3], **node}],
        },
    }


@pytest.mark.parametrize(("node", "domain", "fabric", "message"), [
    ({"nvlink_pairs": [[0, 1, 12], [2, 3, 12]]}, True, None,
     r"node 'n0': nvlink_pairs leaves GPU pairs \[\(0, 2\), \(0, 3\), \(1, 2\), \(1, 3\)\] without NVLink, but the node is in NVLink domain 'd'"),
    ({"pcie_paths": [[0, 2, "SYS"]]}, True, None, r"node 'n0': pcie_paths gives PCIe paths between GPUs of NVLink domain 'd'"),
    ({"nvlink_pairs": [[0, 1, 12]], "pcie_paths": [[0, 1, "PIX"]]}, False, None, r"GPU pairs \[\(0, 1\)\] are in both nvlink_pairs and pcie_paths"),
    ({"nvlink_pairs": [[0, 1, 12]]}, False, {"host": {"bandwidth_gbytes_per_s": 25}}, r"nvlink_pairs outside an NVLink domain need fabric.nvlink_pair"),
    ({"pcie_paths": [[0, 1, "SYS"]]}, False, {"nvlink_pair": {"bandwidth_gbytes_per_s": 25}},
     r"pcie_paths uses SYS but neither fabric.pcie.SYS nor fabric.host is given"),
    ({"pcie_paths": [[0, 1, "SYS"], [0, 1, "PIX"]]}, False, None, r"pcie_paths lists a GPU pair more than once"),
    ({"pcie_paths": [[1, 0, "PIX"]]}, False, None, r"pcie_paths entry \(1, 0, PIX\): need known GPUs a < b"),
    ({"pcie_paths": [[0, 1, "QPI"]]}, False, None, r"pcie_paths"),
])
def test_contradicting_or_unpriced_pair_links_are_refused_naming_the_field(node, domain, fabric, message) -> None:
    with pytest.raises(TopologyError, match=message):
        parse_topology(_node_map(node, domain, fabric))


def test_a_domain_node_may_list_all_its_pairs_and_pair_links_price_without_a_domain() -> None:
    full = [[a, b, 18] for a, b in itertools.combinations(range(4), 2)]
    assert parse_topology(_node_map({"nvlink_pairs": full}, True)).nodes[0].nvlink_pairs
    topo = parse_topology(_node_map({"nvlink_pairs": [[0, 1, 12]]}, False))
    index = FabricIndex.build(topo)
    assert index.link([(0, 0), (0, 1)]) == Link("nvlink_pair", 12 * 25e9, 1e-6)
    assert index.link([(0, 0), (0, 2)]).level == "host"
    assert Node(name="x", gpus=[0, 1], failed_gpus=[1]).missing_nvlink_pairs() == []


def test_tp2_prefers_a_free_bridge_on_another_node_over_a_fuller_node_without_one() -> None:
    topo = mixed_pcie_fleet(3, su_nodes=1, name="m")  # bridged pairs, PCIe only, NVLink quad + PCIe
    bridged, plain, quad = (n.name for n in topo.nodes)
    plan = place(RankGrid(tp=2), topo, {bridged: set(range(8)), plain: {0, 1}, quad: {0, 1, 4}}, model=PRESETS["tiny"])
    assert plan.gpus_by_node() == {bridged: [0, 1]} and plan.level_by_dim["tp"] == "nvlink_pair"


def test_a_ring_that_would_cross_sockets_goes_to_one_socket_of_two_nodes_when_that_is_faster() -> None:
    """On the bridged preset a socket-crossing (SYS, 20 GB/s) ring is slower than a GPU's share of its
    pair's NIC (25 GB/s): 8-way FSDP takes one socket on each of two nodes, rail-aligned."""
    topo = bridged_pcie_fleet(2, name="b")
    index = FabricIndex.build(topo)
    free = {n.name: set(range(8)) for n in topo.nodes}
    plan = place(RankGrid(dp_shard=8), topo, free, model=PRESETS["tiny"], index=index)
    assert plan.level_by_dim["dp"] == "leaf"
    assert all(len({topo.node(node).numa[g] for g in gpus}) == 1 for node, gpus in plan.gpus_by_node().items())
    traffic = build_traffic(RankGrid(dp_shard=8), PRESETS["tiny"], Workload())
    whole_node = evaluate(traffic, [(0, g) for g in range(8)], index)
    assert whole_node.level_by_dim["dp"] == "SYS" and plan.comm_seconds < whole_node.total_seconds


def test_a_cp_group_crossing_nodes_at_nic_speed_is_not_a_split_when_one_node_would_cross_sockets() -> None:
    """tp2 x cp4 on two bridged nodes: inside one node each CP group takes one GPU of every bridged pair
    and crosses the sockets (SYS); one socket of each of two nodes keeps the bridges and runs the CP
    rings over the NICs, faster, and the solver takes it without counting the CP groups as split."""
    topo = bridged_pcie_fleet(2, name="b")
    index = FabricIndex.build(topo)
    grid = RankGrid(tp=2, cp=4)
    plan = place(grid, topo, {n.name: set(range(8)) for n in topo.nodes}, model=PRESETS["tiny"], index=index)
    assert plan.split_groups == [] and plan.level_by_dim == {"tp": "nvlink_pair", "cp": "leaf", "dp": "leaf"}
    one_node = evaluate(build_traffic(grid, PRESETS["tiny"], Workload()), [(0, g) for g in range(8)], index)
    assert one_node.level_by_dim["cp"] == "SYS" and plan.comm_seconds < one_node.total_seconds
    assert index.unit_bandwidth(4, 2) == index.pair_tables[0].ring((0, 2, 4, 6)).bandwidth < index.unit_bandwidth(4, 1)

