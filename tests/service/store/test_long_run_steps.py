"""Issue 38: a job of a million steps. GetJob(JOB_VIEW_FULL) answers at most FULL_VIEW_STEPS of its steps;
the store picks them (`JobStore.thinned_step_metrics`) by index lookups instead of reading every row, so
the answer costs the same for a long run as for a short one (bench/scale/job_steps.py measures it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainctl.service.api.job_messages import thinned_steps
from trainctl.service.store import JobStore
from trainctl.spec.job import TrainingJob


def job() -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "long"}, "spec": {}})


def fill(store: JobStore, steps: list[int], eval_every: int | None = None) -> str:
    """A job whose steps `steps` were recorded (one transaction, the statements of `record_step`)."""
    record, _ = store.create_job(job())
    with store._core.tx() as db:
        for step in steps:
            metrics: dict[str, Any] = {"step": step, "loss": 1.0 / step, "breakdown": {"forward_backward": 0.1}}
            if eval_every and step % eval_every == 0:
                metrics["eval_loss"] = 2.0 / step
            store._events.write_step(db, record.id, metrics, float(step))
    return record.id


def test_a_short_run_answers_every_step(store_location: str) -> None:
    store = JobStore(store_location)
    job_id = fill(store, list(range(1, 21)), eval_every=5)
    assert store.thinned_step_metrics(job_id, 20) == store.step_metrics(job_id)
    store.close()


def test_a_run_without_gaps_is_thinned_as_an_even_thinning_of_every_row_would(store_location: str) -> None:
    store = JobStore(store_location)
    job_id = fill(store, list(range(1, 1001)))
    kept = store.thinned_step_metrics(job_id, 20)
    assert kept == thinned_steps(store.step_metrics(job_id), 20)
    assert [row["step"] for row in kept][:3] == [1, 54, 106] and kept[-1]["step"] == 1000
    store.close()


def test_a_long_run_keeps_its_eval_curve_beside_the_training_curve_with_gaps_in_the_steps(store_location: str) -> None:
    store = JobStore(store_location)
    steps = [s for s in range(1, 3001) if s % 7]  # gaps: a command job reports the steps it chooses
    job_id = fill(store, steps, eval_every=10)
    kept = store.thinned_step_metrics(job_id, 40)
    numbers = [row["step"] for row in kept]
    assert len(kept) <= 40 and numbers == sorted(set(numbers))
    evaluated = [row["step"] for row in kept if row["eval_loss"] is not None]
    others = [row["step"] for row in kept if row["eval_loss"] is None]
    assert len(evaluated) == 20 and evaluated[0] == 10 and evaluated[-1] == 3000  # the first and last evaluated step
    assert len(others) >= 19 and others[0] == 1 and others[-1] == 2999
    assert max(b - a for a, b in zip(others, others[1:], strict=False)) <= 2 * 3000 / 19  # spread over the run
    assert all(row["step"] in steps and row["breakdown"] == {"forward_backward": 0.1} for row in kept)
    store.close()


def test_thinning_reads_about_as_much_of_a_long_run_as_of_a_short_one(tmp_path: Path) -> None:
    """Counted in SQLite virtual-machine instructions (the progress handler of this thread's read
    connection): a run 20 times longer costs less than twice as much, where reading every row costs 20
    times as much."""
    store = JobStore(tmp_path / "data")
    short = fill(store, list(range(1, 1001)), eval_every=10)
    long = fill(store, list(range(1, 20001)), eval_every=10)
    ticks = [0]

    def counted(read) -> int:
        with store._core.db.reading() as reader:
            reader._db.set_progress_handler(lambda: ticks.__setitem__(0, ticks[0] + 1) or 0, 100)
        ticks[0] = 0
        read()
        return ticks[0]

    thinned = [counted(lambda job_id=job_id: store.thinned_step_metrics(job_id, 50)) for job_id in (short, long)]
    every = [counted(lambda job_id=job_id: store.step_metrics(job_id)) for job_id in (short, long)]
    assert every[1] > 15 * every[0]  # the handler counts what a read does
    assert thinned[1] < 2 * thinned[0], thinned
    store.close()
