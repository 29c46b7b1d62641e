"""GPU-NIC affinity: the map's `nic_paths`, discovery from the NIC columns of `nvidia-smi topo -m`, the
cost of a GPU's inter-node traffic by its PCIe path to its NIC, the lower bound, and the solver's choice."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.presets import PRESETS
from trainctl.workers.placement import place
from trainctl.workers.placement.cost import Workload, build_traffic, evaluate, lower_bound
from trainctl.workers.placement.fabric import FabricIndex
from trainctl.workers.topology.builders import PCIE_SCALE, mixed_pcie_fleet, nic_levels, rail_optimized_fleet
from trainctl.workers.topology.discovery import DiscoveryError, parse_topo_matrix
from trainctl.workers.topology.discovery_node import build_node
from trainctl.workers.topology.merge import SwitchTree, merge
from trainctl.workers.topology.model import (
    Fabric,
    LinkLevel,
    Metadata,
    Nic,
    Node,
    Switch,
    TopologyError,
    TopologyMap,
    TopologySpec,
    parse_topology,
)
from trainctl.workers.topology.nccl import nccl_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
L40S = FIXTURES / "l40s-x4_miss-alignment-106.topo.txt"
DGX_A100 = FIXTURES / "dgx-a100-mlx5cols_gengwg-cheatsheets.topo.txt"
H100_NVL_BRIDGED = FIXTURES / "h100-nvl-x8-bridged_constructed.topo.txt"
V100_CUBE_MESH = FIXTURES / "v100-sxm2-x8-cubemesh_vast-unattributed.topo.txt"
X16_GBS = 50.0
FABRIC = Fabric(
    host=LinkLevel(bandwidth_gbytes_per_s=X16_GBS, latency_us=3.0),
    leaf=LinkLevel(bandwidth_gbytes_per_s=25.0, latency_us=4.0),
    nic=nic_levels(X16_GBS),
)


def matrix(path: Path):
    return parse_topo_matrix(path.read_text(), path.name)


def socket0_nics_map(nodes: int = 2) -> TopologyMap:
    """Nodes of 8 GPUs (GPUs 0-3 on socket 0, 4-7 on socket 1) whose two NICs both sit on socket 0:
    GPUs 0-3 at PIX to theirs (0-1 on mlx5_0, 2-3 on mlx5_1), GPUs 4-7 across the sockets (SYS)."""
    out = []
    for i in range(nodes):
        nics = [Nic(name=f"mlx5_{k}", leaf="tor", gpus=[2 * k, 2 * k + 1]) for k in range(2)]
        paths = [(g, f"mlx5_{g % 4 // 2}", "PIX" if g < 4 else "SYS") for g in range(8)]
        out.append(Node(name=f"n{i}", gpus=list(range(8)), numa={g: g // 4 for g in range(8)}, nics=nics, nic_paths=paths))
    spec = TopologySpec(fabric=FABRIC, switches=[Switch(name="tor", tier="leaf")], nodes=out)
    return TopologyMap(metadata=Metadata(name="socket0-nics"), spec=spec)


# ---- the map ---------------------------------------------------------------------------------------
def _map_with(node: dict) -> dict:
    return {
        "apiVersion": "trainctl/v1", "kind": "TopologyMap", "metadata": {"name": "m"},
        "spec": {"fabric": {"host": {"bandwidth_gbytes_per_s": 25}}, "nodes": [{
            "name": "n0", "gpus": [0, 1, 2, 3],
            "nics": [{"name": "mlx5_0", "gpus": [0, 1]}, {"name": "mlx5_1"}],
            **node,
        }]},
    }


@pytest.mark.parametrize(("paths", "message"), [
    ([[0, "mlx5_9", "PIX"]], r"node 'n0': nic_paths entry \(0, 'mlx5_9', PIX\): the node has no NIC 'mlx5_9'"),
    ([[7, "mlx5_0", "PIX"]], r"nic_paths entry \(7, 'mlx5_0', PIX\): the node has no GPU 7"),
    ([[2, "mlx5_1", "SYS"], [2, "mlx5_1", "NODE"]], r"nic_paths entry \(2, 'mlx5_1', NODE\): GPU 2 is listed more than once"),
    ([[0, "mlx5_0", "SYS"]], r"nic_paths entry \(0, 'mlx5_0', SYS\): NICs \['mlx5_0'\] list GPU 0 among their nearest GPUs"),
    ([[1, "mlx5_1", "NODE"]], r"NICs \['mlx5_0'\] list GPU 1 among their nearest GPUs \(nics\[\]\.gpus: PIX or PXB\)"),
    ([[2, "mlx5_1", "PIX"]], r"nic_paths entry \(2, 'mlx5_1', PIX\): PIX makes GPU 2 near NIC 'mlx5_1', but that NIC's gpus do not list it"),
    ([[2, "mlx5_1", "QPI"]], r"spec\.nodes\[0\]\.nic_paths\[0\]\[2\]: Input should be 'PIX', 'PXB', 'PHB', 'NODE' or 'SYS'"),
])
def test_contradictory_or_unknown_nic_paths_are_refused_naming_the_field(paths, message) -> None:
    with pytest.raises(TopologyError, match=message):
        parse_topology(_map_with({"nic_paths": paths}))


def test_maps_without_affinities_keep_their_meaning_and_price() -> None:
    """A NIC listed with its near GPUs still carries them (at PXB, the farthest `gpus` admits); a map that
    prices no NIC path (every HGX / NVL72 fleet) costs exactly what it did."""
    topo = parse_topology(_map_with({}))
    node = topo.nodes[0]
    assert node.nic_path(1) == (node.nics[0], "PXB") and node.nic_of(2) is None
    listed = parse_topology(_map_with({"nic_paths": [[0, "mlx5_0", "PIX"], [2, "mlx5_1", "SYS"]]})).nodes[0]
    assert listed.nic_path(0)[1] == "PIX" and listed.nic_of(2).name == "mlx5_1" and listed.nic_path(1)[1] == "PXB"
    hgx = FabricIndex.build(rail_optimized_fleet(2, su_nodes=2, name="h"))
    assert hgx.gpu_nic == {} and hgx.link([(0, 0), (1, 0)]).bandwidth == hgx.level_bw["leaf"]


def test_a_down_nic_falls_back_to_another_near_nic() -> None:
    data = _map_with({"nic_paths": [[0, "mlx5_0", "PIX"]]})
    data["spec"]["nodes"][0]["nics"] = [
        {"name": "mlx5_0", "gpus": [0, 1], "state": "Down"}, {"name": "mlx5_1", "gpus": [0, 1]}
    ]
    node = parse_topology(data).nodes[0]
    assert node.nic_path(0) == (node.nics[1], "PXB")


# ---- discovery -------------------------------------------------------------------------------------
def test_discovery_gives_every_gpu_its_nic_and_path_class() -> None:
    # L40S box (SOURCES.md): both NICs on socket 1, NODE to GPUs 2-3, SYS to GPUs 0-1; no NIC is near any GPU
    l40s = build_node("n0", matrix(L40S))
    assert l40s.nic_paths == [(0, "mlx5_0", "SYS"), (1, "mlx5_1", "SYS"), (2, "mlx5_0", "NODE"), (3, "mlx5_1", "NODE")]
    assert [(nic.gpus, nic.rail) for nic in l40s.nics] == [([], 0), ([], 1)], "no near GPUs; rails: the NICs GPUs use"
    assert nccl_env(parse_topology(_one_node_map(l40s)), "n0")["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    # DGX A100: two GPUs share two NICs behind one switch (PXB) and take one each; storage NICs unused
    a100 = build_node("n0", matrix(DGX_A100))
    assert [(nic, path) for _, nic, path in a100.nic_paths] == [
        (f"mlx5_{k}", "PXB") for k in (0, 1, 2, 3, 6, 7, 8, 9)
    ]
    assert [a100.nic_of(g).name for g in a100.gpus] == [f"mlx5_{k}" for k in (0, 1, 2, 3, 6, 7, 8, 9)]
    bridged = build_node("n0", matrix(H100_NVL_BRIDGED))
    assert bridged.nic_paths == [(g, f"mlx5_{g // 2}", "PIX") for g in range(8)], "the management NIC (NODE) is never best"
    cube = build_node("n0", matrix(V100_CUBE_MESH))
    assert [path for _, _, path in cube.nic_paths] == ["NODE"] * 4 + ["SYS"] * 4
    assert build_node("n0", matrix(FIXTURES / "a100-pcie-x4-bridged_unattributed.topo.txt")).nic_paths == []


def _one_node_map(node: Node) -> dict:
    return {"apiVersion": "trainctl/v1", "kind": "TopologyMap", "metadata": {"name": "m"},
            "spec": {"fabric": FABRIC.model_dump(mode="json"), "nodes": [node.model_dump(mode="json")]}}


def test_a_gpu_nic_cell_that_is_not_a_pcie_path_is_refused_naming_it() -> None:
    text = L40S.read_text().replace("GPU0     X      NODE    SYS     SYS     SYS ", "GPU0     X      NODE    SYS     SYS     NV4 ", 1)
    text = text.replace("NIC0    SYS ", "NIC0    NV4 ", 1)
    with pytest.raises(DiscoveryError, match=r"GPU0-mlx5_0 is NV4, which is not a PCIe path between a GPU and a NIC"):
        build_node("n0", parse_topo_matrix(text, "l40s"))


# ---- cost model ------------------------------------------------------------------------------------
def test_inter_node_traffic_is_priced_by_each_gpus_nic_path() -> None:
    """Across two L40S boxes as discovered and merged: GPUs at NODE to their NIC get the NIC's rate with more
    latency than PIX would, GPUs across the sockets (SYS) less bandwidth and more latency still."""
    tree = SwitchTree(
        metadata=Metadata(name="lab"), fabric=FABRIC, switches=[Switch(name="tor", tier="leaf")],
        cabling=[{"nodes": ["a", "b"], "leaf": "tor"}],
    )
    index = FabricIndex.build(merge([build_node(name, matrix(L40S)) for name in "ab"], tree))
    leaf_bw, leaf_latency = index.level_bw["leaf"], index.level_latency["leaf"]
    node_path = index.link([(0, 2), (1, 2)])
    sys_path = index.link([(0, 0), (1, 0)])
    assert node_path.bandwidth == leaf_bw and node_path.latency == pytest.approx(leaf_latency + 1.5e-6)
    assert sys_path.bandwidth == PCIE_SCALE["SYS"][0] * X16_GBS * 1e9 < leaf_bw
    assert sys_path.latency == pytest.approx(leaf_latency + 3e-6)
    assert index.link([(0, 2), (1, 2), (0, 0)]) == sys_path, "a group gets its worst member's NIC path"
    assert index.link([(0, 0), (0, 2)]).level == "SYS", "inside one node no NIC is crossed"
    assert index.nic_best == (float(X16_GBS * 1e9 * PCIE_SCALE["NODE"][0]), 1.5e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]))
def test_random_placements_never_beat_the_bound_with_nic_paths(seed: int, shape: tuple[int, int, int]) -> None:
    pp, dp, tp = shape
    topo = socket0_nics_map(3)
    index = FabricIndex.build(topo)
    grid = RankGrid(pp=pp, dp_shard=dp, tp=tp)
    traffic = build_traffic(grid, PRESETS["tiny"], Workload())
    slots = [(n, g) for n in range(3) for g in range(8)]
    random.Random(seed).shuffle(slots)
    cost = evaluate(traffic, slots[: grid.world_size], index)
    bound = lower_bound(traffic, index)
    assert all(cost.seconds_by_dim[d] >= bound[d] * (1 - 1e-12) for d in cost.seconds_by_dim)


# ---- solver ----------------------------------------------------------------------------------------
def test_a_two_node_dp_job_takes_the_gpus_near_their_nics() -> None:
    """Six free GPUs per node, four at PIX to a NIC and two at SYS: 8-way FSDP must cross nodes and takes
    the four PIX-affine GPUs of each, not six of one node and two of the other."""
    topo = socket0_nics_map()
    index = FabricIndex.build(topo)
    free = {"n0": {0, 1, 2, 3, 4, 5}, "n1": {0, 1, 2, 3, 4, 5}}
    plan = place(RankGrid(dp_shard=8), topo, free, model=PRESETS["tiny"], index=index)
    assert plan.gpus_by_node() == {"n0": [0, 1, 2, 3], "n1": [0, 1, 2, 3]}
    traffic = build_traffic(RankGrid(dp_shard=8), PRESETS["tiny"], Workload())
    packed = evaluate(traffic, [(0, g) for g in range(6)] + [(1, 0), (1, 1)], index)
    assert plan.comm_seconds < packed.total_seconds and packed.level_by_dim["dp"] == "leaf"


def test_the_mixed_fleet_prices_its_socket0_nic_kind() -> None:
    """The mixed PCIe fleet's PCIe-only kind has its NICs on socket 0: its GPUs 4-7 cross the sockets."""
    topo = mixed_pcie_fleet(6, su_nodes=2, name="m")
    index = FabricIndex.build(topo)
    far = topo.nodes[2]
    assert [path for _, _, path in far.nic_paths] == ["PIX"] * 4 + ["SYS"] * 4 and far.nics[2].gpus == []
    near, across = index.link([(2, 0), (3, 0)]), index.link([(2, 4), (3, 4)])
    assert across.bandwidth < near.bandwidth == index.level_bw["leaf"] and near.latency < across.latency
    assert near == index.link([(0, 4), (1, 4)]), "every GPU of a bridged node is at PIX to its NIC"
    assert nccl_env(topo, far.name)["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1", "far NICs still carry traffic"
    free = {n.name: set(range(8)) for n in topo.nodes[2:4]}
    plan = place(RankGrid(dp_shard=4, tp=2), topo, free, model=PRESETS["tiny"], index=index)
    assert plan.gpus_by_node() == {far.name: [0, 1, 2, 3], topo.nodes[3].name: [0, 1, 2, 3]}


def test_a_job_spanning_nodes_goes_where_its_gpus_are_nearest_their_nics() -> None:
    """Two scalable units hold a tp8 x dp2 job equally well inside their nodes (every 8-GPU ring has a
    SYS hop); the one whose GPUs all reach their NICs at PIX wins over the first, whose GPUs 4-7 cross
    the sockets to theirs."""
    topo = mixed_pcie_fleet(6, su_nodes=2, name="m")  # units: bridged, PCIe-only with socket-0 NICs, NVLink quad
    free = {n.name: set(range(8)) for n in topo.nodes[2:]}
    plan = place(RankGrid(tp=8, dp_replicate=2), topo, free, model=PRESETS["tiny"])
    assert sorted(plan.gpus_by_node()) == [topo.nodes[4].name, topo.nodes[5].name]
