"""Discovery parsers on the real command outputs in tests/fixtures/topology (facts from SOURCES.md)."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest

from trainctl.workers.topology.discovery import (
    DiscoveryError,
    parse_fabric_query,
    parse_ib_sysfs_listing,
    parse_ibstat,
    parse_nvlink_status,
    parse_topo_matrix,
    read_ib_sysfs,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def all_pairs(n: int, links: int) -> list[tuple[int, int, int]]:
    return [(a, b, links) for a, b in combinations(range(n), 2)]


# name -> (GPUs, NVLink pairs, NUMA per GPU, nearest GPUs per NIC device)
TOPO_FACTS = {
    "dgx-a100-mlx5cols_gengwg-cheatsheets.topo.txt": (
        8,
        all_pairs(8, 12),
        [3, 3, 1, 1, 7, 7, 5, 5],
        {
            "mlx5_0": [0, 1], "mlx5_1": [0, 1], "mlx5_2": [2, 3], "mlx5_3": [2, 3],
            "mlx5_4": [], "mlx5_5": [], "mlx5_6": [4, 5], "mlx5_7": [4, 5],
            "mlx5_8": [6, 7], "mlx5_9": [6, 7], "mlx5_10": [], "mlx5_11": [],
        },
    ),
    "gb200-x4_gcn17-unattributed.topo.txt": (
        4, all_pairs(4, 18), [0, 0, 1, 1], {f"mlx5_{i}": [] for i in range(8)},
    ),
    "h100-x8-numaoff_slurmv4.topo.txt": (
        8,
        all_pairs(8, 18),
        [0] * 8,
        {
            "mlx5_0": [0], "mlx5_1": [1], "mlx5_2": [2], "mlx5_3": [], "mlx5_4": [], "mlx5_5": [3],
            "mlx5_6": [4], "mlx5_7": [5], "mlx5_8": [6], "mlx5_9": [], "mlx5_10": [], "mlx5_11": [7],
        },
    ),
    "h200-hgx-x8_distributedai.topo.txt": (
        8,
        all_pairs(8, 18),
        [0, 0, 0, 0, 1, 1, 1, 1],
        {
            "mlx5_0": [0], "mlx5_1": [], "mlx5_2": [], "mlx5_3": [1], "mlx5_4": [2], "mlx5_5": [3],
            "mlx5_6": [4], "mlx5_7": [], "mlx5_8": [], "mlx5_9": [5], "mlx5_10": [6], "mlx5_11": [7],
        },
    ),
    "l40s-x4_miss-alignment-106.topo.txt": (4, [], [0, 0, 1, 1], {"mlx5_0": [], "mlx5_1": []}),
    "v100-sxm2-x8-cubemesh_vast-unattributed.topo.txt": (
        8,
        [
            (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2), (2, 3, 2),
            (2, 6, 1), (3, 7, 1), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 2),
        ],
        [0, 0, 0, 0, 1, 1, 1, 1],
        {"mlx5_2": []},
    ),
    "a100-pcie-x4-bridged_unattributed.topo.txt": (4, [(0, 1, 12), (2, 3, 12)], [0, 0, 1, 1], {}),
    "h100-nvl-x8-bridged_constructed.topo.txt": (
        8,
        [(0, 1, 12), (2, 3, 12), (4, 5, 12), (6, 7, 12)],
        [0, 0, 0, 0, 1, 1, 1, 1],
        {"mlx5_0": [0, 1], "mlx5_1": [2, 3], "mlx5_2": [4, 5], "mlx5_3": [6, 7], "mlx5_4": []},
    ),
    "pcie-x8-sys-4numa_nccl-1530.topo.txt": (8, [], [0, 0, 0, 1, 2, 2, 2, 3], {"mlx5_0": [], "mlx5_1": []}),
}


def test_every_topo_fixture_is_covered() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.topo.txt")) == sorted(TOPO_FACTS)


@pytest.mark.parametrize("name", sorted(TOPO_FACTS))
def test_topo_matrix_facts(name: str) -> None:
    gpus, pairs, numa, nearest = TOPO_FACTS[name]
    matrix = parse_topo_matrix(fixture(name), name)
    assert matrix.gpus == list(range(gpus))
    assert matrix.nvlink_pairs() == pairs
    assert [matrix.numa_of(g) for g in matrix.gpus] == numa
    assert {nic: matrix.nearest_gpus(nic) for nic in matrix.nics} == nearest


def test_closest_levels_of_far_nics() -> None:
    dgx = parse_topo_matrix(fixture("dgx-a100-mlx5cols_gengwg-cheatsheets.topo.txt"))
    assert dgx.closest_level("mlx5_4") == "SYS" and dgx.cells[("mlx5_4", "mlx5_5")] == "PIX"
    h100 = parse_topo_matrix(fixture("h100-x8-numaoff_slurmv4.topo.txt"))
    assert h100.closest_level("mlx5_3") == "NODE" and h100.cells[("mlx5_3", "mlx5_4")] == "PIX"
    l40s = parse_topo_matrix(fixture("l40s-x4_miss-alignment-106.topo.txt"))
    assert [l40s.cells[("mlx5_0", f"GPU{g}")] for g in range(4)] == ["SYS", "SYS", "NODE", "NODE"]
    assert l40s.cells[("GPU0", "GPU1")] == "NODE" and l40s.cells[("GPU0", "GPU2")] == "SYS"


def test_grace_numa_node_lists_and_gpu_numa_ids() -> None:
    matrix = parse_topo_matrix(fixture("gb200-x4_gcn17-unattributed.topo.txt"))
    assert matrix.numa_affinity[0] == [0, *range(3, 10), *range(11, 18)]
    assert matrix.numa_affinity[2] == [1, *range(19, 26), *range(27, 34)]
    assert matrix.gpu_numa_id == {0: 2, 1: 10, 2: 18, 3: 26}
    assert matrix.cpu_affinity == {0: "0-71", 1: "0-71", 2: "72-143", 3: "72-143"}
    assert matrix.cells[("mlx5_2", "mlx5_3")] == "PIX" and matrix.cells[("mlx5_6", "mlx5_7")] == "PIX"


def test_old_format_has_no_gpu_numa_id_and_cpu_affinity_kept() -> None:
    matrix = parse_topo_matrix(fixture("dgx-a100-mlx5cols_gengwg-cheatsheets.topo.txt"))
    assert matrix.gpu_numa_id == {}
    assert matrix.cpu_affinity[0] == "48-63,176-191" and matrix.cpu_affinity[6] == "80-95,208-223"


def test_nvlink_status_fixture() -> None:
    [status] = parse_nvlink_status(fixture("h100-sxm-gpu0_awesome-ml-sys.nvlink-s.txt"))
    assert status.gpu == 0 and status.name == "NVIDIA H100 80GB HBM3"
    assert status.uuid == "GPU-5a10e6e5-95f7-2785-ed63-6f6147f304f7"
    assert sorted(status.links) == list(range(18)) and set(status.links.values()) == {26.562}
    assert status.active_links == 18
    assert status.bandwidth_gbytes_per_s == pytest.approx(18 * 26.562)


def test_nvlink_status_inactive_links() -> None:
    text = "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-x)\n\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n"
    [status] = parse_nvlink_status(text)
    assert status.links == {0: 25.0, 1: None} and status.active_links == 1


def test_ibstat_fixture() -> None:
    ports = {p.device: p for p in parse_ibstat(fixture("h100-ndr-8hca_gpud.ibstat.txt"))}
    assert sorted(ports) == sorted(["mlx5_0", "mlx5_1", *(f"mlx5_{i}" for i in range(4, 10)), "mlx5_bond_0"])
    for name, port in ports.items():
        bond = name == "mlx5_bond_0"
        assert port.rate_gbps == (200.0 if bond else 400.0)
        assert port.link_layer == ("Ethernet" if bond else "InfiniBand")
        assert port.state == "ACTIVE" and port.phys_state == "LINKUP" and port.port == 1


def test_sysfs_rate_listing_fixture() -> None:
    ports = {p.device: p for p in parse_ib_sysfs_listing(fixture("h100-ndr-8hca_gpud.sysfs-rate.txt"))}
    assert ports["mlx5_0"].rate_gbps == 400.0 and ports["mlx5_bond_0"].rate_gbps == 200.0
    assert len(ports) == 9


def test_sysfs_tree(tmp_path: Path) -> None:
    for dev, rate, state, layer in (
        ("mlx5_0", "400 Gb/sec (4X NDR)", "4: ACTIVE", "InfiniBand"),
        ("mlx5_1", "200 Gb/sec (2X NDR)", "1: DOWN", "Ethernet"),
    ):
        port = tmp_path / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(rate)
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "link_layer").write_text(layer + "\n")
    ports = {p.device: p for p in read_ib_sysfs(tmp_path)}
    assert (ports["mlx5_0"].rate_gbps, ports["mlx5_0"].state, ports["mlx5_0"].link_layer) == (400.0, "ACTIVE", "InfiniBand")
    assert (ports["mlx5_1"].rate_gbps, ports["mlx5_1"].state, ports["mlx5_1"].link_layer) == (200.0, "DOWN", "Ethernet")
    assert ports["mlx5_1"].phys_state == "LINKUP"


def test_fabric_query() -> None:
    text = (
        "index, fabric.cluster_uuid, fabric.clique_id\n"
        "0, 7f3c2a10-5b4e-4d6a-9c1e-2b8f0e6d4a91, 1\n"
        "1, 7f3c2a10-5b4e-4d6a-9c1e-2b8f0e6d4a91, 1\n"
    )
    infos = parse_fabric_query(text)
    assert [i.domain for i in infos] == ["7f3c2a10-5b4e-4d6a-9c1e-2b8f0e6d4a91.1"] * 2
    [none] = parse_fabric_query("index, fabric.cluster_uuid, fabric.clique_id\n0, N/A, N/A\n")
    assert none.domain is None


H100 = "h100-x8-numaoff_slurmv4.topo.txt"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.replace("GPU0\t X \tNV18", "GPU0\t X \tNV1X", 1), "unknown connection 'NV1X'"),
        (lambda t: t.replace("\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX", "\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX", 1), "connection cells, expected 20"),
        (lambda t: t.replace("GPU0", "GPUX"), "no header line with a GPU0"),
        (lambda t: t.replace("GPU3\tNV18", "GPU9\tNV18", 1), "row device 'GPU9' is not a column"),
        (lambda t: t.replace("NIC5:", "NIC55:"), "NIC Legend names ['NIC55']"),
        (lambda t: t.replace("  NIC2: mlx5_2", "  NIC2 mlx5_2"), "is not 'NICn: device'"),
        (lambda t: t.replace("\t0-191\t0\t", "\t0-191\t0x\t", 1), "NUMA affinity '0x'"),
        (lambda t: t.replace("GPU1\tNV18\t X \tNV18", "GPU1\tPIX\t X \tNV18", 1), "must be symmetric"),
        (lambda t: t.replace("GPU2\tNV18\tNV18\t X ", "GPU2\tNV18\tNV18\tNV18", 1), "X must be exactly on the diagonal"),
        (lambda t: "".join(t.splitlines(keepends=True)[:5]), "no rows for devices"),
    ],
)
def test_malformed_topo_matrix(mutate, message: str) -> None:
    text = mutate(fixture(H100))
    assert text != fixture(H100)
    with pytest.raises(DiscoveryError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse_topo_matrix(text, "bad.txt")


# A table of malformed inputs, one row per parser error the message must name.
@pytest.mark.parametrize(
    ("parser", "text", "message"),
    [
        (parse_nvlink_status, "\t Link 0: 26.562 GB/s\n", "before any 'GPU n:' header"),
        (parse_nvlink_status, "GPU 0: H100 (UUID: x)\n Link 0: fast\n", "neither 'GPU n: name'"),
        (parse_nvlink_status, "", "no 'GPU n:' sections"),
        (parse_ib_sysfs_listing, "mlx5_0/ports/1/rate:fast\n", "rate 'fast' is not like"),
        (parse_ib_sysfs_listing, "mlx5_0/rate:400 Gb/sec\n", "is not '<device>/ports/<n>/<attribute>:<value>'"),
        (parse_ib_sysfs_listing, "mlx5_0/ports/1/state:ACTIVE\n", "state 'ACTIVE' is not like '4: ACTIVE'"),
        (parse_ib_sysfs_listing, "mlx5_0/ports/1/link_layer:Token Ring\n", "neither InfiniBand nor Ethernet"),
        (parse_ibstat, "CA 'mlx5_0'\n\tPort 1:\n\t\tRate: fast\n", "Rate 'fast' is not a number"),
        (parse_ibstat, "hello\n", "no CA / Port sections"),
        (parse_fabric_query, "index, name\n0, x\n", "lacks one of"),
        (parse_fabric_query, "index, fabric.cluster_uuid, fabric.clique_id\n0, u, seven\n", "clique id 'seven'"),
        (parse_fabric_query, "index, fabric.cluster_uuid, fabric.clique_id\n0, u\n", "does not match the header"),
    ],
)
def test_malformed_other_inputs(parser, text: str, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parser(text)


def test_missing_sysfs_root(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="not a directory"):
        read_ib_sysfs(tmp_path / "absent")
    with pytest.raises(DiscoveryError, match="no <device>/ports/<n>/ attributes"):
        read_ib_sysfs(tmp_path)
