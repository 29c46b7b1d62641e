"""pydantic TrainingJob <-> proto Job: lossless both ways, defaults for unset fields, errors name paths."""

from __future__ import annotations

import pytest

from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import SpecError, parse_object
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import job_from_proto, job_to_proto

RICH = {
    "metadata": {"name": "rich-job", "labels": {"team": "nlp", "exp": "42"}},
    "spec": {
        "model": {
            "preset": "debug-moe", "dim": 96, "n_heads": 6, "n_kv_heads": 3, "rope_theta": 5e5, "norm_eps": 1e-6,
            "moe": {
                "num_experts": 8, "top_k": 1, "shared_expert": True, "aux_loss_coef": 0.0, "interval": 2,
                "aux_loss": "transformers",
            },
        },
        "data": {"paths": ["/data/*.txt", "@stdlib"], "tokenizer": "byte", "seq_len": 64, "seed": -7, "max_files": None},
        "parallelism": {
            "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2, "pp": 2, "ep": 4, "sequence_parallel": True,
            "zero_stage": 0, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "cp_load_balance": False,
        },
        "training": {
            "steps": 7, "global_batch_size": 16, "micro_batch_size": 2, "optimizer": "adafactor", "lr": 1e-3,
            "min_lr_ratio": 0.0, "warmup_steps": 0, "weight_decay": 0.0, "beta1": 0.0, "beta2": 0.5, "eps": 1e-6,
            "grad_clip": 0.0, "dtype": "bfloat16", "activation_checkpointing": "selective", "compile": True,
            "seed": 2**40, "log_interval": 3,
        },
        "checkpoint": {"interval_steps": 0, "keep_last": 1, "resume": False},
        "resources": {"gpus": 64, "device": "cpu"},
        "scheduling": {"priority": -1000, "max_restarts": 0, "step_timeout_seconds": 0.5},
    },
}


@pytest.mark.parametrize(
    "document",
    [
        {"metadata": {"name": "defaults"}},
        RICH,
        {"metadata": {"name": "empty-paths"}, "spec": {"data": {"paths": [], "max_files": 5}}},
        {"metadata": {"name": "dense-override"}, "spec": {"model": {"preset": "tiny", "vocab_size": 512}}},
    ],
    ids=["defaults", "rich", "empty-paths", "dense-override"],
)
def test_pydantic_proto_pydantic_is_identity(document: dict) -> None:
    job = TrainingJob.model_validate(document)
    message = job_to_proto(job)
    again = job_from_proto(pb.Job.FromString(message.SerializeToString()))
    assert again == job
    assert again.model_dump() == job.model_dump()


def test_proto_pydantic_proto_is_identity() -> None:
    message = job_to_proto(TrainingJob.model_validate(RICH))
    assert job_to_proto(job_from_proto(message)) == message


def test_rich_fields_land_in_typed_proto_fields() -> None:
    message = job_to_proto(TrainingJob.model_validate(RICH))
    assert message.api_version == "trainctl/v1" and message.kind == "TrainingJob"
    assert dict(message.metadata.labels) == {"team": "nlp", "exp": "42"}
    assert message.spec.model.moe.num_experts == 8 and message.spec.model.moe.shared_expert
    assert message.spec.parallelism.pp_schedule == pb.PIPELINE_SCHEDULE_INTERLEAVED_1F1B
    assert message.spec.training.optimizer == pb.OPTIMIZER_ADAFACTOR
    assert message.spec.training.dtype == pb.DTYPE_BFLOAT16
    assert message.spec.resources.device == pb.DEVICE_CPU
    assert message.spec.data.WhichOneof("file_limit") == "all_files"
    assert list(message.spec.data.paths.values) == ["/data/*.txt", "@stdlib"]
    assert message.spec.parallelism.HasField("zero_stage") and message.spec.parallelism.zero_stage == 0


def test_unset_fields_take_spec_defaults() -> None:
    job = job_from_proto(pb.Job(metadata=pb.ObjectMeta(name="sparse"), spec=pb.JobSpec(training=pb.TrainingSpec(steps=5))))
    assert job.spec.training.steps == 5
    assert job == TrainingJob.model_validate({"metadata": {"name": "sparse"}, "spec": {"training": {"steps": 5}}})
    assert job.spec.model.moe is None and job.spec.data.paths == ["@stdlib"] and job.spec.data.max_files == 2000


def test_optional_override_absent_vs_present() -> None:
    spec = pb.JobSpec(model=pb.ModelSpec(preset="debug"))
    assert job_from_proto(pb.Job(metadata=pb.ObjectMeta(name="a"), spec=spec)).spec.model.dim is None
    spec.model.dim = 128
    assert job_from_proto(pb.Job(metadata=pb.ObjectMeta(name="a"), spec=spec)).spec.model.dim == 128


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.Job(metadata=pb.ObjectMeta(name="x"), spec=pb.JobSpec(training=pb.TrainingSpec(steps=0))), "spec.training.steps"),
        (pb.Job(metadata=pb.ObjectMeta(name="")), "metadata.name"),
        (pb.Job(), "metadata"),
        (pb.Job(metadata=pb.ObjectMeta(name="x"), spec=pb.JobSpec(training=pb.TrainingSpec(optimizer=99))), "spec.training.optimizer"),
        (pb.Job(metadata=pb.ObjectMeta(name="x"), api_version="v2"), "apiVersion"),
        (pb.Job(metadata=pb.ObjectMeta(name="x"), spec=pb.JobSpec(parallelism=pb.ParallelismSpec(zero_stage=7))), "spec.parallelism.zero_stage"),
        (pb.Job(metadata=pb.ObjectMeta(name="x"), spec=pb.JobSpec(data=pb.DataSpec(max_files=0))), "spec.data.max_files"),
    ],
    ids=["zero-steps", "empty-name", "no-metadata", "unknown-enum", "api-version", "zero-stage", "max-files"],
)
def test_bad_proto_names_the_field(message: pb.Job, field: str) -> None:
    with pytest.raises(SpecError) as info:
        job_from_proto(message)
    assert field in [v.field for v in info.value.violations]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_integer_beyond_int64_is_a_field_error(seed: int) -> None:
    with pytest.raises(SpecError) as info:
        parse_object({"metadata": {"name": "x"}, "spec": {"data": {"seed": seed}}})
    assert [v.field for v in info.value.violations] == ["spec.data.seed"]


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_int64_extremes_round_trip(seed: int) -> None:
    job = parse_object({"metadata": {"name": "x"}, "spec": {"data": {"seed": seed}, "training": {"seed": seed}}})
    assert job_from_proto(job_to_proto(job)) == job
