"""Sharded loading: fill a model built on the meta device, and already cut and sharded, from a Hugging
Face directory, each rank reading only the regions of the tensors it owns.

`owned_region(param)` is where this rank's local tensor sits in the global parameter: for a DTensor
(tensor, expert or FSDP sharding, in any combination) the offsets DTensor itself computes
(`compute_local_shape_and_global_offset`, the function distributed checkpointing uses), for a plain
tensor (a pipeline stage's own layer, a replicated parameter) the whole of it. `fill_from_hf` gives
every parameter storage-backed values: pretrained weights from `hf_import.HFWeights`, LoRA adapters
from `lora.initial_adapter` (cut to the same region), so the result equals loading the whole model
and then parallelizing it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainctl.parallelism.checkpoint.hf_import import HFWeights, Region, whole
from trainctl.parallelism.model.lora import initial_adapter
from trainctl.parallelism.model.lora_names import is_adapter
from trainctl.spec.files import FileRule
from trainctl.spec.presets import ModelConfig


def owned_region(param: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """(this rank's local tensor of `param`, the region of the global tensor it holds)."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
    return param, whole(tuple(param.shape))


@torch.no_grad()
def fill_from_hf(
    named_parameters: Iterable[tuple[str, nn.Parameter]], directory: str | Path, config: ModelConfig, seed: int,
    files: FileRule = FileRule(),
) -> None:
    """Copy into each (canonical name, parameter) its owned region: pretrained weights read from
    `directory` under `files`, adapters from their seeded initial value (`seed`: the training seed)."""
    with HFWeights(directory, config, files) as weights:
        for name, param in named_parameters:
            local, region = owned_region(param)
            shape = tuple(param.shape)
            value = initial_adapter(name, shape, seed)[region] if is_adapter(name) else weights.read(name, shape, region)
            local.copy_(value)
