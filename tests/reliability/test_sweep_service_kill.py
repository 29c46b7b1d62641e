"""A sweep survives a SIGKILL of the service (issue 19): a real `trainctl serve` process on an embedded
2-node Ray (1 simulated GPU each), a 4-trial sweep of 1-GPU debug-model trials two at a time; the
service is killed while two trials run (one of them frozen, so it is certainly mid-run), restarted on
the same data dir, and the sweep completes with every trial accounted for exactly once: trial numbers
0..3 once each, one job per trial and no other, what was recorded before the crash unchanged, each
objective its own job's last reported loss."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from fault_support import assert_nothing_left, rank_pids, signal_all, wait_for
from serve_process import ServeProcess
from small_jobs import trial_template

from trainctl.cli.client import TrainctlClient
from trainctl.spec.sweep import SWEEP_LABEL, parse_sweep_object
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(420)

STEPS = 12


@pytest.fixture(scope="module")
def serve(cluster: EmbeddedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("serve")
    topology = base / "topology.yaml"
    topology.write_text(cluster.topology.to_yaml())
    with ServeProcess(cluster.address, topology, base / "data") as process:
        process.start()
        yield process


def test_sigkilled_service_continues_the_sweep_accounting_for_every_trial_once(serve: ServeProcess, cluster: EmbeddedRay) -> None:
    client = TrainctlClient(serve.target)
    sweep = client.create_sweep(parse_sweep_object({
        "metadata": {"name": "kill-sweep"},
        "spec": {
            "template": trial_template(STEPS),
            "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2, "log": True}],
            "trials": 4, "parallel_trials": 2, "algorithm": "random", "seed": 5,
        },
    }))
    def steps_of_first() -> int:
        trials = client.get_sweep(sweep.id).status.trials
        return trials[0].steps_done if trials else 0

    wait_for(lambda: steps_of_first() >= 2, "trial 0 reporting steps")
    first = client.get_sweep(sweep.id).status.trials[0]
    ranks = list(rank_pids(cluster, first.job_id).values())
    signal_all(ranks, signal.SIGSTOP)  # trial 0 is certainly mid-run while the service is down
    try:
        before = client.get_sweep(sweep.id).status
        assert before.state == pb.SWEEP_STATE_RUNNING and before.trials[0].state == pb.TRIAL_STATE_RUNNING
        serve.kill()
        serve.start()  # same data dir, same port
    finally:
        signal_all(ranks, signal.SIGCONT)

    final = list(client.watch_sweep(sweep.id))[-1]
    assert final.status.state == pb.SWEEP_STATE_SUCCEEDED, final.status.reason
    trials = final.status.trials
    assert [t.number for t in trials] == [0, 1, 2, 3]
    jobs = {j.id: j for j in client.list_jobs(labels={SWEEP_LABEL: sweep.id})}
    assert sorted(jobs) == sorted(t.job_id for t in trials), "one job per trial, and no other"
    for old in before.trials:  # recorded before the crash: kept as it was
        new = trials[old.number]
        assert (new.job_id, dict(new.params)) == (old.job_id, dict(old.params))
        if old.state == pb.TRIAL_STATE_COMPLETE:
            assert (new.objective, new.objective_step) == (old.objective, old.objective_step)
    for trial in trials:
        job = client.get_job(trial.job_id, full=True)
        assert trial.state == pb.TRIAL_STATE_COMPLETE and job.status.state == pb.SUCCEEDED, trial.reason
        assert job.status.restarts == 0 and [m.step for m in job.metrics] == list(range(1, STEPS + 1))
        assert (trial.objective_step, trial.objective) == (STEPS, job.metrics[-1].loss)
    assert "pass failed" not in serve.log_path.read_text()
    client.close()
    assert_nothing_left(cluster)
