"""Node entries from discovery outputs, their Ray labels, the merge with a switch tree, and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainctl.cli import topology_cmd
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.workers.placement import capacity, place
from trainctl.workers.topology.discovery import DiscoveryError, parse_fabric_query, parse_topo_matrix
from trainctl.workers.topology.discovery_node import build_node, node_labels
from trainctl.workers.topology.merge import SwitchTree, load_switch_tree, merge
from trainctl.workers.topology.model import TopologyError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "topology"
H100 = FIXTURES / "h100-x8-numaoff_slurmv4.topo.txt"
H200 = FIXTURES / "h200-hgx-x8_distributedai.topo.txt"
A100 = FIXTURES / "dgx-a100-mlx5cols_gengwg-cheatsheets.topo.txt"


def node_from(path: Path, name: str = "n0", **kw):
    return build_node(name, parse_topo_matrix(path.read_text(), path.name), **kw)


def test_h200_node_entry_rails_follow_gpu_affinity() -> None:
    node = node_from(H200)
    assert node.nvlink_domain == "nvl-n0" and len(node.nvlink_pairs) == 28
    assert node.numa == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    nic_of = {g: node.nic_of(g).name for g in node.gpus}
    assert nic_of == {0: "mlx5_0", 1: "mlx5_3", 2: "mlx5_4", 3: "mlx5_5", 4: "mlx5_6", 5: "mlx5_9", 6: "mlx5_10", 7: "mlx5_11"}
    assert [node.nic_of(g).rail for g in node.gpus] == list(range(8))
    storage = [n for n in node.nics if not n.gpus]
    assert [n.name for n in storage] == ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"] and all(n.rail is None for n in storage)


def test_dgx_a100_gpus_sharing_two_nics_take_one_each() -> None:
    node = node_from(A100)
    assert [node.nic_of(g).name for g in node.gpus] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    assert [node.nic_of(g).rail for g in node.gpus] == list(range(8))


def test_pcie_node_has_no_nvlink_domain() -> None:
    node = node_from(FIXTURES / "pcie-x8-sys-4numa_nccl-1530.topo.txt")
    assert node.nvlink_domain is None and node.nvlink_pairs == []
    assert node_labels(node)["trainctl.io/nvlink-domain"] == "none"


def test_ib_ports_and_inactive_nvlink_are_applied() -> None:
    from trainctl.workers.topology.discovery import IbPort, NvlinkStatus

    ports = [IbPort("mlx5_0", 1, 200.0, "DOWN", "Ethernet"), IbPort("mlx5_3", 1, 400.0, "ACTIVE", "InfiniBand")]
    nvlink = [NvlinkStatus(gpu=7, name="NVIDIA H200", uuid=None, links={0: None, 1: None})]
    node = node_from(H200, ib_ports=ports, nvlink=nvlink)
    nic0 = next(n for n in node.nics if n.name == "mlx5_0")
    assert (nic0.rate_gbps, nic0.state, nic0.link_layer) == (200.0, "Down", "Ethernet")
    assert node.nic_of(0) is None, "a down NIC carries no traffic"
    assert all(7 not in pair[:2] for pair in node.nvlink_pairs) and len(node.nvlink_pairs) == 21
    assert node.gpu_model == "NVIDIA H200"


def test_fabric_clique_names_a_multi_node_domain() -> None:
    fabric = parse_fabric_query("index, fabric.cluster_uuid, fabric.clique_id\n" + "".join(f"{g}, abc-1, 7\n" for g in range(4)))
    node = node_from(FIXTURES / "gb200-x4_gcn17-unattributed.topo.txt", fabric=fabric)
    assert node.nvlink_domain == "abc-1.7"
    mixed = parse_fabric_query("index, fabric.cluster_uuid, fabric.clique_id\n0, abc, 7\n1, abc, 8\n")
    with pytest.raises(DiscoveryError, match="different NVLink fabric cliques"):
        node_from(FIXTURES / "gb200-x4_gcn17-unattributed.topo.txt", fabric=mixed)


def test_labels_are_valid_ray_labels() -> None:
    from ray._private.label_utils import validate_node_labels

    labels = node_labels(node_from(H100, name="dgx-07"))
    validate_node_labels(labels)
    assert labels["trainctl.io/node"] == "dgx-07"
    assert labels["trainctl.io/nvlink-domain"] == "nvl-dgx-07"
    assert [labels[f"trainctl.io/rail-gpu{g}"] for g in range(8)] == [str(g) for g in range(8)]
    assert labels["trainctl.io/numa-gpu5"] == "0" and labels["trainctl.io/gpus"] == "8"


TREE = {
    "apiVersion": "trainctl/v1",
    "kind": "SwitchTree",
    "metadata": {"name": "lab"},
    "fabric": {
        "nvlink": {"bandwidth_gbytes_per_s": 450},
        "leaf": {"bandwidth_gbytes_per_s": 50, "latency_us": 4},
        "spine": {"bandwidth_gbytes_per_s": 50, "latency_us": 5, "oversubscription": 2},
    },
    "switches": [
        {"name": "spine", "tier": "spine"},
        *({"name": f"rail{r}", "tier": "leaf", "rail": r, "parent": "spine"} for r in range(8)),
    ],
    "cabling": [{"nodes": ["a", "b"], "rails": {r: f"rail{r}" for r in range(8)}}],
}


def test_merge_builds_a_map_the_solver_uses() -> None:
    topo = merge([node_from(H100, "a"), node_from(H200, "b")], SwitchTree.model_validate(TREE))
    assert capacity(topo) == 16 and [d.name for d in topo.spec.nvlink_domains] == ["nvl-a", "nvl-b"]
    assert topo.node("b").nic_of(1).leaf == "rail1"
    plan = place(RankGrid(tp=8, dp_shard=2), topo, {"a": set(range(8)), "b": set(range(8))})
    assert plan is not None and plan.split_groups == []
    assert plan.level_by_dim["dp"] == "leaf", "DP peers are same-rail across the two nodes"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t["cabling"][0]["nodes"].append("ghost"), "cabling names node 'ghost'"),
        (lambda t: t["cabling"][0]["nodes"].remove("b"), "node 'b' has no cabling entry"),
        (lambda t: t["cabling"][0]["rails"].pop(5), "NIC 'mlx5_7' is on rail 5, which the cabling does not list"),
        (lambda t: t["cabling"].append({"nodes": ["a"], "leaf": "rail0"}), "node 'a' is cabled twice"),
    ],
)
def test_merge_errors(change, message: str) -> None:
    import copy

    tree = copy.deepcopy(TREE)
    change(tree)
    with pytest.raises(TopologyError, match=message):
        merge([node_from(H100, "a"), node_from(H200, "b")], SwitchTree.model_validate(tree))


def test_switch_tree_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "tree.yaml"
    path.write_text(yaml.safe_dump({**TREE, "cabling": [{"nodes": ["a"], "rails": {0: "rail0"}, "leaf": "rail0"}]}))
    with pytest.raises(TopologyError, match="give exactly one of `rails` or `leaf`"):
        load_switch_tree(path)


def test_cli_inspect_prints_the_node_entry(capsys: pytest.CaptureFixture[str]) -> None:
    rc = topology_cmd.main([
        "topology", "inspect", "--topo-m", str(H100), "--nvlink", str(FIXTURES / "h100-sxm-gpu0_awesome-ml-sys.nvlink-s.txt"),
        "--ib-sysfs", str(FIXTURES / "h100-ndr-8hca_gpud.sysfs-rate.txt"), "--name", "dgx-1",
    ])
    out = capsys.readouterr().out
    assert rc == 0
    entry = yaml.safe_load(out)
    assert entry["name"] == "dgx-1" and entry["gpus"] == list(range(8))
    assert entry["gpu_model"] == "NVIDIA H100 80GB HBM3" and entry["nvlink_domain"] == "nvl-dgx-1"
    nics = {n["name"]: n for n in entry["nics"]}
    assert nics["mlx5_11"]["gpus"] == [7] and nics["mlx5_11"]["rail"] == 7


def test_cli_labels_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert topology_cmd.main(["topology", "inspect", "--topo-m", str(H200), "--labels"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainctl.io/rail-gpu1"] == "1"
    assert topology_cmd.main(["topology", "inspect", "--topo-m", str(FIXTURES / "h100-ndr-8hca_gpud.ibstat.txt")]) == 2
    assert "no header line with a GPU0 column" in capsys.readouterr().err
    assert topology_cmd.main(["topology", "inspect", "--topo-m", str(tmp_path / "absent.txt")]) == 2
    assert "--topo-m" in capsys.readouterr().err


def test_cli_validate_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainctl.cli.topology_cmd", "topology", "validate", str(REPO / "deploy/topologies/pcie-servers.yaml")],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "valid TopologyMap 'pcie-l40s': 4 nodes, 32 usable GPUs" in result.stdout


def test_discover_local_node_runs_the_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.workers.topology.discovery_node import discover_local_node

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n'
        f"  topo) cat '{H100}' ;;\n"
        f"  nvlink) cat '{FIXTURES / 'h100-sxm-gpu0_awesome-ml-sys.nvlink-s.txt'}' ;;\n"
        "  *) echo 'index, fabric.cluster_uuid, fabric.clique_id'; for g in 0 1 2 3 4 5 6 7; do echo \"$g, N/A, N/A\"; done ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "state").write_text("4: ACTIVE\n")
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    node = discover_local_node("gpu-7", ib_root=tmp_path / "ib")
    assert node.name == "gpu-7" and node.gpus == list(range(8)) and node.nvlink_domain == "nvl-gpu-7"
    assert node.gpu_model == "NVIDIA H100 80GB HBM3" and node.nic_of(0).rate_gbps == 400.0
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(DiscoveryError, match="`nvidia-smi topo -m` failed"):
        discover_local_node("gpu-7")
