"""The long-job bench (bench/scale/job_steps.py, issue 38) at its smallest size, one repetition, so it
cannot rot: the store and the event log are filled, every figure is measured on the real code paths, the
full view holds every step, and the restart relaunched the job (its second relaunch: the bench's log
holds one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench


@pytest.mark.slow
def test_the_smallest_job_steps_bench_measures_every_figure(tmp_path: Path) -> None:
    bench = load_bench("scale/job_steps.py")
    row = bench.measure(1000, reps=1, work=tmp_path)
    assert row["steps"] == 1000 and row["events"] >= 1000
    assert row["get_job_full_steps"] == 1000
    for figure in ("store_bytes", "log_bytes", "get_job_seconds", "get_job_full_seconds", "list_jobs_seconds",
                   "watch_start_first_seconds", "watch_middle_page_seconds", "watch_end_page_seconds",
                   "decide_relaunch_seconds", "restart_seconds"):
        assert row[figure] > 0, figure
    assert "| 1,000 |" in bench.table([row])
