"""A rank killed mid-run on chat records (JSONL read through cached token shards, with loss masks and a
tokenizer directory) resumes from its checkpoint with no sample repeated or skipped, through the real
service in this process on the shared embedded 2-node Ray (1 simulated GPU per node).

One format is killed here: what differs between formats is only the record reader, and every format's
exact resume (each sample trained once across a checkpoint) is proven in the engine by
tests/parallelism/test_data_formats.py (`test_trainer_resumed_under_another_dp_size_trains_every_sample_once`
for JSONL, Parquet and Arrow chat records, `test_resume_under_another_dp_size_reads_every_sample_once`
for text records).

What the ranks trained is observed two ways: every checkpoint's data position (the global sample
offset the engine saves) is `step x global_batch_size`, and every step's loss, before the kill and
after the resume, equals the loss of the same step of the job trained uninterrupted in one process
(a step on other samples, or on the same samples twice, gives another loss)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from data_sources import build_tokenizer, format_data
from fault_support import assert_nothing_left, kind, rank_pids, read_until, states_of
from small_jobs import restartable_job, single_process_losses

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.checkpoint.dcp import complete_checkpoints
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.server import Service
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = pytest.mark.timeout(420)

STEPS = 8
DATA_KIND = "chat-jsonl"
"""The record format the killed job reads (tests/data_sources.py's `format_data`)."""


@dataclass(frozen=True)
class KilledRun:
    """The job whose rank 1 was killed once mid-run: its spec, id and every event of its watch."""

    spec: TrainingJob
    job_id: str
    seen: list[pb.JobEvent]


def resume_job(root: Path) -> TrainingJob:
    """The 2-rank restartable job on chat records, keeping every checkpoint (to read its data position)."""
    data = format_data(DATA_KIND, root / "data", build_tokenizer(root / "tokenizer"))
    spec = restartable_job(f"{DATA_KIND}-resume", STEPS, labels={"suite": "data-resume"}).model_copy(deep=True)
    spec.spec.data = spec.spec.data.model_validate({**spec.spec.data.model_dump(), **data, "seed": 7})
    spec.spec.checkpoint.keep_last = STEPS
    return spec


def kill_once_and_follow(client: TrainctlClient, cluster: EmbeddedRay, spec: TrainingJob) -> KilledRun:
    """Submit `spec`, SIGKILL its rank 1 once step 3 is reported (checkpoint 2 is complete), and read
    its watch to the end."""
    created = client.create_job(spec)
    stream = client.watch(created.id)
    seen: list[pb.JobEvent] = []
    read_until(stream, seen, lambda e: kind(e) == "step" and e.step.step >= 3)
    [victim] = [pid for name, pid in rank_pids(cluster, created.id).items() if name.endswith("-g0-1")]
    os.kill(victim, signal.SIGKILL)
    seen += list(stream)
    return KilledRun(spec, created.id, seen)


def data_offset(checkpoint: Path) -> int:
    """The global sample offset a checkpoint resumes the loader at."""
    state = {"train": {"data_offset": -1}}
    dcp.load(state, checkpoint_id=str(checkpoint))
    return int(state["train"]["data_offset"])


def test_killed_rank_resumes_record_data_without_repeating_or_skipping_a_sample(
    client: TrainctlClient, service: Service, cluster: EmbeddedRay, tmp_path: Path,
) -> None:
    spec = resume_job(tmp_path)
    with ThreadPoolExecutor(1) as background:  # the reference trains here while the ranks start
        run = background.submit(kill_once_and_follow, client, cluster, spec)
        reference = single_process_losses(spec)
        seen = run.result().seen
        job_id = run.result().job_id
    batch = spec.spec.training.global_batch_size

    assert states_of(seen) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.RESTARTING, pb.RUNNING, pb.SUCCEEDED]
    restart = next(i for i, e in enumerate(seen) if kind(e) == "state_change" and e.state_change.to_state == pb.RESTARTING)
    before = {e.step.step: e.step.loss for e in seen[:restart] if kind(e) == "step"}
    after = {e.step.step: e.step.loss for e in seen[restart:] if kind(e) == "step"}
    resumed = min(after) - 1
    assert resumed >= 2 and resumed % 2 == 0 and resumed <= max(before), (sorted(before), sorted(after))
    assert any(e.log.message.endswith(f"(step {resumed})") and "resumed from checkpoint" in e.log.message
               for e in seen[restart:] if kind(e) == "log")
    assert sorted(after) == list(range(resumed + 1, STEPS + 1))

    for losses in (before, after):
        assert [losses[s] for s in sorted(losses)] == pytest.approx([reference[s - 1] for s in sorted(losses)], rel=1e-4)

    checkpoints = complete_checkpoints(RunDirectory.of_job(service.config.data_dir / "runs", job_id).checkpoints)
    assert [step for step, _ in checkpoints] == list(range(2, STEPS + 1, 2))
    assert [data_offset(path) for _, path in checkpoints] == [step * batch for step, _ in checkpoints]
    status = client.get_job(job_id).status
    assert status.state == pb.SUCCEEDED and status.restarts == 1, status.reason
    assert_nothing_left(cluster)
