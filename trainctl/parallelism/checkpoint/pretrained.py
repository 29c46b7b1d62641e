"""Trained weights out of a checkpoint: find it, know its model, load it as one plain state dict.

A Trainer with a checkpoint directory records its job there as `job.json` (`write_run_spec`), so a
checkpoint describes itself: `export`, `generate` and `init_from` need only a path. Accepted paths:
a `step_*` checkpoint, a checkpoint root (its newest complete checkpoint) or a job's run directory
(its `checkpoints/`).

`load_weights(path)` returns the full, merged model weights: for a LoRA run (whose checkpoints hold
only adapters) the base comes from the run's own `init_from`, recursively, and the adapters are
merged in; a LoRA run on a Hugging Face model (`spec.model.from_pretrained`) takes its base from
that directory (`hf_import`). Reading uses DCP without a process group (every caller reads the whole model, as the
engine builds the whole model on CPU before sharding it). A Trainer starting from a Hugging Face model
instead builds it on the meta device (`pretrained_skeleton`) and fills it per rank after sharding
(`sharded_load`).

A job reads another run's checkpoint under its `FileRule` (trainctl.spec.files): the checkpoint
directory whole (every file DCP may open in it) before DCP reads it, and, through `source` and
`hf_import`, its markers, recorded job and base weights. DCP reads through `dcp_reader`: its metadata
unpickled restricted to what DCP writes, every file it names a member of the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainctl.parallelism.checkpoint.dcp_reader import CheckpointReader, load_dcp
from trainctl.parallelism.checkpoint.hf_import import read_model_weights
from trainctl.parallelism.checkpoint.source import FIELD
from trainctl.parallelism.checkpoint.source import CheckpointNotFoundError as CheckpointNotFoundError
from trainctl.parallelism.checkpoint.source import Pretrained as Pretrained
from trainctl.parallelism.checkpoint.source import init_from_problem as init_from_problem
from trainctl.parallelism.checkpoint.source import open_checkpoint as open_checkpoint
from trainctl.parallelism.checkpoint.source import write_run_spec as write_run_spec
from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.model.lora import apply_lora, merge_lora_state
from trainctl.parallelism.model.transformer import Transformer, build_model
from trainctl.spec.files import FileRule
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig

MAX_CHAIN = 16


@contextlib.contextmanager
def _quiet() -> contextlib.AbstractContextManager:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_model_state(step_dir: Path, files: FileRule = FileRule()) -> dict[str, torch.Tensor]:
    """Every tensor under the checkpoint's `model` key, as full plain tensors by parameter name (every
    file of the checkpoint directory checked against `files` first)."""
    files.check_tree(step_dir, FIELD)
    reader = CheckpointReader(step_dir, files, FIELD)
    metadata = reader.read_metadata()
    state = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointNotFoundError(f"{step_dir}: the checkpoint holds no model weights")
    with _quiet():
        load_dcp({"model": state}, reader, no_dist=True)
    return state


def load_weights(pretrained: Pretrained, files: FileRule = FileRule(), _depth: int = 0) -> dict[str, torch.Tensor]:
    """The full model weights of `pretrained`, LoRA adapters merged into their base weights (every file
    read under `files`)."""
    state = read_model_state(pretrained.path, files)
    job = pretrained.job
    if job.lora is None:
        return state
    if _depth >= MAX_CHAIN:
        raise CheckpointNotFoundError(f"{pretrained.path}: init_from chain longer than {MAX_CHAIN}")
    if job.model.from_pretrained is not None:  # adapters on a Hugging Face model (the skeleton gives the shapes)
        with torch.device("meta"):
            skeleton = Transformer(pretrained.config)
        base = read_model_weights(job.model.from_pretrained, skeleton, pretrained.config, files)
    elif job.init_from is None:  # adapters on a fresh model: its initialisation is reproducible
        base = build_model(pretrained.config, job.training.seed).state_dict()
    else:
        base = load_weights(open_checkpoint(job.init_from, files=files), files, _depth + 1)
    missing = [k for k in state if k.endswith(".lora_a") and k.replace(".lora_a", ".weight") not in {**base, **state}]
    if missing:
        raise CheckpointNotFoundError(
            f"{pretrained.path}: LoRA checkpoint without base weights for {missing[0]} (its init_from is {job.init_from!r})"
        )
    return merge_lora_state({**base, **state}, job.lora)


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str, field: str = "spec.init_from") -> None:
    """Copy `weights` into a plain model; the names and shapes must match exactly (errors name `field`)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ConfigurationError(
            f"{field}: {source} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ConfigurationError(
                f"{field}: {source}: {name} has shape {tuple(tensor.shape)}, the model needs {tuple(own[name].shape)}"
            )
    model.load_state_dict(weights)


def check_sliding_window(config: ModelConfig, job: JobSpecBody) -> None:
    """Refuse a sequence longer than a Hugging Face model's `sliding_window` (the engine attends to the
    whole causal prefix, so within the window both agree exactly)."""
    if config.sliding_window is not None and job.data.seq_len > config.sliding_window:
        raise ConfigurationError(
            f"spec.data.seq_len: {job.data.seq_len} exceeds config.json sliding_window {config.sliding_window} "
            f"of spec.model.from_pretrained {job.model.from_pretrained}"
        )


def loads_sharded(job: JobSpecBody) -> bool:
    """Whether `job` starts from a Hugging Face model read shard by shard (`pretrained_skeleton`, then
    `sharded_load.fill_from_hf` once parallelized): yes unless `init_from` supplies the weights."""
    return job.model.from_pretrained is not None and job.init_from is None


def pretrained_skeleton(config: ModelConfig, job: JobSpecBody) -> torch.nn.Module:
    """A Hugging Face model's engine model on the meta device, LoRA adapters included: no storage
    until the parallelized parts are filled."""
    check_sliding_window(config, job)
    with torch.device("meta"):
        model = Transformer(config)
    if job.lora is not None:
        apply_lora(model, job.lora, job.training.seed)
    return model


def prepare_model(model: torch.nn.Module, job: JobSpecBody, files: FileRule = FileRule()) -> None:
    """The Trainer's hook for a model built whole, before parallelizing: load `init_from`'s weights
    (read under `files`), then add LoRA adapters."""
    if job.model.from_pretrained is not None:
        check_sliding_window(model.config, job)
    if job.init_from is not None:
        try:
            source = open_checkpoint(job.init_from, files=files)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"{FIELD}: {exc}") from None
        load_into(model, load_weights(source, files), job.init_from)
    if job.lora is not None:
        apply_lora(model, job.lora, job.training.seed)
