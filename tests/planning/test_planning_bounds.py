"""The submit-time fit check and the bounded plan (issue 20): estimates from the configuration, the
largest per-rank estimate against the pool's largest GPU, byte counts that fit the proto's int64."""

from __future__ import annotations

from typing import Any

import yaml

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.fit import fit_violations
from trainctl.planning.plan import plan_job
from trainctl.planning.pool import GpuPool
from trainctl.spec.bounds import INT64_MAX
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import parse_object, semantic_violations
from trainctl.wire.plan_convert import plan_to_proto
from trainctl.workers.topology import simulated_topology
from trainctl.workers.topology.model import parse_topology

H100 = "NVIDIA H100 80GB HBM3"
AT_BOUNDS = {"vocab_size": 4_194_304, "dim": 65_536, "n_layers": 1_024, "n_heads": 1_024, "n_kv_heads": 1_024,
             "ffn_dim": 262_144, "moe": {"num_experts": 1_024, "top_k": 2}}


def pool(gpu_model: str = "simulated", nodes: int = 1) -> GpuPool:
    text = simulated_topology(nodes, 8).to_yaml().replace("gpu_model: simulated", f"gpu_model: {gpu_model}")
    return GpuPool(parse_topology(yaml.safe_load(text)), gpu_model)


def resolved(job: TrainingJob) -> ResolvedJob:
    return ResolvedJob.resolve(job.spec)


def job(model: dict[str, Any], gpus: int = 1, **spec: Any) -> TrainingJob:
    return parse_object({"metadata": {"name": "sized"}, "spec": {
        "model": model, "parallelism": {"dp_shard": gpus}, "resources": {"gpus": gpus},
        "training": {"global_batch_size": gpus, "dtype": "bfloat16"}, **spec,
    }})


def test_a_job_that_fits_its_gpus_passes_and_one_that_cannot_is_refused_with_both_figures() -> None:
    h100s = pool(H100)
    assert fit_violations(resolved(job({"preset": "llama3-8b"}, gpus=8)), h100s) == []
    [refusal] = fit_violations(resolved(job({"preset": "llama3-70b"})), h100s)
    assert refusal.field == "spec.resources.gpus"
    assert "rank 0 needs an estimated" in refusal.description and "largest GPU has 80.0 GiB" in refusal.description


def test_no_fit_check_without_a_known_gpu_memory_or_on_cpu() -> None:
    assert fit_violations(resolved(job({"preset": "llama3-70b"})), pool()) == []
    assert fit_violations(resolved(job({"preset": "llama3-70b"}, resources={"gpus": 1, "device": "cpu"})), pool(H100)) == []


def test_a_plan_with_every_size_at_its_bound_is_bounded_and_its_bytes_fit_int64() -> None:
    giant = job(AT_BOUNDS, gpus=8, data={"seq_len": 2_097_152})
    assert semantic_violations(giant, pool_gpus=8, check_data=False) == []
    plan = plan_job(resolved(giant), pool())
    assert [m.rank for m in plan.memory] == list(range(8))
    assert all(0 < m.bytes["total"] <= INT64_MAX for m in plan_to_proto(plan).memory)


def test_beyond_the_estimate_budget_only_the_first_shard_of_each_stage_is_estimated() -> None:
    giant = job(AT_BOUNDS, gpus=32)
    plan = plan_job(resolved(giant), pool(nodes=4))
    assert any("too large to estimate every shard" in note for note in plan.notes), plan.notes
    assert [m.rank for m in plan.memory] == [0]


def test_micro_batch_auto_is_planned_with_micro_batch_one() -> None:
    plan = plan_job(resolved(job({"preset": "debug"}, gpus=2, training={"global_batch_size": 4, "micro_batch_size": "auto"})), pool())
    assert plan.valid and len(plan.memory) == 2
    assert any("micro_batch_size auto" in note for note in plan.notes)
