"""A RankWorker kept for its job's next generation (warm restarts), in process: it settles only once its
call has returned and no checkpoint writer of it is still running; a spare takes its GPU when bound."""

from __future__ import annotations

import threading
import time

import pytest

from trainctl.parallelism.checkpoint.async_writer import WRITER_THREAD_PREFIX
from trainctl.workers import rank_worker
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.rank_worker import RankBinding, RankWorker


@pytest.fixture
def isolated_env(rank_env: pytest.MonkeyPatch) -> None:
    """`rank_env`, and no placement group to watch."""
    rank_env.setattr(rank_worker, "_exit_with_group", lambda binding: None)


def bound_worker() -> RankWorker:
    return RankWorker("node-0", 1, False, RankBinding("job", 0, 1, 2, "00"))


def test_a_worker_settles_only_once_its_call_has_returned(isolated_env) -> None:
    worker = bound_worker()
    entered, release = threading.Event(), threading.Event()

    def call() -> None:
        with worker._call():
            entered.set()
            release.wait(10)

    running = threading.Thread(target=call)
    running.start()
    entered.wait(10)
    started = time.monotonic()
    assert worker.settle(0.3) is False, "a worker still in its call is not kept"
    assert time.monotonic() - started < 2
    release.set()
    running.join(10)
    assert worker.settle(0.3) is True


def test_a_worker_whose_checkpoint_writer_still_writes_does_not_settle(isolated_env) -> None:
    worker = bound_worker()
    release = threading.Event()
    writer = threading.Thread(target=release.wait, args=(10,), name=f"{WRITER_THREAD_PREFIX}_0")
    writer.start()
    try:
        assert worker.settle(0.3) is False
    finally:
        release.set()
        writer.join(10)
    assert worker.settle(0.3) is True


def test_a_kept_worker_forgets_the_stop_request_and_runs_the_next_generation(isolated_env) -> None:
    worker = bound_worker()
    worker.request_stop()
    assert worker.settle(0.3) is True
    assert not worker._stop_requested.is_set(), "a preemption of the failed generation does not stop the next"
    worker.rebind(3)
    assert worker.binding() == RankBinding("job", 3, 1, 2, "00")


def test_a_spare_takes_the_gpu_of_the_slot_it_is_bound_to(isolated_env) -> None:
    spare = RankWorker("node-0", None, False)  # preloads the engine, as on its node
    binding = RankBinding("job", 2, 0, 2, "00")
    assert spare.bind(binding, RankAssignment(rank=0, node="node-1", gpu=3)) is False, "another node"
    assert spare.bind(binding, RankAssignment(rank=0, node="node-0", gpu=3)) is True
    assert spare.binding() == binding
    assert spare._gpu == 3
    assert spare.bind(binding, RankAssignment(rank=0, node="node-0", gpu=3)) is False, "bound already"


def test_a_worker_created_for_a_rank_needs_its_gpu(isolated_env) -> None:
    with pytest.raises(ValueError, match="needs its planned GPU"):
        RankWorker("node-0", None, False, RankBinding("job", 0, 0, 1, "00"))
