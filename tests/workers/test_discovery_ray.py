"""Discovery as a Ray task on a labelled node of the embedded cluster (nvidia-smi faked on PATH)."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from trainctl.workers.topology.discovery_node import discover_and_label

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def test_discover_and_label_on_a_ray_node(embedded_ray, tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  topo) cat '{(FIXTURES / 'h200-hgx-x8_distributedai.topo.txt').resolve()}' ;;\n"
        f"  nvlink) cat '{(FIXTURES / 'h100-sxm-gpu0_awesome-ml-sys.nvlink-s.txt').resolve()}' ;;\n"
        "  *) exit 9 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    task = ray.remote(discover_and_label).options(
        num_cpus=0,
        label_selector={"trainctl.io/node": "node-1"},
        runtime_env={"env_vars": {"PATH": f"{tmp_path}:{os.environ['PATH']}"}},
    )
    result = ray.get(task.remote("node-1"), timeout=120)
    labels, missing = result["labels"], result["labels_missing_on_node"]
    assert result["node"]["name"] == "node-1" and len(result["node"]["gpus"]) == 8
    assert labels["trainctl.io/node"] == "node-1" and labels["trainctl.io/rail-gpu5"] == "5"
    assert "trainctl.io/node" not in missing, "the embedded node already carries its name label"
    assert missing["trainctl.io/gpus"] == "8", "the simulated node has 4 GPUs; discovery saw 8"
