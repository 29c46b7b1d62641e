"""The training objective of one micro-batch: next-token cross-entropy, in float32.

Used by the Trainer's single-stage loop and by the pipeline's last stage, so every layout optimizes
the same function (compiled with `training.compile` when the logits are plain tensors: `objectives`).
Two normalisations:

- Unmasked data (`MicroBatch.loss_tokens` None): `cross_entropy`, the mean over the micro-batch's
  tokens; the step's objective is the mean over micro-batches and data-parallel ranks.
- Masked data (chat: targets outside the assistant's tokens are IGNORE_INDEX): the step's objective is
  the SUM of token losses over the global batch divided by the number of targets it covers in the
  global batch (`loss_tokens`, what transformers' Trainer calls num_items_in_batch), so a micro-batch
  or rank with few assistant tokens weighs as much as its tokens and not more. Each rank backpropagates
  `summed_cross_entropy * masked_loss_scale(...)`: the gradient averaging over dp x cp (DDP, FSDP,
  the CP group) divides by dp x cp, which the scale multiplies back, so every layout reproduces the
  single-process objective and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from trainctl.parallelism.data.corpus import IGNORE_INDEX


def _plain(loss: Tensor) -> Tensor:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all local tokens, in float32, as a plain tensor.

    Vocabulary-sharded DTensor logits (TP) need `tensor_parallel.loss_context`; the replicated
    DTensor loss is then turned into a plain tensor (differentiably).
    """
    return _plain(F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten()))


def summed_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Sum of the next-token cross-entropy over the local targets that are not IGNORE_INDEX (float32)."""
    loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return _plain(loss)


@dataclass(frozen=True)
class Objectives:
    """The two objectives one Trainer uses: `cross_entropy` and `summed_cross_entropy`, or both compiled."""

    mean: Callable[[Tensor, Tensor], Tensor]
    summed: Callable[[Tensor, Tensor], Tensor]


def objectives(compiled: bool) -> Objectives:
    """The objectives, through `torch.compile` when `compiled` (training.compile with plain logits, as
    torchtitan compiles its loss): Inductor fuses the float32 upcast, the log-softmax and its gradient,
    where eager materialises three float32 [tokens, vocab] tensors at the start of backward."""
    if not compiled:
        return Objectives(cross_entropy, summed_cross_entropy)
    return Objectives(torch.compile(cross_entropy), torch.compile(summed_cross_entropy))


def masked_loss_scale(loss_tokens: int, averaged_over: int) -> float:
    """Factor of a rank's summed token loss: `averaged_over` (the dp x cp ranks the gradients are
    averaged over) / the global batch's loss tokens (at least 1: a batch without any contributes 0)."""
    return averaged_over / max(loss_tokens, 1)
