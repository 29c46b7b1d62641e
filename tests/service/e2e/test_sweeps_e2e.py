"""A sweep through the real service on the embedded 2-node Ray (issue 19): built-in trial jobs of the
debug model on CPU ranks, two at a time, with median early stopping; every trial is settled, its
objective is its job's own last reported loss, a pruned trial's job ends CANCELLED early with the
pruning reason, and the best trial is the lowest objective, better than the template's default."""

from __future__ import annotations

import pytest

from trainctl.cli.client import TrainctlClient
from trainctl.spec.job import Metadata
from trainctl.spec.sweep import SWEEP_LABEL, parse_sweep_object, trial_job
from trainctl.v1 import training_pb2 as pb

pytestmark = pytest.mark.timeout(300)

STEPS = 40


def test_sweep_of_debug_model_trials_on_the_embedded_cluster(client: TrainctlClient) -> None:
    sweep = parse_sweep_object({
        "metadata": {"name": "e2e-sweep"},
        "spec": {
            "template": {
                "model": {"preset": "debug"},
                "data": {"seq_len": 32, "max_files": 10},
                "training": {"steps": STEPS, "global_batch_size": 2, "warmup_steps": 0},
                "checkpoint": {"interval_steps": 0},
                "resources": {"gpus": 1, "device": "cpu"},
                "scheduling": {"max_restarts": 0},
            },
            "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-6, "high": 3e-2, "log": True}],
            "trials": 6, "parallel_trials": 2, "algorithm": "random", "seed": 1,
            "early_stopping": {"rule": "median", "min_steps": 4, "startup_trials": 1},
        },
    })
    created = client.create_sweep(sweep)
    updates = list(client.watch_sweep(created.id))
    final = client.get_sweep(created.id)
    assert updates[-1].status.state == final.status.state == pb.SWEEP_STATE_SUCCEEDED, final.status.reason
    trials = final.status.trials
    assert [t.number for t in trials] == list(range(6))
    jobs = {j.id: j for j in client.list_jobs(labels={SWEEP_LABEL: created.id})}
    assert sorted(jobs) == sorted(t.job_id for t in trials)
    complete = []
    for trial in trials:
        job = client.get_job(trial.job_id, full=True)
        assert job.spec.training.lr == trial.params["spec.training.lr"].float_value
        if trial.state == pb.TRIAL_STATE_COMPLETE:
            complete.append(trial)
            assert job.status.state == pb.SUCCEEDED
            assert (trial.objective_step, trial.objective) == (STEPS, job.metrics[-1].loss)
        else:
            assert trial.state == pb.TRIAL_STATE_PRUNED, trial.reason
            assert trial.reason.startswith(f"pruned at step {trial.objective_step}: loss ")
            # cancelled with the reason, unless its last step came before the cancel did
            assert (job.status.state, job.status.reason) == (pb.CANCELLED, trial.reason) or job.status.state == pb.SUCCEEDED
    best = min(complete, key=lambda t: t.objective)
    assert (final.status.best_trial, final.status.best_objective) == (best.number, best.objective)
    pruned = [t for t in trials if t.state == pb.TRIAL_STATE_PRUNED]
    assert pruned, "the sampled learning rates include hopeless ones, which the median rule stops"
    stopped = [t for t in pruned if client.get_job(t.job_id).status.state == pb.CANCELLED]
    # the median rule stopped a trial early; another may have run its last step while its cancel was in
    # flight (CANCELLED with every step done: seen once in make test)
    assert any(client.get_job(t.job_id).status.steps_done < STEPS for t in stopped)

    # the template as written (the spec's default learning rate) does worse than the best trial
    default = client.create_job(trial_job(sweep, "none", 0, {}).model_copy(update={"metadata": Metadata(name="e2e-default")}))
    for _ in client.watch(default.id):
        pass
    default = client.get_job(default.id)
    assert default.status.state == pb.SUCCEEDED and default.status.steps_done == STEPS
    assert best.objective < default.status.last_loss
