"""Watchdog: when a supervisor starts its job's spares."""

from __future__ import annotations

from small_jobs import small_job

from trainctl.workers.watchdog import Watchdog


def test_spares_wait_for_the_generations_first_step_even_when_the_job_has_trained_long_enough() -> None:
    watchdog = Watchdog(small_job("spares", gpus=2), startup_grace=300.0)
    watchdog.started()
    assert not watchdog.spares_due(spare_after=0.0)  # a new job's first generation: no step yet
    watchdog.stepped()
    assert watchdog.spares_due(spare_after=0.0)
    assert not watchdog.spares_due(spare_after=3600.0)  # stepping, but not trained long enough
    watchdog.trained = 7200.0  # a restart: generations before this one trained past spare_after
    watchdog.ended()
    watchdog.started()
    assert not watchdog.spares_due(spare_after=3600.0)  # the restarted generation has not stepped yet
    watchdog.stepped()
    assert watchdog.spares_due(spare_after=3600.0)
