"""A model job's rank runs one OpenMP thread (torchrun's default) unless its environment sets another
number; set before the engine's import, as torch reads it then (bench/rank_threads.py measures why)."""

from __future__ import annotations

import os

import pytest

from trainctl.workers.rank_worker import RankBinding, RankWorker


def test_a_rank_gets_one_openmp_thread_where_its_environment_sets_none(rank_env: pytest.MonkeyPatch) -> None:
    RankWorker("node-0", 1, False, RankBinding("job", 0, 1, 2, "00"))
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_a_number_the_nodes_environment_sets_is_kept(rank_env: pytest.MonkeyPatch) -> None:
    rank_env.setenv("OMP_NUM_THREADS", "6")
    RankWorker("node-0", 1, False, RankBinding("job", 0, 1, 2, "00"))
    assert os.environ["OMP_NUM_THREADS"] == "6"
