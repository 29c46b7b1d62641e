"""Sweeps over the scripted runtime (no Ray): trials as labelled jobs through the scheduler, early
stopping with its own terminal reason, the best trial, a service restart mid-sweep with every trial
accounted for exactly once, and the interrupted-cancel repair."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from control_plane_fakes import ScriptedRuntime, make_scheduler

from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.api.sweep_rpcs import best_trial
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.scheduling.sweeps import SweepDriver, objective_value
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.tenancy import Principal, Role
from trainctl.service.store import StoreUnavailable, SweepRecord, SweepState, TrialState
from trainctl.spec.sweep import SWEEP_LABEL, TRIAL_LABEL, Sweep, parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.events import JobState, JobStatus

STEPS = 8
BEST_LR = 1e-2


def sweep_spec(trials: int = 8, parallel: int = 2, rule: str = "median", **spec: Any) -> Sweep:
    return parse_sweep_object({
        "metadata": {"name": "lr-sweep", "labels": {"team": "a"}},
        "spec": {
            "template": {
                "data": {"seq_len": 32, "max_files": 10},
                "training": {"steps": STEPS, "global_batch_size": 2, "warmup_steps": 1},
                "resources": {"gpus": 1, "device": "cpu"},
            },
            "parameters": [
                {"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1.0, "log": True},
                {"path": "spec.training.warmup_steps", "type": "int", "low": 0, "high": 4},
            ],
            "trials": trials, "parallel_trials": parallel, "algorithm": "random", "seed": 3,
            "early_stopping": {"rule": rule, "min_steps": 2, "startup_trials": 2},
            **spec,
        },
    })


def loss(lr: float, step: int) -> float:
    """A loss curve that is lower at every step the closer lr is to BEST_LR."""
    return 1.0 + abs(math.log10(lr / BEST_LR)) + 2.0 / step


class Player:
    """Plays the supervisor of every trial job: one step per round, then SUCCEEDED; with `eval_every`,
    every that many steps also an eval loss (the step's loss + 0.5)."""

    def __init__(self, runtime: ScriptedRuntime, eval_every: int = 0):
        self.runtime = runtime
        self.eval_every = eval_every
        self.steps: dict[str, int] = {}

    def round(self, scheduler: Scheduler) -> None:
        for job_id in list(self.runtime.logs):
            record = scheduler.store.get_job(job_id)
            if record.terminal or record.state == JobState.CANCELLING or job_id not in self.runtime.alive:
                continue
            done = self.steps.get(job_id, 0)
            if done == 0:
                self.runtime.state(job_id, JobState.RUNNING, "ranks up")
            if done < STEPS:
                step = self.steps[job_id] = done + 1
                value = loss(record.job.spec.training.lr, step)
                evaluated = self.eval_every and step % self.eval_every == 0
                self.runtime.step(job_id, step, value, eval_loss=value + 0.5 if evaluated else None)
            else:
                self.runtime.state(job_id, JobState.SUCCEEDED, "done")


def drive(scheduler: Scheduler, driver: SweepDriver, player: Player, sweep_id: str, rounds: int = 400) -> None:
    for _ in range(rounds):
        scheduler.tick()
        driver.tick()
        if scheduler.store.get_sweep(sweep_id).state.terminal:
            return
        player.round(scheduler)
        time.sleep(0.002)  # lets the scheduler's cancel threads run
    raise AssertionError(f"sweep {sweep_id} did not end: {scheduler.store.get_sweep(sweep_id)}")


def settle_cancels(scheduler: Scheduler) -> None:
    deadline = time.monotonic() + 10
    while scheduler.store.list_jobs(states=[JobState.CANCELLING]):
        assert time.monotonic() < deadline, "cancels did not finish"
        time.sleep(0.01)
        scheduler.tick()


def assert_accounted(scheduler: Scheduler, sweep_id: str, trials: int) -> None:
    """Trials 0..trials-1 exist once each, each with its own job labelled with the sweep and its number."""
    record = scheduler.store.get_sweep(sweep_id)
    assert [t.number for t in record.trials] == list(range(trials))
    jobs = scheduler.store.list_jobs(labels={SWEEP_LABEL: sweep_id})
    assert sorted(j.id for j in jobs) == sorted(t.job_id for t in record.trials)
    by_id = {j.id: j for j in jobs}
    for trial in record.trials:
        job = by_id[trial.job_id]
        assert job.labels[TRIAL_LABEL] == str(trial.number) and job.labels["team"] == "a"
        assert job.job.spec.training.lr == trial.params["spec.training.lr"]
        assert job.job.spec.training.warmup_steps == trial.params["spec.training.warmup_steps"]
        assert trial.state != TrialState.RUNNING


def start_sweep(tmp_path: Path, runtime: ScriptedRuntime) -> tuple[Scheduler, SweepDriver, SweepRecord, Player]:
    """The scheduler, the sweep driver, the sweep of `sweep_spec()` created, and a player of its jobs."""
    scheduler = make_scheduler(tmp_path, runtime)
    record, _ = scheduler.store.create_sweep(sweep_spec())
    return scheduler, SweepDriver(scheduler.store, scheduler), record, Player(runtime)


def test_sweep_runs_trials_as_jobs_prunes_bad_ones_and_finds_the_best(tmp_path: Path) -> None:
    scheduler, driver, record, player = start_sweep(tmp_path, ScriptedRuntime())
    driver.tick()
    assert len(scheduler.store.list_jobs(labels={SWEEP_LABEL: record.id})) == 2  # parallel_trials at once
    drive(scheduler, driver, player, record.id)
    settle_cancels(scheduler)

    record = scheduler.store.get_sweep(record.id)
    assert record.state == SweepState.SUCCEEDED
    assert_accounted(scheduler, record.id, 8)
    pruned = [t for t in record.trials if t.state == TrialState.PRUNED]
    complete = [t for t in record.trials if t.state == TrialState.COMPLETE]
    assert pruned and complete
    for trial in pruned:
        job = scheduler.store.get_job(trial.job_id)
        assert job.state == JobState.CANCELLED and job.reason == trial.reason
        assert job.reason.startswith(f"pruned at step {trial.objective_step}: ") and trial.objective_step < STEPS
    for trial in complete:  # the objective is the last step's loss, as the job reported it
        metrics = scheduler.store.step_metrics(trial.job_id)
        assert (trial.objective_step, trial.objective) == (STEPS, metrics[-1]["loss"])
    # a pruned trial was worse, at its last step, than the median of the completed trials there
    for trial in pruned:
        others = sorted(
            scheduler.store.step_metrics(t.job_id)[trial.objective_step - 1]["loss"]
            for t in complete if t.end_time < trial.end_time
        )
        if others:
            assert trial.objective > others[(len(others) - 1) // 2]


def test_service_restart_mid_sweep_accounts_for_every_trial_once(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()  # the supervisors outlive the service, as Ray actors do
    scheduler = make_scheduler(tmp_path, runtime)
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(sweep_spec(trials=6, parallel=3, rule="none"))
    player = Player(runtime)
    for _ in range(14):  # some trials finished, others half way
        scheduler.tick()
        driver.tick()
        player.round(scheduler)
    before = scheduler.store.get_sweep(record.id)
    assert any(t.state == TrialState.COMPLETE for t in before.trials)
    assert any(t.state == TrialState.RUNNING for t in before.trials)
    # SIGKILL: nothing of the old service's memory survives; a new one opens the same store
    scheduler = make_scheduler(tmp_path, runtime)
    scheduler.recover()
    driver = SweepDriver(scheduler.store, scheduler)
    driver.recover()
    drive(scheduler, driver, player, record.id)

    after = scheduler.store.get_sweep(record.id)
    assert after.state == SweepState.SUCCEEDED
    assert_accounted(scheduler, record.id, 6)
    assert all(t.state == TrialState.COMPLETE for t in after.trials)
    for old in before.trials:  # what was recorded before the crash is kept as it was
        new = after.trials[old.number]
        assert (new.job_id, new.params) == (old.job_id, old.params)
        if old.state == TrialState.COMPLETE:
            assert (new.objective, new.objective_step) == (old.objective, old.objective_step)
    best = min(after.trials, key=lambda t: t.objective)
    assert best.objective == min(loss(t.params["spec.training.lr"], STEPS) for t in after.trials)


def test_restart_cancels_the_job_of_a_trial_pruned_just_before_a_crash(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(sweep_spec(trials=2, parallel=1))
    driver.tick()
    scheduler.tick()
    trial = scheduler.store.get_sweep(record.id).trials[0]
    runtime.state(trial.job_id, JobState.RUNNING, "ranks up")
    scheduler.tick()
    # the driver settled the trial as pruned, then the service died before cancelling its job
    scheduler.store.finish_trial(record.id, 0, TrialState.PRUNED, reason="pruned at step 1: test")
    assert scheduler.store.get_job(trial.job_id).state == JobState.RUNNING
    scheduler = make_scheduler(tmp_path, runtime)
    scheduler.recover()
    SweepDriver(scheduler.store, scheduler).recover()
    settle_cancels(scheduler)
    job = scheduler.store.get_job(trial.job_id)
    assert job.state == JobState.CANCELLED and job.reason == "pruned at step 1: test"


def test_cancelled_sweep_creates_no_trial_and_its_queued_trials_end(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(sweep_spec(trials=4, parallel=2))
    driver.tick()
    scheduler.store.finish_sweep(record.id, SweepState.CANCELLED, "enough")
    driver.tick()
    record = scheduler.store.get_sweep(record.id)
    assert len(record.trials) == 2 and {t.state for t in record.trials} == {TrialState.CANCELLED}
    assert scheduler.store.create_trial(record.id, 2, {}, None) is None


def test_command_job_sweep_passes_parameters_in_the_environment(tmp_path: Path) -> None:
    """A command-job template: the parameter reaches the program as an environment variable, and the
    objective is the loss its trainctl.report calls send."""
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    driver = SweepDriver(scheduler.store, scheduler)
    sweep = parse_sweep_object({
        "metadata": {"name": "script-sweep"},
        "spec": {
            "template": {"command": {"program": "python", "args": ["train.py"]}, "resources": {"gpus": 2, "device": "cpu"}},
            "parameters": [{"path": "spec.command.env.LR", "type": "float", "low": 1e-4, "high": 1e-1, "log": True}],
            "trials": 3, "parallel_trials": 3, "algorithm": "random",
        },
    })
    record, _ = scheduler.store.create_sweep(sweep)
    driver.tick()
    scheduler.tick()
    trials = scheduler.store.get_sweep(record.id).trials
    for trial in trials:
        job = scheduler.store.get_job(trial.job_id).job
        assert job.spec.command is not None and job.spec.command.env == {"LR": str(trial.params["spec.command.env.LR"])}
        assert job.spec.resources.gpus == 2 and job.spec.parallelism.dp_replicate == 2
    scheduler.tick()
    for trial in trials:
        runtime.run(trial.job_id, [2.0, loss(trial.params["spec.command.env.LR"], 2)])
    for _ in range(3):
        scheduler.tick()
        driver.tick()
    record = scheduler.store.get_sweep(record.id)
    assert record.state == SweepState.SUCCEEDED
    assert [t.objective for t in record.trials] == [loss(t.params["spec.command.env.LR"], 2) for t in record.trials]


@dataclass
class SlowCancels(ScriptedRuntime):
    """A cluster whose cancelled jobs let go of their GPUs only once `release` is set."""

    release: threading.Event = field(default_factory=threading.Event)

    def cancel(self, job_id: str) -> JobStatus:
        self.release.wait(60)
        return super().cancel(job_id)


def test_a_sweep_ends_only_once_the_jobs_of_its_pruned_trials_have_ended(tmp_path: Path) -> None:
    runtime = SlowCancels()
    scheduler, driver, record, player = start_sweep(tmp_path, runtime)
    try:
        with pytest.raises(AssertionError, match="did not end"):
            drive(scheduler, driver, player, record.id, rounds=300)
        waiting = scheduler.store.get_sweep(record.id)
        assert waiting.state == SweepState.RUNNING and len(waiting.trials) == 8
        assert all(t.state != TrialState.RUNNING for t in waiting.trials)  # every trial settled
        assert scheduler.store.list_jobs(labels={SWEEP_LABEL: record.id}, states=[JobState.CANCELLING])
    finally:
        runtime.release.set()
    drive(scheduler, driver, player, record.id)
    assert scheduler.store.get_sweep(record.id).state == SweepState.SUCCEEDED
    assert all(job.terminal for job in scheduler.store.list_jobs(labels={SWEEP_LABEL: record.id}))


def test_a_pruned_trials_cancel_lost_to_a_store_error_is_sent_again_by_the_next_pass(tmp_path: Path) -> None:
    """The driver settles a trial PRUNED, then its job's cancel fails (the database gone for a moment): the
    next pass sends it again, so the job does not run to its end holding its GPUs."""
    scheduler, driver, record, player = start_sweep(tmp_path, ScriptedRuntime())
    cancel, failed = scheduler.request_cancel, []

    def fail_the_first_cancel(job_id: str, reason: str) -> Any:
        if not failed:
            failed.append(job_id)
            raise StoreUnavailable("the database is unreachable (injected)")
        return cancel(job_id, reason)

    scheduler.request_cancel = fail_the_first_cancel  # type: ignore[method-assign]
    for _ in range(400):
        scheduler.tick()
        with contextlib.suppress(StoreUnavailable):  # SweepDriver._run logs it and goes on
            driver.tick()
        if failed:
            break
        player.round(scheduler)
    assert failed, "no trial was pruned"
    driver.tick()
    job = scheduler.store.get_job(failed[0])
    assert job.state == JobState.CANCELLING and job.reason.startswith("pruned at step ")
    assert job.reason == next(t.reason for t in scheduler.store.get_sweep(record.id).trials if t.job_id == failed[0])
    drive(scheduler, driver, player, record.id)
    settle_cancels(scheduler)
    assert scheduler.store.get_job(failed[0]).state == JobState.CANCELLED


@pytest.mark.parametrize("leading_before", [True, False], ids=["driver-leading", "driver-leading-after"])
def test_a_cancel_sweep_cut_short_by_a_store_error_is_completed_by_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leading_before: bool
) -> None:
    """CancelSweep settles every running trial CANCELLED, then cancels their jobs one by one; when a cancel
    fails, the rest are cancelled by the driver's next pass: the driver that drove the sweep, or a
    standby's driver on its first pass as the leader."""
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    leading = [True]
    monkeypatch.setattr(Scheduler, "leading", property(lambda _s: leading[0]))
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(sweep_spec(trials=4, parallel=2))
    driver.tick()
    scheduler.tick()
    leading[0] = leading_before
    driver.tick()
    jobs = [t.job_id for t in scheduler.store.get_sweep(record.id).trials]
    assert len(jobs) == 2 and all(scheduler.store.get_job(j).state == JobState.SCHEDULED for j in jobs)
    cancel = scheduler.request_cancel

    def the_second_cancel_fails(job_id: str, reason: str) -> Any:
        if job_id == jobs[1]:
            raise StoreUnavailable("the database is unreachable (injected)")
        return cancel(job_id, reason)

    scheduler.request_cancel = the_second_cancel_fails  # type: ignore[method-assign]
    servicer = TrainingServicer(scheduler.store, scheduler, scheduler.pool, Authenticator(None), sweeps=driver)
    with pytest.raises(StoreUnavailable):
        servicer.CancelSweep(pb.CancelSweepRequest(id=record.id, reason="enough"), Principal("ops", "default", Role.ADMIN))
    scheduler.request_cancel = cancel  # type: ignore[method-assign]
    assert [scheduler.store.get_job(j).state for j in jobs] == [JobState.CANCELLING, JobState.SCHEDULED]

    leading[0] = True
    driver.tick()
    assert [scheduler.store.get_job(j).state for j in jobs] == [JobState.CANCELLING, JobState.CANCELLING]
    assert scheduler.store.get_job(jobs[1]).reason == "enough"
    settle_cancels(scheduler)
    assert all(scheduler.store.get_job(j).state == JobState.CANCELLED for j in jobs)


def eval_sweep(**spec: Any) -> Sweep:
    """`sweep_spec` with eval_loss as the objective and a template that evaluates every 2 steps."""
    sweep = sweep_spec(**spec)
    document = sweep.model_dump(mode="json", exclude_unset=True)
    document["spec"]["template"]["evaluation"] = {"holdout_fraction": 0.1, "interval_steps": 2, "at_end": False}
    document["spec"]["objective"] = {**document["spec"].get("objective", {}), "metric": "eval_loss"}
    return parse_sweep_object(document)


def test_an_eval_loss_objective_is_the_newest_step_that_carries_it_and_can_pick_another_best(tmp_path: Path) -> None:
    """Issue 37: eval_loss is only on the steps that evaluated. A trial's objective is its newest such
    step (not its last step), the trial that trains best is not the one that evaluates best (it
    overfits), and a trial that never reports eval_loss fails with a reason instead of breaking the sweep."""
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(eval_sweep(trials=3, parallel=3, rule="none"))
    driver.tick()
    scheduler.tick()
    overfits, generalises, silent = (t.job_id for t in scheduler.store.get_sweep(record.id).trials)
    for job_id, losses, evals in ((overfits, [3.0, 2.0, 1.5, 1.0], {2: 2.5, 3: 2.8}),
                                  (generalises, [3.0, 2.5, 2.0, 1.8], {2: 2.6, 3: 2.4}),
                                  (silent, [3.0, 2.0, 1.0, 0.5], {})):
        runtime.state(job_id, JobState.RUNNING, "ranks up")
        for step, value in enumerate(losses, start=1):
            runtime.step(job_id, step, value, eval_loss=evals.get(step))
        runtime.state(job_id, JobState.SUCCEEDED, "done")
    for _ in range(20):
        scheduler.tick()
        driver.tick()
    record = scheduler.store.get_sweep(record.id)
    assert record.state == SweepState.SUCCEEDED
    assert [(t.state, t.objective_step, t.objective) for t in record.trials] == [
        (TrialState.COMPLETE, 3, 2.8), (TrialState.COMPLETE, 3, 2.4), (TrialState.FAILED, None, None)]
    assert record.trials[2].reason == "the job reported no eval_loss at any step"
    assert best_trial(record) == record.trials[1]
    by_loss = min(record.trials, key=lambda t: scheduler.store.get_job(t.job_id).last_loss)
    assert by_loss.job_id == silent and scheduler.store.get_job(overfits).last_loss < scheduler.store.get_job(generalises).last_loss
    rows = scheduler.store.step_metrics(overfits)
    assert objective_value(rows, "eval_loss", 2) == (2, 2.5) and objective_value(rows, "eval_loss", 1) is None
    assert objective_value(rows, "eval_loss", None) == (3, 2.8) and objective_value(rows, "loss", None) == (4, 1.0)


def test_pruning_on_eval_loss_sees_only_the_steps_that_evaluated(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime)
    record, _ = scheduler.store.create_sweep(eval_sweep())
    driver = SweepDriver(scheduler.store, scheduler)
    drive(scheduler, driver, Player(runtime, eval_every=2), record.id)
    settle_cancels(scheduler)
    record = scheduler.store.get_sweep(record.id)
    pruned = [t for t in record.trials if t.state == TrialState.PRUNED]
    complete = [t for t in record.trials if t.state == TrialState.COMPLETE]
    assert record.state == SweepState.SUCCEEDED and pruned and complete
    for trial in pruned:  # stopped at a step that carried eval_loss, judged by it
        rows = {r["step"]: r for r in scheduler.store.step_metrics(trial.job_id)}
        assert trial.objective_step % 2 == 0 and trial.objective == rows[trial.objective_step]["eval_loss"]
        assert trial.reason.startswith(f"pruned at step {trial.objective_step}: eval_loss ")
    for trial in complete:
        assert (trial.objective_step, trial.objective) == (STEPS, scheduler.store.step_metrics(trial.job_id)[-1]["eval_loss"])
    rebuilt = driver._rebuild(record).study.trials
    assert {step for t in rebuilt for step in t.intermediate_values} <= set(range(2, STEPS + 1, 2))


def test_a_nan_objective_fails_its_trial_and_is_never_the_best(tmp_path: Path, store_location: str) -> None:
    """A trial whose job's last loss is NaN (a diverged run) is FAILED, as Optuna counts it, on either
    store; a NaN objective recorded COMPLETE by an older trainctl is neither the best nor stops a rebuild."""
    runtime = ScriptedRuntime()
    scheduler = make_scheduler(tmp_path, runtime, store=store_location)
    driver = SweepDriver(scheduler.store, scheduler)
    record, _ = scheduler.store.create_sweep(sweep_spec(trials=2, parallel=2, rule="none"))
    driver.tick()
    scheduler.tick()
    diverged, finite = (t.job_id for t in scheduler.store.get_sweep(record.id).trials)
    runtime.run(diverged, [2.0, math.nan])
    runtime.run(finite, [3.0, 2.5])
    for _ in range(20):
        scheduler.tick()
        driver.tick()
    record = scheduler.store.get_sweep(record.id)
    assert record.state == SweepState.SUCCEEDED and [t.state for t in record.trials] == [TrialState.FAILED, TrialState.COMPLETE]
    assert record.trials[0].reason == "loss is NaN at step 2" and best_trial(record) == record.trials[1]

    older, _ = scheduler.store.create_sweep(sweep_spec(trials=2, parallel=2, rule="none"))
    params = {"spec.training.lr": 1e-3, "spec.training.warmup_steps": 1}
    scheduler.store.create_trial(older.id, 0, params, None)
    for number, objective in enumerate((math.nan, 1.5), start=1):
        scheduler.store.create_trial(older.id, number, params, None)
        scheduler.store._core.db.execute(  # as an older trainctl settled it
            "UPDATE sweep_trials SET state = ?, objective = ? WHERE sweep_id = ? AND number = ?",
            (TrialState.COMPLETE, objective, older.id, number),
        )
    older = scheduler.store.get_sweep(older.id)
    assert best_trial(older) == older.trials[2]
    driver._rebuild(older)
