"""Apply a parallel layout to the (full, initialised) model, in one fixed order.

    1. split pipeline stages    (pipeline.split_pipeline_stages)  -> this rank's model chunks
    2. float8 linears           (float8.apply_float8, `training.fp8`: before TP, which then shards
                                 the Float8Linear weights, and before FSDP, which gathers them in float8)
    3. tensor + sequence parallel (tensor_parallel.apply_tensor_parallel)
    4. expert parallel          (expert_parallel.apply_expert_parallel, MoE models)
    5. context parallel         (context_parallel.apply_context_parallel: ring attention cores, and
                                 each stage's default positions are its CP shard's, so pipeline
                                 stages that receive only hidden states still apply RoPE correctly)
    6. activation checkpointing (none / selective = every other block / full = every block)
    7. torch.compile            (each decoder block, in place: names do not change)
    8. FSDP / ZeRO / DDP        (data_parallel.apply_data_parallel; EP experts are left out of it)
    9. tied embeddings under PP (tied_embeddings.TiedEmbeddingSync: first/last stage gradient sum)

The model is built whole on CPU from the training seed and only then cut, so every layout starts
from bit-identical weights (see model.init_weights). A model on the meta device (a Hugging Face
model loaded sharded) comes with `materialize(parts)`, which gives the cut parts storage and values
once they are sharded: before step 8 where data parallelism replicates parameters (none, DDP,
ZeRO-1: torch DDP needs real tensors), after it where FSDP shards them (a rank then holds, and
reads, only its TP x FSDP shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainctl.parallelism.layouts.context_parallel import apply_context_parallel
from trainctl.parallelism.layouts.data_parallel import (
    ZeroOneSharding,
    apply_data_parallel,
    has_dtensor_params,
)
from trainctl.parallelism.layouts.dp_mode import DPMode, effective_mode, gathers_parameters
from trainctl.parallelism.layouts.expert_parallel import apply_expert_parallel, expert_parameters
from trainctl.parallelism.layouts.float8 import apply_float8
from trainctl.parallelism.layouts.mesh import ParallelMesh
from trainctl.parallelism.layouts.pipeline import PipelineChunk, split_pipeline_stages
from trainctl.parallelism.layouts.tensor_parallel import apply_tensor_parallel
from trainctl.parallelism.layouts.tied_embeddings import TiedEmbeddingSync
from trainctl.spec.job import JobSpecBody

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(fqn: str) -> str:
    """A parameter's name with wrapper components removed (DDP's leading `module.`, checkpoint and
    compile wrappers): the name it has in the plain model."""
    if fqn.startswith("module."):
        fqn = fqn[len("module.") :]
    for prefix in WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


@dataclass
class ParallelModel:
    """What a rank trains: its model chunks and how they are parallelized."""

    parts: list[nn.Module]
    """This rank's model chunks in pipeline-stage order (one without PP)."""
    dp_mode: DPMode
    """Data-parallel implementation in use."""
    zero1: list[ZeroOneSharding] = field(default_factory=list)
    """Per part, the ZeRO-1 ownership (empty unless dp_mode is zero1)."""
    chunks: list[PipelineChunk] = field(default_factory=list)
    """With PP: this rank's `PipelineChunk`s, whose `.module` is the final (wrapped) part."""
    expert_parallel: bool = False
    """Experts are sharded over EP groups; their gradients need `expert_parallel.reduce_expert_gradients`."""
    tied: TiedEmbeddingSync | None = None
    """With PP and tied embeddings: the first / last stage copies whose gradients are summed."""
    float8: list[str] = field(default_factory=list)
    """Canonical names of the linears that train in float8 (`training.fp8`), over all parts."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(canonical name, parameter) over all parts."""
        return [(canonical_name(n), p) for part in self.parts for n, p in part.named_parameters()]

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def _blocks(part: nn.Module) -> nn.ModuleDict:
    layers = getattr(part, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError("model chunks must keep the decoder blocks in a ModuleDict named `layers`")
    return layers


def apply_activation_checkpointing(part: nn.Module, mode: str) -> None:
    """Wrap blocks in non-reentrant activation checkpointing: `full` every block, `selective` every
    other one (even layer ids), `none` nothing."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"spec.training.activation_checkpointing: unknown mode {mode!r}")
    layers = _blocks(part)
    for name in list(layers.keys()):
        if mode == "full" or int(name) % 2 == 0:
            layers[name] = checkpoint_wrapper(layers[name], preserve_rng_state=False)


def apply_compile(part: nn.Module) -> None:
    """torch.compile each decoder block in place (names and state dicts are unchanged)."""
    for block in _blocks(part).values():
        block.compile()


Materialize = Callable[[list[nn.Module]], None]
"""Gives a meta-device model's parts (cut and sharded) storage on the device and their values."""


def parallelize(
    model: nn.Module,
    pmesh: ParallelMesh | None,
    job: JobSpecBody,
    device: torch.device,
    materialize: Materialize | None = None,
) -> ParallelModel:
    """Cut, shard and wrap `model` for this rank; `pmesh` None means a single process. A model on the
    meta device needs `materialize` (see the module docstring)."""
    par = job.parallelism
    train = job.training
    if pmesh is None and par.world_size != 1:
        raise ValueError(f"the layout needs {par.world_size} ranks but no device mesh was given")

    chunks: list[PipelineChunk] = []
    if par.pp > 1:
        chunks = split_pipeline_stages(
            model, pp_rank=pmesh["pp"].get_local_rank(), pp=par.pp, virtual_stages=par.pp_virtual_stages
        )
        parts = [c.module for c in chunks]
    else:
        parts = [model]
    if materialize is None:
        parts = [p.to(device) for p in parts]
    float8: list[str] = []
    if train.fp8 != "none":
        for part in parts:
            float8 += apply_float8(part, train.fp8, fsdp=pmesh is not None and gathers_parameters(par))

    if par.tp > 1:
        for part in parts:
            apply_tensor_parallel(part, pmesh["tp"], par.sequence_parallel)
    experts: list[list[nn.Parameter]] = [[] for _ in parts]
    if par.ep > 1:
        for part in parts:
            apply_expert_parallel(part, pmesh, job)
        experts = [expert_parameters(part) for part in parts]
    if par.cp > 1:
        for part in parts:
            apply_context_parallel(part, pmesh["cp"], par.cp_load_balance)

    for part in parts:
        apply_activation_checkpointing(part, train.activation_checkpointing)
        if train.compile:
            apply_compile(part)

    # torch DDP (none / ddp / zero1 without DTensor parameters) needs real tensors; FSDP shards meta ones.
    dtensors = any(has_dtensor_params(p, ex) for p, ex in zip(parts, experts, strict=True))
    mode = effective_mode(par, dtensors)
    materialize_first = mode == "none" or (mode in ("ddp", "zero1") and not dtensors)
    if materialize is not None and (pmesh is None or materialize_first):
        materialize(parts)
    if pmesh is None:
        return ParallelModel(parts=parts, dp_mode="none", float8=float8)
    param_dtype = torch.bfloat16 if train.dtype == "bfloat16" else None
    parts, mode = apply_data_parallel(parts, pmesh, par, param_dtype=param_dtype, ignored=experts)
    if materialize is not None and not materialize_first:
        materialize(parts)
    for chunk, part in zip(chunks, parts, strict=False):
        chunk.module = part
    zero1 = (
        [ZeroOneSharding(p.parameters(), pmesh.group("dp_shard_cp"), private=ex) for p, ex in zip(parts, experts, strict=True)]
        if mode == "zero1"
        else []
    )
    pmodel = ParallelModel(
        parts=parts, dp_mode=mode, zero1=zero1, chunks=chunks, expert_parallel=par.ep > 1, float8=float8
    )
    if par.pp > 1 and getattr(getattr(model, "config", None), "tie_embeddings", False):
        pmodel.tied = TiedEmbeddingSync(pmodel.named_parameters(), pmesh)
    return pmodel
