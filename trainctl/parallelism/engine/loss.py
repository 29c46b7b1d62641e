"""The training objective of one micro-batch: mean next-token cross-entropy, in float32.

Used by the Trainer's single-stage loop and by the pipeline's last stage, so every layout optimizes
the same function.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all local tokens, in float32, as a plain tensor.

    Vocabulary-sharded DTensor logits (TP) need `tensor_parallel.loss_context`; the replicated
    DTensor loss is then turned into a plain tensor (differentiably).
    """
    loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
