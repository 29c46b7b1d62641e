"""Named cluster presets (trainctl.workers.topology.presets): each builds a valid map of N units whose GPU
model the sizing tables know, with the NVLink reach of its hardware; bad names and sizes are refused by name."""

from __future__ import annotations

import re

import pytest
import yaml

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.sizing.device_memory import GPU_MEMORY_BYTES, gpu_memory_bytes
from trainctl.parallelism.sizing.flops import PEAK_FLOPS, peak_flops
from trainctl.workers.placement import capacity, place
from trainctl.workers.topology import TopologyError
from trainctl.workers.topology.model import parse_topology
from trainctl.workers.topology.presets import CLUSTER_PRESETS, cluster_preset, cluster_topology


def _table_key(table: tuple, model: str) -> str:
    """The first entry of a sizing table whose key the model name contains (the tables' own rule)."""
    return next(key for key, _ in table if key in model)


@pytest.mark.parametrize("preset", CLUSTER_PRESETS, ids=lambda p: p.name)
def test_a_preset_is_a_valid_map_of_its_units_with_a_known_gpu(preset) -> None:
    topology = cluster_topology(f"{preset.name}:2")
    assert parse_topology(yaml.safe_load(topology.to_yaml())) == topology  # what a map file of it loads as
    assert capacity(topology) == 2 * preset.gpus_per_unit
    assert {node.gpu_model for node in topology.nodes} == {preset.gpu_model}
    assert peak_flops(preset.gpu_model, "bfloat16") == dict(PEAK_FLOPS)[_table_key(PEAK_FLOPS, preset.gpu_model)]["bfloat16"]
    assert gpu_memory_bytes(preset.gpu_model) == dict(GPU_MEMORY_BYTES)[_table_key(GPU_MEMORY_BYTES, preset.gpu_model)]
    for table in (PEAK_FLOPS, GPU_MEMORY_BYTES):  # its own row, not another GPU's whose name it contains
        assert preset.gpu_model.startswith(_table_key(table, preset.gpu_model))


def test_nvlink_reach_per_preset() -> None:
    hgx = cluster_topology("hgx-h100:3")
    assert [len(d.nodes) for d in hgx.spec.nvlink_domains] == [1, 1, 1]
    assert all(sorted(nic.rail for nic in node.nics) == list(range(8)) for node in hgx.nodes)
    racks = cluster_topology("gb200-nvl72:2")
    assert [sum(len(racks.node(n).gpus) for n in d.nodes) for d in racks.spec.nvlink_domains] == [72, 72]
    pcie = cluster_topology("pcie-h100-nvl:2")
    assert pcie.spec.nvlink_domains == [] and pcie.spec.fabric.nvlink is None
    for node in pcie.nodes:
        pairs = [(a, b) for a, b, _ in node.nvlink_pairs]
        assert pairs == [(g, g + 1) for g in range(0, 8, 2)]
        assert sorted(tuple(nic.gpus) for nic in node.nics) == pairs  # one NIC per bridged pair


def test_a_tp2_job_on_a_bridged_pairs_node_gets_a_bridged_pair_when_one_is_free() -> None:
    """Through the solver on the preset: whichever pair is free, a bridged one is taken and priced as its
    bridge; with none free, the best PCIe pair (one socket) is."""
    topology = cluster_topology("pcie-h100-nvl:1")
    node = topology.nodes[0]
    bridges = {(a, b): links for a, b, links in node.nvlink_pairs}
    for free in ({0, 1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5}, {0, 2, 4, 5, 7}, {1, 3, 6, 7}):
        placed = place(RankGrid(tp=2), topology, {node.name: free})
        [gpus] = placed.gpus_by_node().values()
        assert tuple(gpus) in bridges and set(gpus) <= free, free
        assert placed.level_by_dim["tp"] == "nvlink_pair"
    unbridged = place(RankGrid(tp=2), topology, {node.name: {1, 2, 4, 7}})
    assert unbridged.gpus_by_node() == {node.name: [1, 2]} and unbridged.level_by_dim["tp"] == "PXB"
    assert unbridged.comm_seconds > placed.comm_seconds


@pytest.mark.parametrize("text, message", [
    ("dgx-a100:2", "no cluster preset 'dgx-a100'; known presets: " + ", ".join(p.name for p in CLUSTER_PRESETS)),
    ("hgx-h100", "expected PRESET:N"),
    (":4", "expected PRESET:N"),
    ("hgx-h100:0", "hgx-h100 takes a whole number of nodes from 1 to"),
    ("gb200-nvl72:-1", "gb200-nvl72 takes a whole number of racks from 1 to"),
    ("gb200-nvl72:1.5", "N='1.5'"),
    ("hgx-h100:" + "9" * 5000, "hgx-h100 takes a whole number of nodes"),
])
def test_bad_preset_names_and_sizes_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        cluster_topology(text)


def test_the_largest_size_builds_and_one_more_is_refused() -> None:
    preset = cluster_preset("gb200-nvl72")
    assert capacity(cluster_topology(f"gb200-nvl72:{preset.max_units}")) == preset.max_units * 72
    with pytest.raises(TopologyError, match=f"from 1 to {preset.max_units}"):
        cluster_topology(f"gb200-nvl72:{preset.max_units + 1}")
