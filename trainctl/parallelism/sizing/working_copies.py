"""What a rank's data-parallel implementation holds during a step beyond its sharded state: the
gathered parameters, unsharded gradients and communication buffers of FSDP2 (`fully_shard`), and
ZeRO-1's broadcast buffers. The estimator adds them to the phase of the step they belong to
(sizing/activations.py `step_activations`); docs/engine.md, "Memory estimator", gives the formulas.

FSDP2 (ZeRO-2 / ZeRO-3 / HSDP, and DDP's stand-in for TP parameters: FSDP2 over a one-way shard),
per `fully_shard` unit (each decoder block, and the part's root: embedding, final norm, output), in
the parameter dtype p (2 bytes under bf16, whose all-gathers are bf16; else 4) and the reduce dtype
(float32, 4 bytes):

- gathered parameters: all-gather output, padded, p bytes per element. ZeRO-3 frees a block's after
  its forward and gathers it again in backward, one block ahead (explicit backward prefetch): two
  blocks at a time. ZeRO-2 (`reshard_after_forward=False`) keeps every block's from its forward until
  its backward is done. The root is gathered again for backward and held to the end.
- unsharded gradients: autograd's gradient of the gathered parameter (trainable ones), p bytes,
  held until the unit's reduce-scatter copies them in; the root's until the end of backward.
- reduce-scatter input: float32, padded, one unit's; the previous unit's stays referenced until the
  next unit's reduce-scatter starts (`reduce_scatter_max_input_buffers` 1).
- under a pipeline schedule, every micro-batch's backward runs without resharding or reducing
  (torch.distributed.pipelining's stage): each unit's parameters stay gathered after its backward,
  all of them at its end (ZeRO-3's next forward frees them again, so its blocks' backward holds two
  blocks as above; ZeRO-2 holds every block throughout), and its gradients accumulate unsharded in
  float32, in place of the sharded ones, until the reduce-scatters after the last micro-batch; each
  block's backward adds its new gradients (p bytes) before they are accumulated.

DDP and ZeRO-1 keep their gradients in DDP's buckets (the gradients the estimator counts); ZeRO-1's
`broadcast_params` concatenates each owner's parameters into one flat float32 buffer per owner, the
previous owner's still referenced while the next is built: two owners' partitions after the
optimizer step. Tensor and pipeline parallelism add no parameter copies: their collectives carry
activations (sizing/activations.py), and a stage's received activations are the inputs its blocks
save. Not modelled: buffers a collective library holds outside the framework's allocator (NCCL's;
gloo's flat copies of each all-gather and reduce-scatter on CPU, bench/memory_modes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainctl.parallelism.layouts.dp_mode import effective_mode
from trainctl.spec.job import JobSpecBody

FP32 = 4


@dataclass(frozen=True)
class FsdpUnit:
    """Element counts of one `fully_shard` unit on a rank."""

    gathered: int
    """Elements its all-gather outputs (every data-parallel parameter, padded to the shard count)."""
    grads: int
    """Elements of its trainable parameters' unsharded gradients (unpadded)."""
    reduced: int
    """Elements of its reduce-scatter input (trainable parameters, padded)."""


@dataclass(frozen=True)
class PartUnits:
    """The `fully_shard` units of one model part (pipeline chunk)."""

    blocks: tuple[FsdpUnit, ...]
    root: FsdpUnit


@dataclass(frozen=True)
class WorkingCopies:
    """Bytes held beyond the sharded state (parameters, gradients, optimizer state) in each phase."""

    backward_start: int = 0
    """When backward starts (the loss's temporaries are live)."""
    blocks: int = 0
    """While the decoder blocks run backward (a checkpointed block's recompute too)."""
    backward_end: int = 0
    """At the end of backward (the root's reduction)."""
    reduction: int = 0
    """After the last backward, before any sharded gradient exists: a pipeline schedule's deferred
    reduce-scatters (no activations held)."""
    optimizer: int = 0
    """During the optimizer step (every gradient held)."""
    unsharded_grads: int = 0
    """Gradients held unsharded in place of the sharded ones from the second micro-batch's backward on
    (FSDP under a pipeline schedule; 0: the sharded gradients are held)."""


def fsdp_working_copies(job: JobSpecBody, parts: Sequence[PartUnits]) -> WorkingCopies:
    """FSDP2's gathered parameters, unsharded gradients and reduce-scatter buffers (module docstring)."""
    par = job.parallelism
    p = 2 if job.training.dtype == "bfloat16" else FP32
    mode = effective_mode(par, dtensor_params=par.tp > 1)
    reshard = mode == "fsdp" or (mode == "hsdp" and par.zero_stage == 3)
    if par.pp > 1:  # gathered and unsharded until the last micro-batch's backward, then reduced unit by unit
        units = [u for part in parts for u in (*part.blocks, part.root)]
        gathered = sum(u.gathered * p for u in units)
        unsharded = sum(u.grads * FP32 for u in units)
        roots = sum(part.root.gathered * p for part in parts)
        largest = max((u.gathered * p for part in parts for u in part.blocks), default=0)
        in_backward = roots + 2 * largest if reshard else gathered
        return WorkingCopies(
            backward_start=roots if reshard else gathered,
            blocks=in_backward + max((u.grads * p for u in units), default=0),
            backward_end=gathered,
            reduction=gathered + unsharded + max((u.reduced * FP32 for u in units), default=0),
            unsharded_grads=unsharded,
        )
    (part,) = parts
    root, blocks = part.root, part.blocks
    gathered = [u.gathered * p for u in blocks]
    in_backward = 2 * max(gathered, default=0) if reshard else sum(gathered)
    block_reduce = max((u.grads * p + u.reduced * FP32 for u in blocks), default=0)
    root_held = root.gathered * p + root.grads * p
    return WorkingCopies(
        backward_start=(0 if reshard else sum(gathered)) + root.gathered * p,
        blocks=in_backward + root_held + block_reduce,
        backward_end=root_held + max([root.reduced * FP32, *(u.reduced * FP32 for u in blocks)]),
    )


def zero1_working_copies(owner_bytes: Sequence[Sequence[int]]) -> WorkingCopies:
    """ZeRO-1's broadcast buffers: per part, the largest two consecutive owners' flat partitions
    (`owner_bytes[part][owner]`, float32 bytes of the parameters each owner steps)."""
    pairs = [a + b for owners in owner_bytes for a, b in zip(owners, owners[1:], strict=False)]
    return WorkingCopies(optimizer=max(pairs, default=0))
