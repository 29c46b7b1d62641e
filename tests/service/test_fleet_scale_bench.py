"""The fleet-scale bench (bench/scale/fleet.py, issue 38) at its smallest size, one repetition: every
figure is measured on the real code paths, the 1/8-fleet job is placed, GetCluster masks other tenants'
jobs (the bench checks it) and no metric family grows with steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench


@pytest.mark.slow
def test_the_quick_fleet_bench_measures_every_figure(tmp_path: Path) -> None:
    fleet = load_bench("scale/fleet.py")
    row = fleet.measure(128, reps=1, seed=0, work=tmp_path)
    assert row["gpus"] == 1024 and row["free_gpus"] <= 0.3 * 1024 + 8
    assert row["admission"]["admitted_per_pass"] > 0
    assert row["placement"]["placed"] and row["placement"]["job_gpus"] == 128
    assert row["scrape"]["bounded"] and row["scrape"]["series_by_family"]["trainctl_cluster_gpus"] == 128
    for figure in fleet.FIGURES:
        assert fleet.stat(row, figure) > 0
