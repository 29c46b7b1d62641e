"""The sweep driver: turns each RUNNING sweep's search into trial jobs, one pass per tick, in its own thread.

Per pass and sweep: report every trial job's new step metrics to the search, settle the trials whose
jobs ended (COMPLETE with the objective, or FAILED), stop the trials the early-stopping rule condemns
(PRUNED, then the job is cancelled with reason `pruned at step N: ...`), ask for new trials while fewer
than `parallel_trials` run and fewer than `trials` exist, and end the sweep when every trial is settled
and every trial's job has ended (a pruned trial's job may still be cancelling when the trial settles).

The search is an Optuna study used through ask-and-tell (docs/sweeps.md says why Optuna). The store is
the only state: a trial and its job are recorded in one transaction, settled by compare-and-set, and the
study is a cache rebuilt from the stored trials (finished ones re-added with their recorded values and
step metrics, running ones re-enqueued with their parameters) the first time a sweep is seen after a
(re)start. A cancel lost between settling a trial PRUNED or CANCELLED and cancelling its job (a store
error, a crash, a CancelSweep cut short) is sent again: by every pass over a running sweep, by the
passes after a sweep ended until none of its trials' jobs is left to cancel, and by `recover` (every
sweep) when the driver starts leading.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import optuna

from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.store import (
    JobStore,
    StoreUnavailable,
    SweepRecord,
    SweepState,
    TrialRecord,
    TrialState,
)
from trainctl.spec.sweep import Sweep, SweepParameter, trial_job
from trainctl.spec.validate import SpecError, semantic_violations
from trainctl.workers.events import JobState

log = logging.getLogger(__name__)

_CANCELLABLE = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING)
_STOPPED = (TrialState.PRUNED, TrialState.CANCELLED)
"""Trial states whose job must be cancelled."""
_FINISHED = {TrialState.COMPLETE: optuna.trial.TrialState.COMPLETE, TrialState.PRUNED: optuna.trial.TrialState.PRUNED}


@dataclass
class _Study:
    """The in-memory search of one sweep: the study, the Optuna trial of each RUNNING trial, and the
    last step reported to it."""

    study: optuna.Study
    distributions: dict[str, optuna.distributions.BaseDistribution]
    handles: dict[int, optuna.Trial] = field(default_factory=dict)
    reported: dict[int, int] = field(default_factory=dict)


def distribution(parameter: SweepParameter) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution of a (validated) parameter."""
    if parameter.type == "choice":
        return optuna.distributions.CategoricalDistribution(list(parameter.values or ()))
    if parameter.type == "int":
        return optuna.distributions.IntDistribution(int(parameter.low), int(parameter.high), log=parameter.log)  # type: ignore[arg-type]
    return optuna.distributions.FloatDistribution(float(parameter.low), float(parameter.high), log=parameter.log)  # type: ignore[arg-type]


def new_study(sweep: Sweep, seed_offset: int) -> optuna.Study:
    """An in-memory study with the sweep's direction, sampler (seeded with seed + `seed_offset`, so a
    rebuilt study does not replay the first samples) and pruner."""
    spec = sweep.spec
    seed = spec.seed + seed_offset
    if spec.algorithm == "random":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials)
    stopping = spec.early_stopping
    if stopping.rule == "median":
        pruner: optuna.pruners.BasePruner = optuna.pruners.MedianPruner(
            n_startup_trials=stopping.startup_trials, n_warmup_steps=stopping.min_steps
        )
    elif stopping.rule == "successive_halving":
        pruner = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=stopping.min_steps, reduction_factor=stopping.reduction_factor
        )
    else:
        pruner = optuna.pruners.NopPruner()
    return optuna.create_study(direction=spec.objective.direction, sampler=sampler, pruner=pruner)


class SweepDriver:
    """Advances every RUNNING sweep of `store`, creating and cancelling trial jobs through `scheduler`."""

    def __init__(self, store: JobStore, scheduler: Scheduler, *, interval: float = 0.5):
        self.store = store
        self.scheduler = scheduler
        self.interval = interval
        self._studies: dict[str, _Study] = {}
        self._running: set[str] = set()
        """The sweeps the last pass found RUNNING."""
        self._ended: set[str] = set()
        """Sweeps that ended since this driver leads, until none of their trials' jobs is left to cancel."""
        self._leading = False
        """Whether the last pass found the scheduler leading (a pass that finds it newly leading recovers)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        optuna.logging.set_verbosity(optuna.logging.WARNING)

    def start(self) -> None:
        """Start the loop (its first pass as the leader repairs interrupted cancels)."""
        self._thread = threading.Thread(target=self._run, name="trainctl-sweeps", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Run the next pass now (a sweep was created)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except StoreUnavailable as exc:  # passes resume when the database returns
                log.warning("sweep pass skipped: %s", exc)
            except Exception:  # the loop must survive anything one sweep does
                log.exception("sweep pass failed")
            self._wake.wait(self.interval)
            self._wake.clear()

    def recover(self) -> None:
        """Cancel the jobs of every sweep's trials settled PRUNED or CANCELLED whose cancel was lost."""
        for record in self.store.list_sweeps():
            self._send_cancels(record)

    def _send_cancels(self, record: SweepRecord) -> bool:
        """Cancel the jobs of the sweep's trials settled PRUNED or CANCELLED that are still cancellable
        (their cancel was lost); whether there was any."""
        sent = False
        for trial in record.trials:
            if trial.state in _STOPPED and trial.job_id is not None and self.store.get_job(trial.job_id).state in _CANCELLABLE:
                log.info("sweep %s: cancelling trial %d's job %s (%s)", record.id, trial.number, trial.job_id, trial.state)
                self.scheduler.request_cancel(trial.job_id, trial.reason)
                sent = True
        return sent

    # ---- one pass ------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Advance every RUNNING sweep once; forget the searches of sweeps that ended. Only the leading
        replica's driver works (trainctl.service.scheduling.leadership); a standby's studies are dropped."""
        if not self.scheduler.leading:
            self._studies.clear()
            self._running.clear()
            self._ended.clear()
            self._leading = False
            return
        if not self._leading:
            self.recover()
            self._leading = True
        running = self.store.list_sweeps(states=[SweepState.RUNNING])
        for record in running:
            try:
                self._advance(record)
            except StoreUnavailable:
                self._studies.pop(record.id, None)  # a write may have committed unseen: rebuild from the store
                raise
            except Exception:
                log.exception("sweep %s: pass failed", record.id)
        running_ids = {r.id for r in running}
        for sweep_id in set(self._studies) - running_ids:
            del self._studies[sweep_id]
        self._cancel_for_ended(running_ids)

    def _cancel_for_ended(self, running: set[str]) -> None:
        """Send the cancels lost for sweeps that were running and ended (a CancelSweep cut short), pass
        after pass until none of their trials' jobs is left to cancel."""
        self._ended |= self._running - running
        self._running = running
        for sweep_id in sorted(self._ended):
            if not self._send_cancels(self.store.get_sweep(sweep_id)):
                self._ended.discard(sweep_id)

    def _advance(self, record: SweepRecord) -> None:
        self._send_cancels(record)
        search = self._studies.get(record.id) or self._rebuild(record)
        for trial in record.trials:
            if trial.state == TrialState.RUNNING:
                self._follow(record, search, trial)
        record = self.store.get_sweep(record.id)
        if record.state != SweepState.RUNNING:
            return
        spec = record.sweep.spec
        running = sum(t.state == TrialState.RUNNING for t in record.trials)
        created = 0
        while len(record.trials) < spec.trials and running < spec.parallel_trials:
            trial = self._ask(record, search)
            if trial is None:
                break
            record.trials.append(trial)
            running += trial.state == TrialState.RUNNING
            created += 1
        if created:
            self.scheduler.wake()
        if len(record.trials) >= spec.trials and running == 0 and self._jobs_ended(record):
            complete = sum(t.state == TrialState.COMPLETE for t in record.trials)
            if complete:
                self.store.finish_sweep(record.id, SweepState.SUCCEEDED, f"{complete} of {len(record.trials)} trials completed")
            else:
                self.store.finish_sweep(record.id, SweepState.FAILED, f"none of {len(record.trials)} trials completed")

    def _jobs_ended(self, record: SweepRecord) -> bool:
        """Whether every trial's job has ended: a pruned trial is settled when its cancel is sent, and
        the sweep ends only once that job has let go of its GPUs."""
        return all(self.store.get_job(t.job_id).terminal for t in record.trials if t.job_id is not None)

    def _ask(self, record: SweepRecord, search: _Study) -> TrialRecord | None:
        """Sample the next trial and record it with its job (or as FAILED when its parameters make no
        valid job); None when the sweep changed meanwhile."""
        number = len(record.trials)
        handle = search.study.ask(search.distributions)
        params = dict(handle.params)
        try:
            job = trial_job(record.sweep, record.id, number, params)
            problems = semantic_violations(job, check_data=False)
        except SpecError as exc:
            job, problems = None, exc.violations
        if problems:
            job = None
        reason = "" if job is not None else "the parameters make no valid job: " + "; ".join(map(str, problems))
        trial = self.store.create_trial(record.id, number, params, job, reason=reason)
        if trial is None:
            search.study.tell(handle, state=optuna.trial.TrialState.FAIL)
            return None
        if trial.job_id is None:
            search.study.tell(handle, state=optuna.trial.TrialState.FAIL)
        else:
            search.handles[number] = handle
            log.info("sweep %s: trial %d is job %s (%s)", record.id, number, trial.job_id, params)
        return trial

    def _follow(self, record: SweepRecord, search: _Study, trial: TrialRecord) -> None:
        """Report a running trial's new steps one by one, asking the early-stopping rule after each while
        its job runs (so a trial is stopped at the first step the rule condemns, however late this pass);
        settle it when its job ended. A job that ran to its end before the rule condemned it completes."""
        assert trial.job_id is not None
        spec = record.sweep.spec
        handle = search.handles[trial.number]
        job = self.store.get_job(trial.job_id)  # read before the steps: a job that ended has all of its steps
        prunable = spec.early_stopping.rule != "none" and not job.terminal
        for row in self.store.step_metrics(job.id, after_step=search.reported.get(trial.number, 0)):
            step = search.reported[trial.number] = int(row["step"])
            if row.get(spec.objective.metric) is None:
                continue
            value = float(row[spec.objective.metric])
            handle.report(value, step)
            if prunable and handle.should_prune():
                self._prune(record, search, trial, job.id, step, value)
                return
        if job.terminal:
            self._settle(record, search, trial, job.state, job.reason)

    def _prune(self, record: SweepRecord, search: _Study, trial: TrialRecord, job_id: str, step: int, value: float) -> None:
        """Settle the trial as PRUNED, then cancel its job with the same reason (the next pass sends the
        cancel again if it is lost: a store error, or the service dying in between)."""
        spec = record.sweep.spec
        reason = (
            f"pruned at step {step}: {spec.objective.metric} {value:.6g} is worse than the "
            f"{spec.early_stopping.rule.replace('_', ' ')} rule allows"
        )
        if self.store.finish_trial(record.id, trial.number, TrialState.PRUNED, reason=reason, objective=value, objective_step=step):
            search.study.tell(search.handles.pop(trial.number), state=optuna.trial.TrialState.PRUNED)
            self.scheduler.request_cancel(job_id, reason)
            log.info("sweep %s: trial %d %s", record.id, trial.number, reason)

    def _settle(self, record: SweepRecord, search: _Study, trial: TrialRecord, state: JobState, job_reason: str) -> None:
        assert trial.job_id is not None
        handle = search.handles.pop(trial.number)
        objective = record.sweep.spec.objective
        if state != JobState.SUCCEEDED:
            self.store.finish_trial(record.id, trial.number, TrialState.FAILED, reason=f"job {state}: {job_reason}")
            search.study.tell(handle, state=optuna.trial.TrialState.FAIL)
            return
        found = objective_value(self.store.step_metrics(trial.job_id), objective.metric, objective.step)
        if found is None:
            at = f"at or before step {objective.step}" if objective.step is not None else "at any step"
            self.store.finish_trial(record.id, trial.number, TrialState.FAILED, reason=f"the job reported no {objective.metric} {at}")
            search.study.tell(handle, state=optuna.trial.TrialState.FAIL)
            return
        step, value = found
        if math.isnan(value):  # a diverged run: Optuna fails a NaN value, and so does the trial
            self.store.finish_trial(record.id, trial.number, TrialState.FAILED, reason=f"{objective.metric} is NaN at step {step}")
            search.study.tell(handle, state=optuna.trial.TrialState.FAIL)
            return
        self.store.finish_trial(
            record.id, trial.number, TrialState.COMPLETE, reason=f"{objective.metric} {value:.6g} at step {step}",
            objective=value, objective_step=step,
        )
        search.study.tell(handle, value)

    def _rebuild(self, record: SweepRecord) -> _Study:
        """The sweep's study from its stored trials: finished trials re-added with their outcome and step
        metrics, running ones re-enqueued (in number order) so their reports and settlement go on."""
        spec = record.sweep.spec
        search = _Study(
            study=new_study(record.sweep, seed_offset=len(record.trials)),
            distributions={p.path: distribution(p) for p in spec.parameters},
        )
        running = []
        for trial in record.trials:
            if trial.state == TrialState.RUNNING:
                running.append(trial)
                continue
            intermediate = self._intermediate(trial.job_id, spec.objective.metric)
            state = _FINISHED.get(trial.state, optuna.trial.TrialState.FAIL)
            if state == optuna.trial.TrialState.COMPLETE and math.isnan(trial.objective):  # recorded before NaN failed a trial
                state = optuna.trial.TrialState.FAIL
            search.study.add_trial(optuna.trial.create_trial(
                params=trial.params, distributions=search.distributions, state=state,
                value=trial.objective if state == optuna.trial.TrialState.COMPLETE else None,
                intermediate_values=intermediate,
            ))
        for trial in running:
            search.study.enqueue_trial(trial.params)
            search.handles[trial.number] = search.study.ask(search.distributions)
        self._studies[record.id] = search
        return search

    def _intermediate(self, job_id: str | None, metric: str) -> dict[int, float]:
        if job_id is None:
            return {}
        return {int(r["step"]): float(r[metric]) for r in self.store.step_metrics(job_id) if r.get(metric) is not None}


def objective_value(rows: list[dict[str, Any]], metric: str, step: int | None) -> tuple[int, float] | None:
    """(step, value) of the objective in a job's step metrics: the last report at or before `step`
    (None: the last report), or None when there is none."""
    found = None
    for row in rows:
        if step is not None and row["step"] > step:
            break
        if row.get(metric) is not None:
            found = (int(row["step"]), float(row[metric]))
    return found
