"""The rank-path bench (bench/scale/rank_path.py, issue 38) at its smallest size: 32 simulated ranks at a
0.2 s step drive the real JobSupervisor actor; every figure is measured, STEP events carry
straggler statistics from the ranks' batched step times, and the killed rank's generation is restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench


@pytest.mark.slow
def test_the_smallest_rank_path_bench_measures_every_figure(embedded_ray, tmp_path: Path) -> None:
    bench = load_bench("scale/rank_path.py")
    bench.by_value()
    row = bench.measure(32, step=0.2, window=5, warmup=9, interval=1.6, log_every=4, work=tmp_path)
    assert row["ranks"] == 32 and row["rank_calls_per_step"] > 0
    assert row["supervisor_cpu_per_step_s"] > 0 and row["supervisor_rss_bytes"] > 0
    assert row["report_to_event_s"]["n"] > 0 and row["report_to_event_s"]["p99"] > 0
    straggler = row["straggler_in_last_step"]
    assert straggler is not None and straggler["ranks"] == 32
    restart = row["restart"]
    assert restart["kill_to_running_s"] > 0 and "31" in restart["reason"], restart
    assert row["stats_tracemalloc_bytes"] > 0
