"""Single-device efficiency knobs: `micro_batch_size: auto` (estimator choice, CUDA probe),
`empty_cache_steps` with the allocator report, and pinned prefetching; the CUDA parts run only
where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from harness import tiny_job

from trainctl.parallelism.data.corpus import ShardedLoader
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.token_shards import PrefetchLoader
from trainctl.parallelism.engine import efficiency
from trainctl.parallelism.engine.trainer import StepReport, Trainer
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.micro_batch import micro_batch_candidates, with_micro_batch_size
from trainctl.spec.job import DataSpec, TrainingJob
from trainctl.spec.validate import semantic_violations

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_auto_takes_the_largest_micro_batch_whose_estimate_fits(corpus: str) -> None:
    job = tiny_job(corpus, training={"micro_batch_size": "auto"}, dp_replicate=2)
    resolved = ResolvedJob.resolve(job)
    assert micro_batch_candidates(job) == [4, 2, 1]
    estimates = {m: efficiency.peak_estimate(resolved.with_spec(with_micro_batch_size(job, m))) for m in (4, 2, 1)}
    assert estimates[4] > estimates[2] > estimates[1]
    assert efficiency.choose_micro_batch_size(resolved, estimates[4]) == 4
    assert efficiency.choose_micro_batch_size(resolved, estimates[4] - 1) == 2
    assert efficiency.choose_micro_batch_size(resolved, estimates[2] - 1) == 1
    with pytest.raises(ValueError, match="spec.training.micro_batch_size: auto found no micro-batch"):
        efficiency.choose_micro_batch_size(resolved, estimates[1] - 1)
    fixed = ResolvedJob.resolve(tiny_job(corpus, training={"micro_batch_size": 2}))
    assert efficiency.resolve_micro_batch_size(fixed, torch.device("cpu")) is fixed


def test_auto_in_the_trainer_resolves_before_the_loader(corpus: str) -> None:
    trainer = Trainer(tiny_job(corpus, steps=2, training={"micro_batch_size": "auto"}), device="cpu")
    assert trainer.job.training.micro_batch_size == 8  # the debug model fits many times in host memory
    assert trainer.loader.n_micro == 1
    assert trainer.run().steps_completed == 2


def test_auto_is_refused_with_pipeline_parallel() -> None:
    job = TrainingJob.model_validate({
        "metadata": {"name": "x"},
        "spec": {"parallelism": {"pp": 2}, "resources": {"gpus": 2}, "training": {"micro_batch_size": "auto"}},
    })
    assert "spec.training.micro_batch_size" in [v.field for v in semantic_violations(job, check_data=False)]


def test_probe_halves_on_out_of_memory_until_a_step_fits() -> None:
    tried: list[int] = []

    def try_step(micro: int) -> None:
        tried.append(micro)
        if micro > 2:
            raise torch.cuda.OutOfMemoryError("simulated")

    assert efficiency.probe_micro_batch(try_step, [8, 4, 2, 1], start=4) == 2
    assert tried == [4, 2]
    assert efficiency.probe_micro_batch(lambda m: None, [8, 4, 2, 1], start=8) == 8


def test_allocator_knobs_are_no_ops_on_cpu() -> None:
    cpu = torch.device("cpu")
    report = efficiency.allocator_report(cpu)
    assert report.reserved_bytes is None and "no caching allocator" in report.note
    assert report.as_breakdown() == {}
    assert efficiency.after_step(4, 2, cpu) is None


@needs_cuda
def test_cuda_auto_probe_and_allocator_report(corpus: str) -> None:
    reports: list[StepReport] = []
    job = tiny_job(corpus, steps=2, training={"micro_batch_size": "auto", "empty_cache_steps": 1})
    job = job.model_copy(update={"resources": job.resources.model_copy(update={"device": "cuda"})})
    trainer = Trainer(job, device="cuda", on_step=reports.append)
    assert trainer.job.training.micro_batch_size in micro_batch_candidates(job)
    trainer.run()
    breakdown = reports[-1].breakdown
    assert breakdown["allocator_reserved_bytes"] >= 0 and 0.0 <= breakdown["allocator_fragmentation"] <= 1.0
    assert breakdown["allocator_retries"] >= 0


@needs_cuda
def test_cuda_prefetch_pins_host_batches(corpus: str) -> None:
    loader = PrefetchLoader(
        ShardedLoader(build_dataset(DataSpec(paths=[corpus], seq_len=16), 256), global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1),
        depth=2, pin_memory=True,
    )
    try:
        assert all(m.inputs.is_pinned() and m.targets.is_pinned() for m in loader.next_batch())
    finally:
        loader.close()
