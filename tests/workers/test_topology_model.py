"""The topology map: example files, the simulated map, and validation errors that name the culprit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from trainctl.workers.topology import TopologyError, load_topology, simulated_topology
from trainctl.workers.topology.builders import example_maps
from trainctl.workers.topology.model import parse_topology

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "topologies"


def test_example_files_are_the_generated_maps() -> None:
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert files == sorted(example_maps())
    for name, topology in example_maps().items():
        loaded = load_topology(EXAMPLES / name)
        assert loaded == topology, f"{name} is stale: run python -m trainctl.workers.topology.builders deploy/topologies"


def test_example_shapes() -> None:
    su = load_topology(EXAMPLES / "dgx-h100-superpod-su.yaml")
    assert len(su.nodes) == 32 and all(n.gpus == list(range(8)) for n in su.nodes)
    leaves = [s for s in su.spec.switches if s.tier == "leaf"]
    assert sorted(s.rail for s in leaves) == list(range(8))
    nvl = load_topology(EXAMPLES / "gb200-nvl72-2racks.yaml")
    assert [len(d.nodes) * 4 for d in nvl.spec.nvlink_domains] == [72, 72]
    pcie = load_topology(EXAMPLES / "pcie-servers.yaml")
    assert pcie.spec.nvlink_domains == [] and all(n.nvlink_domain is None for n in pcie.nodes)


def test_simulated_topology() -> None:
    topo = simulated_topology(3, 4)
    assert [n.name for n in topo.nodes] == ["node-0", "node-1", "node-2"]
    assert all(n.gpus == [0, 1, 2, 3] and n.healthy for n in topo.nodes)
    assert len({n.nvlink_domain for n in topo.nodes}) == 3
    assert {nic.leaf for n in topo.nodes for nic in n.nics} == {"leaf-0"}
    assert parse_topology(yaml.safe_load(topo.to_yaml())) == topo
    with pytest.raises(TopologyError, match="nodes >= 1"):
        simulated_topology(0, 8)


@pytest.fixture(scope="module")
def base_map() -> dict:
    return yaml.load((EXAMPLES / "gb200-nvl72-2racks.yaml").read_text(), Loader=yaml.CSafeLoader)


@pytest.fixture
def data(base_map: dict) -> dict:
    """A fresh copy of a valid map to break."""
    return copy.deepcopy(base_map)


def _node(data: dict, i: int = 0) -> dict:
    return data["spec"]["nodes"][i]


CASES = [
    ("duplicate node name", lambda d: _node(d, 1).update(name=_node(d, 0)["name"]), "node name 'gb200-nvl72-r000-t00' is used more than once"),
    ("duplicate switch", lambda d: d["spec"]["switches"].append(dict(d["spec"]["switches"][1])), "switch name .* more than once"),
    ("negative bandwidth", lambda d: d["spec"]["fabric"]["leaf"].update(bandwidth_gbytes_per_s=-1), "spec.fabric.leaf.bandwidth_gbytes_per_s: Input should be greater than 0"),
    ("oversubscription below 1", lambda d: d["spec"]["fabric"]["spine"].update(oversubscription=0.5), "spec.fabric.spine.oversubscription"),
    ("unknown parent", lambda d: d["spec"]["switches"][2].update(parent="nowhere"), "switch 'gb200-nvl72-su0-rail0' \\(leaf\\): parent 'nowhere' is not a switch"),
    ("skipping a tier", lambda d: d["spec"]["switches"][2].update(parent="gb200-nvl72-core"), "parent 'gb200-nvl72-core' is a core switch; a leaf switch's parent must be one tier up \\(spine\\)"),
    ("rail on a spine", lambda d: d["spec"]["switches"][1].update(rail=0), "only leaf switches carry a rail"),
    ("rail mismatch", lambda d: _node(d)["nics"][0].update(rail=3), "node 'gb200-nvl72-r000-t00': NIC 'mlx5_0' has rail 3 but is cabled to leaf 'gb200-nvl72-su0-rail0' of rail 0"),
    ("repeated rail", lambda d: _node(d)["nics"][1].update(rail=0, leaf="gb200-nvl72-su0-rail0"), "rails \\[0, 0, 2, 3\\] repeat"),
    ("nic to unknown leaf", lambda d: _node(d)["nics"][1].update(leaf="leaf-x"), "node 'gb200-nvl72-r000-t00': NIC 'mlx5_1' is cabled to 'leaf-x', which is not a switch"),
    ("nic to a spine", lambda d: _node(d)["nics"][1].update(leaf="gb200-nvl72-pod0-spine"), "is cabled to 'gb200-nvl72-pod0-spine', a spine switch, not a leaf"),
    ("nic lists unknown gpu", lambda d: _node(d)["nics"][1].update(gpus=[9]), "NIC 'mlx5_1' lists GPUs \\[9\\] the node does not have"),
    ("duplicate gpu", lambda d: _node(d).update(gpus=[0, 0, 1, 2]), "duplicate GPU indices"),
    ("numa of unknown gpu", lambda d: _node(d)["numa"].update({7: 0}), "numa names GPUs \\[7\\]"),
    ("node in two domains", lambda d: d["spec"]["nvlink_domains"][1]["nodes"].append(_node(d)["name"]), "is in two NVLink domains"),
    ("domain names unknown node", lambda d: d["spec"]["nvlink_domains"][0]["nodes"].append("ghost"), "NVLink domain 'gb200-nvl72-rack000': node 'ghost' is not in the map"),
    ("wrong nvlink_domain", lambda d: _node(d).update(nvlink_domain="gb200-nvl72-rack001"), "node 'gb200-nvl72-r000-t00': nvlink_domain 'gb200-nvl72-rack001'"),
    ("partition outside domain", lambda d: d["spec"]["nvlink_domains"][0].update(partitions=[{"name": "p", "nodes": [_node(d, 20)["name"]]}]), "partition 'p' has nodes .* outside the domain"),
    ("nvlink level missing", lambda d: d["spec"]["fabric"].pop("nvlink"), "level 'nvlink'"),
    ("leaf level missing", lambda d: d["spec"]["fabric"].pop("leaf"), "level 'leaf': the map has leaf switches but fabric.leaf is not given"),
    ("two roots", lambda d: d["spec"]["switches"].append({"name": "lone", "tier": "leaf"}), "one root"),
    ("unknown key", lambda d: _node(d).update(colour="red"), "spec.nodes\\[0\\].colour: unknown field"),
    ("wrong kind", lambda d: d.update(kind="TrainingJob"), "kind: Input should be 'TopologyMap'"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), CASES, ids=[c[0] for c in CASES])
def test_validation_names_the_culprit(data: dict, case: str, mutate, message: str) -> None:
    mutate(data)
    with pytest.raises(TopologyError, match=message):
        parse_topology(data, "map.yaml")


def test_domain_must_nest_in_one_leaf_set(data: dict) -> None:
    node = _node(data, 1)
    data["spec"]["switches"].append({"name": "other-rail0", "tier": "leaf", "rail": 0, "parent": "gb200-nvl72-pod0-spine"})
    node["nics"][0]["leaf"] = "other-rail0"
    with pytest.raises(TopologyError, match="NVLink domain 'gb200-nvl72-rack000': its nodes are cabled to different leaf"):
        parse_topology(data)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read topology map"):
        load_topology(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)
    bad.write_text("- a list\n")
    with pytest.raises(TopologyError, match="a topology map is a YAML mapping, got list"):
        load_topology(bad)


def test_health_and_nic_choice(data: dict) -> None:
    _node(data, 0)["health"] = "unhealthy"
    _node(data, 1)["failed_gpus"] = [2]
    topo = parse_topology(data)
    assert topo.nodes[0].usable_gpus == [] and topo.nodes[1].usable_gpus == [0, 1, 3]
    assert topo.nodes[1].nic_of(3).name == "mlx5_3"
