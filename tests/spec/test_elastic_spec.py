"""`spec.scheduling.elastic`: the smaller layouts an elastic job may shrink to, the layout a plan's size names,
and the submit-time rules, each naming the field."""

from __future__ import annotations

import pytest

from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import elastic_layouts, layout_on, semantic_violations
from trainctl.wire.convert import job_from_proto, job_to_proto


def job(parallelism: dict, gpus: int, batch: int = 8, micro: int | str = 1, **scheduling) -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "e"}, "spec": {
        "model": {"preset": "debug"}, "parallelism": parallelism, "resources": {"gpus": gpus, "device": "cpu"},
        "training": {"global_batch_size": batch, "micro_batch_size": micro}, "scheduling": scheduling,
    }})


def degrees(bodies) -> list[tuple[int, int, int]]:
    return [(b.parallelism.dp_replicate, b.parallelism.dp_shard, b.resources.gpus) for b in bodies]


def test_each_data_parallel_mode_shrinks_its_own_degree_keeping_the_batch_split_even() -> None:
    fsdp = job({"dp_shard": 8}, 8, batch=16, elastic={"min_gpus": 2})
    assert degrees(elastic_layouts(fsdp.spec, 7)) == [(1, 4, 4), (1, 2, 2)], "dp 7, 6, 5 and 3 do not split 16 evenly"
    ddp = job({"dp_replicate": 4}, 4, batch=12, elastic={"min_gpus": 1})
    assert degrees(elastic_layouts(ddp.spec, 8)) == [(3, 1, 3), (2, 1, 2), (1, 1, 1)]
    hsdp = job({"dp_replicate": 4, "dp_shard": 2}, 8, batch=16, elastic={"min_gpus": 2})
    assert degrees(elastic_layouts(hsdp.spec, 7)) == [(2, 2, 4), (1, 2, 2)], "whole shard groups only"
    tp = job({"dp_shard": 4, "tp": 2, "sequence_parallel": True}, 8, elastic={"min_gpus": 4})
    shrunk = list(elastic_layouts(tp.spec, 6))
    assert degrees(shrunk) == [(1, 2, 4)] and shrunk[0].parallelism.tp == 2, "tp kept: 2 replicas of 2 GPUs"
    assert all(body.scheduling.elastic is None for body in shrunk)
    assert list(elastic_layouts(job({"dp_shard": 4}, 4).spec, 3)) == [], "not elastic: nothing"


def test_a_plans_size_names_its_layout() -> None:
    fsdp = job({"dp_shard": 4}, 4, elastic={"min_gpus": 1})
    assert layout_on(fsdp.spec, 4) is fsdp.spec
    assert layout_on(fsdp.spec, 2).parallelism.dp_shard == 2 and layout_on(fsdp.spec, 1).parallelism.dp_shard == 1
    assert layout_on(fsdp.spec, 3) is None, "dp 3 does not split 8"
    assert layout_on(job({"dp_shard": 4}, 4).spec, 2) is None, "not elastic"


@pytest.mark.parametrize(("parallelism", "gpus", "scheduling", "extra", "field", "message"), [
    ({"dp_shard": 4, "tp": 2}, 8, {"min_gpus": 3}, {}, "spec.scheduling.elastic.min_gpus", "3 is not a multiple of pp x cp x tp = 2"),
    ({"dp_shard": 4}, 4, {"min_gpus": 4}, {}, "spec.scheduling.elastic.min_gpus", "4 leaves nothing to shrink"),
    ({"dp_shard": 4}, 4, {"min_gpus": 3}, {}, "spec.scheduling.elastic.min_gpus", "no smaller layout from 4 down to 3 GPUs"),
    ({"dp_shard": 4}, 4, {"min_gpus": 2}, {"checkpoint": {"resume": False}}, "spec.checkpoint.resume", "must be true"),
])
def test_bad_minimums_are_refused_naming_the_field(parallelism, gpus, scheduling, extra, field, message) -> None:
    bad = job(parallelism, gpus, elastic=scheduling)
    bad = bad.model_copy(update={"spec": bad.spec.model_copy(update={
        name: getattr(bad.spec, name).model_copy(update=values) for name, values in extra.items()})})
    violations = [v for v in semantic_violations(bad, check_data=False) if v.field == field]
    assert violations and message in violations[0].description, semantic_violations(bad, check_data=False)


def test_a_command_job_cannot_be_elastic_and_the_field_crosses_the_wire() -> None:
    command = TrainingJob.model_validate({"metadata": {"name": "c"}, "spec": {
        "command": {"program": "train.py"}, "resources": {"gpus": 2}, "scheduling": {"elastic": {"min_gpus": 1}},
    }})
    assert [v.field for v in semantic_violations(command, check_data=False)] == ["spec.scheduling.elastic"]
    good = job({"dp_shard": 4}, 4, elastic={"min_gpus": 2})
    assert semantic_violations(good, check_data=False) == []
    assert job_from_proto(job_to_proto(good)) == good
