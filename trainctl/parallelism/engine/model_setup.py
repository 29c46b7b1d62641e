"""The model a rank trains: built, loaded and parallelized (the Trainer's model setup step).

Two ways, both ending in `layouts.parallelize`:

- built whole on CPU from the training seed (a preset or a Hugging Face shape with `init_from`):
  `init_from`'s weights loaded, LoRA added, then cut and wrapped, so every layout starts from
  bit-identical weights;
- a Hugging Face model (`spec.model.from_pretrained` without `init_from`): built on the meta device
  (LoRA adapters included), cut and sharded there, then `parallelize` calls `fill_pretrained`, which
  gives the parts storage on the device and reads only this rank's regions of the checkpoint
  (`checkpoint.sharded_load`). The values equal the whole-model path's, bit for bit.

Either way every file is read under the job's `FileRule` (trainctl.spec.files).
"""

from __future__ import annotations

import torch
from torch import nn

from trainctl.parallelism.checkpoint import pretrained
from trainctl.parallelism.checkpoint.sharded_load import fill_from_hf
from trainctl.parallelism.layouts.mesh import ParallelMesh
from trainctl.parallelism.layouts.parallelize import ParallelModel, canonical_name, parallelize
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.files import FileRule
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig


def build_parallel_model(
    job: JobSpecBody, config: ModelConfig, pmesh: ParallelMesh | None, device: torch.device, files: FileRule = FileRule()
) -> ParallelModel:
    """This rank's parallelized model of `job`, its weights read under `files` (see the module
    docstring for the two ways)."""
    torch.manual_seed(job.training.seed)
    if pretrained.loads_sharded(job):
        skeleton = pretrained.pretrained_skeleton(config, job)

        def materialize(parts: list[nn.Module]) -> None:
            fill_pretrained(parts, job, config, device, files)

        return parallelize(skeleton, pmesh, job, device, materialize=materialize)
    model = build_model(config, job.training.seed)
    pretrained.prepare_model(model, job, files)
    return parallelize(model, pmesh, job, device)


def fill_pretrained(
    parts: list[nn.Module], job: JobSpecBody, config: ModelConfig, device: torch.device, files: FileRule = FileRule()
) -> None:
    """Give meta-device `parts` (cut and sharded) storage on `device`, then this rank's regions of the
    Hugging Face checkpoint `job.model.from_pretrained`, read under `files` (adapters: their seeded start)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep Parameter objects: tied stay tied
    try:
        for part in parts:
            part.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    named = [(canonical_name(n), p) for part in parts for n, p in part.named_parameters()]
    fill_from_hf(named, job.model.from_pretrained, config, job.training.seed, files)
